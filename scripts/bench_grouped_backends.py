"""float8_moe's fp8 GEMMs on every GEMM backend against bf16, at the per-GPU expert shapes of
real runs.

    python scripts/bench_grouped_backends.py [--shapes S,..] [--routings balanced,skewed]
        [--repeat 3] [--out outputs/benchmarks/grouped_backends.json]

For each shape (one rank's routed rows M, local experts G, dim K -> expert hidden N of the gate
/ up projection w1 ``[G, N, K]``; G = 1: a shared expert's dense GEMMs) and each routing of the
M rows over the experts (``balanced``: equal groups; ``skewed``: seeded heavy-tailed group sizes,
a multiple of 16 each, some near empty), it times the three GEMMs of w1 as float8_moe runs them,
on operands quantized beforehand by its CUDA quantizers (the GEMM alone, through
``RowwiseRecipe.grouped_mm`` / ``grouped_wgrad_mm`` with each backend of
``torchtitan_fp8_moe/fp8/kernels/gemm_backends.py`` that loads here):

- ``fwd``: ``x [M, K] . w1_g^T`` (m-grouped; dense for G = 1);
- ``dgrad``: ``dy [M, N] . w1_g`` (the input gradient: m-grouped with K and N swapped, the shape
  of w2's forward);
- ``wgrad``: ``dy_g^T . x_g`` per group (k-grouped; fbgemm has no such fp8 kernel);

and the same products in bf16 (``torch._grouped_mm`` / ``torch.mm``), what an unconverted model
runs. Each fp8 result is checked against bf16's first (SQNR in dB, rows of a group). Times are
triton ``do_bench`` medians, the backends interleaved in ``--repeat`` rounds; each row keeps the
median over rounds and the spread (max - min). Writes the JSON and a PNG of TFLOP/s beside it,
and prints a table. Needs CUDA with fp8 (sm89+); fbgemm-gpu-genai is optional.
"""

import argparse
import json
import statistics
import traceback
from pathlib import Path

import torch
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8.kernels import gemm_backends
from torchtitan_fp8_moe.fp8.recipes import recipe_named
from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS
from torchtitan_fp8_moe.fp8.sqnr import sqnr

ROWWISE = recipe_named("rowwise")
# name: (routed rows M on one rank at 16K tokens = tokens x top-k, local experts G, K, N)
SHAPES = {
    "dsv3_671b_ep8": (131072, 32, 7168, 2048),
    "dsv3_671b_ep16": (131072, 16, 7168, 2048),
    "dsv3_671b_ep32": (131072, 8, 7168, 2048),
    "qwen3_30b": (131072, 128, 2048, 768),
    "qwen3_235b_ep8": (131072, 16, 4096, 1536),
    "scout": (16384, 16, 5120, 8192),
    "scout_tp8": (16384, 16, 5120, 1024),
    # GPT-OSS's mlp1 holds gate and up side by side: 2 x 2880 wide
    "gpt_oss_120b": (65536, 128, 2880, 5760),
    # shared experts: one dense GEMM per projection over the 16K tokens
    "dsv3_671b_shared": (16384, 1, 7168, 2048),
    "scout_shared": (16384, 1, 5120, 8192),
}
ROUTINGS = ("balanced", "skewed")
ALIGN = 16  # torchtitan pads each expert's token group to this for fp8
BF16 = torch.bfloat16


