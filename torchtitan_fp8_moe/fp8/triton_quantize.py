"""The quantization rules of ``quantize.py`` as fused Triton kernels (CUDA only).

Same outputs as ``torch_quantize.py`` (fp8 data, fp32 power-of-2 multipliers), laid out the way
the fp8 GEMMs want them: activations row-major, weights column-major per expert. Scales along a
contiguous dim use our one-pass kernel (``triton_rowwise.py``, faster than torchao's), the
per-group casts of the weight gradient our kernel without token-count autotuning
(``triton_per_group.py``); the transposing weight cast uses torchao's kernel.
"""

import torch
from torchao.prototype.moe_training.kernels import (
    triton_fp8_colwise_3d_scale_and_cast,
    triton_fp8_rowwise_2d_scale_and_cast,
    triton_fp8_rowwise_3d_transpose_rhs,
)

from .gemm import column_major
from .quantize import FP8_DTYPE
from .triton_per_group import per_group_colwise_fp8_pair
from .triton_rowwise import MAX_ROW, rowwise_fp8


def rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
    if x.shape[-1] <= MAX_ROW:
        return rowwise_fp8(x)
    return triton_fp8_rowwise_2d_scale_and_cast(
        x.contiguous(), output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
    )


def weight(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` (column-major) -> fp8 ``[G, K, N]``, scales ``[G, 1, N]`` (over K)."""
    if b.shape[-2] <= MAX_ROW:
        # Column-major, K is the contiguous dim: each column is one row of the storage.
        stored = column_major(b).transpose(-2, -1)
        data, scales = rowwise_fp8(stored)
        return data.transpose(-2, -1), scales.transpose(-2, -1)
    return triton_fp8_colwise_3d_scale_and_cast(
        column_major(b), output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
    )


def weight_transposed(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K, N]`` -> fp8 of ``b^T [G, N, K]``, scales ``[G, 1, K]`` (over N)."""
    data, scales = triton_fp8_rowwise_3d_transpose_rhs(
        column_major(b), output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
    )
    return data, scales.view(b.shape[0], 1, b.shape[1])


def per_group_pair(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
    """Per-group scales over tokens for the weight-gradient GEMM: ``(a_fp8, a_scales [G, K],
    grad_fp8, grad_scales [G, N])``, data column-major."""
    return per_group_colwise_fp8_pair(a, grad, offs)
