"""The emulated fp8 GEMMs' building blocks, shared by every recipe (``recipes/``).

A recipe's emulated GEMM dequantizes its fp8 operands (exact, the scales are powers of two) and
multiplies in fp32 with these, so it checks the same numerics as the CUDA kernels up to fp32
accumulation order.

Grouped shapes follow ``torch._grouped_mm``: ``offs`` holds the int32 end offset of each group
along the token dimension M. Rows past the last offset belong to no group and come out as zeros.
The emulation dequantizes and runs ``torch._grouped_mm`` in fp32, so its work grows with the
tokens, not with tokens x groups; a non-finite weight or scale of one group never reaches another
group's tokens. It never reads the offsets on the host (group ids come from ``bucketize``), so it
traces under ``torch.compile(fullgraph=True)`` as the CUDA kernels do.
"""

import torch
import torch.nn.functional as F

from .opaque import compile_opaque

# torch._grouped_mm wants 16-byte aligned strides: fp32 rows a multiple of 4 elements.
FP32_ALIGNMENT = 4


def token_groups(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[M]`` group index of each token; ``G`` (one past the last group) for tokens of no group."""
    token = torch.arange(tokens, device=offs.device, dtype=offs.dtype)
    return torch.bucketize(token, offs, right=True)


def per_token(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """``[M, C]``: row m holds ``values [G, C]`` of token m's group (``groups`` from
    ``token_groups``; zeros for tokens of no group). Indexing, not a one-hot product, so a
    non-finite value of one group never reaches another group's tokens (0 * inf is NaN)."""
    no_group = values.new_zeros((1, values.shape[1]))
    return torch.cat([values, no_group])[groups]


def padded(x: torch.Tensor, *dims: int) -> torch.Tensor:
    """``x`` zero-padded at the end of each of ``dims`` (negative) to a multiple of
    FP32_ALIGNMENT. Zeros add nothing to a dot product; no copy when already aligned."""
    pad = [0] * (2 * x.dim())
    for dim in dims:
        pad[2 * (-dim - 1) + 1] = -x.shape[dim] % FP32_ALIGNMENT
    return F.pad(x, pad) if any(pad) else x


def _grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32 ``a [M, K]`` times ``b [G, K, N]`` per group -> ``[M, N]``; rows of no group are 0."""
    tokens, n = a.shape[0], b.shape[-1]
    out = torch._grouped_mm(padded(a, -1), padded(b, -2, -1), offs=offs)[:, :n]
    # _grouped_mm leaves the rows of no group unwritten.
    token = torch.arange(tokens, device=offs.device, dtype=offs.dtype)
    return torch.where((token < offs[-1])[:, None], out, 0)


def _grouped_mm_fp32_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[-1]))


def _grouped_wgrad_mm_fp32(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per group ``a_g^T @ grad_g`` of fp32 ``a [M, K]``, ``grad [M, N]`` -> ``[G, K, N]``; an
    empty group gives zeros and rows of no group are never read."""
    k, n = a.shape[1], grad.shape[1]
    out = torch._grouped_mm(padded(a, -1).t(), padded(grad, -1), offs=offs)
    return out[:, :k, :n].contiguous()


def _grouped_wgrad_mm_fp32_fake(
    a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    return a.new_empty((offs.shape[0], a.shape[1], grad.shape[1]))


# torch.compile's shape rule for _grouped_mm accepts bf16 only: compiled code calls the fp32
# grouped GEMMs as opaque ops (the same kernel eager runs).
grouped_mm_fp32 = compile_opaque("grouped_mm_fp32", _grouped_mm_fp32, _grouped_mm_fp32_fake)
grouped_wgrad_mm_fp32 = compile_opaque(
    "grouped_wgrad_mm_fp32", _grouped_wgrad_mm_fp32, _grouped_wgrad_mm_fp32_fake
)


def column_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last two dims stored column-major (no copy if they already are)."""
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)
