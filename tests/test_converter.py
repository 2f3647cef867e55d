"""The float8_moe converter through torchtitan's own ConfigManager, ParallelDims and Llama4."""

import logging
import re
import textwrap
from dataclasses import replace

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_fp8_moe import Float8MoEConverter, Float8MoEWeight

CUSTOM_CONFIG = "--job.custom_config_module=torchtitan_fp8_moe.config"


def _parallel_dims(world_size=8, **degrees):
    dims = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1)
    dims.update(degrees)
    return ParallelDims(**dims, world_size=world_size)


def _convert(args: list[str], parallel_dims=None):
    job_config = ConfigManager().parse_args(args)
    model_args = replace(get_train_spec("llama4").model_args["debugmodel"], n_layers=4)
    with torch.device("meta"):
        model = get_train_spec("llama4").model_cls(model_args)
    converters = build_model_converters(job_config, parallel_dims or _parallel_dims())
    converters.convert(model)
    return model, converters.converters


def _converted_names(model):
    return {n for n, p in model.named_parameters() if isinstance(p, Float8MoEWeight)}


def _expected(layers, shared):
    names = set()
    for layer in layers:
        names |= {f"layers.{layer}.moe.experts.w{i}" for i in (1, 2, 3)}
        if shared:
            names |= {f"layers.{layer}.moe.shared_experts.w{i}.weight" for i in (1, 2, 3)}
    return names


def test_toml_selects_converter_and_swaps_exactly_the_experts(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        textwrap.dedent("""
        [job]
        custom_config_module = "torchtitan_fp8_moe.config"
        [model]
        name = "llama4"
        flavor = "debugmodel"
        converters = ["float8_moe"]
        [float8_moe]
        recipe = "rowwise"
        fqns = ["experts", "shared_expert"]
    """)
    )
    model, (converter,) = _convert([f"--job.config_file={toml}"])
    assert isinstance(converter, Float8MoEConverter)
    # Llama4 debugmodel: MoE on every second layer (1 and 3 of 4); nothing else is touched.
    assert _converted_names(model) == _expected([1, 3], shared=True)
    assert [row.fqn for row in converter.shard_plan] == sorted(
        _expected([1, 3], True), key=list(n for n, _ in model.named_parameters()).index
    )