def group_sizes(m: int, groups: int, routing: str) -> torch.Tensor:
    """``groups`` sizes, multiples of ``ALIGN``, summing to ``m``."""
    if routing == "balanced":
        weights = torch.ones(groups)
    else:  # a few hot experts, some nearly idle
        gen = torch.Generator().manual_seed(0)
        weights = torch.rand(groups, generator=gen) ** 4 + 0.02
    sizes = (weights / weights.sum() * (m // ALIGN)).floor().long() * ALIGN
    sizes[torch.argmax(sizes)] += m - sizes.sum()
    return sizes


def _gemms(x, w, dy, offs):
    """gemm -> (bf16 callable, {backend: fp8 callable}); float8_moe's operands and calls."""
    dense = w.shape[0] == 1
    a, a_scale = TRITON_QUANTIZERS.rows(x)
    b, b_scale, amax_over_n = TRITON_QUANTIZERS.weight(w.transpose(-2, -1))
    g, g_scale = TRITON_QUANTIZERS.rows(dy)
    b_t, b_t_scale = TRITON_QUANTIZERS.weight_transposed(w.transpose(-2, -1), amax_over_n)
    pair = TRITON_QUANTIZERS.per_group_pair(x, dy, offs)
    names = gemm_backends.available()

    def forward(backend):
        return lambda: ROWWISE.grouped_mm(a, a_scale, b, b_scale, offs, BF16, False, backend)

    def input_grad(backend):
        return lambda: ROWWISE.grouped_mm(g, g_scale, b_t, b_t_scale, offs, BF16, False, backend)

    def weight_grad(backend):
        return lambda: ROWWISE.grouped_wgrad_mm(*pair, offs, BF16, False, backend)

    wgrad_form = "dense" if dense else "k_grouped"
    m_form = "dense" if dense else "m_grouped"
    has = {name: gemm_backends.backend(name).forms for name in names}
    if dense:
        bf16 = {
            "fwd": lambda: x @ w[0].t(),
            "dgrad": lambda: dy @ w[0],
            "wgrad": lambda: (dy.t() @ x).unsqueeze(0),
        }
    else:
        bf16 = {
            "fwd": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        }
    return {
        "fwd": (bf16["fwd"], {n: forward(n) for n in names if m_form in has[n]}),
        "dgrad": (bf16["dgrad"], {n: input_grad(n) for n in names if m_form in has[n]}),
        # float8_moe's weight gradient comes back [G, K, N]; bf16's here [G, N, K]
        "wgrad": (
            bf16["wgrad"],
            {n: _transposed(weight_grad(n)) for n in names if wgrad_form in has[n]},
        ),
    }


def _transposed(fn):
    return lambda: fn().transpose(-2, -1)


def _time_all(bf16, fp8: dict, rows: int, repeat: int, flops: float) -> dict:
    """Rows per backend: SQNR against bf16 (token rows of a group), then interleaved timings."""
    reference = bf16().float()
    fns = {"bf16": bf16, **fp8}
    out = {"bf16": {"ms": []}}
    for name, fn in fp8.items():
        try:
            got = fn().float()
            torch.cuda.synchronize()
            if got.dim() == 2:
                got, want = got[:rows], reference[:rows]
            else:
                want = reference
            out[name] = {"sqnr_db": round(sqnr(want, got), 2), "ms": []}
        except Exception as error:  # a backend that cannot run this shape: reported
            out[name] = {"error": traceback.format_exception_only(error)[-1].strip()[:300]}
    del reference
    for round_ in range(repeat):
        order = list(fns) if round_ % 2 == 0 else list(reversed(fns))
        for name in order:
            if "ms" in out[name]:
                out[name]["ms"].append(do_bench(fns[name], warmup=10, rep=40))
    for row in out.values():
        if "ms" in row:
            row["median_ms"] = round(statistics.median(row["ms"]), 4)
            row["spread_ms"] = round(max(row["ms"]) - min(row["ms"]), 4)
            row["tflops"] = round(flops / row["median_ms"] / 1e9, 1)
    bf16_ms = out["bf16"]["median_ms"]
    for row in out.values():
        if "median_ms" in row:
            row["speedup_vs_bf16"] = round(bf16_ms / row["median_ms"], 3)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results["cases"])
    gemms = ("fwd", "dgrad", "wgrad")
    backends = ["bf16", *results["backends"]]
    fig, axes = plt.subplots(len(gemms), 1, figsize=(max(10, len(cases) * 0.9), 11), sharex=True)
    width = 0.8 / len(backends)
    for ax, gemm in zip(axes, gemms, strict=True):
        for i, backend in enumerate(backends):
            values = [
                results["cases"][case][gemm].get(backend, {}).get("tflops", 0) for case in cases
            ]
            positions = [c + (i - (len(backends) - 1) / 2) * width for c in range(len(cases))]
            ax.bar(positions, values, width, label=backend)
        ax.set_ylabel(f"{gemm} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=len(backends))
    axes[0].set_title(f"{results['device']}, torch {results['torch']}: medians of the rounds")
    axes[-1].set_xticks(range(len(cases)), cases, rotation=40, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", help="comma-separated names of SHAPES (default: all)")
    parser.add_argument("--routings", default=",".join(ROUTINGS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="outputs/benchmarks/grouped_backends.json")
    args = parser.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends": gemm_backends.available(),
        "repeat": args.repeat,
        "cases": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{'case':26} {'gemm':6} {'backend':8} {'ms':>8} {'spread':>7} {'TFLOP/s':>8} "
        f"{'x bf16':>7} {'SQNR':>6}",
        flush=True,
    )
    for name in names:
        m, groups, k, n = SHAPES[name]
        routings = ["balanced"] if groups == 1 else args.routings.split(",")
        for routing in routings:
            torch.manual_seed(0)
            sizes = group_sizes(m, groups, routing)
            offs = sizes.cumsum(0).to(torch.int32).cuda()
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            w = torch.randn(groups, n, k, device="cuda", dtype=BF16) * 0.02
            dy = torch.randn(m, n, device="cuda", dtype=BF16)
            case = f"{name}/{routing}"
            row = {
                "M": m,
                "G": groups,
                "K": k,
                "N": n,
                "routing": routing,
                "largest_group_vs_mean": round(sizes.max().item() / sizes.float().mean().item(), 2),
            }
            for gemm, (bf16, fp8) in _gemms(x, w, dy, offs).items():
                row[gemm] = _time_all(bf16, fp8, m, args.repeat, 2.0 * m * k * n)
                for backend, r in row[gemm].items():
                    if "error" in r:
                        print(f"{case:26} {gemm:6} {backend:8} {r['error']}", flush=True)
                        continue
                    print(
                        f"{case:26} {gemm:6} {backend:8} {r['median_ms']:8.3f} "
                        f"{r['spread_ms']:7.3f} {r['tflops']:8.1f} {r['speedup_vs_bf16']:7.3f} "
                        f"{r.get('sqnr_db', float('nan')):6.1f}",
                        flush=True,
                    )
            results["cases"][case] = row
            out.write_text(json.dumps(results, indent=1))  # each case as it ends
            del x, w, dy
            torch.cuda.empty_cache()
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
