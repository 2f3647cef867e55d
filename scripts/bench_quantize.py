"""The fp8 cast kernels of one routed projection, ours against torchao 0.18's, on Scout shapes.

    python scripts/bench_quantize.py [--tokens 16384,65536] [--new-counts 3]
        [--out docs/benchmarks/h200_quantize.json]

For each token count M (16 experts, uneven token groups aligned to 16, Scout's 5120 x 8192):
- the weight-gradient operands' per-group column-wise cast (``a [M, K]`` and ``grad [M, N]``,
  one scale per group and column): ours (``per_group_colwise_fp8_pair``) against torchao's
  ``triton_fp8_per_group_colwise_scales`` on each operand;
- the two weight orientations of a ``[16, N, K]`` expert weight.
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
import triton
from torchao.prototype.moe_training.kernels import triton_fp8_per_group_colwise_scales
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8 import triton_per_group as per_group
from torchtitan_fp8_moe.fp8 import triton_quantize
from torchtitan_fp8_moe.fp8.quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from torchtitan_fp8_moe.fp8.triton_per_group import per_group_colwise_fp8_pair

EXPERTS, DIM, HIDDEN = 16, 5120, 8192
# (BLOCK_ROWS, BLOCK_COLS, num_warps) tried by --sweep; the first is the shipped tile.
TILES = [
    (per_group.BLOCK_ROWS, per_group.BLOCK_COLS, per_group.NUM_WARPS),
    (64, 64, 4),
    (128, 32, 4),
    (64, 32, 2),
    (256, 64, 8),
    (32, 128, 4),
    (64, 128, 8),
]


def group_ends(tokens: int, seed: int, skew: float = 0.0) -> torch.Tensor:
    """Uneven groups (as routing gives), each a multiple of 16 tokens, summing to ``tokens``;
    ``skew`` > 0 gives expert i a share proportional to (i + 1) ** -skew (imbalanced routing)."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(EXPERTS, generator=generator) + 0.2
    weights *= (torch.arange(EXPERTS) + 1.0) ** -skew
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
    """Our per-group kernel's time for other fixed tiles (rows, cols, warps), balanced and
    skewed routing: the evidence behind the tile ``triton_per_group.py`` ships."""
    rows = []
    a = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16)
    for skew in (0.0, 1.0, 2.0):
        offs = group_ends(tokens, seed=1, skew=skew)
        for block_rows, block_cols, warps in TILES:
            out, scales = per_group.cast_per_group_colwise(a, offs)  # buffers of the right layout

            def launch(
                block_rows=block_rows,
                block_cols=block_cols,
                warps=warps,
                offs=offs,
                out=out,
                scales=scales,
            ):
                grid = (triton.cdiv(DIM, block_cols), EXPERTS)
                per_group._per_group_colwise_kernel[grid](
                    a,
                    out,
                    scales,
                    offs,
                    tokens,
                    DIM,
                    FP8_LIMIT=FP8_MAX,
                    AMAX_FLOOR=AMAX_FLOOR,
                    BLOCK_ROWS=block_rows,
                    BLOCK_COLS=block_cols,
                    num_warps=warps,
                )

            rows.append(
                {
                    "kernel": f"per_group tile {block_rows}x{block_cols} w{warps}",
                    "case": f"skew {skew}",
                    "tokens": tokens,
                    "largest_group": int(torch.diff(offs, prepend=offs.new_zeros(1)).max()),
                    "impl": "float8_moe",
                    "ms": round(do_bench(launch, warmup=25, rep=100), 4),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="16384,65536")
    parser.add_argument("--new-counts", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also time other per-group tiles")
    parser.add_argument("--sweep-tokens", type=int, default=32768)
    parser.add_argument("--out", default="docs/benchmarks/h200_quantize.json")
    args = parser.parse_args()
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
        offs = group_ends(tokens, seed=tokens)
        for case, (in_dim, out_dim) in (("routed_w1", (DIM, HIDDEN)), ("routed_w2", (HIDDEN, DIM))):
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
    for case, (in_dim, out_dim) in (("routed_w1", (DIM, HIDDEN)), ("routed_w2", (HIDDEN, DIM))):
        # Stored as the expert modules hold it: [E, out, in], used as [E, in, out].
        stored = torch.randn(EXPERTS, out_dim, in_dim, device="cuda", dtype=torch.bfloat16)
        b = stored.transpose(-2, -1)
        for kernel, fn in (
            ("weight (scales over K)", triton_quantize.weight),
            ("weight_transposed (scales over N)", triton_quantize.weight_transposed),
        ):
            ms = do_bench(partial(fn, b), warmup=25, rep=200)
            rows.append({"kernel": kernel, "case": case, "impl": "float8_moe", "ms": round(ms, 4)})
    print(f"{'kernel':<36}{'case':<11}{'M':>7} {'impl':<11}{'ms / first-call s':>20}")
    for r in rows:
        value = r.get("ms", r.get("seconds"))
        print(
            f"{r['kernel']:<36}{r.get('case', '-'):<11}{r.get('tokens', '-'):>7} "
            f"{r['impl']:<11}{value!s:>20}"
        )
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
