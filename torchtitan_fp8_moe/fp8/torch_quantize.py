"""The quantization steps of the fp8 grouped GEMM in plain torch ops (any device)."""

import torch

from .gemm import group_masks, per_token
from .quantize import quantize_rowwise, scales_from_amax, to_fp8


def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
    return quantize_rowwise(x, dim=-1)


def weight(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` -> fp8 ``[G, K, N]``, scales ``[G, 1, N]`` (over K)."""
    return quantize_rowwise(b, dim=-2)


def weight_transposed(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` -> fp8 of ``b^T [G, N, K]``, scales ``[G, 1, K]`` (over N)."""
    return quantize_rowwise(b.transpose(-2, -1), dim=-2)


def _per_group_along_tokens(x: torch.Tensor, masks: torch.Tensor):
    if x.shape[0] == 0:  # no tokens at all (an idle expert in the for-loop path)
        amax = x.new_zeros((masks.shape[0], x.shape[1]), dtype=torch.float32)
    else:
        in_group = masks[:, :, None] > 0
        amax = torch.where(in_group, x.detach().abs().float()[None], 0).amax(dim=1)  # [G, C]
    scales = scales_from_amax(amax)
    return to_fp8(x, per_token(scales, masks)), scales


def per_group_pair(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
    """Per-group scales over tokens for the weight-gradient GEMM: ``(a_fp8, a_scales [G, K],
    grad_fp8, grad_scales [G, N])``. Rows of no group quantize to zero."""
    masks = group_masks(offs, a.shape[0])
    return (*_per_group_along_tokens(a, masks), *_per_group_along_tokens(grad, masks))
