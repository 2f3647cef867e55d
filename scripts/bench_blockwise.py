"""Blockwise fp8 grouped GEMMs (ours, Triton) against bf16, torch's fp8 rowwise and torchao's
blockwise prototype, on MoE shapes.

    python scripts/bench_blockwise.py [--quick] [--repeat 3]
        [--out outputs/benchmarks/blockwise.json]

Shapes (token groups even and 128-aligned): Llama4 Scout's routed projection (16 experts,
5120 -> 8192) at 64K and 16K routed tokens, and DeepSeek-V3's with 16 local experts
(7168 -> 2048) at 8K tokens x top-8 = 64K routed tokens; ``--quick`` runs Scout 16K only.
For each: the forward ``y = x . W_g``, the input gradient ``dx = dy . W_g^T`` and the weight
gradient ``dW_g = x_g^T . dy_g`` of
- ``bf16``: ``torch._grouped_mm``;
- ``blockwise``: our kernels, GEMM only; ``dgrad`` reads the weight's fp8 blocks through the
  transposed view (the weight's own memory order), ``dgrad_kmajor`` from a copy whose contraction
  dim is contiguous (what fp8 MMA wants);
- ``blockwise+quant``: the same with their casts (forward: activation and weight; input gradient:
  the output gradient, the weight's blocks being the forward's; weight gradient: both operands);
- ``rowwise``: ``torch._scaled_grouped_mm`` (GEMM only), the package's current recipe;
- ``torchao``: torchao 0.18's blockwise Triton GEMMs (``triton_fp8_gemm_1x128_128x128``,
  ``triton_fp8_gemm_1x128_128x1``), dense kernels, so one call per group (skipped if torchao
  does not import).
Times are triton ``do_bench`` medians (ms) after a first call that compiles and autotunes, the
implementations interleaved ``--repeat`` times and the median taken; TFLOP/s counts 2*M*K*N.
Before timing, each shape's blockwise results are checked against fp64 math on the same fp8
values (sampled rows / groups) and against bf16 (SQNR). Needs CUDA with fp8 (sm89+).
"""

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8.kernels import blockwise_quantize as bq
from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (
    blockwise_grouped_mm,
    blockwise_grouped_mm_wgrad,
)
from torchtitan_fp8_moe.fp8.quantize import quantize_rowwise
from torchtitan_fp8_moe.fp8.sqnr import sqnr

# (name, experts, K (in), N (out), routed tokens)
SHAPES = [
    ("scout_64k", 16, 5120, 8192, 65536),
    ("scout_16k", 16, 5120, 8192, 16384),
    ("dsv3_ep16_64k", 16, 7168, 2048, 8192 * 8),
]
QUICK = ["scout_16k"]
OPS = ("fwd", "dgrad", "wgrad")


def even_ends(tokens: int, experts: int) -> list[int]:
    """Cumulative ends of ``experts`` even groups, each a multiple of 128 tokens."""
    size = tokens // experts // 128 * 128
    ends = [size * (group + 1) for group in range(experts)]
    ends[-1] = tokens
    return ends


def column_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


