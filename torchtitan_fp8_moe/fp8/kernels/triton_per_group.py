"""Our Triton kernel for the weight gradient's per-group column-wise fp8 cast (CUDA only).

The weight-gradient GEMM ``a_g^T @ grad_g`` contracts over each group's tokens, so ``a [M, K]``
and ``grad [M, N]`` get one scale per (group, column), over the group's rows, and are stored
column-major for the GEMM. torchao 0.18's kernel for this autotunes 36 configurations keyed on
the token count M: every new M (each step under expert parallelism, where the tokens a rank
receives vary) re-benchmarks all of them, which made an EP 2 training step on two H200s about
20x slower than bf16 (docs/benchmarks/archive/2026-11-30-deepseek-check-ep-tp/), and every
first M costs seconds of compilation. This kernel has one fixed configuration and no
autotuning: it compiles once per dtype and is launched as is for any M. Same rules as
``quantize.py`` (largest power-of-2 scale that keeps the amax in fp8 range, saturating cast, NaN
stays NaN). Rows past the last offset are neither read nor written.
"""

import torch
import triton
import triton.language as tl

from ..opaque import compile_opaque
from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from .triton_rules import pow2_scale, saturate

# Tile: BLOCK_ROWS tokens x BLOCK_COLS columns; one program per (column block, group). Chosen by
# `scripts/bench_quantize.py --sweep` on an H200
# (docs/benchmarks/archive/2026-11-30-per-group-kernel/): the fastest of 7 tiles for even and
# skewed routing, where one group's programs stream most tokens.
BLOCK_ROWS, BLOCK_COLS, NUM_WARPS = 256, 64, 8


@triton.jit
def _per_group_colwise_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    offs_ptr,
    n_rows,
    n_cols,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    col_block = tl.program_id(0)
    group = tl.program_id(1)
    start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + group).to(tl.int64)
    cols = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
    col_mask = cols < n_cols
    # Pass 1: the amax of each column over the group's rows.
    amax = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        mask = (rows < end)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    scale = pow2_scale(amax, FP8_LIMIT, AMAX_FLOOR)
    tl.store(scale_ptr + group * n_cols + cols, scale, mask=col_mask)
    # Pass 2: scale, saturate, cast; written column-major (element (r, c) at c * n_rows + r).
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        mask = (rows < end)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        y = saturate(x.to(tl.float32) * scale[None, :], FP8_LIMIT)
        tl.store(
            out_ptr + cols[None, :] * n_rows + rows[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


def cast_per_group_colwise(
    x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, C]`` -> ``out_dtype [M, C]`` column-major and fp32 scales ``[G, C]``, one per
    (group, column) over the group's rows (groups end at ``offs``). ``out_dtype`` other than
    fp8 keeps the scaled, saturated values uncast (how the tests check the kernel's logic in
    Triton's CPU interpreter, which does not round to fp8 as the GPU does)."""
    x = x.contiguous()
    n_rows, n_cols = x.shape
    groups = offs.numel()
    out = torch.empty((n_cols, n_rows), dtype=out_dtype, device=x.device).t()
    scales = torch.empty((groups, n_cols), dtype=torch.float32, device=x.device)
    if groups and n_cols:
        _per_group_colwise_kernel[(triton.cdiv(n_cols, BLOCK_COLS), groups)](
            x,
            out,
            scales,
            offs,
            n_rows,
            n_cols,
            FP8_LIMIT=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_COLS=BLOCK_COLS,
            num_warps=NUM_WARPS,
        )
    return out, scales


def _colwise_fp8_pair(
    a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight gradient's operands: ``(a_fp8, a_scales [G, K], grad_fp8, grad_scales [G, N])``,
    data column-major."""
    return (*cast_per_group_colwise(a, offs), *cast_per_group_colwise(grad, offs))


def _colwise_fp8_pair_fake(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
    def fake(x):
        data = x.new_empty((x.shape[1], x.shape[0]), dtype=FP8_DTYPE).t()
        return data, x.new_empty((offs.shape[0], x.shape[1]), dtype=torch.float32)

    return (*fake(a), *fake(grad))


per_group_colwise_fp8_pair = compile_opaque(
    "per_group_colwise_fp8_pair", _colwise_fp8_pair, _colwise_fp8_pair_fake
)
