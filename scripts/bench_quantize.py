"""The fp8 cast kernels of one routed projection, ours against torchao 0.18's, on Scout shapes.

    python scripts/bench_quantize.py [--tokens 16384,65536] [--new-counts 3]
        [--out outputs/benchmarks/h200_quantize.json]
    python scripts/bench_quantize.py --lazy-cast 5   # the lazy bf16 cast's weight casts
    python scripts/bench_quantize.py --rows-sweep    # the activation row cast's tile shapes
    python scripts/bench_quantize.py --per-group-sweep  # the weight gradient's per-group casts

For each token count M (16 experts, uneven token groups aligned to 16, Scout's 5120 x 8192):
- the weight-gradient operands' per-group column-wise cast (``a [M, K]`` and ``grad [M, N]``,
  one scale per group and column): ours (``per_group_colwise_fp8_pair``) against torchao's
  ``triton_fp8_per_group_colwise_scales`` on each operand;
- the two weight orientations of Scout's routed, grouped shared and TP 8 shard weights
  (``WEIGHT_CASES``): ours (the forward cast also takes the amax over N, so the transposed cast
  reads the weight once) against torchao's ``triton_fp8_colwise_3d_scale_and_cast`` and
  ``triton_fp8_rowwise_3d_transpose_rhs``.
Steady-state times are triton ``do_bench`` medians (ms). ``first call`` is the wall time of the
first call at each of ``--new-counts`` token counts never seen before (what expert parallelism
meets every step, since the tokens a rank receives vary): compilation and autotuning included.
Needs CUDA with fp8 (sm89+).
"""

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torchao.prototype.moe_training.kernels import (
    triton_fp8_colwise_3d_scale_and_cast,
    triton_fp8_per_group_colwise_scales,
    triton_fp8_rowwise_3d_transpose_rhs,
)
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8.gemm import column_major
from torchtitan_fp8_moe.fp8.kernels import triton_per_group as per_group
from torchtitan_fp8_moe.fp8.kernels import triton_rowwise as rowwise
from torchtitan_fp8_moe.fp8.kernels.triton_per_group import per_group_colwise_fp8_pair
from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE
from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS

EXPERTS, DIM, HIDDEN = 16, 5120, 8192
# (BLOCK_ROWS, BLOCK_COLS, num_warps, cast pass descending) tried by --sweep; the first is the
# shipped tile.
TILES = [
    (per_group.BLOCK_ROWS, per_group.BLOCK_COLS, per_group.NUM_WARPS, True),
    (256, 64, 8, False),
    (128, 64, 4, False),
    (256, 32, 8, False),
]


# (TILE_ROWS, ROW_TILES) of the forward weight cast timed by --sweep (tiles capped at MAX_TILE).
WEIGHT_SWEEP = [(2, 16), (4, 16), (8, 16), (16, 16), (32, 16), (32, 8), (32, 4), (8, 8)]
WEIGHT_SWEEP += [(4, 32), (2, 32), (4, 64)]
# One-row tiles: the shipped bf16 tile (4 x 16, 16 warps) spills 1512 bytes a thread for sm_90
# where these spill none (`scripts/kernel_resources.py`, no GPU needed).
WEIGHT_SWEEP += [(1, 32), (1, 64)]


