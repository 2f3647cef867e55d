"""The auto policy (``torchtitan_fp8_moe/policy.py``): its estimates against the H200
measurements it was fit to, and what it keeps in bf16 at the per-GPU shapes of real runs."""

import json
import sys
from pathlib import Path

import pytest
import torch
from expert_modules import scout_meta_model
from test_converter import _parallel_dims

from torchtitan_fp8_moe import Float8MoEWeight, convert

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from fit_policy import estimated_gain_ms, measured_pairs  # noqa: E402

PRESETS = REPO / "docs/benchmarks/presets/h200.json"


def test_estimates_have_the_measured_sign_wherever_fp8_is_10_percent_off_bf16():
    """Every preset, token count and mode measured on the H200 where float8_moe was at least
    10% faster or slower than bf16 (torchtitan's MoE layer, every expert weight in fp8)."""
    checked = 0
    for bf16, fp8 in measured_pairs(json.loads(PRESETS.read_text())):
        speedup = bf16["wall_ms"] / fp8["wall_ms"]
        if abs(speedup - 1) < 0.1:
            continue
        checked += 1
        case = (bf16["preset"], bf16["tokens"], bf16["mode"], round(speedup, 2))
        assert (estimated_gain_ms(bf16) > 0) == (speedup > 1), case
    assert checked >= 20


def _verdicts(plan) -> dict[str, bool]:
    return {row.fqn.split("moe.")[1]: row.fp8 for row in plan}


def test_scout_fsdp_at_16k_tokens_converts_everything():
    """Measured faster than bf16 (eager and compiled) with every expert weight in fp8
    (docs/benchmarks/presets/h200.json)."""
    model = scout_meta_model()
    plan = convert(model, emulate=False, tokens=16384)
    assert all(row.fp8 for row in plan) and len(plan) == 6
    assert all("(auto: est." in row.path and "faster)" in row.path for row in plan)
    assert all(isinstance(model.get_parameter(row.fqn), Float8MoEWeight) for row in plan)


def test_scout_fsdp_at_8k_tokens_keeps_the_routed_experts_bf16():
    """16 experts top-1 at 8K tokens: 512 tokens per expert do not pay for casting each
    [8192, 5120] expert weight twice; the shared expert (8K tokens, one weight) does."""
    model = scout_meta_model()
    verdicts = _verdicts(convert(model, emulate=False, tokens=8192))
    assert verdicts == {
        "experts.w1": False,
        "experts.w2": False,
        "experts.w3": False,
        "shared_experts.w1.weight": True,
        "shared_experts.w2.weight": True,
        "shared_experts.w3.weight": True,
    }
    routed = model.layers["0"].moe.experts.w1
    assert type(routed) is torch.nn.Parameter and not isinstance(routed, Float8MoEWeight)
    assert isinstance(model.layers["0"].moe.shared_experts.w1.weight, Float8MoEWeight)
    assert type(model.layers["0"].moe.shared_experts.w1).__name__ == "Float8MoELinear"


@pytest.mark.parametrize("compiled", [False, True])
def test_scout_preset_tp8_etp8_stays_bf16_and_always_forces_fp8(compiled):
    """torchtitan's Scout preset (TP 8 x ETP 8): measured slower than bf16 with every weight in
    fp8 (docs/benchmarks/presets/h200.json)."""
    dims = _parallel_dims(64, tp=8, etp=8)
    plan = convert(
        scout_meta_model(), emulate=False, tokens=16384, parallel_dims=dims, compiled=compiled
    )
    assert not any(row.fp8 for row in plan)
    assert all(row.path.startswith("bf16 (auto: fp8 est.") for row in plan)
    forced = convert(scout_meta_model(), emulate=False, parallel_dims=dims, policy="always")
    assert all(row.fp8 and row.path == "cuda" for row in forced)


def test_auto_converts_every_weight_under_a_recipe_without_a_cost_model():
    """The cost model is rowwise's: under recipe "blockwise" auto cannot weigh speed, so it
    converts what the user selected (where rowwise would stay bf16) and the plan says why."""
    dims = _parallel_dims(64, tp=8, etp=8)
    plan = convert(
        scout_meta_model(), emulate=False, tokens=16384, parallel_dims=dims, recipe="blockwise"
    )
    assert len(plan) == 6
    assert all(
        row.fp8 and row.path == "cuda (auto: no cost model for blockwise, converted)"
        for row in plan
    )


def test_auto_keeps_a_weight_bf16_where_tensor_parallelism_splits_it_unevenly():
    """TP 3 splits Scout's 8192-wide hidden dim 2731/2731/2730: torchtitan runs that in bf16,
    so auto keeps those weights bf16 and says why (the shared expert would otherwise pay at 16K
    tokens); "always", which makes them fp8 (equal shares needed), names the split."""
    dims = _parallel_dims(6, tp=3)
    plan = convert(scout_meta_model(), emulate=False, tokens=16384, parallel_dims=dims)
    assert len(plan) == 6 and not any(row.fp8 for row in plan)
    shared = [row for row in plan if "shared_experts" in row.fqn]
    assert all(
        row.path == "bf16 (auto: TP splits it unevenly, fp8 needs equal shares)" for row in shared
    )
    with pytest.raises(ValueError, match=r"over tensor parallelism of degree 3"):
        convert(scout_meta_model(), emulate=False, parallel_dims=dims, policy="always")


def test_emulated_path_converts_everything_under_auto():
    assert all(row.fp8 for row in convert(scout_meta_model(), emulate=True, tokens=64))


def test_auto_on_cuda_needs_the_tokens_and_policy_must_be_known():
    """The message names the config keys the trainer reads the tokens from, and the policy."""
    with pytest.raises(ValueError) as error:
        convert(scout_meta_model(), emulate=False)
    message = str(error.value)
    assert "training.local_batch_size" in message and "training.seq_len" in message, message
    assert 'float8_moe.policy = "always"' in message, message
    with pytest.raises(ValueError, match="policy 'sometimes' is not one of"):
        convert(scout_meta_model(), emulate=False, policy="sometimes")


@pytest.mark.parametrize(
    "overrides,tokens",
    [
        (["--training.local_batch_size=4", "--training.seq_len=4096"], 16384),
        (["--parallelism.context_parallel_degree=2", "--training.seq_len=4096"], 2 * 2048),
        (
            [
                "--parallelism.pipeline_parallel_degree=2",
                "--parallelism.pipeline_parallel_microbatch_size=1",
                "--training.local_batch_size=8",
                "--training.seq_len=4096",
            ],
            4096,
        ),
    ],
    ids=["batch", "context_parallel", "pipeline_microbatch"],
)
def test_converter_decides_at_the_tokens_one_forward_multiplies(overrides, tokens):
    """local batch x sequence per forward; a pipeline stage runs micro-batches, CP splits the
    sequence."""
    from torchtitan.config import ConfigManager

    from torchtitan_fp8_moe import Float8MoEConverter
    from torchtitan_fp8_moe.preflight import planning_for

    args = ["--job.custom_config_module=torchtitan_fp8_moe.config", "--model.converters=float8_moe"]
    job_config = ConfigManager().parse_args([*args, "--training.local_batch_size=2", *overrides])
    degrees = {
        "cp": job_config.parallelism.context_parallel_degree,
        "pp": job_config.parallelism.pipeline_parallel_degree,
    }
    with planning_for("cuda"):  # CP is refused on CPU
        converter = Float8MoEConverter(job_config, _parallel_dims(8, **degrees))
    assert converter.tokens == tokens
