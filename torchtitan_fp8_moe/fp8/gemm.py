"""GEMMs on quantized operands: real fp8 kernels on CUDA, an exact emulation elsewhere.

Every function takes fp8 data with fp32 multipliers from ``quantize.py`` and returns
``sum_k dequant(a)[m, k] * dequant(b)[k, n]``. The emulated path dequantizes (exact, the scales
are powers of two) and multiplies in fp32, so it checks the same numerics as the CUDA kernels up
to fp32 accumulation order.

Grouped shapes follow ``torch._grouped_mm``: ``offs`` holds the int32 end offset of each group
along the token dimension M. Rows past the last offset belong to no group and come out as zeros.
The emulation works on group masks, never reading the offsets on the host, so it traces under
``torch.compile(fullgraph=True)`` as the CUDA kernels do.
"""

import torch

from .quantize import dequantize


def group_masks(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[G, M]`` float mask: 1 where token m belongs to group g."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    token = torch.arange(tokens, device=offs.device)
    return ((token >= starts[:, None]) & (token < ends[:, None])).float()


def per_token(values: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``[M, C]``: row m holds ``values [G, C]`` of token m's group (zeros for tokens of no
    group). Indexing, not ``masks.t() @ values``, so a non-finite value of one group never
    reaches another group's tokens (0 * inf is NaN), as in the CUDA kernels."""
    group = masks.argmax(dim=0)
    in_a_group = masks.sum(dim=0) > 0
    return torch.where(in_a_group[:, None], values[group], 0)


def column_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last two dims stored column-major (no copy if they already are)."""
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


def grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    use_cuda_kernels: bool,
) -> torch.Tensor:
    """``a [M, K]`` (scales ``[M, 1]``) times ``b [G, K, N]`` (scales ``[G, 1, N]``) per group."""
    if use_cuda_kernels:
        if b.shape[0] == 1:
            # One group is a plain GEMM; _scaled_mm is faster than the grouped kernel for it.
            out = torch._scaled_mm(
                a,
                column_major(b[0]),
                scale_a=a_scale.reciprocal(),
                scale_b=b_scale[0].reciprocal(),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        else:
            out = torch._scaled_grouped_mm(
                a,
                column_major(b),
                a_scale.reciprocal().squeeze(-1),
                b_scale.reciprocal().squeeze(-2),
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        return out.to(out_dtype)
    masks = group_masks(offs, a.shape[0])
    per_group = torch.einsum("mk,gkn->gmn", dequantize(a, a_scale), dequantize(b, b_scale))
    # Each token takes its own group's product; where, not a 0/1 product, keeps another
    # group's non-finite weights out of it.
    return torch.where(masks[:, :, None] > 0, per_group, 0).sum(0).to(out_dtype)


def grouped_wgrad_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    use_cuda_kernels: bool,
) -> torch.Tensor:
    """Per group ``a_g^T @ grad_g``: ``a [M, K]`` and ``grad [M, N]`` with per-group scales
    ``[G, K]`` and ``[G, N]`` over each group's tokens; returns ``[G, K, N]``."""
    if use_cuda_kernels:
        # Computed as (grad^T @ a)^T: grad^T is row-major and a column-major as the Triton
        # quantizer writes them, and the transposed result has the weight's own layout, so
        # autograd needs no copy to accumulate it.
        if offs.numel() == 1:
            out = torch._scaled_mm(
                grad.t(),
                column_major(a),
                scale_a=grad_scale.reciprocal().view(-1, 1),
                scale_b=a_scale.reciprocal().view(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            ).unsqueeze(0)
        else:
            out = torch._scaled_grouped_mm(
                grad.t(),
                column_major(a),
                grad_scale.reciprocal().reshape(-1),
                a_scale.reciprocal().reshape(-1),
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        return out.transpose(-2, -1).to(out_dtype)
    masks = group_masks(offs, a.shape[0])
    # Each token's row is unscaled with its own group's scales (rows of no group: zero), and
    # each group sums only its own tokens.
    a_hp = a.float() * per_token(a_scale.reciprocal(), masks)
    grad_hp = grad.float() * per_token(grad_scale.reciprocal(), masks)
    a_per_group = torch.where(masks[:, :, None] > 0, a_hp, 0)
    return torch.einsum("gmk,mn->gkn", a_per_group, grad_hp).to(out_dtype)

