"""fp8 rowwise quantization: the one set of rules every fp8 GEMM in this package uses.

A "rowwise" scale is one scale per row of the GEMM's contraction: the amax is taken along the
dimension that the matmul sums over, so every output element is a dot product of two vectors that
each carry a single scale. Scales are powers of two (rounded down), which makes scaling and
unscaling exact in any float format: the only rounding is the cast to float8_e4m3fn itself.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
# Rows that are all zero get this amax, so their scale stays finite (and the row stays zero).
AMAX_FLOOR = 1e-12


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The largest power-of-2 multipliers that keep ``amax`` within fp8 range."""
    scale = FP8_MAX / amax.float().clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(scale)))


def amax_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 amax of |x| along ``dim`` (NaN where a slice holds one), without making |x|."""
    x = x.detach()
    return torch.maximum(x.amax(dim=dim), -x.amin(dim=dim)).float()


def rowwise_scales(x: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 multipliers that map each slice of ``x`` along ``dim`` into fp8 range (keepdim)."""
    return scales_from_amax(x.detach().abs().amax(dim=dim, keepdim=True))


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Multiply by ``scale`` (broadcast) and cast to fp8, saturating at the fp8 range."""
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 data and fp32 scales (keepdim) of ``x``, one scale per slice along ``dim``."""
    scale = rowwise_scales(x, dim)
    return to_fp8(x, scale), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values that fp8 ``data`` with multiplier ``scale`` stands for (exact)."""
    return data.float() / scale
