"""``torchtitan_fp8_moe.convert``: the public one-call conversion, on torchtitan's Llama4 debug
model without the trainer, the fqns it refuses (empty, or matching dense feed-forwards), and its
refusals on the fp8 kernel path."""

import math
import re
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from test_converter import CUSTOM_CONFIG, _convert, _converted_names, _expected, _parallel_dims
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_fp8_moe import Float8MoESettings, Float8MoEWeight, convert, format_plan
from torchtitan_fp8_moe.cpu import enable_moe_ops
from torchtitan_fp8_moe.fp8.sqnr import sqnr


def _llama4(n_layers: int = 2, seed: int = 0):
    spec = get_train_spec("llama4")
    model = spec.model_cls(replace(spec.model_args["debugmodel"], n_layers=n_layers))
    torch.manual_seed(seed)
    with torch.no_grad():  # as torchtitan's trainer initializes
        model.init_weights()
    return model


def test_convert_swaps_the_experts_and_trains_within_the_sqnr_bars():
    enable_moe_ops()  # torchtitan's MoE on CPU (cpu.py)
    reference, model = _llama4(), _llama4()
    plan = convert(model, fqns=["experts", "shared_expert"], emulate=True)
    assert _converted_names(model) == _expected([1], shared=True)
    assert [row.fqn for row in plan] == [
        n for n, p in model.named_parameters() if isinstance(p, Float8MoEWeight)
    ]
    assert all(row.path == "emulated" and row.fsdp_degree == 1 for row in plan)
    assert "layers.1.moe.experts.w1" in format_plan(plan)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    out_ref, out = reference(tokens), model(tokens)
    out_ref.float().square().mean().backward()
    out.float().square().mean().backward()
    assert sqnr(out_ref, out) >= 23
    ref_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if isinstance(param, Float8MoEWeight):
            assert sqnr(ref_grads[name].grad, param.grad) >= 21, name


def test_convert_plans_the_shards_of_the_parallelism_it_is_given():
    """8 routed experts over FSDP 3: ceil(8 / 3) = 3 rows a rank, 1 padding row in all."""
    model = _llama4()
    plan = {r.fqn: r for r in convert(model, emulate=True, parallel_dims=_parallel_dims(3))}
    routed = plan["layers.1.moe.experts.w1"]
    assert (routed.fsdp_degree, routed.rows_per_rank) == (3, math.ceil(8 / 3))
    assert routed.padding_only_ranks == 0
    assert routed.padding_bytes == (3 * 3 - 8) * math.prod(routed.shape[1:]) * 4


@pytest.mark.parametrize("fqns", [[], [""], ["experts", " "]])
def test_empty_fqns_are_refused(fqns):
    with pytest.raises(ValueError, match="empty string, which would match every module"):
        convert(_llama4(), fqns=fqns)


