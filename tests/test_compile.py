"""torch.compile(fullgraph=True) over converted weights gives the eager fp8 results exactly,
the way torchtitan compiles Llama4 (the routed-expert function and the shared expert)."""

import torch
import torch._inductor.config
from expert_modules import build_expert_module, convert_to_float8_moe, expert_inputs
from torchtitan.models.moe.moe import _run_experts_grouped_mm


def _fwd_bwd(fn, module, kind, dim0):
    x, routing, target = expert_inputs(kind, dim0, 0)
    x.requires_grad_()
    out = fn(x, *routing)
    (out.float() * target).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return out.detach(), x.grad, grads


def test_compiled_experts_equal_eager(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)
    for kind, dim0, compile_target in [
        ("routed", 4, "function"),  # torchtitan compiles _run_experts_grouped_mm
        ("grouped_shared", 1, "module"),  # and the shared expert module
        ("linear_shared", 64, "module"),
    ]:
        torch._dynamo.reset()
        module = convert_to_float8_moe(build_expert_module(kind, dim0))
        eager = _fwd_bwd(module, module, kind, dim0)
        if compile_target == "function":
            experts = module.experts
            compiled_fn = torch.compile(_run_experts_grouped_mm, fullgraph=True)

            def compiled(x, tokens, fn=compiled_fn, experts=experts):
                return fn(experts.w1, experts.w2, experts.w3, x, tokens)
        else:
            compiled = torch.compile(module, fullgraph=True)
        result = _fwd_bwd(compiled, module, kind, dim0)
        assert torch.equal(result[0], eager[0]), kind
        assert torch.equal(result[1], eager[1]), kind
        for got, want in zip(result[2], eager[2], strict=True):
            assert torch.equal(got, want), kind
        assert all(type(p).__name__ == "Float8MoEWeight" for p in module.parameters())
