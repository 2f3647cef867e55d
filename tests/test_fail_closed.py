"""Fail closed: every matmul of a converted weight is fp8 rowwise or raises, whatever views,
casts and call forms lead to it. Each result is checked against an fp8 reference written here in
plain torch (quantize both operands per row of the contraction dim with power-of-2 scales,
dequantize, multiply in float64), not against the package's own code, and against the
high-precision product, which an fp8 result must not equal."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig
from torchtitan_fp8_moe.weight.gathered import GATHERED_OPS
from torchtitan_fp8_moe.weight.lazy_cast import LAZY_CAST_OPS
from torchtitan_fp8_moe.weight.ops import Kind, OpTable
from torchtitan_fp8_moe.weight.tensor import WEIGHT_OPS

H, D, M = 48, 32, 24
E4M3_MAX = 448.0
# fp8 against its reference: equal up to fp32 accumulation order. fp8 against high precision:
# 3 mantissa bits keep the output SQNR near 28 dB; 40 dB would mean the fp8 path did not run.
SAME_DB, NOT_FP8_DB = 100.0, 40.0


def fp8_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` rounded to float8_e4m3fn with one power-of-2 scale per slice along ``dim``."""
    t = t.double()
    amax = t.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() / scale


def fp8_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., K] @ b [..., K, N]`` with both operands fp8 per row of K."""
    return fp8_rows(a, -1) @ fp8_rows(b, -2)


def assert_fp8(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """``out`` is the fp8 product of ``a`` and ``b`` (``b`` plain, contraction dim -2)."""
    assert type(out) is torch.Tensor
    assert sqnr(fp8_product(a, b), out) > SAME_DB
    assert sqnr(a.double() @ b.double(), out) < NOT_FP8_DB, "ran in high precision"


def _weight(shape=(1, H, D), cache_fp8=False):
    plain = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return plain, Float8MoEWeight(plain.clone(), WeightConfig(emulate=True, cache_fp8=cache_fp8))


X = torch.randn(M, D, generator=torch.Generator().manual_seed(1))

# The call forms that ran in high precision before (issue #10), and more. Each gives
# (output, the plain right operand [K, N] or [G, K, N] it must be the fp8 product with, lhs).
FP8_FORMS = {
    "linear(squeeze)": lambda w, p: (F.linear(X, w.squeeze(0)), p[0].t(), X),
    "@ squeeze.t": lambda w, p: (X @ w.squeeze(0).t(), p[0].t(), X),
    "linear(next(iter))": lambda w, p: (F.linear(X, next(iter(w))), p[0].t(), X),
    "linear(unbind[0])": lambda w, p: (F.linear(X, w.unbind(0)[0]), p[0].t(), X),
    "bmm(expand)": lambda w, p: (
        torch.bmm(X.expand(2, M, D), w.expand(2, H, D).transpose(-2, -1)),
        p.expand(2, H, D).transpose(-2, -1),
        X.expand(2, M, D),
    ),
    "linear(view)": lambda w, p: (F.linear(X, w.view(H, D)), p[0].t(), X),
    "linear(reshape.float)": lambda w, p: (F.linear(X, w.reshape(H, D).float()), p[0].t(), X),
    "matmul(mT[0])": lambda w, p: (torch.matmul(X, w.mT[0]), p[0].t(), X),
    "mm(chunk.t)": lambda w, p: (torch.mm(X, w[0].chunk(2)[1].t()), p[0, H // 2 :].t(), X),
    "linear(narrow)": lambda w, p: (F.linear(X, w[0].narrow(0, 8, 16)), p[0, 8:24].t(), X),
    "linear(contiguous.T)": lambda w, p: (F.linear(X, w[0].t().contiguous().T), p[0].t(), X),
    "linear(movedim)": lambda w, p: (F.linear(X, w.movedim(0, 2)[..., 0]), p[0].t(), X),
    "linear(clone.detach)": lambda w, p: (F.linear(X, w[0].clone().detach()), p[0].t(), X),
    "linear(w * 2)": lambda w, p: (F.linear(X, w[0] * 2), p[0].t() * 2, X),
    # DTensor zero-pads uneven shards before collectives
    "linear(pad)": lambda w, p: (
        F.linear(X, F.pad(w[0], (0, 0, 0, 2))),
        F.pad(p[0], (0, 0, 0, 2)).t(),
        X,
    ),
    "_grouped_mm 3D x 3D": lambda w, p: (
        torch._grouped_mm(X.unsqueeze(0), w.transpose(-2, -1)),
        p.transpose(-2, -1),
        X[None],
    ),
}

RAISING_FORMS = {
    "einsum": lambda w: torch.einsum("md,hd->mh", X, w[0]),
    "addmm": lambda w: torch.addmm(torch.zeros(M, H), X, w[0].t()),
    "tensordot": lambda w: torch.tensordot(X, w[0], dims=([1], [1])),
    "conv1d": lambda w: F.conv1d(X.t()[None], w.view(H, D, 1)),
    "bilinear": lambda w: F.bilinear(X, X, w.view(H, D, 1).expand(H, D, D)),
    "mv": lambda w: torch.mv(w[0], X[0]),
    "rmatmul": lambda w: w[0] @ X.t(),
    "index_select": lambda w: torch.index_select(w[0], 0, torch.tensor([0, 2])),
    "cat": lambda w: torch.cat([w[0], w[0]]),
    "stack": lambda w: torch.stack([w[0], w[0]]),
    "sum(dim)": lambda w: (X[:, None, :] * w[0]).sum(-1),
    "linear 3D weight": lambda w: F.linear(X, w),
    "_grouped_mm 2D x 3D without offsets": lambda w: torch._grouped_mm(X, w.transpose(-2, -1)),
    "transpose_": lambda w: w.transpose_(1, 2),
}


@pytest.mark.parametrize("form", FP8_FORMS)
def test_call_form_runs_in_fp8(form):
    plain, w = _weight()
    out, b, a = FP8_FORMS[form](w, plain)
    assert_fp8(out, a, b)


# Each handled op on an fp32 activation x [M, D] and a weight w [1, H, D] (converted or plain).
AUTOCAST_FORMS = {
    "linear": lambda x, w: F.linear(x, w[0]),
    "linear(bias)": lambda x, w: F.linear(x, w[0], torch.ones(H)),
    "matmul": lambda x, w: torch.matmul(x, w[0].t()),
    "@": lambda x, w: x @ w[0].t(),
    "mm": lambda x, w: torch.mm(x, w[0].t()),
    "bmm": lambda x, w: torch.bmm(x[None], w.transpose(-2, -1)),
    "_grouped_mm": lambda x, w: torch._grouped_mm(
        x, w.transpose(-2, -1), offs=torch.tensor([M], dtype=torch.int32)
    ),
}


@pytest.mark.parametrize("form", AUTOCAST_FORMS)
def test_call_form_follows_autocast(form):
    """Under autocast (torchtitan trains single-device and DDP runs under it) a converted
    weight's matmul gives the dtype that the same call with the plain weight gives (bf16 for
    the ops autocast lowers: fp32 there doubled every later activation's memory), the fp8
    product of the activation as autocast casts it, and gradients reach the fp32 input."""
    plain, w = _weight()
    x = X.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = AUTOCAST_FORMS[form](X, plain)
        out = AUTOCAST_FORMS[form](x, w)
    assert out.dtype == expected.dtype
    bias = 1.0 if "bias" in form else 0.0
    reference = fp8_product(X.to(out.dtype), plain[0].t()) + bias
    assert sqnr(reference, out.detach().reshape(reference.shape)) > 40
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0


@pytest.mark.parametrize("form", RAISING_FORMS)
def test_unsupported_call_form_raises(form):
    _, w = _weight()
    with pytest.raises(NotImplementedError, match="float8_moe"):
        RAISING_FORMS[form](w)


def test_statistics_and_explicit_high_precision_stay_plain():
    """What cannot be a matmul operand comes out plain: scalars, bool and integer tensors.
    ``high_precision()`` is the explicit opt-out, and gradients flow through it."""
    plain, w = _weight()
    w.requires_grad_()
    assert type(w.norm()) is torch.Tensor and torch.allclose(w.norm(), plain.norm())
    assert w.abs().max().item() == plain.abs().max().item()
    assert torch.equal(torch.isfinite(w), torch.isfinite(plain))
    assert torch.equal(w, plain) and torch.allclose(w, plain)
    out = F.linear(X, w.high_precision()[0])
    assert type(out) is torch.Tensor and torch.allclose(out, X @ plain[0].t(), atol=1e-5)
    (w.high_precision() ** 2).sum().backward()
    assert torch.allclose(w.grad, 2 * plain)


# ---- hypothesis: chains of view ops, then each matmul entry point -----------------------------

VIEW_STEPS = {
    "transpose": lambda t: t.transpose(-2, -1),
    "mT": lambda t: t.mT,
    "unsqueeze0.squeeze0": lambda t: t.unsqueeze(0).squeeze(0),
    "view_as": lambda t: t.view_as(t),
    "contiguous": lambda t: t.contiguous(),
    "float": lambda t: t.float(),
    "bfloat16": lambda t: t.bfloat16(),
    "detach": lambda t: t.detach(),
    "alias(as_strided)": lambda t: t.as_strided(t.shape, t.stride(), t.storage_offset()),
    "expand": lambda t: t.expand(*t.shape),
    "flatten.unflatten": lambda t: t.flatten(-2).unflatten(-1, t.shape[-2:]),
    "clone": lambda t: t.clone(),
}


def _entry_points(w2: torch.Tensor):
    """Each matmul entry point with ``w2 [N, K]`` (or a view of it) as the weight: (name,
    callable on x [M, K], the plain right operand's function of w2)."""
    return {
        "F.linear": (lambda x, w: F.linear(x, w), lambda w: w.t()),
        "matmul(t)": (lambda x, w: torch.matmul(x, w.t()), lambda w: w.t()),
        "@ t": (lambda x, w: x @ w.t(), lambda w: w.t()),
        "mm(t)": (lambda x, w: torch.mm(x, w.t()), lambda w: w.t()),
        "bmm": (lambda x, w: torch.bmm(x[None], w.t()[None])[0], lambda w: w.t()),
        "_grouped_mm 3D": (
            lambda x, w: torch._grouped_mm(x[None], w.t()[None])[0],
            lambda w: w.t(),
        ),
        "_grouped_mm offs": (
            lambda x, w: torch._grouped_mm(
                x, w.t()[None], offs=torch.tensor([x.shape[0]], dtype=torch.int32)
            ),
            lambda w: w.t(),
        ),
        "einsum": (lambda x, w: torch.einsum("mk,nk->mn", x, w), lambda w: w.t()),
        "addmm": (lambda x, w: torch.addmm(torch.zeros(()), x, w.t()), lambda w: w.t()),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=st.lists(st.sampled_from(sorted(VIEW_STEPS)), max_size=5),
    entry=st.sampled_from(sorted(_entry_points(torch.zeros(1, 1)))),
    start=st.sampled_from(["squeeze", "select", "unbind", "iter", "view"]),
)
def test_view_chains_then_matmul_are_fp8_or_raise(chain, entry, start):
    """A chain of views and casts of a ``[1, H, D]`` weight, then a matmul entry point: the
    result is the fp8 product of the same chain applied to the plain weight, or the call raises
    NotImplementedError. Never a high-precision product."""
    plain, w = _weight()
    first = {
        "squeeze": lambda t: t.squeeze(0),
        "select": lambda t: t[0],
        "unbind": lambda t: t.unbind(0)[0],
        "iter": lambda t: next(iter(t)),
        "view": lambda t: t.view(H, D),
    }[start]
    w2, p2 = first(w), first(plain)
    for step in chain:
        w2, p2 = VIEW_STEPS[step](w2), VIEW_STEPS[step](p2)
        # Transposes alternate the layout: bring it back to [N, K] for the entry point.
    if w2.shape != (H, D):
        w2, p2 = w2.transpose(-2, -1), p2.transpose(-2, -1)
    assert isinstance(w2, Float8MoEWeight), f"{start} {chain} dropped the wrapper"
    call, right_operand = _entry_points(p2)[entry]
    try:
        out = call(X, w2)
    except NotImplementedError as e:
        assert "float8_moe" in str(e)
        return
    assert_fp8(out, X, right_operand(p2.float()))


@pytest.mark.parametrize("on", ["weight", "view"])
@pytest.mark.parametrize("form", ["linear", "high_precision"])
def test_a_matmul_leaves_the_weights_storage_out_of_autograd(form, on):
    """F.linear on the weight itself gave its stored tensor a grad_fn, a reference cycle
    through autograd's C++ nodes that kept the weight alive after its last use (found when
    the timing policy's weights outlived it, measure.py)."""
    import gc
    import weakref

    param = torch.nn.Parameter(Float8MoEWeight(torch.randn(H, D), WeightConfig("rowwise", True)))
    w = param if on == "weight" else param.view(H, D)
    x = X.clone().requires_grad_()
    out = F.linear(x, w) if form == "linear" else x @ w.high_precision().t()
    out.sum().backward()
    assert param.grad is not None and x.grad is not None
    assert not param._data.requires_grad and param._data.grad_fn is None
    freed = weakref.ref(param)
    del param, w, out, x
    gc.collect()
    assert freed() is None


@pytest.mark.parametrize(
    "table", [WEIGHT_OPS, LAZY_CAST_OPS, GATHERED_OPS], ids=["weight", "lazy_cast", "gathered"]
)
def test_every_op_kind_has_a_handler(table):
    """Each weight type's op table says what every kind of op does to it; a table refuses a
    kind it has no handler for."""
    for kind in Kind:
        assert callable(table.handler(kind))
    with pytest.raises(NotImplementedError, match="no handler"):
        OpTable(Float8MoEWeight).handler(Kind.VIEW)
