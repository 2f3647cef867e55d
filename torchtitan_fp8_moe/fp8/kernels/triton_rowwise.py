"""Our own Triton kernel for rowwise fp8 quantization along a tensor's contiguous last dim.

torchao's rowwise kernels read each row twice (once for the amax, once for the cast), well below
the GPU's memory bandwidth for Llama4 activations. Here a program holds whole rows in registers,
so each row is read once: amax, power-of-2 scale and cast in one pass. Same rules as
``quantize.py``: the scale is the largest power of two that keeps the row's amax within fp8 range
(taken from the float's exponent bits, so it is exact), values saturate at +-FP8_MAX, and NaN stays
NaN. CUDA only.

For an expert weight (rows of the stored ``[G, N, K]``, scales over K) the same pass also takes
each group's amax along N, per column k: the scales of the weight's other orientation (scales
over N, ``triton_transposed.py``), which then needs one read of the weight instead of two.
"""

import math

import torch
import triton
import triton.language as tl

from ..opaque import compile_triton, launcher
from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from .triton_rules import as_float32, pow2_scale, saturate

# Rows up to this many elements fit one program's registers; longer rows are not supported here.
MAX_ROW = 16384
# A weight program's tile holds at most this many elements (4 rows of 8192 were the fastest
# shape; 8 rows of 8192 spilled registers and ran many times slower).
MAX_TILE = 32768
# A weight program casts ROW_TILES tiles of TILE_ROWS rows, so that its column amax goes to
# memory (one atomic max per column) once per TILE_ROWS * ROW_TILES rows, not per row. The
# fastest of the shapes swept (`scripts/bench_quantize.py --weights-only --sweep`): the column
# amax costs less than the transposed cast saves by using it (it then reads the weight once
# instead of twice, as torchao's does). Small weights too (a shared expert, a TP 8 shard): one
# tile per program, to spread them over more programs, was slower.
TILE_ROWS, ROW_TILES = 4, 16
# fp32 weights (a lazy bf16 cast's, one device; fp32 parameters under autocast) take twice the
# registers per row: half the tile and twice the tiles per program cast a Scout routed weight
# faster than the bf16 shape does, and faster than casting to bf16 first and quantizing that
# (`scripts/bench_quantize.py --lazy-cast 1 --sweep`; timings in docs/benchmarks/README.md).
FP32_MAX_TILE, FP32_ROW_TILES = 16384, 32
# Activation and gradient rows (no column amax): rows per tile, tiles per program, and warps
# (None: one warp per 512 elements of the tile, 4 to 16, but 4 where a row is shorter than its
# power-of-2 tile: rows of 5120 / 2880 / 7168 are faster at 4 warps than at 16 / 8 / 16, rows
# of 8192 are fastest at 16 (`scripts/bench_quantize.py --rows-sweep`; timings in
# docs/benchmarks/README.md).
ROWS_TILE_ROWS, ROWS_ROW_TILES, ROWS_WARPS = 1, 1, None
MASKED_ROWS_WARPS = 4


