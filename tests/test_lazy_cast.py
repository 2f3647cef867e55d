"""The forward's cast of a converted fp32 parameter to bf16 (torchtitan's grouped experts call
``w.bfloat16()`` where FSDP does not cast: one device, DDP) is lazy: it holds no bf16 copy, yet
its matmuls are the fp8 products of the bf16 values (the quantizer rounds the fp32 values as it
reads them), bit for bit what a copied cast gives; any other op sees the bf16 values, and
gradients reach the fp32 parameter as through a plain cast. References are plain torch
(``fp8_product`` of test_fail_closed) and the copied cast (``.clone()``), never the lazy path's
own code."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fail_closed import NOT_FP8_DB, SAME_DB, VIEW_STEPS, fp8_product

from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, LazyCastWeight, WeightConfig

G, H, D, M = 3, 48, 32, 48
OFFS = torch.tensor([16, 16, 48], dtype=torch.int32)  # one empty group


def _parameter(cache_fp8=False):
    plain = torch.randn(G, H, D, generator=torch.Generator().manual_seed(0)) * 0.02
    config = WeightConfig(emulate=True, cache_fp8=cache_fp8)
    return plain, torch.nn.Parameter(Float8MoEWeight(plain.clone(), config))


def _inputs():
    """fp32 tokens and output gradient: fp32 outputs, so fp8 products compare exactly."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(M, D, generator=gen), torch.randn(M, H, generator=gen)


def _routed(x, w16):
    """torchtitan's call: ``_grouped_mm(x, w.bfloat16().transpose(-2, -1), offs)``."""
    return torch._grouped_mm(x, w16.transpose(-2, -1), offs=OFFS)


def _per_group(fn, *tensors):
    """``fn`` of each group's token rows (and the group index)."""
    bounds = zip([0, *OFFS.tolist()[:-1]], OFFS.tolist(), strict=True)
    return [fn(g, *(t[s:e] for t in tensors)) for g, (s, e) in enumerate(bounds)]


@pytest.mark.parametrize("cache_fp8", [False, True], ids=["uncached", "cached"])
def test_lazy_cast_is_the_fp8_product_of_the_bf16_values(cache_fp8):
    plain, w = _parameter(cache_fp8)
    rounded = plain.bfloat16().float()
    assert sqnr(plain, rounded) < 60  # the two differ: a product tells which one was quantized
    x, target = _inputs()
    x = x.requires_grad_()
    w16 = w.bfloat16()
    assert w16.dtype == torch.bfloat16 and w16._data.dtype == torch.float32
    assert w16._data.untyped_storage().data_ptr() == w._data.untyped_storage().data_ptr()
    assert _routed(x.detach().bfloat16(), w16).dtype == torch.bfloat16
    out = _routed(x, w16)
    # Forward: per group, x times the fp8 copy of the weight's bf16 values.
    expected = torch.cat(_per_group(lambda g, xg: fp8_product(xg, rounded[g].t()), x.detach()))
    assert sqnr(expected, out.detach()) > SAME_DB
    high_precision = x.detach()[:16].double() @ plain.double()[0].t()
    assert sqnr(high_precision, out.detach()[:16]) < NOT_FP8_DB
    (out.float() * target.float()).sum().backward()
    # Input gradient: the gradient times the fp8 copy of w^T, scaled per row of H.
    expected_dx = torch.cat(_per_group(lambda g, tg: fp8_product(tg, rounded[g]), target))
    assert sqnr(expected_dx, x.grad) > SAME_DB
    # Weight gradient: fp32 on the parameter, as through a plain cast; its fp8 operands are
    # the tokens and the gradient, so it equals the plain fp32 product within fp8's bar.
    assert w.grad.dtype == torch.float32 and type(w.grad) is torch.Tensor
    plain_grad = torch.stack(
        _per_group(lambda g, xg, tg: tg.double().t() @ xg.double(), x.detach(), target)
    )
    assert sqnr(plain_grad, w.grad) > 21


