"""The torchtitan 0.3 converter without the trainer: which weights of each 0.3 MoE family it
converts, the numerics of a converted MoE layer against bf16, the shard plan for N ranks
against 0.3's FSDP placement rule, and its errors."""

import dataclasses
import logging
import re

import pytest
import torch
import torch.nn as nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models import deepseek_v3, gpt_oss, qwen3
from torchtitan.trainer import Trainer

import torchtitan_fp8_moe
from torchtitan_fp8_moe import Float8MoEWeight, torch_private
from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.run_context import RunContext, planning
from torchtitan_fp8_moe.torchtitan_v03 import Float8MoEConverter, preflight
from torchtitan_fp8_moe.torchtitan_v03 import config_registry as entries

ALWAYS = [Float8MoEConverter.Config(policy="always")]


def _meta_model(model_config):
    with torch.device("meta"):
        return model_config.build()


def _converted(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if isinstance(p, Float8MoEWeight)}


def test_package_picks_the_torchtitan_03_glue():
    assert torchtitan_fp8_moe.Float8MoEConverter is Float8MoEConverter
    # A quantization converter: torchtitan orders it before LoRA.
    assert issubclass(Float8MoEConverter.Config, QuantizationConverter.Config)


@pytest.mark.parametrize(
    "spec, routed, shared",
    [
        # weights: 5 MoE layers x (w1, w2, w3), routed and shared
        (lambda: deepseek_v3.model_registry("debugmodel", converters=ALWAYS), 15, 15),
        (lambda: qwen3.model_registry("debugmodel_moe", converters=ALWAYS), 24, 0),
        # 4 MoE layers x (mlp1, mlp2); their biases stay plain
        (lambda: gpt_oss.model_registry("debugmodel", converters=ALWAYS), 8, 0),
    ],
    ids=["deepseek_v3", "qwen3", "gpt_oss"],
)
def test_each_family_converts_its_expert_weights(spec, routed, shared):
    model = _meta_model(spec().model)
    model.verify_module_protocol()  # what the trainer checks after building
    converted = _converted(model)
    routed_names = {n for n in converted if ".routed_experts.inner_experts." in n}
    shared_names = {n for n in converted if ".shared_experts." in n}
    assert converted == routed_names | shared_names, converted
    assert (len(routed_names), len(shared_names)) == (routed, shared)
    assert all("bias" not in n for n in converted)
    assert len(model.float8_moe_shard_plan) == len(converted)
    # Checkpoints hold plain tensors.
    state = model.state_dict()
    assert not any(isinstance(state[n], Float8MoEWeight) for n in converted)


def _deepseek_two_layers(converters):
    config = deepseek_v3.model_registry("debugmodel", converters=converters).model
    config.layers = config.layers[:2]  # layer 0 dense, layer 1 MoE with a shared expert
    return config


