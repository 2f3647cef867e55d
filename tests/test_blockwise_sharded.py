"""The blockwise recipe sharded: tensor parallelism at 128-aligned local shards against the
unsharded model (2 ranks, gloo, CPU), and the shard plan's 128 rule where a split does not fit.
FSDP's uneven shards and fp8 all-gathers of blockwise weights are cases of
tests/test_fsdp_uneven.py and tests/test_fp8_all_gather.py (names ending in -blockwise)."""

import logging
from dataclasses import replace

import pytest
import torch
from harness.parallel_checks import assert_matches_unsharded
from harness.suites.blockwise import BLOCKWISE_PARALLEL_CASES
from test_converter import CUSTOM_CONFIG, _convert, _parallel_dims
from test_preflight import _preflight
from torchtitan.config import ConfigManager
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_fp8_moe.preflight import EXIT_FAILED, EXIT_OK

BLOCKWISE = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.recipe=blockwise"]


@pytest.mark.slow  # one 2-rank launch of torchtitan's TP on the debug model
@pytest.mark.parametrize("case", [c[0] for c in BLOCKWISE_PARALLEL_CASES])
def test_tensor_parallel_blockwise_matches_unsharded(dist_results, case):
    for result in assert_matches_unsharded(dist_results("blockwise_parallel", 2), case):
        for fqn, planned in result["plan"].items():
            assert planned["local_shape"] == result["actual"][fqn]["local_shape"], fqn


def test_tensor_parallel_split_off_the_block_grid_is_refused():
    """TP 8 splits the debug model's 512-wide expert hidden dim into 64s, off the 128 grid:
    refused at conversion (what the launch and the preflight run), naming the weight, the
    recipe and the 128 rule."""
    with pytest.raises(ValueError) as error:
        _convert(BLOCKWISE, _parallel_dims(world_size=8, dp_shard=1, tp=8))
    message = str(error.value)
    for part in ("recipe blockwise", "multiple of 128", "float8_moe.recipe", ".moe."):
        assert part in message, message


def _plan_at_dim(dim: int, parallel_dims) -> dict:
    """The blockwise plan of the 2-layer Llama4 debug model at model dim ``dim``: layer 1's
    expert weights, FQN after ``moe.``, to (local shape, model parallelism)."""
    job_config = ConfigManager().parse_args(BLOCKWISE)
    model_args = replace(get_train_spec("llama4").model_args["debugmodel"], n_layers=2, dim=dim)
    with torch.device("meta"):
        model = get_train_spec("llama4").model_cls(model_args)
    converters = build_model_converters(job_config, parallel_dims)
    converters.convert(model)
    (converter,) = converters.converters
    return {
        row.fqn.split("moe.")[1]: (row.local_shape, row.model_parallel)
        for row in converter.shard_plan
        if row.fqn.startswith("layers.1.")
    }


@pytest.mark.parametrize(
    "degrees, routed_w1, shared_w1",
    [
        (dict(dp_shard=8, ep=2), ((4, 512, 208), "ep 2 (dim 0)"), ((512, 208), "-")),
        (
            dict(dp_shard=4, tp=2, ep=2, etp=2),
            ((4, 256, 208), "ep 2 (dim 0), etp 2 (dim 1)"),
            ((256, 208), "tp 2 (dim 0)"),
        ),
        (
            dict(dp_shard=2, tp=4, ep=4, etp=1),
            ((2, 512, 208), "ep 4 (dim 0)"),
            ((128, 208), "tp 4 (dim 0)"),
        ),
    ],
    ids=["ep2-fsdp4", "ep2-etp2-fsdp2", "ep4-tp4-borrowed"],
)
def test_a_model_dim_off_the_block_grid_is_planned_under_ep_and_etp(degrees, routed_w1, shared_w1):
    """Model dim 208 (not a multiple of 128: ragged blocks, as unsharded) on 8 ranks: expert
    and tensor parallelism split only the experts and the 512-wide hidden dim, into whole
    blocks, so the plan takes them; only a split dim must be on the grid."""
    plan = _plan_at_dim(208, _parallel_dims(world_size=8, **degrees))
    assert plan["experts.w1"] == routed_w1, plan
    assert plan["shared_experts.w1.weight"] == shared_w1, plan


def test_an_expert_tensor_parallel_split_off_the_block_grid_is_refused():
    """ETP 8 splits the routed experts' 512-wide hidden dim into 64s (16 ranks, EP 2)."""
    with pytest.raises(ValueError) as error:
        _plan_at_dim(208, _parallel_dims(world_size=16, dp_shard=2, tp=8, ep=2, etp=8))
    message = str(error.value)
    assert (
        "layers.1.moe.experts.w1 is split by tensor parallelism on dim 1 into local shards "
        "of shape [4, 64, 208]" in message
    ), message
    assert "multiple of 128" in message and "expert_tensor_parallel_degree" in message, message


def test_preflight_checks_the_128_rule(capsys):
    """The preflight, planning for CUDA without GPUs: TP 2 (256-wide local hidden dims) passes
    and names the recipe; TP 8 fails with the converter's message."""
    config = ["--config", "train_configs/llama4_debug.toml", "--float8_moe.recipe=blockwise"]
    rc, out, _ = _preflight(
        capsys, *config, "--ngpu", "4", "--parallelism.tensor_parallel_degree=2"
    )
    assert rc == EXIT_OK and "float8_moe: fp8 blockwise" in out, out
    rc, out, err = _preflight(
        capsys, *config, "--ngpu", "8", "--parallelism.tensor_parallel_degree=8"
    )
    assert (
        rc == EXIT_FAILED and "recipe blockwise needs that dim to be a multiple of 128" in out + err
    )


def test_plan_log_says_the_recipe(caplog):
    with caplog.at_level(logging.INFO):
        _convert(BLOCKWISE, _parallel_dims(world_size=2, dp_shard=2))
    (message,) = [r.getMessage() for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    assert "fp8 blockwise" in message