def test_cli_override_selects_only_shared_expert():
    model, (converter,) = _convert(
        [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=shared_expert"]
    )
    assert converter.fqns == ["shared_expert"]
    assert _converted_names(model) == {
        f"layers.{layer}.moe.shared_experts.w{i}.weight" for layer in (1, 3) for i in (1, 2, 3)
    }


def _toml(tmp_path, float8_moe: str) -> str:
    toml = tmp_path / "job.toml"
    toml.write_text(
        textwrap.dedent(f"""
        [job]
        custom_config_module = "torchtitan_fp8_moe.config"
        [model]
        converters = ["float8_moe"]
        [float8_moe]
        {float8_moe}
    """)
    )
    return f"--job.config_file={toml}"


@pytest.mark.parametrize(
    "fqns, shared_only",
    [('"shared_experts"', True), ('"shared_experts,experts"', False)],
    ids=["one", "comma-separated"],
)
def test_toml_string_fqns_are_one_entry_or_a_comma_separated_list(tmp_path, fqns, shared_only):
    """A TOML string is what torchtitan's command line makes of it, never its characters."""
    model, (converter,) = _convert([_toml(tmp_path, f"fqns = {fqns}")])
    assert converter.fqns == ["shared_experts"] if shared_only else ["shared_experts", "experts"]
    shared = _expected([1, 3], shared=True) - _expected([1, 3], shared=False)
    assert _converted_names(model) == (shared if shared_only else _expected([1, 3], True))


@pytest.mark.parametrize(
    "setting, message",
    [
        ('emulate = "false"', "emulate = 'false' is of type str; emulate takes a bool"),
        ("cache_fp8_weights = 1", "cache_fp8_weights = 1 is of type int; cache_fp8_weights takes"),
        ("policy = 3", "policy = 3 is of type int; policy takes a str"),
    ],
)
def test_toml_settings_of_another_type_are_refused(tmp_path, setting, message):
    """tyro only warns of a TOML value's type: a string "false" was taken as true."""
    with pytest.raises(ValueError, match=re.escape(message)):
        _convert([_toml(tmp_path, setting)])


def test_spaces_around_command_line_fqns_are_stripped():
    """ " experts" matched nothing: llama4's routed experts stayed bf16 beside an fp8 shared
    expert."""
    model, (converter,) = _convert(
        [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=shared_expert, experts"]
    )
    assert converter.fqns == ["shared_expert", "experts"]
    assert _converted_names(model) == _expected([1, 3], shared=True)


def test_bad_recipe_is_a_clear_error():
    with pytest.raises(ValueError, match=r"recipe 'tensorwise' is not supported.*rowwise"):
        _convert([CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.recipe=tensorwise"])


def test_unmatched_fqns_name_the_modules_looked_at():
    with pytest.raises(ValueError, match=r"\['router'\] match none.*layers\.1\.moe\.experts"):
        _convert([CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=router"])


def test_the_no_match_error_tells_dense_feed_forwards_from_expert_modules():
    """Llama4's even layers are dense: listed among the modules looked at, not the experts."""
    with pytest.raises(ValueError) as error:
        _convert([CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=router"])
    first, *lines = str(error.value).splitlines()
    assert "'layers.1.moe.shared_experts'" in first and "feed_forward" not in first, first
    assert (
        "  FeedForward x2 (layers.1.moe.shared_experts, layers.3.moe.shared_experts): expert "
        "module, FQN matches none of float8_moe.fqns" in lines
    ), lines
    assert (
        "  FeedForward x2 (layers.0.feed_forward, layers.2.feed_forward): a dense feed-forward, no "
        "expert module (no grouped experts beside it)" in lines
    ), lines


def test_an_fqns_entry_matching_nothing_is_refused_beside_one_that_matches():
    """It was dropped without a word: the module it meant trained in bf16."""
    with pytest.raises(ValueError) as error:
        _convert(
            [
                CUSTOM_CONFIG,
                "--model.converters=float8_moe",
                "--float8_moe.fqns=experts,shared_expertz",
            ]
        )
    message = str(error.value)
    assert message.startswith(
        "float8_moe: fqns entries ['shared_expertz'] of ['experts', 'shared_expertz'] match none "
        "of the model's expert modules"
    ), message
    assert "every entry must match one; correct or remove it" in message
    assert "(layers.1.moe.experts, layers.3.moe.experts): expert module, matched by" in message


def test_the_default_fqns_convert_a_model_without_shared_experts():
    """The defaults name routed and shared experts: Qwen3's MoE has no shared expert."""
    spec = get_train_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_cls(replace(spec.model_args["debugmodel_moe"], n_layers=2))
    converters = build_model_converters(
        ConfigManager().parse_args([CUSTOM_CONFIG, "--model.converters=float8_moe"]),
        _parallel_dims(),
    )
    converters.convert(model)
    assert _converted_names(model) == {
        f"layers.{i}.moe.experts.w{j}" for i in (0, 1) for j in (1, 2, 3)
    }


def test_missing_config_section_is_a_clear_error():
    with pytest.raises(ValueError, match="custom_config_module"):
        _convert(["--model.converters=float8_moe"])


def test_emulated_path_and_shard_plan_are_logged(caplog):
    with caplog.at_level(logging.INFO):
        model, (converter,) = _convert([CUSTOM_CONFIG, "--model.converters=float8_moe"])
    assert all(p.emulate for p in model.parameters() if isinstance(p, Float8MoEWeight))
    (message,) = [
        r.getMessage() for r in caplog.records if "float8_moe: converted" in r.getMessage()
    ]
    assert "converted 12 expert weights of 4 modules" in message
    assert "emulated path (no CUDA device)" in message
    assert "padding-only ranks" in message
    assert "layers.3.moe.shared_experts.w2.weight  [256, 512]" in message


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "fp8 weight cache on, "),
        (["--compile.enable", "--compile.components=loss"], "fp8 weight cache on, "),
        (["--compile.enable"], "fp8 weight cache off (torch.compile: compiled blocks quantize"),
        # The routed experts' shards quantize in FSDP's eager hook; the 2D shared ones gather
        # bf16 and quantize in the compiled blocks.
        (
            ["--compile.enable", "--float8_moe.fp8_all_gather"],
            "fp8 weight cache on for 6 of 12 fp8 weights (torch.compile: only the shards",
        ),
    ],
    ids=["eager", "loss-compiled", "compiled", "compiled-fp8-all-gather"],
)
def test_the_log_says_whether_the_fp8_weight_cache_is_used(caplog, args, expected):
    """Compiled blocks quantize their weights inline, without the cache: the log said "fp8
    weight cache on" under compile all the same."""
    with caplog.at_level(logging.INFO):
        _convert(
            [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.cache_fp8_weights"]
            + args
        )
    (message,) = [
        r.getMessage() for r in caplog.records if "float8_moe: converted" in r.getMessage()
    ]
    assert expected in message, message


def test_shard_plan_rows():
    """8 ranks: routed [8, 512, 256] splits 1 row each; with EP=4 and FSDP 2 over the rest,
    [2, ...] per EP rank; shared [512, 256] 64 rows."""
    _, (converter,) = _convert([CUSTOM_CONFIG, "--model.converters=float8_moe"])
    rows = {r.fqn: r for r in converter.shard_plan}
    w1 = rows["layers.1.moe.experts.w1"]
    assert (w1.fsdp_degree, w1.rows_per_rank, w1.padding_only_ranks, w1.padding_bytes) == (
        8,
        1,
        0,
        0,
    )
    assert rows["layers.1.moe.shared_experts.w2.weight"].rows_per_rank == 32
    _, (converter,) = _convert(
        [CUSTOM_CONFIG, "--model.converters=float8_moe"], _parallel_dims(world_size=6)
    )
    w1 = {r.fqn: r for r in converter.shard_plan}["layers.1.moe.experts.w1"]
    # 8 experts on 6 ranks: 2 rows each on ranks 0-3, ranks 4-5 only padding (4 zero rows).
    assert (w1.rows_per_rank, w1.padding_only_ranks, w1.padding_bytes) == (2, 2, 4 * 512 * 256 * 2)


@pytest.mark.slow
def test_plan_matches_all_gather_padding_in_real_fsdp(dist_results):
    """World size 3: the converter's plan equals what each weight pads to at all-gather."""
    ranks = dist_results("llama4", 3)
    for rank, result in enumerate(ranks):
        assert "error" not in result, result.get("traceback")
        assert len(result["plan"]) == 6  # one MoE layer of 2
        for fqn, row in result["plan"].items():
            assert row["plan_rows"] == row["all_gather_rows"], (rank, fqn, row)
            assert row["wrapped"] == "Float8MoEWeight", (rank, fqn)
        assert result["grads_finite"] and result["loss"] > 0


def test_tensor_parallel_plan_rows():
    """TP 2 x FSDP 4: routed experts split on the hidden dim (w1/w3 dim 1, w2 dim 2), the
    FeedForward shared expert colwise (w1/w3 dim 0) / rowwise (w2 dim 1); FSDP over what each
    rank holds. The log names the split and the shape each rank multiplies."""
    model, (converter,) = _convert(
        [CUSTOM_CONFIG, "--model.converters=float8_moe", "--parallelism.tensor_parallel_degree=2"],
        _parallel_dims(tp=2),
    )
    rows = {r.fqn: r for r in converter.shard_plan}
    expected = {
        "layers.1.moe.experts.w1": ("tp 2 (dim 1)", (8, 256, 256), 4),
        "layers.1.moe.experts.w2": ("tp 2 (dim 2)", (8, 256, 256), 4),
        "layers.1.moe.shared_experts.w1.weight": ("tp 2 (dim 0)", (256, 256), 4),
        "layers.1.moe.shared_experts.w2.weight": ("tp 2 (dim 1)", (256, 256), 4),
    }
    for fqn, (split, local, degree) in expected.items():
        row = rows[fqn]
        assert (row.model_parallel, row.local_shape, row.fsdp_degree) == (split, local, degree)


def test_tensor_parallel_degree_that_splits_a_weight_unevenly_is_named():
    with pytest.raises(ValueError, match=r"splits dim 1 over tensor parallelism of degree 3"):
        _convert(
            [CUSTOM_CONFIG, "--model.converters=float8_moe"], _parallel_dims(world_size=6, tp=3)
        )


def test_expert_parallel_selective_op_ac_is_refused_on_cpu():
    """torchtitan 0.2.2 cannot recompute EP's token dispatch under selective op AC on CPU (bf16
    too); on a machine without CUDA the converter says so, naming the options."""
    args = [
        CUSTOM_CONFIG,
        "--model.converters=float8_moe",
        "--parallelism.expert_parallel_degree=2",
    ]
    with pytest.raises(
        ValueError,
        match=r'expert_parallel_degree = 2 with .*selective_ac_option = "op" fails on CPU',
    ):
        _convert(
            args
            + [
                "--activation_checkpoint.mode=selective",
                "--activation_checkpoint.selective_ac_option=op",
            ],
            _parallel_dims(ep=2),
        )
    _convert(args + ["--activation_checkpoint.mode=full"], _parallel_dims(ep=2))


def test_tensor_parallel_compile_is_refused_on_cpu_where_torch_fails():
    """torch 2.13 on CPU, bf16 too: the model compiled under TP fails with selective op AC or
    AC full (TP 2 x FSDP 2, 4 ranks), and with TP alone under any AC (2 ranks); it trains with
    FSDP as well and AC none (test_train_parallel.py) or selective per layer (bf16 and fp8, 4
    ranks, by hand), with only the loss compiled (TP alone, 2 ranks), and without compile."""
    args = [
        CUSTOM_CONFIG,
        "--model.converters=float8_moe",
        "--parallelism.tensor_parallel_degree=2",
    ]
    compiled = [*args, "--compile.enable"]
    tp_fsdp, tp_alone = _parallel_dims(world_size=4, tp=2), _parallel_dims(world_size=2, tp=2)
    for ac, dims, message in [
        (
            [
                "--activation_checkpoint.mode=selective",
                "--activation_checkpoint.selective_ac_option=op",
            ],
            tp_fsdp,
            r'mode = "selective", selective_ac_option = "op" fails',
        ),
        (["--activation_checkpoint.mode=full"], tp_fsdp, r'mode = "full" fails'),
        (["--activation_checkpoint.mode=none"], tp_alone, r"= 2 without FSDP with compile"),
        (["--activation_checkpoint.mode=full"], tp_alone, r"= 2 without FSDP with compile"),
    ]:
        with pytest.raises(ValueError, match=message):
            _convert(compiled + ac, dims)
    _convert(compiled + ["--activation_checkpoint.mode=none"], tp_fsdp)
    layer_ac = [
        "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=2",
    ]
    _convert(compiled + layer_ac, tp_fsdp)
    _convert(
        compiled + ["--activation_checkpoint.mode=full", "--compile.components=loss"], tp_alone
    )
    _convert([*args, "--activation_checkpoint.mode=selective"], tp_alone)


def test_float8_linear_converter_claiming_shared_experts_is_refused():
    """torchtitan's quantize.linear.float8 would also convert the FeedForward shared experts:
    one of the two converters must leave them alone."""
    args = [
        CUSTOM_CONFIG,
        "--model.converters=quantize.linear.float8,float8_moe",
        "--quantize.linear.float8.emulate",
    ]
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.moe\.shared_experts is a FeedForward that "
        r"quantize\.linear\.float8 converts too.*filter_fqns",
    ):
        _convert(args)
    model, converters = _convert(
        args + ["--quantize.linear.float8.filter_fqns=output,router.gate,shared_experts"]
    )
    assert _converted_names(model) == _expected([1, 3], shared=True)
    assert type(model.layers["0"].feed_forward.w1).__name__ == "Float8Linear"
    assert type(model.layers["1"].moe.shared_experts.w1).__name__ == "Float8MoELinear"


def test_shard_plan_with_expert_parallelism():
    """torchtitan's rule with EP: routed experts split over EP, FSDP over the rest (efsdp), on
    dim 1 once efsdp x EP exceeds the expert count; shared experts over all FSDP ranks."""
    from torchtitan_fp8_moe.sharding import plan_expert_weight

    dims = _parallel_dims(world_size=8, ep=2)  # efsdp = 8 / 2 = 4; 4 x 2 <= 16 experts
    row = plan_expert_weight("w1", (16, 512, 256), dims, "routed", 2, "emulated")
    assert (row.shape, row.fsdp_degree, row.shard_dim, row.rows_per_rank) == (
        (8, 512, 256),
        4,
        0,
        2,
    )
    dims = _parallel_dims(world_size=8, ep=4)  # efsdp 2 x EP 4 = 8 > 4 experts: dim 1
    row = plan_expert_weight("w1", (4, 512, 256), dims, "routed", 2, "emulated")
    assert (row.shape, row.fsdp_degree, row.shard_dim, row.rows_per_rank) == (
        (1, 512, 256),
        2,
        1,
        256,
    )
    row = plan_expert_weight("shared.w1", (1, 512, 256), dims, "grouped", 2, "emulated")
    assert (row.fsdp_degree, row.rows_per_rank, row.padding_only_ranks) == (8, 1, 7)
