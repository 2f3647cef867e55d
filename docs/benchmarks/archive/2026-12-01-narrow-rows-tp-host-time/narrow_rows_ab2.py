"""Second A/B, rows of 1024-8192 elements (TP 8 / 4 / 2 shards of a routed w2, and routed w1):
the fused cast (4 x 16 tiles, the only path before the narrow-row rule), the fused cast with full
tiles (TILE_ROWS = MAX_TILE // row block), and the cast alone (one row per program) followed by a
column amax in torch: amax and amin (two passes) or ``linalg.vector_norm(ord=inf)`` (one pass).
Five do_bench medians each (ms).

    python3 docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time/narrow_rows_ab2.py OUT.json
"""

import json
import sys
from functools import partial

import torch
from narrow_rows_ab import amax_and_amin, cast_then, fused_with, time_variants

from torchtitan_fp8_moe.fp8 import triton_rowwise as rowwise
from torchtitan_fp8_moe.fp8.gemm import column_major

# name: (groups, in_dim K, out_dim N); stored [G, N, K]
SHAPES = {
    "tp8_w2": (16, 1024, 5120),
    "tp4_w2": (16, 2048, 5120),
    "tp2_w2": (16, 4096, 5120),
    "routed_w1": (16, 5120, 8192),
    "routed_w2": (16, 8192, 5120),
}


def vector_norm_amax(b):
    return torch.linalg.vector_norm(b, ord=float("inf"), dim=-1).float()


def main():
    rows = []
    for case, (groups, in_dim, out_dim) in SHAPES.items():
        stored = torch.randn(groups, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        b = stored.transpose(-2, -1)
        ref_amax = fused_with(4, 16, b)[2]
        assert torch.equal(vector_norm_amax(b), ref_amax), case
        variants = {
            "fused 4x16 (shipped)": partial(fused_with, 4, 16, b),
            "fused full tiles x16": partial(fused_with, 64, 16, b),
            "cast + amax_along": partial(cast_then, amax_and_amin, b),
            "cast + vector_norm": partial(cast_then, vector_norm_amax, b),
            "cast alone": partial(rowwise.rowwise_fp8, column_major(b).transpose(-2, -1)),
        }
        time_variants(case, variants, rows)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
