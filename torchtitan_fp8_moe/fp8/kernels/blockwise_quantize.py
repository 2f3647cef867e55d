"""Blockwise fp8 casts (DeepSeek-V3 style) in Triton, and the same rules in torch for reference.

Three tilings, per the blockwise numerics contract (``BLOCK`` = 128, power-of-2 multiplier scales of
``fp8/quantize.py``; a partial tile at a ragged edge takes its amax over the elements it has):
- ``quantize_1x128``: ``x [M, K]`` -> 1x128 tiles along the last dim, scale ``[M, ceil(K/128)]``
  (the activations and output gradients of the forward and input-gradient GEMMs);
- ``quantize_128x128``: a weight ``[G, K, N]`` (any strides) -> 128x128 blocks over (K, N), scale
  ``[G, ceil(K/128), ceil(N/128)]``; the data keeps the weight's memory order, so the transposed
  view is the input-gradient GEMM's operand with no second cast;
- ``quantize_128x1``: ``x [M, C]`` -> 128x1 tiles along the tokens, scale ``[ceil(M/128), C]``,
  data column-major (tokens contiguous), as the weight-gradient GEMM reads it. The tiles are the
  global 128-row blocks, which are each group's own blocks when group starts are 128-aligned.
The Triton kernels are CUDA only (and run in Triton's CPU interpreter in the tests).
``out_dtype`` other than fp8 keeps the scaled, saturated values uncast: the interpreter does not
round to fp8 as a GPU does, so the tests check those values.
"""

import torch
import triton
import triton.language as tl

from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, scales_from_amax, to_fp8
from .triton_rules import pow2_scale, saturate

BLOCK = 128
# Rows of 1x128 tiles (or columns of 128x1 tiles) one program casts.
TILES_PER_PROGRAM = 32


def blocks(size: int) -> int:
    """How many 128-wide blocks cover ``size`` elements."""
    return triton.cdiv(size, BLOCK)


@triton.jit
def _quantize_1x128_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    k_block = tl.program_id(1)
    cols = k_block * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < K)[None, :]
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0
    ).to(tl.float32)
    scale = pow2_scale(tl.max(tl.abs(x), axis=1), FP8_LIMIT, AMAX_FLOOR)
    y = saturate(x * scale[:, None], FP8_LIMIT)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows * tl.cdiv(K, BLOCK) + k_block, scale, mask=row_mask)


@triton.jit
def _quantize_128x128_kernel(
    w_ptr,
    out_ptr,
    scale_ptr,
    K,
    N,
    stride_wg,
    stride_wk,
    stride_wn,
    stride_og,
    stride_ok,
    stride_on,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k_block, n_block = tl.program_id(0), tl.program_id(1)
    group = tl.program_id(2).to(tl.int64)
    ks = (k_block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ns = (n_block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (ks < K)[:, None] & (ns < N)[None, :]
    w = tl.load(
        w_ptr + group * stride_wg + ks[:, None] * stride_wk + ns[None, :] * stride_wn,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    scale = pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), FP8_LIMIT, AMAX_FLOOR)
    y = saturate(w * scale, FP8_LIMIT)
    out = out_ptr + group * stride_og + ks[:, None] * stride_ok + ns[None, :] * stride_on
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
    n_blocks = tl.cdiv(N, BLOCK)
    tl.store(scale_ptr + (group * tl.cdiv(K, BLOCK) + k_block) * n_blocks + n_block, scale)


@triton.jit
def _quantize_128x1_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    M,
    C,
    stride_xm,
    stride_xc,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    COLS: tl.constexpr,
):
    m_block = tl.program_id(0)
    rows = (m_block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS)).to(tl.int64)
    col_mask = cols < C
    mask = (rows < M)[:, None] & col_mask[None, :]
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xc, mask=mask, other=0.0
    ).to(tl.float32)
    scale = pow2_scale(tl.max(tl.abs(x), axis=0), FP8_LIMIT, AMAX_FLOOR)
    y = saturate(x * scale[None, :], FP8_LIMIT)
    # Column-major: the tokens of a column are contiguous.
    tl.store(out_ptr + rows[:, None] + cols[None, :] * M, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + m_block * C + cols, scale, mask=col_mask)


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, C], got shape {tuple(x.shape)}")