def test_moe_layer_numerics_against_bf16():
    """The project's SQNR bars for the layer's output and the gradient of every converted
    weight, against the same layer in bf16, given the same upstream gradient."""
    torch.manual_seed(0)
    reference = _deepseek_two_layers(None).build()
    with torch.no_grad():
        reference.init_weights()
    converted = _deepseek_two_layers(ALWAYS).build()
    converted.load_state_dict(reference.state_dict())
    x_ref = torch.randn(2, 64, reference.config.dim, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    out_ref = reference.layers["1"].moe(x_ref)
    out = converted.layers["1"].moe(x)
    upstream = torch.randn_like(out_ref)  # the same gradient into both layers
    out_ref.backward(upstream)
    out.backward(upstream)
    assert sqnr(out_ref, out) >= 23
    # The layer's input gradient runs through two fp8 GEMMs in a row (w2's, then w1's and
    # w3's input gradients), not one: the output's bar, not a single GEMM's 29 dB.
    assert sqnr(x_ref.grad, x.grad) >= 23
    ref_params = dict(reference.named_parameters())
    converted_names = _converted(converted)
    assert len(converted_names) == 6  # layer 1's routed and shared w1, w2, w3
    for name in converted_names:
        assert sqnr(ref_params[name].grad, converted.get_parameter(name).grad) >= 21, name


def _trainer_config(**parallelism) -> Trainer.Config:
    config = entries.deepseek_v3_debugmodel_float8_moe()
    config.parallelism = dataclasses.replace(config.parallelism, **parallelism)
    return config


def _plan_for(config: Trainer.Config, world_size: int):
    with planning(RunContext(world_size=world_size)):
        config.model_spec.model.update_from_config(config=config)
    return {row.fqn: row for row in _meta_model(config.model_spec.model).float8_moe_shard_plan}


@pytest.mark.parametrize("world_size, shard_dim", [(8, 0), (16, 1)])
def test_plan_follows_torchtitan_03_fsdp_placement_without_ep(world_size, shard_dim):
    """0.3 shards routed experts on dim 1 once the FSDP degree exceeds their count (8 here),
    also without expert parallelism; linears always on dim 0."""
    plan = _plan_for(_trainer_config(data_parallel_shard_degree=-1), world_size)
    routed = plan["layers.1.moe.routed_experts.inner_experts.w2_EDF"]
    assert (routed.fsdp_degree, routed.shard_dim) == (world_size, shard_dim)
    shared = plan["layers.1.moe.shared_experts.w1.weight"]
    assert (shared.fsdp_degree, shared.shard_dim) == (world_size, 0)


@pytest.mark.parametrize(
    "compiled, fp8_all_gather, expected",
    [
        (False, False, "fp8 weight cache on, "),
        (True, False, "fp8 weight cache off (torch.compile: compiled blocks quantize"),
        # The routed experts' shards quantize in FSDP's eager hook; the 2D shared ones gather
        # bf16 and quantize in the compiled blocks.
        (True, True, "fp8 weight cache on for 15 of 30 fp8 weights (torch.compile: only"),
    ],
    ids=["eager", "compiled", "compiled-fp8-all-gather"],
)
def test_the_log_says_whether_the_fp8_weight_cache_is_used(
    caplog, compiled, fp8_all_gather, expected
):
    """Compiled blocks quantize their weights inline, without the cache: the log said "fp8
    weight cache on" under compile all the same."""
    config = _trainer_config(data_parallel_shard_degree=-1)
    config.compile = dataclasses.replace(config.compile, enable=compiled, components=["model"])
    settings = config.model_spec.model.float8_moe
    settings.cache_fp8_weights, settings.fp8_all_gather = True, fp8_all_gather
    with caplog.at_level(logging.INFO):
        _plan_for(config, 2)
    (message,) = [
        r.getMessage() for r in caplog.records if "float8_moe: converted" in r.getMessage()
    ]
    assert expected in message, message


def test_plan_under_expert_parallelism():
    plan = _plan_for(_trainer_config(expert_parallel_degree=4), 8)
    routed = plan["layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    # 8 experts over EP 4: 2 per rank; FSDP over the other 2 ranks (efsdp = 8 / 4) on dim 0.
    assert routed.local_shape == (2, 256, 256) and routed.model_parallel == "ep 4 (dim 0)"
    assert (routed.fsdp_degree, routed.shard_dim) == (2, 0)


def test_preflight_plans_the_full_size_entries_for_gpus():
    config, rows = preflight.plan(
        "torchtitan_fp8_moe.torchtitan_v03.config_registry",
        "qwen3_30b_a3b_float8_moe",
        8,
        "cuda",
        [],
    )
    assert config.parallelism.data_parallel_shard_degree == -1
    assert len(rows) == 48 * 3  # 48 MoE layers, three routed projections each
    assert all(row.path.startswith(("bf16 (auto", "cuda (auto")) for row in rows)


def test_preflight_prints_the_plan_once(capsys, caplog):
    """The converter's own log line (a warning where the policy keeps every weight bf16, as for
    Qwen3-30B's narrow experts) is the launch's; preflight prints the plan once, and says why
    no weight is in fp8."""
    module = "torchtitan_fp8_moe.torchtitan_v03.config_registry"
    args = ["--module", module, "--config", "qwen3_30b_a3b_float8_moe", "--ngpu", "8"]
    assert preflight.main(args) == preflight.EXIT_OK
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("FQN ") == 1
    assert not [r for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    assert "0 of 144 expert weights in fp8 (144 kept in bf16 by the auto policy)" in captured.out


def test_preflight_exit_codes(capsys):
    module = "torchtitan_fp8_moe.torchtitan_v03.config_registry"
    assert (
        preflight.main(
            ["--module", module, "--config", "qwen3_moe_debug_float8_moe", "--ngpu", "2"]
        )
        == preflight.EXIT_OK
    )
    assert "routed_experts.inner_experts.w1_EFD" in capsys.readouterr().out
    # 64 experts do not split over EP 3.
    code = preflight.main(
        [
            "--module",
            module,
            "--config",
            "qwen3_moe_debug_float8_moe",
            "--ngpu",
            "3",
            "--parallelism.expert_parallel_degree",
            "3",
        ]
    )
    assert code == preflight.EXIT_FAILED
    assert "expert_parallel_degree" in capsys.readouterr().err
    # An entry without the converter.
    code = preflight.main(["--module", module, "--config", "qwen3_moe_debug", "--ngpu", "2"])
    assert code == preflight.EXIT_FAILED
    assert "no Float8MoEConverter" in capsys.readouterr().err


def test_preflight_plans_an_entry_with_the_fp8_weight_cache(capsys):
    """cache_fp8_weights registers torch's optimizer-step hook when the run is captured."""
    argv = ["--module", "tests_v03.entries", "--config", "deepseek_v3_float8_moe_cached"]
    assert preflight.main([*argv, "--ngpu", "2", "--target", "cpu"]) == preflight.EXIT_OK
    assert "routed_experts.inner_experts.w1_EFD" in capsys.readouterr().out


@pytest.mark.parametrize(
    "override, message",
    [
        ("--training.local_batch_size=0", "training.local_batch_size = 0 must be at least 1"),
        ("--training.seq_len=0", "training.seq_len = 0 must be at least 1"),
        ("--training.seq_len=-64", "training.seq_len = -64 must be at least 1"),
    ],
)
def test_preflight_refuses_sizes_below_one_with_the_launchs_message(capsys, override, message):
    """The launch stops on them where the model config captures the run (run.py), before the
    model is built."""
    argv = ["--module", "tests_v03.entries", "--config", "qwen3_float8_moe", "--ngpu", "2"]
    assert preflight.main([*argv, "--target", "cpu", override]) == preflight.EXIT_FAILED
    err = capsys.readouterr().err
    assert f"preflight: the launch would fail: {message}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(recipe="tensorwise"), "recipe 'tensorwise'"),
        (dict(policy="fast"), "policy 'fast'"),
        # A string was taken as true; 1 and None were used as true and false.
        (dict(emulate="false"), "emulate = 'false' is of type str; emulate takes a bool"),
        (
            dict(cache_fp8_weights=1),
            "cache_fp8_weights = 1 is of type int; cache_fp8_weights takes",
        ),
        (
            dict(fp8_all_gather=None),
            "fp8_all_gather = None is of type NoneType",
        ),
        (dict(policy=3), "policy = 3 is of type int; policy takes a str"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Float8MoEConverter.Config(**settings).build()


def test_settings_set_after_the_model_config_is_built_are_type_checked():
    """A config entry may set them on the built model config (tests_v03/entries.py does)."""
    config = _trainer_config()
    config.model_spec.model.float8_moe.emulate = "false"
    with pytest.raises(ValueError, match=re.escape("emulate = 'false' is of type str")):
        config.model_spec.model.update_from_config(config=config)


def test_a_string_of_fqns_is_one_entry():
    """fqns="shared_experts" converts the shared experts, not what its characters match."""
    spec = deepseek_v3.model_registry(
        "debugmodel", converters=[Float8MoEConverter.Config(policy="always", fqns="shared_experts")]
    )
    converted = _converted(_meta_model(spec.model))
    assert len(converted) == 15 and all(".shared_experts." in n for n in converted), converted


def test_fqns_matching_no_expert_are_refused_at_build():
    spec = qwen3.model_registry(
        "debugmodel_moe",
        converters=[Float8MoEConverter.Config(policy="always", fqns=["attention"])],
    )
    with pytest.raises(ValueError, match="match none of the model's expert modules"):
        _meta_model(spec.model)


def test_an_fqns_entry_matching_nothing_is_refused_beside_one_that_matches():
    settings = Float8MoEConverter.Config(policy="always", fqns=["routed_experts", "shared_expertz"])
    spec = deepseek_v3.model_registry("debugmodel", converters=[settings])
    with pytest.raises(ValueError, match=r"fqns entries \['shared_expertz'\] of \["):
        _meta_model(spec.model)


def test_converter_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        deepseek_v3.model_registry("debugmodel", converters=ALWAYS * 2)


def test_untested_spmd_backend_is_refused():
    config = _trainer_config(spmd_backend="spmd_types")
    with pytest.raises(ValueError, match="spmd_backend = 'spmd_types'"):
        config.model_spec.model.update_from_config(config=config)


def test_experts_quantized_by_torchtitans_converter_are_refused():
    """torchao's fp8 grouped experts (what torchtitan's Float8GroupedExpertsConverter puts in
    the config; the converter itself needs an sm89 GPU) are not converted again."""
    from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls

    config = qwen3.model_registry("debugmodel_moe").model
    routed = config.layers[0].moe.routed_experts
    torchao_cls = _get_float8_grouped_experts_cls(type(routed.inner_experts)._owner)
    values = {
        f.name: getattr(routed.inner_experts, f.name)
        for f in dataclasses.fields(routed.inner_experts)
    }
    routed.inner_experts = torchao_cls.Config(**values)
    with pytest.raises(ValueError, match="Float8GroupedExpertsConverter"):
        Float8MoEConverter.Config(policy="always").build().convert(config)


def test_the_private_torchtitan_names_the_glue_uses_resolve():
    """torchtitan_fp8_moe/torch_private.py's torchtitan table (tests/test_torch_private.py checks
    that it lists every private torchtitan name the package uses): those checked on 0.3.0."""
    on_v03 = {n: p for n, p in torch_private.PRIVATE_TORCHTITAN.items() if "0.3.0" in p.checked}
    assert torch_private.unresolved(on_v03) == []


def test_the_config_holds_the_settings_fields_and_gives_them_back():
    """``Float8MoEConverter.Config`` is generated from ``Float8MoESettings``: the same fields
    and defaults, mutable as 0.3's configs are, read back by ``settings()``."""
    from torchtitan_fp8_moe import Float8MoESettings

    names = [f.name for f in dataclasses.fields(Float8MoESettings)]
    config = Float8MoEConverter.Config()
    assert [f.name for f in dataclasses.fields(config)][-len(names) :] == names
    assert config.settings() == Float8MoESettings()
    config.policy = "always"
    assert config.settings() == Float8MoESettings(policy="always")
    assert Float8MoEConverter.Config.__qualname__ == "Float8MoEConverter.Config"
    assert isinstance(config.build(), Float8MoEConverter)
