"""torchtitan 0.2.2's MoE with float8_moe's routed path (``routed_dispatch.py``) against the same
converted layer on torchtitan's own forward: the output bit for bit (on CUDA up to the order of
the combine kernel's sums), the gradients equal up to the order of summation, each token cast
once in the forward; under skewed routing (experts with no token), with and without a shared
expert, rowwise and blockwise, eager (emulated fp8 on CPU)."""

import copy
import functools

import pytest
import torch
from torchtitan.models.moe.moe import MoE, MoEArgs

import torchtitan_fp8_moe
from torchtitan_fp8_moe import cpu, routed_dispatch
from torchtitan_fp8_moe.fp8.recipes import recipe_named

DIM, HIDDEN = 64, 32


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
            reason="fp8 kernels need CUDA sm89+",
        ),
    ),
]


def _layer(experts: int, top_k: int, shared: int, score_before_experts: bool = False) -> MoE:
    args = MoEArgs(
        num_experts=experts,
        num_shared_experts=shared,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        score_before_experts=score_before_experts,
    )
    torch.manual_seed(0)
    layer = MoE(args, dim=DIM, hidden_dim=HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        layer.init_weights(0.02, torch.device("cpu"))
    return layer


def _run(layer, x):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out, x.grad, grads


@pytest.mark.parametrize(
    "experts,top_k,shared,skew",
    [(8, 4, 1, False), (8, 2, 0, False), (8, 4, 0, True), (1, 1, 1, False), (16, 8, 1, True)],
    ids=["top4-shared", "top2", "top4-skewed", "one-expert", "top8-skewed-shared"],
)
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("device", DEVICES)
def test_routed_path_equals_torchtitans(monkeypatch, device, recipe, experts, top_k, shared, skew):
    if device == "cpu":
        cpu.enable_moe_ops()
    base = _layer(experts, top_k, shared).to(device)
    if skew:  # a bias that sends most tokens to the first experts: some get none
        with torch.no_grad():
            base.router.gate.weight.zero_()
            base.expert_bias = torch.linspace(4.0, -4.0, experts, device=device)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    emulate = device == "cpu"
    torchtitan_fp8_moe.convert(ours, policy="always", emulate=emulate, recipe=recipe)
    torchtitan_fp8_moe.convert(theirs, policy="always", emulate=emulate, recipe=recipe)
    routed_dispatch.uninstall(theirs)
    assert "forward" in ours.__dict__ and "forward" not in theirs.__dict__
    x = torch.randn(2, 24, DIM, dtype=torch.bfloat16, device=device)

    cast_rows = []
    quantize = recipe_named(recipe).quantizers(emulate=device == "cpu")
    original = quantize.tokens

    def counted(t):
        cast_rows.append(t.shape[0])
        return original(t)

    monkeypatch.setattr(quantize, "tokens", counted)
    out, x_grad, grads = _run(ours, x)
    ours_casts = list(cast_rows)
    cast_rows.clear()
    want_out, want_x_grad, want_grads = _run(theirs, x)
    theirs_casts = list(cast_rows)

    if device == "cpu":
        assert torch.equal(out, want_out)
    else:  # the combine kernel's fp32 sums over top_k, in its own order, rounded once
        torch.testing.assert_close(out, want_out, rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=1e-2, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-2, atol=1e-6, msg=name)
    tokens = x.shape[0] * x.shape[1]
    # The routed experts' forward casts the tokens (and the zero padding row) once, where
    # torchtitan's casts every padded routed copy; the shared expert casts the tokens itself.
    routed_casts = [rows for rows in ours_casts if rows == tokens + 1]
    assert routed_casts == [tokens + 1], ours_casts
    assert max(theirs_casts) >= tokens * top_k, theirs_casts
    assert not any(rows > tokens + 1 for rows in ours_casts), ours_casts


def test_not_installed_where_scores_precede_the_experts():
    """Llama4 scores each routed copy before the experts: torchtitan's forward stays."""
    layer = _layer(8, 1, 1, score_before_experts=True)
    torchtitan_fp8_moe.convert(layer, policy="always")
    assert "forward" not in layer.__dict__


def test_torchtitans_forward_where_the_routed_experts_are_not_selected():
    layer = _layer(8, 2, 1)
    torchtitan_fp8_moe.convert(layer, fqns=["shared_experts"], policy="always", emulate=True)
    assert "forward" not in layer.__dict__


@pytest.mark.parametrize("device", DEVICES)
def test_routed_experts_kept_bf16_take_the_routed_path_too(device):
    """No routed weight converted (the policy kept them bf16): the same gathers, no fp8 cast;
    the output is torchtitan's bit for bit."""
    if device == "cpu":
        cpu.enable_moe_ops()
    base = _layer(8, 4, 1).to(device)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    for layer in (ours, theirs):
        torchtitan_fp8_moe.convert(layer, fqns=["shared_experts"], policy="always", emulate=True)
        routed_dispatch.install(layer, {layer.experts})
    routed_dispatch.uninstall(theirs)
    assert "forward" in ours.__dict__
    x = torch.randn(2, 24, DIM, dtype=torch.bfloat16, device=device)
    out, x_grad, _ = _run(ours, x)
    want_out, want_x_grad, _ = _run(theirs, x)
    if device == "cpu":
        assert torch.equal(out, want_out)
    else:  # the combine kernel's fp32 sums over top_k, in its own order, rounded once
        torch.testing.assert_close(out, want_out, rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=1e-2, atol=1e-5)


def test_no_eager_cast_for_experts_torchtitan_compiled(monkeypatch):
    """torchtitan's compile.enable compiles the experts' function, whose casts never take the
    eager cast: the routed path then casts nothing itself (only the gathers stay)."""
    from torchtitan.models.moe import moe

    cpu.enable_moe_ops()
    layer = _layer(8, 4, 0)
    torchtitan_fp8_moe.convert(layer, policy="always", emulate=True)
    original = moe._run_experts_grouped_mm

    @functools.wraps(original)
    def wrapped(*args):  # what torch.compile hands torchtitan: a wrapper of the function
        return original(*args)

    monkeypatch.setattr(moe, "_run_experts_grouped_mm", wrapped)
    quantize = recipe_named("rowwise").quantizers(emulate=True)
    cast_rows = []
    tokens = quantize.tokens
    monkeypatch.setattr(quantize, "tokens", lambda t: cast_rows.append(t.shape[0]) or tokens(t))
    _run(layer, torch.randn(2, 24, DIM, dtype=torch.bfloat16))
    assert 2 * 24 + 1 not in cast_rows, cast_rows