@triton.jit
def _rowwise_fp8_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    column_amax_ptr,
    n_rows,
    n_cols,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    ROW_TILES: tl.constexpr,
    COLUMN_AMAX: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    """Rows of group ``program_id(1)`` (``n_rows`` rows of ``n_cols``); with COLUMN_AMAX also
    the group's amax over its rows per column, as float32 bits in int32; with ROUND_TO_BF16 of
    the values rounded to bf16."""
    group = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    column_amax = tl.zeros((BLOCK,), dtype=tl.int32)
    first_row = tl.program_id(0) * ROW_TILES * TILE_ROWS
    rows = first_row + tl.arange(0, TILE_ROWS)
    x = tl.load(
        x_ptr + (group * n_rows + rows)[:, None] * n_cols + cols[None, :],
        mask=(rows < n_rows)[:, None] & col_mask[None, :],
        other=0.0,
    )
    for tile in range(ROW_TILES):
        rows = first_row + tile * TILE_ROWS + tl.arange(0, TILE_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        flat_rows = group * n_rows + rows
        offsets = flat_rows[:, None] * n_cols + cols[None, :]
        # Issue the next tile's load before this tile's math, so a program keeps a load in
        # flight (its rows are otherwise read one tile at a time).
        if ROW_TILES > 1:
            next_mask = (rows + TILE_ROWS < n_rows) & (tile + 1 < ROW_TILES)
            x_next = tl.load(
                x_ptr + offsets + TILE_ROWS * n_cols,
                mask=next_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
        values = as_float32(x, ROUND_TO_BF16)
        magnitude = tl.abs(values)
        scale = pow2_scale(tl.max(magnitude, axis=1), FP8_LIMIT, AMAX_FLOOR)
        y = saturate(values * scale[:, None], FP8_LIMIT)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + flat_rows, scale, mask=row_mask)
        if COLUMN_AMAX:
            # The bits of a non-negative float order like the float, and NaN's lie above
            # infinity's: an integer max keeps NaN, whatever the float max would do with it.
            bits = magnitude.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # whatever abs does to NaN
            column_amax = tl.maximum(column_amax, tl.max(bits, axis=0))
        if ROW_TILES > 1:
            x = x_next
    if COLUMN_AMAX:
        tl.atomic_max(column_amax_ptr + group * n_cols + cols, column_amax, mask=col_mask)


def cast_rows(
    x: torch.Tensor,
    column_amax: bool,
    out_dtype: torch.dtype = FP8_DTYPE,
    round_to_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [G, R, C]`` -> ``out_dtype [G, R, C]``, fp32 scales ``[G, R, 1]`` (per row over C),
    and with ``column_amax`` each group's amax of |x| over its rows, ``[G, C]`` float32 (NaN
    if the column holds one); with ``round_to_bf16``, all of it of ``x.bfloat16()``'s values.
    ``out_dtype`` other than fp8 keeps the scaled, saturated values uncast (how the tests check
    the kernel in Triton's CPU interpreter, which does not round to fp8 as the GPU does)."""
    groups, n_rows, n_cols = x.shape
    if n_cols > MAX_ROW:
        raise ValueError(f"rowwise fp8 cast: rows of {n_cols} elements exceed {MAX_ROW}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    scales = torch.empty((groups, n_rows, 1), dtype=torch.float32, device=x.device)
    # Without column_amax the kernel never touches the amax buffer: scales stands in for it.
    amax_bits = (
        torch.zeros((groups, n_cols), dtype=torch.int32, device=x.device) if column_amax else None
    )
    if x.numel():
        block = triton.next_power_of_2(n_cols)
        tile_rows, row_tiles = ROWS_TILE_ROWS, ROWS_ROW_TILES
        if column_amax:
            tile_rows, row_tiles = weight_tile(block, x.element_size())
            num_warps = _warps_per_tile(block, tile_rows)
        else:
            num_warps = _rows_warps(n_cols, block, tile_rows)
        grid = (triton.cdiv(n_rows, tile_rows * row_tiles), groups)
        launcher(_rowwise_fp8_kernel, x)[grid](
            x,
            out,
            scales,
            scales if amax_bits is None else amax_bits,
            n_rows,
            n_cols,
            FP8_LIMIT=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            BLOCK=block,
            TILE_ROWS=tile_rows,
            ROW_TILES=row_tiles,
            COLUMN_AMAX=column_amax,
            ROUND_TO_BF16=round_to_bf16,
            num_warps=num_warps,
        )
    return out, scales, None if amax_bits is None else amax_bits.view(torch.float32)


def weight_tile(block: int, element_size: int) -> tuple[int, int]:
    """(rows per tile, tiles per program) of a weight cast of rows padded to ``block`` lanes:
    the fp32 or bf16 tile, capped at that tile's elements."""
    max_tile, row_tiles = (
        (FP32_MAX_TILE, FP32_ROW_TILES) if element_size == 4 else (MAX_TILE, ROW_TILES)
    )
    return max(1, min(TILE_ROWS, max_tile // block)), row_tiles


def _warps_per_tile(block: int, tile_rows: int) -> int:
    """One warp per 512 elements of a program's tile, 4 to 16."""
    return max(4, min(16, block * tile_rows // 512))


def _rows_warps(n_cols: int, block: int, tile_rows: int) -> int:
    """Warps of an activation row cast: ROWS_WARPS, else 4 for rows with masked lanes."""
    if ROWS_WARPS is not None:
        return ROWS_WARPS
    return MASKED_ROWS_WARPS if n_cols < block else _warps_per_tile(block, tile_rows)


def _rowwise_fp8(x: torch.Tensor, round_to_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., C]`` -> fp8 ``[..., C]`` and fp32 scales ``[..., 1]`` (per row over C)."""
    rows = x.reshape(1, math.prod(x.shape[:-1]), x.shape[-1])
    out, scales, _ = cast_rows(rows, column_amax=False, round_to_bf16=round_to_bf16)
    return out.view(x.shape), scales.view(*x.shape[:-1], 1)


def _rowwise_fp8_with_column_amax(
    x: torch.Tensor, round_to_bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [G, R, C]`` -> fp8 ``[G, R, C]``, scales ``[G, R, 1]`` and the amax over each
    group's rows ``[G, C]``, from one read of x."""
    return cast_rows(x, column_amax=True, round_to_bf16=round_to_bf16)


rowwise_fp8 = compile_triton("rowwise_fp8", _rowwise_fp8)
rowwise_fp8_with_column_amax = compile_triton(
    "rowwise_fp8_with_column_amax", _rowwise_fp8_with_column_amax
)
