"""Our Triton kernels for the weight gradient's per-group column-wise fp8 casts (CUDA only).

The weight-gradient GEMM ``a_g^T @ grad_g`` contracts over each group's tokens, so ``a [M, K]``
and ``grad [M, N]`` get one scale per (group, column), over the group's rows, and are stored
column-major for the GEMM. Same rules as ``quantize.py`` (largest power-of-2 scale that keeps
the amax in fp8 range, saturating cast, NaN stays NaN where it was). Rows past the last offset
are not read, and are zeros in the outputs: a one-group weight gradient is a plain GEMM over all
the rows, and torchtitan pads its routed tokens past the last group (``_permute``), so with one
local expert those rows held whatever memory the outputs were given.

Two ways to split the work, by how many programs one per (column block, group) would make:
- enough (routed experts): one launch, each program takes one group's rows of its columns, the
  amax pass, then the cast pass, which reads them again from L2;
- few (a shared expert is one group): one program per group streamed a whole expert's tokens, and a
  few dozen programs did all the work, a large share of a layer call at the Scout preset's TP 8
  shapes (docs/benchmarks/presets/). Then programs take chunks of rows, which may span groups or
  split one: each chunk's column amaxes go to a zeroed buffer by atomic max, and a second launch
  casts with the finished scales (reading the tokens again from memory).
Both tensors of the pair share each launch.

No autotuning: torchao 0.18's kernel re-tunes 36 configurations for every new token count, which
made expert-parallel steps many times slower than bf16; ours compiles once per dtype and
takes any M. A column's amax skips NaN (``tl.max``), so a NaN stays in its own element and
its column's other values keep a finite scale.
"""

import torch
import triton
import triton.language as tl

from ..opaque import compile_opaque, compile_triton, launcher
from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MATRIX_ALIGNMENT, FP8_MAX
from .triton_rules import pow2_scale, saturate

# Tile of one step: BLOCK_ROWS tokens x BLOCK_COLS columns, and the warps of a program. At
# Scout's routed w2 operands (32K tokens in 16 groups, 8192 + 5120 columns) on an H200 it is
# the fastest of nine tiles, with balanced and skewed routing, ahead of the earlier 128 x 64 x 4
# warps, also for a TP 8 shard (5120 + 1024); one group (the chunked launches) about even
# (`scripts/bench_quantize.py --per-group-sweep`; timings in docs/benchmarks/README.md).
BLOCK_ROWS, BLOCK_COLS, NUM_WARPS = 256, 64, 8
# The whole-group kernel's cast pass takes the rows last first (``_cast_rows``): faster at this
# tile in all four cases above.
WHOLE_GROUP_DESCENDING = True
# Row chunks are sized so that each launch has about this many programs: several per SM on an
# H200 (132 SMs), whatever the groups.
TARGET_PROGRAMS = 1024
# Group ends read per step when finding a row's group.
BLOCK_GROUPS = 128


@triton.jit
def _group_of(row, offs_ptr, groups, BLOCK_GROUPS: tl.constexpr):
    """The group of token ``row``: how many group ends are <= row (``groups`` if none holds it)."""
    count = 0
    for first in range(0, groups, BLOCK_GROUPS):
        index = first + tl.arange(0, BLOCK_GROUPS)
        ends = tl.load(offs_ptr + index, mask=index < groups, other=2147483647)
        count += tl.sum((ends <= row).to(tl.int32), axis=0)
    return count


# The chunked kernels load the group ends that bound a chunk's rows themselves: torch 2.11's
# mutation analysis of a triton op takes every pointer passed to a helper whose result leads to
# a store's address as written, and inductor then copied the group ends for each cast launch,
# which failed to compile under dynamic shapes (an AssertionError in
# ``decompose_triton_kernel_wrapper_functional``). A helper's result that only bounds a loop
# (the groups of a chunk) is not such a result.