def group_ends(tokens: int, seed: int, skew: float = 0.0, groups: int = EXPERTS) -> torch.Tensor:
    """Uneven groups (as routing gives), each a multiple of 16 tokens, summing to ``tokens``;
    ``skew`` > 0 gives expert i a share proportional to (i + 1) ** -skew (imbalanced routing)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=generator) + 0.2
    weights *= (torch.arange(groups) + 1.0) ** -skew
    sizes = (weights / weights.sum() * tokens / 16).floor().long() * 16
    sizes[-1] += tokens - sizes.sum()
    return torch.cumsum(sizes, 0).to(torch.int32).cuda()


def ours(a, grad, offs):
    return per_group_colwise_fp8_pair(a, grad, offs)


def torchao(a, grad, offs):
    return tuple(
        out
        for x in (a, grad)
        for out in triton_fp8_per_group_colwise_scales(
            x, offs, output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
        )
    )


def first_call_seconds(fn, tokens: int, in_dim: int, out_dim: int, seed: int) -> float:
    a = torch.randn(tokens, in_dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, out_dim, device="cuda", dtype=torch.bfloat16)
    offs = group_ends(tokens, seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(a, grad, offs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def sweep_tiles(tokens: int) -> list[dict]:
    """Our per-group kernel's time for other fixed tiles (rows, cols, warps, order), balanced
    and skewed routing, at Scout's routed w2 operands, a TP 8 shard's and the shared expert's
    (one group: the chunked launches): the evidence behind
    the tile ``triton_per_group.py`` ships. Every tile's output is checked equal to the first's."""
    rows = []
    shipped = TILES[0]
    cases = (("scout", EXPERTS, HIDDEN, DIM), ("tp8", EXPERTS, DIM, HIDDEN // 8))
    for case, groups, a_cols, grad_cols in (*cases, ("shared", 1, DIM, HIDDEN)):
        a = torch.randn(tokens, a_cols, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, grad_cols, device="cuda", dtype=torch.bfloat16)
        for skew in (0.0, 1.0) if groups > 1 else (0.0,):
            offs = group_ends(tokens, seed=1, skew=skew, groups=groups)
            want = None
            for tile in TILES:
                (
                    per_group.BLOCK_ROWS,
                    per_group.BLOCK_COLS,
                    per_group.NUM_WARPS,
                    per_group.WHOLE_GROUP_DESCENDING,
                ) = tile
                launch = partial(per_group.cast_per_group_colwise_pair, a, grad, offs)
                got = [t.float() for t in launch()]
                want = want or got
                rows.append(
                    {
                        "kernel": "per_group tile {}x{} w{} desc {}".format(*tile),
                        "case": f"{case} skew {skew}",
                        "tokens": tokens,
                        "largest_group": int(torch.diff(offs, prepend=offs.new_zeros(1)).max()),
                        "impl": "float8_moe",
                        "ms": round(do_bench(launch, warmup=25, rep=200), 4),
                        "equal": all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
                    }
                )
    (
        per_group.BLOCK_ROWS,
        per_group.BLOCK_COLS,
        per_group.NUM_WARPS,
        per_group.WHOLE_GROUP_DESCENDING,
    ) = shipped
    return rows


def _torchao_weight_casts(b):
    """torchao's kernels for the two orientations (what we used before our own)."""
    options = {"output_dtype": FP8_DTYPE, "round_scales_to_power_of_2": True}
    return (
        triton_fp8_colwise_3d_scale_and_cast(column_major(b), **options),
        triton_fp8_rowwise_3d_transpose_rhs(column_major(b), **options),
    )