def test_empty_fqns_from_the_command_line_are_refused():
    with pytest.raises(ValueError, match=r"fqns \[''\] is empty"):
        _convert([CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns="])


def test_dense_feed_forwards_are_refused_with_the_converter_to_use():
    """Llama4's even layers are dense (``layers.N.feed_forward``); its MoE layers' shared
    experts sit beside grouped experts and convert."""
    with pytest.raises(ValueError) as error:
        _convert([CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=feed_forward"])
    message = str(error.value)
    assert "dense feed-forwards layers.0.feed_forward, layers.2.feed_forward" in message
    assert "quantize.linear.float8" in message
    assert message.endswith(
        "narrow fqns to the expert modules layers.1.moe.experts, "
        "layers.1.moe.shared_experts, layers.3.moe.experts, layers.3.moe.shared_experts"
    ), message
    model, _ = _convert(
        [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fqns=shared_experts"]
    )
    assert _converted_names(model) == _expected([1, 3], shared=True) - _expected([1, 3], False)


def test_hf_state_dict_adapter_sees_the_plain_values_both_ways():
    """torchtitan's Llama4 HF adapter on a converted model's state dict gives the unconverted
    model's HF tensors, and its from_hf result loads back into the converted weights."""
    from torchtitan.models.llama4 import Llama4StateDictAdapter

    plain, model = _llama4(), _llama4()
    convert(model, emulate=True)
    adapter = Llama4StateDictAdapter(model.model_args, None)
    expected, hf = adapter.to_hf(plain.state_dict()), adapter.to_hf(model.state_dict())
    assert expected.keys() == hf.keys()
    for key, tensor in expected.items():
        assert type(hf[key]) is torch.Tensor and torch.equal(hf[key], tensor), key
    loaded_back = adapter.from_hf({k: v * 2 for k, v in hf.items()})
    model.load_state_dict(loaded_back, strict=False)  # the adapter maps not every key back
    assert {n for n, p in model.named_parameters() if isinstance(p, Float8MoEWeight)} <= set(
        loaded_back
    )
    for name, param in plain.named_parameters():
        if name not in loaded_back:
            continue
        loaded = model.get_parameter(name)
        values = loaded._data if isinstance(loaded, Float8MoEWeight) else loaded
        assert torch.equal(values, param * 2), name


def _experts(hidden: int) -> nn.Module:
    """6 grouped experts of dim 256, on the meta device."""
    with torch.device("meta"):
        return nn.ModuleDict({"experts": GroupedExperts(256, hidden, 6, use_grouped_mm=True)})


@pytest.mark.parametrize(
    "hidden, tp, cause",
    [
        (200, 1, r"not dim 1 \(200\): the model's own size"),
        # 272 = 17 x 16 rows, 136 a rank under TP 2
        (272, 2, r"dim 1 is split by parallelism\.tensor_parallel_degree .*; lower it"),
    ],
)
def test_fp8_kernel_shape_refusal_names_the_cause(hidden, tp, cause):
    """w1 [6, hidden, 256] on the CUDA path, policy "always": 200 rows are the model's, and
    no tensor-parallel degree to lower; 272 split over TP 2 is TP's."""
    dims = _parallel_dims(world_size=tp, tp=tp)
    with pytest.raises(ValueError) as error:
        convert(_experts(hidden), emulate=False, policy="always", parallel_dims=dims)
    message = str(error.value)
    assert re.search(r"experts\.w1 has shape \[6, \d+, 256\] per rank.*multiples of 16", message)
    assert re.search(cause, message), message
    assert ("tensor_parallel_degree" in message) == (tp > 1), message
    assert 'float8_moe.policy = "auto"' in message and "float8_moe.fqns" in message, message


def test_convert_takes_a_settings_object_and_keyword_options_alike():
    """``convert(model, settings)``: the same plan as the options as keywords; keywords
    override the settings' fields, and an unknown one is refused."""
    settings = Float8MoESettings(fqns=["experts"], policy="always")
    by_object = convert(_llama4(), settings, emulate=True)
    by_keywords = convert(_llama4(), fqns=["experts"], policy="always", emulate=True)
    assert by_object == by_keywords
    overridden = convert(_llama4(), settings, fqns=["shared_expert"], emulate=True)
    assert overridden and all(".shared_experts." in row.fqn for row in overridden)
    with pytest.raises(TypeError, match="polcy"):
        convert(_llama4(), polcy="always")


def test_the_run_context_reaches_the_converter_explicitly_or_by_its_scope():
    """A converter plans for the context it is given, else for the scope's
    (``run_context.planning``); the scope ends where it is left."""
    from torchtitan.config import ConfigManager

    from torchtitan_fp8_moe import Float8MoEConverter, run_context
    from torchtitan_fp8_moe.run_context import RunContext

    job_config = ConfigManager().parse_args([CUSTOM_CONFIG, "--model.converters=float8_moe"])
    cuda = RunContext(plan_target="cuda")
    assert Float8MoEConverter(job_config, _parallel_dims(1), cuda).path == "cuda"
    with run_context.planning(cuda):
        converter = Float8MoEConverter(job_config, _parallel_dims(1))
    assert converter.context == cuda and not converter.context.launching
    assert run_context.current() == RunContext()
    trainer = Float8MoEConverter(job_config, _parallel_dims(1))
    assert trainer.context.launching
    assert trainer.path == ("cuda" if torch.cuda.is_available() else "emulated")
