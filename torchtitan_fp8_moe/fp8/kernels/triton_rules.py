"""The rules of ``quantize.py`` as Triton device functions, shared by our fp8 cast kernels."""

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