@pytest.mark.parametrize("cache_fp8", [False, True], ids=["uncached", "cached"])
def test_lazy_cast_equals_a_copied_cast_bit_for_bit(cache_fp8):
    """Output, input gradient and weight gradient as through a materialized cast (``.clone()``
    of it), twice in a row (the second from the cache where there is one)."""
    results = []
    for lazy, make in ((True, lambda w: w.bfloat16()), (False, lambda w: w.bfloat16().clone())):
        _, w = _parameter(cache_fp8)
        for _ in range(2):
            x, target = _inputs()
            x.requires_grad_()
            w16 = make(w)
            assert isinstance(w16, LazyCastWeight) == lazy
            out = _routed(x, w16)
            (out.float() * target.float()).sum().backward()
            results.append((out.detach(), x.grad, w.grad.clone()))
    lazy, copied = results[:2], results[2:]
    for lazy_step, copied_step in zip(lazy, copied, strict=True):
        for got, want in zip(lazy_step, copied_step, strict=True):
            assert torch.equal(got, want)


def test_other_ops_see_the_bf16_values():
    plain, w = _parameter()
    w16 = w.bfloat16()
    rounded = plain.bfloat16()
    assert torch.equal(w16.high_precision(), rounded)
    assert torch.equal((w16 * 2).high_precision(), rounded * 2)
    assert torch.equal(w16.transpose(-2, -1)[1].high_precision(), rounded.transpose(-2, -1)[1])
    assert w16.sum().item() == rounded.sum().item()
    assert torch.equal(w16.view(torch.int16), rounded.view(torch.int16))  # a bytes view
    copy = w16.clone()
    assert not isinstance(copy, LazyCastWeight) and copy._data.dtype == torch.bfloat16
    assert torch.equal(copy.high_precision(), rounded)


def test_writes_fail_closed():
    """The cast holds no copy: a write into it raises, and a use after the parameter was written
    raises instead of seeing the new values; a clone of the cast is an ordinary copy."""
    _, w = _parameter()
    x, _ = _inputs()
    w16 = w.bfloat16()
    with pytest.raises(NotImplementedError, match="lazy"):
        w16.mul_(2)
    with pytest.raises(NotImplementedError, match="lazy"):
        w16.transpose(-2, -1).zero_()
    copy = w.bfloat16().clone()
    copy.mul_(2)  # an ordinary copy: writable
    with torch.no_grad(), pytest.raises(NotImplementedError, match="lazy"):
        torch.add(copy.detach(), 1, out=w16)  # another weight before the cast in the arguments
    view = w16.transpose(-2, -1)
    with torch.no_grad():
        w.add_(1.0)
    for use in (
        lambda: torch._grouped_mm(x, view, offs=OFFS),
        lambda: w16.high_precision(),
        lambda: w16 + 1,
    ):
        with pytest.raises(RuntimeError, match="written"):
            use()
    out = _routed(x, w.bfloat16())  # a new cast after the write is fine
    assert torch.isfinite(out).all()


def test_backward_after_a_write_raises():
    _, w = _parameter()
    x, target = _inputs()
    out = _routed(x.requires_grad_(), w.bfloat16())
    with torch.no_grad():
        w.mul_(0.5)  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="written"):
        (out.float() * target.float()).sum().backward()


def test_compiled_casts_are_lazy_inside_one_graph():
    """In compiled code the cast is lazy in AOTAutograd's trace: the cast and matmul compiled as
    one graph equal eager's copied cast bit for bit, and a cast that would leave the graph (a
    graph break between it and its matmul) fails at compile time, naming the way out, where with
    ``lazy_cast=False`` it is an ordinary copy."""
    plain, w = _parameter()
    x, target = _inputs()

    def fwd_bwd(fn, weight):
        out = fn(x, weight)
        (out * target).sum().backward()
        grad, weight.grad = weight.grad, None
        return out.detach(), grad

    # Forms that use the cast (``cast(w)``) inside the graph: torchtitan's, a view chain, a
    # linear layer on one expert's 2D view, other ops on the bf16 values beside the matmul.
    forms = {
        "routed": lambda x, w16: _routed(x, w16),
        "view_chain": lambda x, w16: _routed(x, w16.transpose(-2, -1).transpose(-2, -1)),
        "linear": lambda x, w16: F.linear(x, w16[1]),
        "other_ops": lambda x, w16: _routed(x, w16) + (w16 * 2).high_precision().sum(),
    }
    for name, form in forms.items():
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x, w, form=form: form(x, w.bfloat16()), backend="aot_eager", fullgraph=True
        )
        got = fwd_bwd(compiled, w)
        want = fwd_bwd(lambda x, w, form=form: form(x, w.bfloat16().clone()), w)
        assert all(map(torch.equal, got, want)), name

    def cast(weight):
        return weight.bfloat16()

    torch._dynamo.reset()
    with pytest.raises(Exception, match="lazy_cast=False"):
        torch.compile(cast, backend="aot_eager", fullgraph=True)(w)
    off = torch.nn.Parameter(
        Float8MoEWeight(plain.clone(), WeightConfig(emulate=True, lazy_cast=False))
    )
    torch._dynamo.reset()
    out = torch.compile(cast, backend="aot_eager", fullgraph=True)(off)
    assert out._data.dtype == torch.bfloat16 and torch.equal(out.high_precision(), plain.bfloat16())


