"""The quantization steps of the fp8 grouped GEMM in plain torch ops (any device)."""

import torch

from .gemm import group_bounds
from .quantize import FP8_DTYPE, quantize_rowwise


def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
    return quantize_rowwise(x, dim=-1)


def weight(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` -> fp8 ``[G, K, N]``, scales ``[G, 1, N]`` (over K)."""
    return quantize_rowwise(b, dim=-2)


def weight_transposed(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` -> fp8 of ``b^T [G, N, K]``, scales ``[G, 1, K]`` (over N)."""
    return quantize_rowwise(b.transpose(-2, -1), dim=-2)


def _per_group_along_tokens(x: torch.Tensor, offs: torch.Tensor):
    data = torch.zeros_like(x, dtype=FP8_DTYPE)
    scales = x.new_ones((offs.numel(), x.shape[1]), dtype=torch.float32)
    for group, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            data[start:end], group_scale = quantize_rowwise(x[start:end], dim=0)
            scales[group] = group_scale.squeeze(0)
    return data, scales


def per_group_pair(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
    """Per-group scales over tokens for the weight-gradient GEMM: ``(a_fp8, a_scales [G, K],
    grad_fp8, grad_scales [G, N])``; an empty group gets scale 1."""
    return (*_per_group_along_tokens(a, offs), *_per_group_along_tokens(grad, offs))