class Case:
    """One shape's operands, bf16 and quantized, and the GEMM calls of every implementation."""

    def __init__(self, experts: int, k: int, n: int, tokens: int):
        self.k, self.n, self.tokens = k, n, tokens
        self.ends = even_ends(tokens, experts)
        self.offs = torch.tensor(self.ends, dtype=torch.int32, device="cuda")
        self.x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        self.dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        # Stored as torchtitan stores experts, [E, out, in]; the GEMM sees [E, in, out].
        stored = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        self.w = stored.transpose(-2, -1)
        self.x_q = bq.quantize_1x128(self.x)
        self.dy_q = bq.quantize_1x128(self.dy)
        self.w_q = bq.quantize_128x128(self.w)
        self.w_kmajor_t = self.w_q[0].contiguous().transpose(-2, -1)  # dgrad's K-major operand
        self.x_t = bq.quantize_128x1(self.x)
        self.dy_t = bq.quantize_128x1(self.dy)

    def flops(self) -> float:
        return 2.0 * self.tokens * self.k * self.n

    # bf16
    def bf16(self):
        return {
            "fwd": lambda: torch._grouped_mm(self.x, self.w, offs=self.offs),
            "dgrad": lambda: torch._grouped_mm(self.dy, self.w.transpose(-2, -1), offs=self.offs),
            "wgrad": lambda: torch._grouped_mm(self.x.t(), self.dy, offs=self.offs),
        }

    # ours
    def fwd(self, out_dtype=torch.bfloat16):
        return blockwise_grouped_mm(*self.x_q, *self.w_q, self.offs, out_dtype)

    def dgrad(self, w_t=None, out_dtype=torch.bfloat16):
        w_t = self.w_q[0].transpose(-2, -1) if w_t is None else w_t
        w_scale = self.w_q[1].transpose(-2, -1)
        return blockwise_grouped_mm(*self.dy_q, w_t, w_scale, self.offs, out_dtype)

    def wgrad(self):
        return blockwise_grouped_mm_wgrad(*self.x_t, *self.dy_t, self.offs)

    def blockwise(self):
        return {
            "fwd": self.fwd,
            "dgrad": self.dgrad,
            "dgrad_kmajor": lambda: self.dgrad(self.w_kmajor_t),
            "wgrad": self.wgrad,
        }

    def blockwise_with_casts(self):
        def fwd():
            w_q = bq.quantize_128x128(self.w)
            return blockwise_grouped_mm(*bq.quantize_1x128(self.x), *w_q, self.offs)

        def dgrad():
            w_t, w_scale = self.w_q[0].transpose(-2, -1), self.w_q[1].transpose(-2, -1)
            return blockwise_grouped_mm(*bq.quantize_1x128(self.dy), w_t, w_scale, self.offs)

        def wgrad():
            x_t, dy_t = bq.quantize_128x1(self.x), bq.quantize_128x1(self.dy)
            return blockwise_grouped_mm_wgrad(*x_t, *dy_t, self.offs)

        return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}

    # torch's fp8 rowwise grouped GEMM (scales are the inverses of our multipliers)
    def rowwise(self):
        x, x_s = quantize_rowwise(self.x, -1)
        dy, dy_s = quantize_rowwise(self.dy, -1)
        w, w_s = quantize_rowwise(self.w, -2)  # [G, K, N], scales [G, 1, N]
        w_t, w_t_s = quantize_rowwise(self.w.transpose(-2, -1), -2)  # [G, N, K], [G, 1, K]
        # Per column over all tokens, for the timing only (the recipe's are per group).
        x_c, x_c_s = quantize_rowwise(self.x, 0)
        dy_c, dy_c_s = quantize_rowwise(self.dy, 0)
        groups = len(self.ends)
        operands = {
            "fwd": (x, column_major(w), x_s.view(-1), w_s.squeeze(-2)),
            "dgrad": (dy, column_major(w_t), dy_s.view(-1), w_t_s.squeeze(-2)),
            "wgrad": (
                dy_c.t().contiguous(),
                column_major(x_c),
                dy_c_s.repeat(groups, 1).view(-1),
                x_c_s.repeat(groups, 1).view(-1),
            ),
        }

        def call(a, b, a_s, b_s):
            return torch._scaled_grouped_mm(
                a,
                b,
                a_s.reciprocal(),
                b_s.reciprocal(),
                offs=self.offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )

        return {op: partial(call, *operands[op]) for op in OPS}

    # torchao's dense blockwise kernels, one call per group (they multiply by reciprocals)
    def torchao(self):
        from torchao.prototype.blockwise_fp8_training.kernels import (
            triton_fp8_gemm_1x128_128x1,
            triton_fp8_gemm_1x128_128x128,
        )

        starts = [0, *self.ends[:-1]]
        spans = list(zip(starts, self.ends, strict=True))
        x, x_s = self.x_q[0], column_major(self.x_q[1].reciprocal())
        dy, dy_s = self.dy_q[0], column_major(self.dy_q[1].reciprocal())
        w = self.w_q[0]  # [G, K, N], K contiguous: column-major per group
        w_s = column_major(self.w_q[1].reciprocal())
        w_t = self.w_q[0].contiguous().transpose(-2, -1)  # [G, N, K], N contiguous
        w_t_s = column_major(self.w_q[1].transpose(-2, -1).reciprocal())
        # dW_g^T [N, K] = dy_g^T [N, M_g] . x_g [M_g, K]: 1x128 tiles of dy^T along the tokens,
        # 128x1 of x; the 128x1 casts' column-major data and row-major scales are those layouts.
        dy_t, dy_t_s = self.dy_t[0].t(), self.dy_t[1].reciprocal().t()
        x_c, x_c_s = self.x_t[0], self.x_t[1].reciprocal()

        def fwd():
            return [
                triton_fp8_gemm_1x128_128x128(x[s:e], w[g], x_s[s:e], w_s[g], 128, torch.bfloat16)
                for g, (s, e) in enumerate(spans)
            ]

        def dgrad():
            return [
                triton_fp8_gemm_1x128_128x128(
                    dy[s:e], w_t[g], dy_s[s:e], w_t_s[g], 128, torch.bfloat16
                )
                for g, (s, e) in enumerate(spans)
            ]

        def wgrad():
            return [
                triton_fp8_gemm_1x128_128x1(
                    dy_t[:, s:e],
                    x_c[s:e],
                    dy_t_s[:, s // 128 : e // 128],
                    x_c_s[s // 128 : e // 128],
                    128,
                    torch.float32,
                )
                for s, e in spans
            ]

        return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}


def check(case: Case) -> dict:
    """Our results against fp64 math on the same fp8 values (256 rows of the first and of the
    last group; those two groups' weight gradients) and SQNR against bf16; raises when off."""
    starts, ends = [0, *case.ends[:-1]], case.ends
    spot_groups = (0, len(ends) - 1)

    def error(got, want, magnitude):
        return ((got.double() - want).abs() / magnitude.clamp(min=1e-30)).max().item()

    def spot_error(got, a, a_scale, w_data, w_scale):
        errors = []
        for g in spot_groups:
            rows = slice(ends[g] - 256, ends[g])
            a_g = a[rows].double() / a_scale[rows].repeat_interleave(128, 1)[:, : a.shape[1]]
            w = (
                w_data[g].double()
                / w_scale[g]
                .repeat_interleave(128, 0)
                .repeat_interleave(128, 1)[: w_data.shape[1], : w_data.shape[2]]
            )
            errors.append(error(got[rows], a_g @ w, a_g.abs() @ w.abs()))
        return max(errors)

    result = {}
    fp32 = torch.float32  # the error checks take the GEMMs' fp32 results, before bf16 rounding
    dw = case.wgrad()
    w_t = (case.w_q[0].transpose(-2, -1), case.w_q[1].transpose(-2, -1))
    result["fwd_max_error_vs_fp64"] = spot_error(case.fwd(fp32), *case.x_q, *case.w_q)
    result["dgrad_max_error_vs_fp64"] = spot_error(case.dgrad(None, fp32), *case.dy_q, *w_t)
    dx_kmajor = case.dgrad(case.w_kmajor_t, fp32)
    result["dgrad_kmajor_max_error_vs_fp64"] = spot_error(dx_kmajor, *case.dy_q, *w_t)
    errors = []
    for g in spot_groups:
        rows = slice(starts[g], ends[g])
        x = case.x_t[0][rows].double() / case.x_t[1].repeat_interleave(128, 0)[rows]
        dy = case.dy_t[0][rows].double() / case.dy_t[1].repeat_interleave(128, 0)[rows]
        errors.append(error(dw[g], x.t() @ dy, x.t().abs() @ dy.abs()))
    result["wgrad_max_error_vs_fp64"] = max(errors)
    bf16 = case.bf16()
    for op, ours in (("fwd", case.fwd()), ("dgrad", case.dgrad()), ("wgrad", dw)):
        result[f"{op}_sqnr_vs_bf16"] = round(sqnr(bf16[op]().float(), ours.float()), 2)
    # A wrong scale, group or block errs by O(1); fp8 MMA accumulation by < 2**-8.
    bad = {key: value for key, value in result.items() if "error" in key and value > 2**-8}
    bad |= {key: value for key, value in result.items() if "sqnr" in key and value < 23}
    if bad:
        raise AssertionError(f"blockwise results off: {bad}")
    return result


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Scout 16K only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="outputs/benchmarks/blockwise.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_blockwise.py needs a CUDA device with fp8 (sm89+)")
    torch.manual_seed(0)
    started = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "repeat": args.repeat,
        "shapes": [],
    }
    for name, experts, k, n, tokens in SHAPES:
        if args.quick and name not in QUICK:
            continue
        case = Case(experts, k, n, tokens)
        impls = {
            "bf16": case.bf16(),
            "blockwise": case.blockwise(),
            "blockwise+quant": case.blockwise_with_casts(),
            "rowwise": case.rowwise(),
        }
        notes = {}
        try:
            impls["torchao"] = case.torchao()
        except ImportError as error:
            notes["torchao"] = f"not importable: {error}"
        calls = [(impl, op, fn) for impl, ops in impls.items() for op, fn in ops.items()]
        first_call = {}
        for impl, op, fn in calls:  # compile and autotune, outside the timings
            begin = time.perf_counter()
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as error:  # an unavailable baseline, reported, not fatal
                notes[f"{impl}/{op}"] = f"{type(error).__name__}: {error}"[:300]
            first_call[(impl, op)] = time.perf_counter() - begin
        checks = check(case)
        calls = [call for call in calls if f"{call[0]}/{call[1]}" not in notes]
        times = {(impl, op): [] for impl, op, _ in calls}
        for _ in range(args.repeat):
            for impl, op, fn in calls:
                times[(impl, op)].append(bench(fn))
        rows = []
        for (impl, op), samples in times.items():
            ms = statistics.median(samples)
            rows.append(
                {
                    "impl": impl,
                    "op": op,
                    "ms": round(ms, 4),
                    "tflops": round(case.flops() / ms / 1e9, 1),
                    "samples_ms": [round(sample, 4) for sample in samples],
                    "first_call_s": round(first_call[(impl, op)], 2),
                }
            )
        report["shapes"].append(
            {
                "name": name,
                "experts": experts,
                "k": k,
                "n": n,
                "tokens": tokens,
                "checks": checks,
                "notes": notes,
                "rows": rows,
            }
        )
        print_table(name, case, rows, checks, notes)
        del case, impls, calls
        torch.cuda.empty_cache()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['wall_s']} s)")


def print_table(name: str, case: Case, rows: list[dict], checks: dict, notes: dict) -> None:
    print(f"\n{name}: M={case.tokens} K={case.k} N={case.n} groups={len(case.ends)}")
    print(f"  checks: {checks}")
    for key, note in notes.items():
        print(f"  skipped {key}: {note}")
    bf16 = {row["op"]: row["ms"] for row in rows if row["impl"] == "bf16"}
    print(f"  {'impl':<16}{'op':<14}{'ms':>9}{'TFLOP/s':>9}{'vs bf16':>9}")
    for row in rows:
        base = bf16.get(row["op"].removesuffix("_kmajor"))
        speedup = f"{base / row['ms']:.2f}x" if base else ""
        print(
            f"  {row['impl']:<16}{row['op']:<14}{row['ms']:>9.3f}{row['tflops']:>9.1f}{speedup:>9}"
        )


if __name__ == "__main__":
    main()