def test_casts_that_copy():
    """Where the cast is not a forward's: without grad (``model.to(torch.bfloat16)``), to fp16
    (its range is not fp32's), of a plain (non-parameter) weight, of a parameter that does not
    require grad; and with ``WeightConfig(lazy_cast=False)``. Each holds a bf16/fp16 copy."""
    plain, w = _parameter()
    with torch.no_grad():
        assert w.bfloat16()._data.dtype == torch.bfloat16
    assert w.half()._data.dtype == torch.float16
    loose = Float8MoEWeight(plain.clone(), WeightConfig(emulate=True))
    assert loose.bfloat16()._data.dtype == torch.bfloat16
    frozen = torch.nn.Parameter(Float8MoEWeight(plain.clone(), WeightConfig(emulate=True)))
    frozen.requires_grad_(False)
    assert frozen.bfloat16()._data.dtype == torch.bfloat16
    off = WeightConfig(emulate=True, lazy_cast=False)
    assert torch.nn.Parameter(Float8MoEWeight(plain.clone(), off)).bfloat16()._data.dtype == (
        torch.bfloat16
    )
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(Float8MoEWeight(plain.clone(), WeightConfig(emulate=True)))
    module.to(torch.bfloat16)
    assert module.w._data.dtype == torch.bfloat16 and not isinstance(module.w, LazyCastWeight)
    with torch.no_grad():
        module.w.add_(1.0)  # a converted model's parameters stay writable


def test_linear_and_matmul_forms_of_a_lazy_cast():
    """2D views of the cast through each matmul entry point: the fp8 product of the bf16
    values in the layout the call uses (F.linear transposes, a square weight included)."""
    plain = torch.randn(2, D, D, generator=torch.Generator().manual_seed(3))
    w = torch.nn.Parameter(Float8MoEWeight(plain.clone(), WeightConfig(emulate=True)))
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(4))
    w16, plain = w.bfloat16(), plain.bfloat16().float()
    for out, b in (
        (F.linear(x, w16[1]), plain[1].t()),
        (x @ w16[1], plain[1]),
        (torch.mm(x, w16[0].t()), plain[0].t()),
        (torch.bmm(x.expand(2, M, D), w16), plain),
    ):
        a = x if out.dim() == 2 else x.expand(2, M, D)
        assert sqnr(fp8_product(a, b), out) > SAME_DB


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=st.lists(st.sampled_from(sorted(VIEW_STEPS)), max_size=4),
    expert=st.integers(0, G - 1),
)
def test_view_chains_of_a_lazy_cast(chain, expert):
    """Views keep the cast lazy; a step that copies anywhere in the chain (where plain torch
    copies a bf16 tensor: clone, a cast to another dtype, contiguous or flatten of a
    non-contiguous one) makes a copy. Either way the matmul is the fp8 product of the bf16
    values."""
    plain, w = _parameter()
    x, _ = _inputs()
    w2, rounded = w.bfloat16()[expert], plain[expert].bfloat16()
    copied = False
    for step in chain:
        fn = VIEW_STEPS[step]
        w2, rounded_next = fn(w2), fn(rounded)
        copied |= rounded_next.untyped_storage().data_ptr() != rounded.untyped_storage().data_ptr()
        rounded = rounded_next
    if w2.shape != (H, D):
        w2, rounded = w2.transpose(-2, -1), rounded.transpose(-2, -1)
    assert (not isinstance(w2, LazyCastWeight)) == copied
    out = F.linear(x, w2)
    assert sqnr(fp8_product(x, rounded.float().t()), out) > SAME_DB