@triton.jit
def _chunk_groups(chunk_start, chunk_end, offs_ptr, groups, BLOCK_GROUPS: tl.constexpr):
    """The first and last group that rows ``[chunk_start, chunk_end)`` hold (last < first when
    there are none)."""
    first_group = _group_of(chunk_start, offs_ptr, groups, BLOCK_GROUPS)
    last_group = _group_of(chunk_end - 1, offs_ptr, groups, BLOCK_GROUPS)
    return first_group, tl.where(chunk_end > chunk_start, last_group, first_group - 1)


@triton.jit
def _clipped(group_start, group_end, chunk_start, chunk_end):
    """The rows of a group ``[group_start, group_end)`` inside the chunk."""
    start = tl.maximum(group_start, chunk_start).to(tl.int64)
    return start, tl.minimum(group_end, chunk_end).to(tl.int64)


@triton.jit
def _column_amax(
    x_ptr, start, end, cols, col_mask, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
    """The amax of each of ``cols`` over rows ``[start, end)``."""
    amax = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for first in range(start, end, BLOCK_ROWS):
        rows = first + tl.arange(0, BLOCK_ROWS)
        mask = (rows < end)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    return amax


@triton.jit
def _cast_rows(
    x_ptr,
    out_ptr,
    start,
    end,
    written_end,
    cols,
    col_mask,
    scale,
    out_rows,
    n_cols,
    FP8_LIMIT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    DESCENDING: tl.constexpr,
):
    """Rows ``[start, end)`` of ``cols`` scaled, saturated and cast, and zeros for rows
    ``[end, written_end)`` (unread: 0 times a finite scale), written column-major (element
    (r, c) at c * out_rows + r). ``DESCENDING`` takes the row blocks last first: right after an
    amax pass over the same rows, the last ones read are the likeliest still in L2."""
    blocks = (written_end - start + BLOCK_ROWS - 1) // BLOCK_ROWS
    for step in range(0, blocks):
        if DESCENDING:
            first = start + (blocks - 1 - step) * BLOCK_ROWS
        else:
            first = start + step * BLOCK_ROWS
        rows = first + tl.arange(0, BLOCK_ROWS)
        read = (rows < end)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * n_cols + cols[None, :], mask=read, other=0.0)
        y = saturate(x.to(tl.float32) * scale[None, :], FP8_LIMIT)
        tl.store(
            out_ptr + cols[None, :] * out_rows + rows[:, None],
            y.to(out_ptr.dtype.element_ty),
            mask=(rows < written_end)[:, None] & col_mask[None, :],
        )


