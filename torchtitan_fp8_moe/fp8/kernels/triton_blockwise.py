"""Blockwise fp8 casts (DeepSeek-V3 style) in Triton, laid out as the blockwise GEMMs read fastest.

The rules are those of ``recipes/blockwise/torch_quantizers.py`` (``BLOCK`` = 128, power-of-2
multiplier scales of ``fp8/quantize.py``; a partial tile at a ragged edge takes its amax over the
elements it has), and the outputs are bit for bit its outputs. What differs is the memory order:
fp8 tensor-core MMA on Hopper wants both operands with the contraction dim contiguous
("K-major"), so
- ``quantize_1x128``: ``x [M, K]`` -> 1x128 tiles along K, data row-major, scale
  ``[M, ceil(K/128)]`` (activations and output gradients of the forward and input gradient);
- ``quantize_128x128``: a weight ``b [G, K, N]`` (any strides) -> 128x128 blocks, scale
  ``[G, ceil(K/128), ceil(N/128)]``, data K contiguous (the forward contracts K); with
  ``transposed_too`` the same read also writes ``b^T [G, N, K]`` with N contiguous (the input
  gradient contracts N); ``quantize_128x128_transposed`` writes that one alone from given scales;
- ``quantize_128x1``: ``x [M, C]`` -> 128x1 tiles along the tokens, data token-contiguous (strides
  ``(1, M)``: the weight gradient contracts the tokens). The tiles are the global 128-row blocks,
  each group's own blocks when group starts are 128-aligned (the CUDA recipe's token alignment);
  with ``offs`` the rows past the last group quantize to 0 and take no part in an amax, and the
  scales have the torch rules' ``M // 128 + G`` block slots.
CUDA only (and Triton's CPU interpreter in the tests). ``out_dtype`` other than fp8 keeps the
scaled, saturated values uncast: the interpreter does not round to fp8 as a GPU does, so the tests
check those values.
"""

import torch
import triton
import triton.language as tl

from ..opaque import compile_triton, launcher
from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
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
    out_t_ptr,
    scale_ptr,
    K,
    N,
    stride_wg,
    stride_wk,
    stride_wn,
    COMPUTE_SCALES: tl.constexpr,
    WRITE_FORWARD: tl.constexpr,
    WRITE_TRANSPOSED: tl.constexpr,
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
    scale_at = scale_ptr + (group * tl.cdiv(K, BLOCK) + k_block) * tl.cdiv(N, BLOCK) + n_block
    if COMPUTE_SCALES:
        scale = pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0), FP8_LIMIT, AMAX_FLOOR)
        tl.store(scale_at, scale)
    else:
        scale = tl.load(scale_at)
    y = saturate(w * scale, FP8_LIMIT)
    first = group * K * N
    if WRITE_FORWARD:  # b [G, K, N] with K contiguous: storage [G, N, K]
        forward = out_ptr + first + ns[None, :] * K + ks[:, None]
        tl.store(forward, y.to(out_ptr.dtype.element_ty), mask=mask)
    if WRITE_TRANSPOSED:  # b^T [G, N, K] with N contiguous: storage [G, K, N]
        transposed = out_t_ptr + first + ks[:, None] * N + ns[None, :]
        tl.store(transposed, y.to(out_t_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_128x1_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    offs_ptr,
    M,
    C,
    G,
    stride_xm,
    stride_xc,
    GROUPED: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    COLS: tl.constexpr,
):
    m_block = tl.program_id(0)
    rows = (m_block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS)).to(tl.int64)
    col_mask = cols < C
    # Rows past the last group's end hold no token: read as 0, so they are left out of the amax
    # (block slots past M are all such rows, and get the scale of an amax of 0).
    end = tl.minimum(tl.load(offs_ptr + G - 1), M) if GROUPED else M
    x = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xc,
        mask=(rows < end)[:, None] & col_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    scale = pow2_scale(tl.max(tl.abs(x), axis=0), FP8_LIMIT, AMAX_FLOOR)
    y = saturate(x * scale[None, :], FP8_LIMIT)
    # Storage [C, M]: the tokens of a column are contiguous.
    out = out_ptr + rows[:, None] + cols[None, :] * M
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])
    tl.store(scale_ptr + m_block * C + cols, scale, mask=col_mask)


def _check_2d(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, C], got shape {tuple(x.shape)}")


