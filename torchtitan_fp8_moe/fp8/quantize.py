"""fp8 rowwise quantization: the one set of rules every fp8 GEMM in this package uses.

A "rowwise" scale is one scale per row of the GEMM's contraction: the amax is taken along the
dimension that the matmul sums over, so every output element is a dot product of two vectors that
each carry a single scale. Scales are powers of two (rounded down), which makes scaling and
unscaling exact in any float format: the only rounding is the cast to float8_e4m3fn itself.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# torch's fp8 GEMMs (CUDA) need the dims they read 16 bytes at a time to be multiples of this:
# both matrix dims of each rank's weight, and the dim a weight gradient contracts over.
FP8_MATRIX_ALIGNMENT = 16
# The smallest amax a scale is taken from: all-zero rows get a finite scale (and stay zero), and
# every row whose amax is at least this (about 8e-31, far below any trained weight) keeps fp8's
# full relative precision. (With torchao's 1e-12, rows of amax 1e-16 lost some values and rows
# of amax 1e-20 quantized to all zeros.) The largest scale, 2**108, and its inverse stay normal
# float32 numbers.
AMAX_FLOOR = 2.0**-100


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The largest power-of-2 multipliers that keep ``amax`` within fp8 range."""
    scale = FP8_MAX / amax.float().clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale)))


def amax_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 amax of |x| along ``dim`` (NaN where a slice holds one), without making |x|."""
    x = x.detach()
    if x.is_cuda:
        # The inf-norm is one pass; amax and amin are two, slower on the GPU, though faster
        # than it on CPU.
        return torch.linalg.vector_norm(x, ord=float("inf"), dim=dim).float()
    return torch.maximum(x.amax(dim=dim), -x.amin(dim=dim)).float()


def rounded(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x``'s values as a cast to ``dtype`` holds them: what a weight quantizer quantizes when
    its operand stands for such a cast (``round_to``: a lazy bf16 cast, ``weight/tensor.py``)."""
    return x if dtype is None else x.to(dtype)


def rowwise_scales(x: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 multipliers that map each slice of ``x`` along ``dim`` into fp8 range (keepdim)."""
    return scales_from_amax(amax_along(x, dim).unsqueeze(dim))


# The emulation's steps are chosen for the CPU, where every test and CI run emulates: in place
# where a new tensor per step cost more (page faults) than the math, and bf16 kept bf16.
def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Multiply by ``scale`` (broadcast) and cast to fp8, saturating at the fp8 range."""
    if x.dtype == torch.bfloat16:
        # A power-of-2 multiple of a bf16 value is a bf16 value (same exponent range as
        # float32), so bf16 math gives the float32 path's bytes with half the memory traffic.
        scaled = x * scale.to(torch.bfloat16)
    else:
        scaled = x.to(torch.float32, copy=True).mul_(scale)
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 data and fp32 scales (keepdim) of ``x``, one scale per slice along ``dim``."""
    scale = rowwise_scales(x, dim)
    return to_fp8(x, scale), scale


# The float32 value of each of the 256 fp8 codes: on CPU, where torch converts fp8 one element
# at a time, looking them up in chunks (one small index buffer, no tensor-sized temporary) is
# faster than ``.float()``.
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
_LOOKUP_CHUNK = 1 << 16


def _fp8_values_on_cpu(data: torch.Tensor) -> torch.Tensor:
    codes = data.contiguous().view(torch.uint8).reshape(-1)
    values = torch.empty(codes.shape, dtype=torch.float32)
    index = torch.empty(min(_LOOKUP_CHUNK, codes.numel()), dtype=torch.int32)
    for start in range(0, codes.numel(), _LOOKUP_CHUNK):
        chunk = codes[start : start + _LOOKUP_CHUNK]
        chunk_index = index[: chunk.numel()].copy_(chunk)
        torch.index_select(_FP8_VALUES, 0, chunk_index, out=values[start : start + chunk.numel()])
    return values.view(data.shape)


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values that fp8 ``data`` with multiplier ``scale`` stands for (exact)."""
    if data.device.type == "cpu" and not torch.compiler.is_compiling():
        values = _fp8_values_on_cpu(data)
    else:
        values = data.float()
    return values.div_(scale)
