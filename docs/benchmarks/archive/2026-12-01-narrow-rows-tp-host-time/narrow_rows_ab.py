"""A/B of the forward weight cast + amax over N on the six weights of bench_quantize.WEIGHT_CASES:
the fused kernel (amax taken in the cast; the only path before the narrow-row rule), fused with
other tiles, and the cast alone (one row per program) followed by torch's amax and amin over N.
Five do_bench medians each (ms).

    python3 docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time/narrow_rows_ab.py OUT.json
"""

import json
import statistics
import sys
from functools import partial

import torch
from triton.testing import do_bench

from scripts.bench_quantize import WEIGHT_CASES
from torchtitan_fp8_moe.fp8 import triton_quantize
from torchtitan_fp8_moe.fp8 import triton_rowwise as rowwise
from torchtitan_fp8_moe.fp8.gemm import column_major


def amax_and_amin(b):
    """The amax over N in two reductions (what ``quantize.amax_along`` does on CPU)."""
    return torch.maximum(b.amax(dim=-1), -b.amin(dim=-1)).float()


def cast_then(amax_fn, b):
    data, scales = rowwise.rowwise_fp8(column_major(b).transpose(-2, -1))
    return data, scales, amax_fn(b)


def fused_with(tile_rows, row_tiles, b):
    """The fused cast + amax with ``tile_rows`` x ``row_tiles`` per program (capped at MAX_TILE)."""
    shipped = (rowwise.TILE_ROWS, rowwise.ROW_TILES)
    rowwise.TILE_ROWS, rowwise.ROW_TILES = tile_rows, row_tiles
    try:
        return rowwise.cast_rows(column_major(b).transpose(-2, -1), column_amax=True)
    finally:
        rowwise.TILE_ROWS, rowwise.ROW_TILES = shipped


def time_variants(case, variants, rows):
    """Five do_bench medians of each variant; a row per variant in ``rows``, printed."""
    for name, fn in variants.items():
        times = [do_bench(fn, warmup=25, rep=200) for _ in range(5)]
        row = {
            "case": case,
            "variant": name,
            "ms": round(statistics.median(times), 4),
            "min": round(min(times), 4),
            "max": round(max(times), 4),
        }
        rows.append(row)
        print(f"{case:10s} {name:22s} {row['ms']:.4f} ({row['min']:.4f}-{row['max']:.4f})")


def main():
    rows = []
    for case, (groups, in_dim, out_dim) in WEIGHT_CASES.items():
        stored = torch.randn(groups, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        b = stored.transpose(-2, -1)
        ref_amax = fused_with(rowwise.TILE_ROWS, rowwise.ROW_TILES, b)[2]
        assert torch.equal(cast_then(amax_and_amin, b)[2], ref_amax), case
        variants = {
            "fused 4x16 (shipped)": partial(fused_with, 4, 16, b),
            "fused 32x4": partial(fused_with, 32, 4, b),
            "fused 8x4": partial(fused_with, 8, 4, b),
            "fused 4x4": partial(fused_with, 4, 4, b),
            "cast + torch amax": partial(cast_then, amax_and_amin, b),
            "torch amax alone": partial(amax_and_amin, b),
            "transposed cast": partial(triton_quantize.weight_transposed, b, ref_amax),
        }
        time_variants(case, variants, rows)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
