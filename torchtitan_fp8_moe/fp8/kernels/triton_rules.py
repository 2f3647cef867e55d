"""The rules of ``quantize.py`` as Triton device functions, shared by our fp8 cast kernels."""

import os

import triton
import triton.language as tl


@triton.jit
def pow2_scale(amax, FP8_LIMIT: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """The largest power of two that keeps ``amax`` within +-FP8_LIMIT (0 for an infinite amax),
    taken from the float's exponent bits, so it is exact."""
    multiplier = FP8_LIMIT / tl.maximum(amax, AMAX_FLOOR)
    return (multiplier.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def saturate(scaled, FP8_LIMIT: tl.constexpr):
    """Clamp to the fp8 range; NaN stays NaN."""
    return tl.clamp(scaled, -FP8_LIMIT, FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL)


# Triton's CPU interpreter holds bf16 as float32 (a cast to it does not round), so there the
# rounding to bf16 below is done on the bits; on a GPU, by the conversion instruction.
_ROUND_ON_BITS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def as_float32(x, ROUND_TO_BF16: tl.constexpr):
    """``x`` as float32; with ROUND_TO_BF16 rounded to bf16 first (to nearest, ties to even,
    overflow to infinity, NaN kept: torch's cast), the values of a bf16 cast of ``x`` without
    making that cast in memory."""
    values = x.to(tl.float32)
    if ROUND_TO_BF16:
        if _ROUND_ON_BITS:
            bits = values.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
            values = tl.where(values != values, values, bits.to(tl.float32, bitcast=True))
        else:
            values = values.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    return values