def _quantize_1x128(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("quantize_1x128 x", x)
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    scale = torch.empty((m, blocks(k)), dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (triton.cdiv(m, TILES_PER_PROGRAM), blocks(k))
        launcher(_quantize_1x128_kernel, x)[grid](
            x, out, scale, m, k, x.stride(0), x.stride(1),
            FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK, ROWS=TILES_PER_PROGRAM,
        )  # fmt: skip
    return out, scale


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 3:
        raise ValueError(f"quantize_128x128 w: expected [G, K, N], got shape {tuple(w.shape)}")


def _empty_transposed(shape: tuple[int, int, int], dtype, device) -> torch.Tensor:
    """``[G, R, C]`` whose dim R is contiguous (a transposed view of a contiguous [G, C, R])."""
    groups, r, c = shape
    return torch.empty((groups, c, r), dtype=dtype, device=device).transpose(-2, -1)


def _cast_128x128(w, out, out_t, scale, compute_scales: bool) -> None:
    groups, k, n = w.shape
    if w.numel():
        launcher(_quantize_128x128_kernel, w)[(blocks(k), blocks(n), groups)](
            w, out if out is not None else out_t, out_t if out_t is not None else out, scale,
            k, n, *w.stride(),
            COMPUTE_SCALES=compute_scales, WRITE_FORWARD=out is not None,
            WRITE_TRANSPOSED=out_t is not None,
            FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip


def _quantize_128x128(w: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _cast_forward(w, out_dtype, None)


def _quantize_128x128_both(
    w: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_weight(w)
    groups, k, n = w.shape
    out_t = _empty_transposed((groups, n, k), out_dtype, w.device)
    return (*_cast_forward(w, out_dtype, out_t), out_t)


def _cast_forward(w, out_dtype, out_t) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward data and block scales of ``w``; with ``out_t``, the same read writes the
    transposed data there."""
    _check_weight(w)
    groups, k, n = w.shape
    out = _empty_transposed((groups, k, n), out_dtype, w.device)
    scale = torch.empty((groups, blocks(k), blocks(n)), dtype=torch.float32, device=w.device)
    _cast_128x128(w, out, None if out_t is None else out_t.transpose(-2, -1), scale, True)
    return out, scale


def _quantize_128x128_transposed(
    w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    _check_weight(w)
    groups, k, n = w.shape
    if scale.shape != (groups, blocks(k), blocks(n)) or scale.dtype != torch.float32:
        raise ValueError(
            f"quantize_128x128_transposed scale: expected float32 {(groups, blocks(k), blocks(n))}"
            f", got {scale.dtype} {tuple(scale.shape)}"
        )
    out_t = _empty_transposed((groups, n, k), out_dtype, w.device)
    _cast_128x128(w, None, out_t.transpose(-2, -1), scale.contiguous(), False)
    return out_t


def _quantize_128x1(
    x: torch.Tensor, offs: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d("quantize_128x1 x", x)
    m, c = x.shape
    slots = blocks(m) if offs is None else m // BLOCK + offs.shape[0]
    out = torch.empty((c, m), dtype=out_dtype, device=x.device).t()
    scale = torch.empty((slots, c), dtype=torch.float32, device=x.device)
    if scale.numel():
        grid = (slots, triton.cdiv(c, TILES_PER_PROGRAM))
        launcher(_quantize_128x1_kernel, x)[grid](
            x, out, scale, scale if offs is None else offs, m, c,
            1 if offs is None else offs.shape[0], x.stride(0), x.stride(1),
            GROUPED=offs is not None, FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, BLOCK=BLOCK,
            COLS=TILES_PER_PROGRAM,
        )  # fmt: skip
    return out, scale


# Triton ops (``opaque.py``): torch.compile traces into them; launched directly they read the
# data of fake tensors and failed the first compiled blockwise step on CUDA.
_quantize_1x128_op = compile_triton("blockwise_quantize_1x128", _quantize_1x128)
_quantize_128x128_op = compile_triton("blockwise_quantize_128x128", _quantize_128x128)
_quantize_128x128_both_op = compile_triton(
    "blockwise_quantize_128x128_both", _quantize_128x128_both
)
_quantize_128x128_transposed_op = compile_triton(
    "blockwise_quantize_128x128_transposed", _quantize_128x128_transposed
)
_quantize_128x1_op = compile_triton("blockwise_quantize_128x1", _quantize_128x1)


def quantize_1x128(
    x: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (any strides) -> data ``[M, K]`` (row-major) and fp32 scales
    ``[M, ceil(K/128)]``, one per 1x128 tile."""
    return _quantize_1x128_op(x, out_dtype)


def quantize_128x128(
    w: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE, transposed_too: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``w [G, K, N]`` (any strides) -> data ``[G, K, N]`` with K contiguous, fp32 scales
    ``[G, ceil(K/128), ceil(N/128)]``, and (``transposed_too``, from the same read) the data of
    ``w^T [G, N, K]`` with N contiguous, else None."""
    if transposed_too:
        return _quantize_128x128_both_op(w, out_dtype)
    return (*_quantize_128x128_op(w, out_dtype), None)


def quantize_128x128_transposed(
    w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> torch.Tensor:
    """The data of ``w^T [G, N, K]`` with N contiguous, cast by ``w``'s block scales ``scale``
    (``quantize_128x128``'s): its forward data transposed, bit for bit."""
    return _quantize_128x128_transposed_op(w, scale, out_dtype)


def quantize_128x1(
    x: torch.Tensor, offs: torch.Tensor | None = None, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, C]`` (any strides) -> data ``[M, C]`` token-contiguous (strides ``(1, M)``) and
    fp32 scales, one per 128x1 tile of the global 128-row blocks: ``[ceil(M/128), C]``, or with
    ``offs`` (int32 group ends, group starts 128-aligned) ``[M // 128 + G, C]``, rows past the
    last group 0."""
    return _quantize_128x1_op(x, offs, out_dtype)
