"""Second A/B, rows of 1024-8192 elements (TP 8 / 4 / 2 shards of a routed w2, and routed w1):
the shipped fused cast, the fused cast with full tiles (TILE_ROWS = MAX_TILE // row block), and
the cast alone (one row per program) followed by a column amax in torch: ``amax_along`` (amax
and amin) or ``linalg.vector_norm(ord=inf)`` (one pass). Five do_bench medians each (ms).

    python3 docs/benchmarks/h200_2026-12-01b/narrow_rows_ab2.py OUT.json
"""

import json
import statistics
import sys
from functools import partial

import torch
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8 import triton_quantize
from torchtitan_fp8_moe.fp8 import triton_rowwise as rowwise
from torchtitan_fp8_moe.fp8.gemm import column_major
from torchtitan_fp8_moe.fp8.quantize import amax_along

# name: (groups, in_dim K, out_dim N); stored [G, N, K]
SHAPES = {
    "tp8_w2": (16, 1024, 5120),
    "tp4_w2": (16, 2048, 5120),
    "tp2_w2": (16, 4096, 5120),
    "routed_w1": (16, 5120, 8192),
    "routed_w2": (16, 8192, 5120),
}


def cast_then(amax_fn, b):
    data, scales = rowwise.rowwise_fp8(column_major(b).transpose(-2, -1))
    return data, scales, amax_fn(b)


def vector_norm_amax(b):
    return torch.linalg.vector_norm(b, ord=float("inf"), dim=-1).float()


def fused_with(tile_rows, b):
    shipped = rowwise.TILE_ROWS
    rowwise.TILE_ROWS = tile_rows
    try:
        return rowwise.cast_rows(column_major(b).transpose(-2, -1), column_amax=True)
    finally:
        rowwise.TILE_ROWS = shipped


rows = []
for case, (groups, in_dim, out_dim) in SHAPES.items():
    b = torch.randn(groups, out_dim, in_dim, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    ref_amax = triton_quantize.weight(b)[2]
    assert torch.equal(vector_norm_amax(b), ref_amax), case
    variants = {
        "fused 4x16 (shipped)": partial(triton_quantize.weight, b),
        "fused full tiles x16": partial(fused_with, 64, b),
        "cast + amax_along": partial(cast_then, partial(amax_along, dim=-1), b),
        "cast + vector_norm": partial(cast_then, vector_norm_amax, b),
        "cast alone": partial(rowwise.rowwise_fp8, column_major(b).transpose(-2, -1)),
    }
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