@triton.jit
def _chunk_amax(
    x_ptr,
    amax_bits_ptr,
    offs_ptr,
    col_block,
    chunk,
    n_cols,
    groups,
    chunk_rows,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    cols = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
    col_mask = cols < n_cols
    chunk_start = chunk * chunk_rows
    chunk_end = tl.minimum(chunk_start + chunk_rows, tl.load(offs_ptr + groups - 1))
    first_group, last_group = _chunk_groups(chunk_start, chunk_end, offs_ptr, groups, BLOCK_GROUPS)
    for group in range(first_group, last_group + 1):
        start, end = _clipped(
            tl.load(offs_ptr + group - 1, mask=group > 0, other=0),
            tl.load(offs_ptr + group),
            chunk_start,
            chunk_end,
        )
        amax = _column_amax(x_ptr, start, end, cols, col_mask, n_cols, BLOCK_ROWS, BLOCK_COLS)
        # A non-negative float's bits order as the float does, so an integer atomic max is a
        # float max for every GPU and Triton version.
        tl.atomic_max(
            amax_bits_ptr + group * n_cols + cols,
            amax.to(tl.int32, bitcast=True),
            mask=col_mask,
        )


@triton.jit
def _chunk_cast(
    x_ptr,
    out_ptr,
    amax_bits_ptr,
    scale_ptr,
    offs_ptr,
    col_block,
    chunk,
    out_rows,
    n_cols,
    groups,
    chunk_rows,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    cols = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
    col_mask = cols < n_cols
    last_end = tl.load(offs_ptr + groups - 1).to(tl.int64)
    chunk_start = chunk * chunk_rows
    chunk_end = tl.minimum(chunk_start + chunk_rows, last_end)
    first_group, last_group = _chunk_groups(chunk_start, chunk_end, offs_ptr, groups, BLOCK_GROUPS)
    for group in range(first_group, last_group + 1):
        start, end = _clipped(
            tl.load(offs_ptr + group - 1, mask=group > 0, other=0),
            tl.load(offs_ptr + group),
            chunk_start,
            chunk_end,
        )
        amax_bits = tl.load(amax_bits_ptr + group * n_cols + cols, mask=col_mask, other=0)
        scale = pow2_scale(amax_bits.to(tl.float32, bitcast=True), FP8_LIMIT, AMAX_FLOOR)
        _cast_rows(
            x_ptr, out_ptr, start, end, end, cols, col_mask, scale, out_rows, n_cols, FP8_LIMIT,
            BLOCK_ROWS, False,
        )  # fmt: skip
    if chunk == 0:
        # Zeros in the rows past the last group (none of them is read; any finite scale).
        _cast_rows(
            x_ptr, out_ptr, last_end, last_end, out_rows, cols, col_mask, col_mask.to(tl.float32),
            out_rows, n_cols, FP8_LIMIT, BLOCK_ROWS, False,
        )  # fmt: skip
        # Every group's scales, empty groups' too (from amax 0), written once per column block.
        for first in range(0, groups, BLOCK_GROUPS):
            group_ids = first + tl.arange(0, BLOCK_GROUPS)
            index = group_ids.to(tl.int64)[:, None] * n_cols + cols[None, :]
            mask = (group_ids < groups)[:, None] & col_mask[None, :]
            amax_bits = tl.load(amax_bits_ptr + index, mask=mask, other=0)
            scales = pow2_scale(amax_bits.to(tl.float32, bitcast=True), FP8_LIMIT, AMAX_FLOOR)
            tl.store(scale_ptr + index, scales, mask=mask)


@triton.jit
def _whole_group(
    x_ptr,
    out_ptr,
    scale_ptr,
    offs_ptr,
    col_block,
    group,
    groups,
    out_rows,
    n_cols,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    DESCENDING: tl.constexpr,
):
    """Both passes over one group's rows in one program; the second reads in the other order."""
    cols = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
    col_mask = cols < n_cols
    start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0).to(tl.int64)
    end = tl.load(offs_ptr + group).to(tl.int64)
    # The last group's program also writes the zeros of the rows past it.
    written_end = tl.where(group == groups - 1, out_rows, end)
    amax = _column_amax(x_ptr, start, end, cols, col_mask, n_cols, BLOCK_ROWS, BLOCK_COLS)
    scale = pow2_scale(amax, FP8_LIMIT, AMAX_FLOOR)
    tl.store(scale_ptr + group * n_cols + cols, scale, mask=col_mask)
    _cast_rows(
        x_ptr, out_ptr, start, end, written_end, cols, col_mask, scale, out_rows, n_cols,
        FP8_LIMIT, BLOCK_ROWS, DESCENDING,
    )  # fmt: skip


@triton.jit
def _per_group_whole_kernel(
    a_ptr,
    grad_ptr,
    a_out_ptr,
    grad_out_ptr,
    a_scale_ptr,
    grad_scale_ptr,
    offs_ptr,
    out_rows,
    a_cols,
    grad_cols,
    a_col_blocks,
    groups,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    DESCENDING: tl.constexpr,
):
    # One program per (column block, group); column blocks of a first, then grad's.
    col_block, group = tl.program_id(0), tl.program_id(1)
    if col_block < a_col_blocks:
        _whole_group(
            a_ptr, a_out_ptr, a_scale_ptr, offs_ptr, col_block, group, groups, out_rows, a_cols,
            FP8_LIMIT, AMAX_FLOOR, BLOCK_ROWS, BLOCK_COLS, DESCENDING,
        )  # fmt: skip
    else:
        _whole_group(
            grad_ptr, grad_out_ptr, grad_scale_ptr, offs_ptr, col_block - a_col_blocks, group,
            groups, out_rows, grad_cols, FP8_LIMIT, AMAX_FLOOR, BLOCK_ROWS, BLOCK_COLS,
            DESCENDING,
        )  # fmt: skip


@triton.jit
def _per_group_amax_kernel(
    a_ptr,
    grad_ptr,
    a_amax_ptr,
    grad_amax_ptr,
    offs_ptr,
    a_cols,
    grad_cols,
    a_col_blocks,
    groups,
    chunk_rows,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    # Column blocks of a first, then grad's.
    col_block, chunk = tl.program_id(0), tl.program_id(1)
    if col_block < a_col_blocks:
        _chunk_amax(
            a_ptr, a_amax_ptr, offs_ptr, col_block, chunk, a_cols, groups, chunk_rows,
            BLOCK_ROWS, BLOCK_COLS, BLOCK_GROUPS,
        )  # fmt: skip
    else:
        _chunk_amax(
            grad_ptr, grad_amax_ptr, offs_ptr, col_block - a_col_blocks, chunk, grad_cols,
            groups, chunk_rows, BLOCK_ROWS, BLOCK_COLS, BLOCK_GROUPS,
        )  # fmt: skip


@triton.jit
def _per_group_cast_kernel(
    a_ptr,
    grad_ptr,
    a_out_ptr,
    grad_out_ptr,
    a_amax_ptr,
    grad_amax_ptr,
    a_scale_ptr,
    grad_scale_ptr,
    offs_ptr,
    out_rows,
    a_cols,
    grad_cols,
    a_col_blocks,
    groups,
    chunk_rows,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    col_block, chunk = tl.program_id(0), tl.program_id(1)
    if col_block < a_col_blocks:
        _chunk_cast(
            a_ptr, a_out_ptr, a_amax_ptr, a_scale_ptr, offs_ptr, col_block, chunk, out_rows,
            a_cols, groups, chunk_rows, FP8_LIMIT, AMAX_FLOOR, BLOCK_ROWS, BLOCK_COLS,
            BLOCK_GROUPS,
        )  # fmt: skip
    else:
        _chunk_cast(
            grad_ptr, grad_out_ptr, grad_amax_ptr, grad_scale_ptr, offs_ptr,
            col_block - a_col_blocks, chunk, out_rows, grad_cols, groups, chunk_rows, FP8_LIMIT,
            AMAX_FLOOR, BLOCK_ROWS, BLOCK_COLS, BLOCK_GROUPS,
        )  # fmt: skip


def chunk_rows_for(n_rows: int, groups: int, col_blocks: int) -> int:
    """Rows per program: 0 (whole groups, one launch) where one program per (column block,
    group) already makes TARGET_PROGRAMS programs, else a multiple of BLOCK_ROWS that does."""
    if groups * col_blocks >= TARGET_PROGRAMS:
        return 0
    rows = triton.cdiv(n_rows * col_blocks, TARGET_PROGRAMS)
    # sym_max: under torch.compile the token count may be symbolic (no guard on it).
    return torch.sym_max(BLOCK_ROWS, triton.cdiv(rows, BLOCK_ROWS) * BLOCK_ROWS)


def output_rows(n_rows: int) -> int:
    """Rows of the cast outputs: ``n_rows`` rounded up to a multiple of 16 (zeros after the
    tokens). The weight gradient contracts over them, and torch's fp8 GEMMs need that dim a
    multiple of 16 (``_scaled_mm``: "Expected trailing dimension of mat1 to be divisible by
    16"): a shared expert's tokens per micro-batch need not be."""
    return -(-n_rows // FP8_MATRIX_ALIGNMENT) * FP8_MATRIX_ALIGNMENT


def cast_per_group_colwise_pair(
    a: torch.Tensor,
    grad: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = FP8_DTYPE,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a [M, K]`` and ``grad [M, N]`` -> ``(a_out [R, K], a_scales [G, K], grad_out [R, N],
    grad_scales [G, N])``: data column-major, fp32 scales one per (group, column) over the
    group's rows (groups end at ``offs``); rows past the last group are zeros, to R
    (``output_rows``). ``out_dtype`` other than fp8 keeps the scaled,
    saturated values uncast (how the tests check the kernels' logic in Triton's CPU interpreter,
    which does not round to fp8 as the GPU does); ``chunk_rows`` overrides ``chunk_rows_for``
    (tests take both paths, and make chunks span groups, with it)."""
    a, grad = a.contiguous(), grad.contiguous()
    n_rows, a_cols = a.shape
    grad_cols = grad.shape[1]
    groups = offs.numel()
    out_rows = output_rows(n_rows)
    a_out = torch.empty((a_cols, out_rows), dtype=out_dtype, device=a.device).t()
    grad_out = torch.empty((grad_cols, out_rows), dtype=out_dtype, device=a.device).t()
    a_scales = torch.empty((groups, a_cols), dtype=torch.float32, device=a.device)
    grad_scales = torch.empty((groups, grad_cols), dtype=torch.float32, device=a.device)
    a_col_blocks = triton.cdiv(a_cols, BLOCK_COLS)
    col_blocks = a_col_blocks + triton.cdiv(grad_cols, BLOCK_COLS)
    if not groups or not col_blocks:
        return a_out, a_scales, grad_out, grad_scales
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(n_rows, groups, col_blocks)
    limits = dict(FP8_LIMIT=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=NUM_WARPS)
    tile = dict(BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS)
    if chunk_rows == 0:
        launcher(_per_group_whole_kernel, a)[(col_blocks, groups)](
            a, grad, a_out, grad_out, a_scales, grad_scales, offs, out_rows, a_cols, grad_cols,
            a_col_blocks, groups, DESCENDING=WHOLE_GROUP_DESCENDING, **limits, **tile,
        )  # fmt: skip
        return a_out, a_scales, grad_out, grad_scales
    # A zeroed buffer of its own per tensor: the kernels write them by atomic max. (Slices of
    # one buffer, as before, were cloned by inductor's functionalization of the triton op from
    # outside the slice's storage: the second operand's amax started from other memory, and
    # the compiled trainer's weight gradients came out wrong, docs/limitations.md.)
    a_amax = torch.zeros(groups * a_cols, dtype=torch.int32, device=a.device)
    grad_amax = torch.zeros(groups * grad_cols, dtype=torch.int32, device=a.device)
    # At least one chunk: the cast launch's first chunk writes every group's scales.
    grid = (col_blocks, torch.sym_max(1, triton.cdiv(n_rows, chunk_rows)))
    launcher(_per_group_amax_kernel, a)[grid](
        a, grad, a_amax, grad_amax, offs, a_cols, grad_cols, a_col_blocks, groups, chunk_rows,
        num_warps=NUM_WARPS, BLOCK_GROUPS=BLOCK_GROUPS, **tile,
    )  # fmt: skip
    launcher(_per_group_cast_kernel, a)[grid](
        a, grad, a_out, grad_out, a_amax, grad_amax, a_scales, grad_scales, offs, out_rows,
        a_cols, grad_cols, a_col_blocks, groups, chunk_rows, BLOCK_GROUPS=BLOCK_GROUPS,
        **limits, **tile,
    )  # fmt: skip
    return a_out, a_scales, grad_out, grad_scales


def _colwise_fp8_pair(
    a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight gradient's operands: ``(a_fp8, a_scales [G, K], grad_fp8, grad_scales [G, N])``,
    data column-major."""
    return cast_per_group_colwise_pair(a, grad, offs)


def _colwise_fp8(x: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One operand's cast (the other's came from ``cast_reuse.py``): a pair whose first tensor
    has no columns."""
    return cast_per_group_colwise_pair(x[:, :0], x, offs)[2:]


per_group_colwise_fp8_pair = compile_triton("per_group_colwise_fp8_pair", _colwise_fp8_pair)
per_group_colwise_fp8 = compile_triton("per_group_colwise_fp8", _colwise_fp8)
# The same cast as a pure custom op under compile, whose equal calls (w3's and w1's weight
# gradients cast the same tokens) are merged into one (``RowwiseTritonQuantizers.tokens``).
per_group_colwise_fp8_shared = compile_opaque(
    "per_group_colwise_fp8_shared", _colwise_fp8, per_group_colwise_fp8
)
