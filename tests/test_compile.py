"""torch.compile(fullgraph=True) over converted weights gives the eager fp8 results exactly,
the way torchtitan compiles Llama4 (the routed-expert function and the shared expert), and over
an expert weight all-gathered as fp8 payloads."""

import pytest
import torch
import torch._dynamo.config
import torch._inductor.config
from expert_modules import (
    build_expert_module,
    convert_to_float8_moe,
    expert_inputs,
    gathered_by_hand,
)
from torchtitan.models.moe.moe import _run_experts_grouped_mm

from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

# Inductor's C++ compilation: about 45 s on 2 cores from an empty cache, as every session starts.
pytestmark = pytest.mark.slow


def _fwd_bwd(fn, module, kind, dim0):
    x, routing, target = expert_inputs(kind, dim0, 0)
    x.requires_grad_()
    out = fn(x, *routing)
    (out.float() * target).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), x.grad, grads


# torch's own config patches: pytest 9.2's monkeypatch undo deletes a config module's entry
# instead of restoring it, which breaks every later test that reads it.
@torch._dynamo.config.patch(capture_scalar_outputs=True)
@torch._inductor.config.patch(emulate_precision_casts=True)
def test_compiled_experts_equal_eager():
    # Inductor lowers the routed experts; the shared experts, which run the same quantization
    # and GEMM ops, are traced by dynamo and AOTAutograd (aot_eager): each inductor case costs
    # about 30 s of C++ compilation on 2 cores, and the README job compiled (test_train.py)
    # lowers FeedForward shared experts with inductor in the trainer.
    for kind, dim0, compile_target, backend in [
        ("routed", 4, "function", "inductor"),  # torchtitan compiles _run_experts_grouped_mm
        ("grouped_shared", 1, "module", "aot_eager"),  # and the shared expert module
        ("linear_shared", 64, "module", "aot_eager"),
    ]:
        torch._dynamo.reset()
        # The fp32 weights' bf16 cast is lazy, eager and compiled (the routed experts' in
        # AOTAutograd's trace); the reference is eager with copied casts: the same bf16 values.
        copied = convert_to_float8_moe(build_expert_module(kind, dim0), lazy_cast=False)
        eager = _fwd_bwd(copied, copied, kind, dim0)
        module = convert_to_float8_moe(build_expert_module(kind, dim0))
        lazy_eager = _fwd_bwd(module, module, kind, dim0)
        assert torch.equal(lazy_eager[0], eager[0]) and torch.equal(lazy_eager[1], eager[1])
        assert all(map(torch.equal, lazy_eager[2], eager[2])), kind
        if compile_target == "function":
            experts = module.experts
            compiled_fn = torch.compile(_run_experts_grouped_mm, backend=backend, fullgraph=True)

            def compiled(x, tokens, fn=compiled_fn, experts=experts):
                return fn(experts.w1, experts.w2, experts.w3, x, tokens)
        else:
            compiled = torch.compile(module, backend=backend, fullgraph=True)
        result = _fwd_bwd(compiled, module, kind, dim0)
        assert torch.equal(result[0], eager[0]), kind
        assert torch.equal(result[1], eager[1]), kind
        for got, want in zip(result[2], eager[2], strict=True):
            assert torch.equal(got, want), kind
        assert all(type(p).__name__ == "Float8MoEWeight" for p in module.parameters())


def test_compiled_fp8_gathered_weight_equals_eager():
    """An expert weight all-gathered as fp8 payloads (3 experts over 2 ranks: one rank holds a
    padding row) enters compiled code as a graph input: inductor's and AOTAutograd's results equal
    eager's, which equal quantizing the unsharded weight, bit for bit."""
    torch.manual_seed(0)
    weight = torch.randn(3, 48, 32, dtype=torch.bfloat16)
    offs = torch.tensor([8, 8, 40], dtype=torch.int32)  # an empty group, 8 rows of no group
    x = torch.randn(48, 32, dtype=torch.bfloat16)
    target = torch.randn(48, 48)

    def experts(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def fwd_bwd(fn, w):
        x_leaf = x.clone().requires_grad_()
        out = fn(x_leaf, w)
        (out.float() * target).sum().backward()
        grad, w.grad = w.grad, None
        return out.detach(), x_leaf.grad, grad

    quantizing = torch.nn.Parameter(Float8MoEWeight(weight.clone(), WeightConfig(emulate=True)))
    want = fwd_bwd(experts, quantizing)
    gathered_weight = torch.nn.Parameter(gathered_by_hand(weight, world=2, emulate=True))
    assert type(gathered_weight).__name__ == "Float8GatheredWeight"
    results = {"eager": fwd_bwd(experts, gathered_weight)}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        results[backend] = fwd_bwd(
            torch.compile(experts, backend=backend, fullgraph=True), gathered_weight
        )
    for name, got in results.items():
        for value, expected in zip(got, want, strict=True):
            assert torch.equal(value, expected), name
    assert type(results["inductor"][2]) is torch.Tensor