def quantize_1x128(
    x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (any strides) -> data ``[M, K]`` (row-major) and fp32 scales
    ``[M, ceil(K/128)]``, one per 1x128 tile."""
    _check_2d("quantize_1x128 x", x)
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, blocks(k)), dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, TILES_PER_PROGRAM), blocks(k))
        _quantize_1x128_kernel[grid](
            x, out, scale, m, k, x.stride(0), x.stride(1),
            FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK, ROWS=TILES_PER_PROGRAM,
        )  # fmt: skip
    return out, scale


def same_order_empty(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``[G, K, N]`` tensor with ``w``'s memory order: K-major (a transposed view of a
    contiguous ``[G, N, K]``, as torchtitan stores experts ``[E, out, in]``) or row-major."""
    if w.transpose(-2, -1).is_contiguous():
        return torch.empty(w.transpose(-2, -1).shape, dtype=dtype, device=w.device).transpose(
            -2, -1
        )
    return torch.empty(w.shape, dtype=dtype, device=w.device)


def quantize_128x128(
    w: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [G, K, N]`` (any strides) -> data ``[G, K, N]`` in ``w``'s memory order (see
    ``same_order_empty``) and fp32 scales ``[G, ceil(K/128), ceil(N/128)]``, one per block."""
    if w.dim() != 3:
        raise ValueError(f"quantize_128x128 w: expected [G, K, N], got shape {tuple(w.shape)}")
    groups, k, n = w.shape
    out = same_order_empty(w, out_dtype)
    scale = torch.empty((groups, blocks(k), blocks(n)), dtype=torch.float32, device=w.device)
    if w.numel():
        _quantize_128x128_kernel[(blocks(k), blocks(n), groups)](
            w, out, scale, k, n, *w.stride(), *out.stride(),
            FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return out, scale


def quantize_128x1(
    x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, C]`` (any strides) -> data ``[M, C]`` column-major (strides ``(1, M)``) and fp32
    scales ``[ceil(M/128), C]``, one per 128x1 tile of the global 128-row blocks."""
    _check_2d("quantize_128x1 x", x)
    m, c = x.shape
    out = torch.empty((c, m), dtype=out_dtype, device=x.device).t()
    scale = torch.empty((blocks(m), c), dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (blocks(m), triton.cdiv(c, TILES_PER_PROGRAM))
        _quantize_128x1_kernel[grid](
            x, out, scale, m, c, x.stride(0), x.stride(1),
            FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK, COLS=TILES_PER_PROGRAM,
        )  # fmt: skip
    return out, scale


# The same rules in torch: the references the kernels are tested against.
def _padded_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    """|x| as float32, zero-padded along ``dim`` to whole 128 blocks (zeros leave an amax as is)."""
    pad = blocks(x.shape[dim]) * BLOCK - x.shape[dim]
    magnitude = x.detach().float().abs().movedim(dim, -1)
    return torch.nn.functional.pad(magnitude, (0, pad)).movedim(-1, dim)


def quantize_1x128_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_1x128`` in torch: fp8 ``[M, K]`` and scales ``[M, ceil(K/128)]``."""
    m, k = x.shape
    amax = _padded_blocks(x, 1).view(m, blocks(k), BLOCK).amax(-1)
    scale = scales_from_amax(amax)
    return to_fp8(x, scale.repeat_interleave(BLOCK, 1)[:, :k]), scale


def quantize_128x128_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_128x128`` in torch: fp8 ``[G, K, N]`` and its block scales."""
    groups, k, n = w.shape
    padded = _padded_blocks(_padded_blocks(w, 1), 2)
    amax = padded.view(groups, blocks(k), BLOCK, blocks(n), BLOCK).amax((2, 4))
    scale = scales_from_amax(amax)
    full = scale.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :k, :n]
    return to_fp8(w, full), scale


def quantize_128x1_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_128x1`` in torch: fp8 ``[M, C]`` and scales ``[ceil(M/128), C]``."""
    m, c = x.shape
    amax = _padded_blocks(x, 0).view(blocks(m), BLOCK, c).amax(1)
    scale = scales_from_amax(amax)
    return to_fp8(x, scale.repeat_interleave(BLOCK, 0)[:m]), scale
