"""A/B of the forward weight cast + amax over N on the six weights of bench_quantize.WEIGHT_CASES:
fused (the shipped kernel: amax taken in the cast), fused with other tiles, and the cast alone
(one row per program) followed by torch's amax over N. Five do_bench medians each (ms).

    python3 docs/benchmarks/h200_2026-12-01b/narrow_rows_ab.py OUT.json
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
from torchtitan_fp8_moe.fp8.quantize import amax_along


def cast_then_torch_amax(b):
    data, scales = rowwise.rowwise_fp8(column_major(b).transpose(-2, -1))
    return data, scales, amax_along(b, dim=-1)


def fused_with(tiles, b):
    shipped = (rowwise.TILE_ROWS, rowwise.ROW_TILES)
    rowwise.TILE_ROWS, rowwise.ROW_TILES = tiles
    try:
        return rowwise.cast_rows(column_major(b).transpose(-2, -1), column_amax=True)
    finally:
        rowwise.TILE_ROWS, rowwise.ROW_TILES = shipped


rows = []
for case, (groups, in_dim, out_dim) in WEIGHT_CASES.items():
    b = torch.randn(groups, out_dim, in_dim, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    ref_data, ref_scales, ref_amax = triton_quantize.weight(b)
    variants = {
        "fused 4x16 (shipped)": partial(triton_quantize.weight, b),
        "fused 32x4": partial(fused_with, (32, 4), b),
        "fused 8x4": partial(fused_with, (8, 4), b),
        "fused 4x4": partial(fused_with, (4, 4), b),
        "cast + torch amax": partial(cast_then_torch_amax, b),
        "torch amax alone": partial(amax_along, b, -1),
        "transposed cast": partial(triton_quantize.weight_transposed, b, ref_amax),
    }
    _, _, amax_b = cast_then_torch_amax(b)
    assert torch.equal(amax_b, ref_amax), case
    for name, fn in variants.items():
        times = [do_bench(fn, warmup=25, rep=200) for _ in range(5)]
        rows.append(
            {
                "case": case,
                "variant": name,
                "ms": round(statistics.median(times), 4),
                "min": round(min(times), 4),
                "max": round(max(times), 4),
            }
        )
        print(
            f"{case:10s} {name:22s} {rows[-1]['ms']:.4f} "
            f"({rows[-1]['min']:.4f}-{rows[-1]['max']:.4f})",
            flush=True,
        )
json.dump(rows, open(sys.argv[1], "w"), indent=1)