# (groups, in_dim, out_dim) of the weights whose casts are timed: Scout's routed experts, its
# [1, hidden, dim] grouped shared expert, and a routed weight's TP 8 shard.
WEIGHT_CASES = {
    "routed_w1": (EXPERTS, DIM, HIDDEN),
    "routed_w2": (EXPERTS, HIDDEN, DIM),
    "shared_w1": (1, DIM, HIDDEN),
    "shared_w2": (1, HIDDEN, DIM),
    "tp8_w1": (EXPERTS, DIM, HIDDEN // 8),
    "tp8_w2": (EXPERTS, HIDDEN // 8, DIM),
}


def weight_casts(sweep: bool) -> list[dict]:
    """Both orientations of each weight of WEIGHT_CASES: ours (the forward cast also takes the
    amax over N; the transposed cast reads the weight once) against torchao's kernels."""
    rows = []
    shipped = (rowwise.TILE_ROWS, rowwise.ROW_TILES)
    for case, (groups, in_dim, out_dim) in WEIGHT_CASES.items():
        # Stored as the expert modules hold it: [E, out, in], used as [E, in, out].
        stored = torch.randn(groups, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        b = stored.transpose(-2, -1)
        _, _, amax = TRITON_QUANTIZERS.weight(b)
        (ao_fwd, _), (ao_t, _) = _torchao_weight_casts(b)
        ours_fwd, ours_t = (
            TRITON_QUANTIZERS.weight(b)[0],
            TRITON_QUANTIZERS.weight_transposed(b, amax)[0],
        )
        same = torch.equal(ours_fwd.float(), ao_fwd.float()) and torch.equal(
            ours_t.float(), ao_t.float()
        )
        timings = {
            ("forward (scales over K) + amax over N", "float8_moe"): partial(
                TRITON_QUANTIZERS.weight, b
            ),
            ("transposed (scales over N)", "float8_moe"): partial(
                TRITON_QUANTIZERS.weight_transposed, b, amax
            ),
            ("forward, rows only (no amax)", "float8_moe"): partial(
                rowwise.rowwise_fp8, column_major(b).transpose(-2, -1)
            ),
            ("forward (scales over K)", "torchao"): partial(
                triton_fp8_colwise_3d_scale_and_cast,
                column_major(b),
                output_dtype=FP8_DTYPE,
                round_scales_to_power_of_2=True,
            ),
            ("transposed (scales over N)", "torchao"): partial(
                triton_fp8_rowwise_3d_transpose_rhs,
                column_major(b),
                output_dtype=FP8_DTYPE,
                round_scales_to_power_of_2=True,
            ),
        }
        for (kernel, impl), fn in timings.items():
            rows.append(
                {
                    "kernel": f"weight {kernel}",
                    "case": case,
                    "impl": impl,
                    "ms": round(do_bench(fn, warmup=25, rep=200), 4),
                    "fp8_data_equal_to_torchao": same,
                }
            )
        for config in WEIGHT_SWEEP if sweep else []:
            rowwise.TILE_ROWS, rowwise.ROW_TILES = config
            rows.append(
                {
                    "kernel": f"weight forward + amax, rows x tiles {config}",
                    "case": case,
                    "impl": "float8_moe",
                    "ms": round(do_bench(partial(TRITON_QUANTIZERS.weight, b), rep=100), 4),
                }
            )
        rowwise.TILE_ROWS, rowwise.ROW_TILES = shipped
    return rows


def lazy_cast_casts(repeat: int) -> list[dict]:
    """The weight casts of an fp32 parameter's lazy bf16 cast (``weight/lazy_cast.py``: the kernels
    read fp32 and round to bf16 as they read) against quantizing a bf16 copy (the cast, then the
    kernel: what compiled code and FSDP's bf16 parameters do) and the fp32 values unrounded;
    medians of ``repeat`` interleaved rounds. Checks that the rounded casts equal the copy's."""
    rows = []
    for case in ("routed_w1", "routed_w2", "tp8_w1", "tp8_w2"):
        groups, in_dim, out_dim = WEIGHT_CASES[case]
        stored = torch.randn(groups, out_dim, in_dim, device="cuda") * 0.02
        b = stored.transpose(-2, -1)
        b16 = b.bfloat16()
        amax = TRITON_QUANTIZERS.weight(b, round_to=torch.bfloat16)[2]
        lazy = (*TRITON_QUANTIZERS.weight(b, round_to=torch.bfloat16), *_transposed(b, amax, True))
        copied = (*TRITON_QUANTIZERS.weight(b16), *_transposed(b16, amax, False))
        equal = all(torch.equal(x.float(), y.float()) for x, y in zip(lazy, copied, strict=True))
        timings = {
            ("forward + amax over N", "bf16 copy"): partial(_cast_then_quantize, b),
            ("forward + amax over N", "fp32 unrounded"): partial(TRITON_QUANTIZERS.weight, b),
            ("forward + amax over N", "fp32 rounded (lazy)"): partial(
                TRITON_QUANTIZERS.weight, b, round_to=torch.bfloat16
            ),
            ("transposed", "bf16 copy"): partial(_transposed, b16, amax, False),
            ("transposed", "fp32 unrounded"): partial(TRITON_QUANTIZERS.weight_transposed, b, amax),
            ("transposed", "fp32 rounded (lazy)"): partial(_transposed, b, amax, True),
        }
        times: dict = {key: [] for key in timings}
        for _ in range(repeat):
            for key, fn in timings.items():
                times[key].append(do_bench(fn, warmup=10, rep=100))
        for (kernel, impl), ms in times.items():
            rows.append(
                {
                    "kernel": f"lazy cast: weight {kernel}",
                    "case": case,
                    "impl": impl,
                    "ms": round(statistics.median(ms), 4),
                    "ms_min_max": [round(min(ms), 4), round(max(ms), 4)],
                    "rounded_equal_to_bf16_copy": equal,
                }
            )
    return rows


def lazy_cast_sweep() -> list[dict]:
    """The fp32 rounded forward weight cast at other tiles (rows per tile via MAX_TILE, tiles
    per program): fp32 rows take twice the registers of bf16's, which the tile was chosen for."""
    rows = []
    shipped = (rowwise.FP32_MAX_TILE, rowwise.FP32_ROW_TILES)
    for case in ("routed_w1", "routed_w2"):
        groups, in_dim, out_dim = WEIGHT_CASES[case]
        b = (torch.randn(groups, out_dim, in_dim, device="cuda") * 0.02).transpose(-2, -1)
        want = TRITON_QUANTIZERS.weight(b.bfloat16())
        for max_tile in (8192, 16384, 32768):
            for row_tiles in (4, 8, 16, 32, 64):
                rowwise.FP32_MAX_TILE, rowwise.FP32_ROW_TILES = max_tile, row_tiles
                fn = partial(TRITON_QUANTIZERS.weight, b, round_to=torch.bfloat16)
                same = [torch.equal(x.float(), y.float()) for x, y in zip(fn(), want, strict=True)]
                rows.append(
                    {
                        "kernel": f"lazy cast: fp32 forward, max tile {max_tile} x {row_tiles}",
                        "case": case,
                        "impl": "float8_moe",
                        "ms": round(do_bench(fn, warmup=10, rep=100), 4),
                        "equal": all(same),
                    }
                )
    rowwise.FP32_MAX_TILE, rowwise.FP32_ROW_TILES = shipped
    return rows


# (rows per tile, tiles per program, warps) of the activation / gradient row cast timed by
# --rows-sweep; the first is the shipped shape (warps None: the kernel's rule).
ROWS_SWEEP = [(1, 1, None), (1, 1, 8), (1, 1, 4), (2, 1, 16), (2, 1, 8), (1, 4, 8), (1, 4, 16)]
ROWS_SWEEP += [(2, 4, 16), (2, 8, 16), (4, 4, 16), (1, 8, 8), (2, 2, 8)]


def rows_sweep(tokens: int, widths: list[int]) -> list[dict]:
    """The row cast of bf16 activations and gradients (the forward's input, the input
    gradient's output gradient) at other tile shapes and row lengths; each shape's output
    checked equal to the shipped one's."""
    rows = []
    shipped = (rowwise.ROWS_TILE_ROWS, rowwise.ROWS_ROW_TILES, rowwise.ROWS_WARPS)
    for width in widths:
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        want = rowwise.rowwise_fp8(x)
        for config in ROWS_SWEEP:
            rowwise.ROWS_TILE_ROWS, rowwise.ROWS_ROW_TILES, rowwise.ROWS_WARPS = config
            got = rowwise.rowwise_fp8(x)
            rows.append(
                {
                    "kernel": "rows tile {} x {}, warps {}".format(*config),
                    "case": f"{tokens} x {width}",
                    "impl": "float8_moe",
                    "ms": round(do_bench(partial(rowwise.rowwise_fp8, x), warmup=25, rep=200), 4),
                    "equal": all(
                        torch.equal(g.float(), w.float()) for g, w in zip(got, want, strict=True)
                    ),
                }
            )
    rowwise.ROWS_TILE_ROWS, rowwise.ROWS_ROW_TILES, rowwise.ROWS_WARPS = shipped
    return rows


def _cast_then_quantize(b):
    return TRITON_QUANTIZERS.weight(b.bfloat16())


def _transposed(b, amax, rounded: bool):
    return TRITON_QUANTIZERS.weight_transposed(b, amax, torch.bfloat16 if rounded else None)


# (groups, in_dim, out_dim) of the weight-gradient operands timed: Scout's routed projections,
# their TP 8 shards, and the shared expert (one group) whole and as a TP 8 shard.
PER_GROUP_CASES = {
    "routed_w1": (EXPERTS, DIM, HIDDEN),
    "routed_w2": (EXPERTS, HIDDEN, DIM),
    "tp8_w1": (EXPERTS, DIM, HIDDEN // 8),
    "tp8_w2": (EXPERTS, HIDDEN // 8, DIM),
    "shared_w1": (1, DIM, HIDDEN),
    "shared_tp8_w1": (1, DIM, HIDDEN // 8),
    "shared_tp8_w2": (1, HIDDEN // 8, DIM),
}


def per_group_casts(args) -> list[dict]:
    """The weight-gradient operands' per-group casts: first calls at new token counts, then
    steady state, ours against torchao's (and other tiles of ours with --sweep)."""
    rows = []
    # First calls before any steady-state timing, so each impl's compile/tune is in its numbers.
    for impl, fn in (("float8_moe", ours), ("torchao", torchao)):
        seconds = [
            first_call_seconds(fn, 16384 + 16 * (7 + 13 * i), DIM, HIDDEN, seed=i)
            for i in range(args.new_counts)
        ]
        rows.append(
            {
                "kernel": "per_group_pair first call, new M",
                "impl": impl,
                "seconds": [round(s, 3) for s in seconds],
                "seconds_median": round(statistics.median(seconds), 3),
            }
        )
    for tokens in (int(t) for t in args.tokens.split(",")):
        for case, (groups, in_dim, out_dim) in PER_GROUP_CASES.items():
            offs = group_ends(tokens, seed=tokens, groups=groups)
            a = torch.randn(tokens, in_dim, device="cuda", dtype=torch.bfloat16)
            grad = torch.randn(tokens, out_dim, device="cuda", dtype=torch.bfloat16)
            # The fp8 data of both operands (torchao's scales are the reciprocals of ours).
            reference, mine = torchao(a, grad, offs), ours(a, grad, offs)
            same = all(torch.equal(reference[i].float(), mine[i].float()) for i in (0, 2))
            for impl, fn in (("float8_moe", ours), ("torchao", torchao)):
                ms = do_bench(partial(fn, a, grad, offs), warmup=25, rep=200)
                rows.append(
                    {
                        "kernel": "per_group_pair",
                        "case": case,
                        "tokens": tokens,
                        "impl": impl,
                        "ms": round(ms, 4),
                        "fp8_data_equal_to_torchao": same,
                    }
                )
    if args.sweep:
        rows += sweep_tiles(args.sweep_tokens)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="16384,65536")
    parser.add_argument("--new-counts", type=int, default=3)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time other tiles of our per-group and weight casts",
    )
    parser.add_argument("--sweep-tokens", type=int, default=32768)
    parser.add_argument("--weights-only", action="store_true", help="only the weight casts")
    parser.add_argument(
        "--lazy-cast",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the lazy bf16 cast's weight casts, in this many interleaved rounds",
    )
    parser.add_argument(
        "--rows-sweep", action="store_true", help="only the row cast of activations, at other tiles"
    )
    parser.add_argument(
        "--per-group-sweep", action="store_true", help="only the per-group cast, at other tiles"
    )
    parser.add_argument(
        "--rows-widths",
        default=f"{DIM},{HIDDEN}",
        help="--rows-sweep's row lengths (Scout's: dim, hidden)",
    )
    parser.add_argument("--out", default="outputs/benchmarks/h200_quantize.json")
    args = parser.parse_args()
    if args.rows_sweep:
        rows = rows_sweep(args.sweep_tokens, [int(w) for w in args.rows_widths.split(",")])
    elif args.per_group_sweep:
        rows = sweep_tiles(args.sweep_tokens)
    elif args.lazy_cast:
        rows = lazy_cast_casts(args.lazy_cast) + (lazy_cast_sweep() if args.sweep else [])
    else:
        rows = [] if args.weights_only else per_group_casts(args)
        rows += weight_casts(args.sweep)
    print(f"{'kernel':<44}{'case':<11}{'M':>7} {'impl':<11}{'ms / first-call s':>20}")
    for r in rows:
        value = r.get("ms", r.get("seconds"))
        print(
            f"{r['kernel']:<44}{r.get('case', '-'):<11}{r.get('tokens', '-'):>7} "
            f"{r['impl']:<11}{value!s:>20}"
        )
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
