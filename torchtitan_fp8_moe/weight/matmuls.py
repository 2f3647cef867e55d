"""The matmul overrides: each call form a converted weight is the right operand of, mapped to
the fp8 matmuls of ``fp8/scaled_grouped_mm.py`` (by the weight's recipe); other forms raise."""

from collections.abc import Callable

from ..fp8 import fp8_batched_mm, fp8_grouped_mm, fp8_matmul


def _grouped_mm(a, weight, offs=None, bias=None, out_dtype=None):
    if bias is not None or out_dtype is not None:
        raise NotImplementedError(
            "float8_moe: torch._grouped_mm with bias or out_dtype is not supported"
        )
    b, source = weight.fp8_operand()
    if a.ndim == 2 and b.ndim == 3 and offs is not None:
        return fp8_grouped_mm(a, b, offs, **_fp8_args(weight, source))
    if a.ndim == 3 and b.ndim == 3 and offs is None:
        return fp8_batched_mm(a, b, **_fp8_args(weight, source))
    raise NotImplementedError(
        f"float8_moe: torch._grouped_mm of {list(a.shape)} x {list(b.shape)} "
        f"{'with' if offs is not None else 'without'} offsets is not supported; supported: "
        "2D x 3D with offsets (routed experts) and 3D x 3D without (grouped shared expert)"
    )


def _fp8_args(weight, source) -> dict:
    """The fp8 matmuls' arguments after the operands: the weight's recipe and path, where its
    fp8 copies come from (``source``), whether another weight shares its input, the backends of
    its GEMMs."""
    recipe, emulate = weight.fp8_path()
    config = weight.config
    return dict(
        recipe=recipe,
        emulate=emulate,
        cached=source,
        shared_a=config.shares_input,
        gemm=config.gemm,
    )


def _unsupported_form(name: str, a, weight, supported: str):
    return NotImplementedError(
        f"float8_moe: {name} of {list(a.shape)} x converted weight {list(weight.shape)} is not "
        f"supported in fp8; supported: {supported}"
    )


def _linear(x, weight, bias=None):
    if weight.ndim != 2:
        raise _unsupported_form("F.linear", x, weight, "a 2D weight [N, K]")
    b, source = weight.fp8_operand(transpose=True)
    out = fp8_matmul(x, b, **_fp8_args(weight, source))
    return out if bias is None else out + bias


def _batched(a, weight) -> bool:
    return a.ndim == 3 and weight.ndim == 3 and a.shape[0] == weight.shape[0]


def _fp8_matmul_of(a, weight):
    b, source = weight.fp8_operand()
    if b.ndim == 2:
        return fp8_matmul(a, b, **_fp8_args(weight, source))
    return fp8_batched_mm(a, b, **_fp8_args(weight, source))


def _matmul(a, weight):
    if not (weight.ndim == 2 and a.ndim >= 1) and not _batched(a, weight):
        raise _unsupported_form("matmul", a, weight, "[..., K] x [K, N] and [G, M, K] x [G, K, N]")
    return _fp8_matmul_of(a, weight)


def _mm(a, weight):
    if not (a.ndim == 2 and weight.ndim == 2):
        raise _unsupported_form("mm", a, weight, "[M, K] x [K, N]")
    return _fp8_matmul_of(a, weight)


def _bmm(a, weight):
    if not _batched(a, weight):
        raise _unsupported_form("bmm", a, weight, "[G, M, K] x [G, K, N]")
    return _fp8_matmul_of(a, weight)


# The handled ops that autocast runs in its lower-precision dtype (linear layers and matmuls;
# ``_grouped_mm`` is not among them, and torchtitan casts its operands to bf16 itself).
AUTOCAST_LOWER_PRECISION = frozenset({"linear", "matmul", "__matmul__", "mm", "bmm"})

MATMUL_HANDLERS: dict[str, Callable] = {
    "_grouped_mm": _grouped_mm,
    "linear": _linear,
    "matmul": _matmul,
    "__matmul__": _matmul,
    "mm": _mm,
    "bmm": _bmm,
}
