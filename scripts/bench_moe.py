"""Benchmark bf16, torchao 0.18's fp8 rowwise and float8_moe on Llama4 Scout MoE shapes.

    python scripts/bench_moe.py [--quick] [--cases C,..] [--tokens M,..] [--profile] [--tp N]
        [--repeat N] [--out outputs/benchmarks/h200.json]

Forward + backward (input and weight gradients) of: one routed-expert projection (w1: D -> H,
w2: H -> D; 16 experts, even token groups), the grouped shared expert (3D x 3D, [1, H, D]), the
FeedForward shared expert's first linear, and a whole torchtitan Llama4 MoE layer (router, 16
routed experts top-1, one shared expert). Times are triton do_bench medians in one process on
one GPU; with --repeat N each implementation is timed N times, interleaved with the others, and
its row has the median and every timing. SQNR is of the output (and gradients) against the bf16
run. Writes the JSON rows and a PNG chart next to it. With --profile each row also gets the GPU
time per step of its largest kernels (torch profiler), the breakdown behind a speedup. With --tp
N the projections have the shapes one rank multiplies under tensor (and expert-tensor)
parallelism of degree N: the hidden dim split N ways, every token on every rank. Needs CUDA with
fp8 (sm89+).
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from triton.testing import do_bench

from torchtitan_fp8_moe.fp8.sqnr import sqnr as fp8_sqnr

DIM, HIDDEN, EXPERTS = 5120, 8192, 16
IMPLS = ("bf16", "torchao", "float8_moe")


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    return round(fp8_sqnr(ref, actual), 2)


def _to_torchao(module: nn.Module) -> nn.Module:
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.conversion_utils import _swap_params

    return _swap_params(module, config=Float8TrainingOpConfig())


def _to_float8_moe(module: nn.Module, emulate: bool = False) -> nn.Module:
    """Every expert module's weights as ``Float8MoEWeight`` (``emulate``: the CPU path, for dry
    runs of the benchmarks)."""
    from torchtitan_fp8_moe import Float8MoEWeight, WeightConfig
    from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights

    if isinstance(module, Projection):
        module.weight = nn.Parameter(
            Float8MoEWeight(module.weight.data, WeightConfig(emulate=emulate, shares_input=False))
        )
    for _, expert in expert_modules(module):
        swap_expert_weights(expert, WeightConfig(emulate=emulate))
    return module


class Projection(nn.Module):
    """One expert projection, shaped as the case uses it."""

    def __init__(self, case: str, tokens: int, hidden: int):
        super().__init__()
        in_dim, out_dim = (hidden, DIM) if case == "routed_w2" else (DIM, hidden)
        groups = EXPERTS if case.startswith("routed") else 1
        shape = (out_dim, in_dim) if case == "shared_linear" else (groups, out_dim, in_dim)
        self.weight = nn.Parameter(torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02)
        self.case, self.in_dim = case, in_dim
        self.offs = torch.arange(1, groups + 1, dtype=torch.int32, device="cuda") * (
            tokens // groups
        )

    def forward(self, x):
        if self.case == "shared_linear":
            return F.linear(x, self.weight)
        if self.case == "shared_grouped":
            return torch._grouped_mm(x.unsqueeze(0), self.weight.transpose(-2, -1)).squeeze(0)
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=self.offs)


def build_case(case: str, tokens: int, hidden: int):
    """(module, input, flops of fwd+bwd); ``hidden``: the experts' hidden dim (one rank's share
    under tensor parallelism)."""
    torch.manual_seed(0)
    if case == "moe_layer":
        from torchtitan.models.moe import MoEArgs
        from torchtitan.models.moe.moe import MoE

        module = MoE(MoEArgs(num_experts=EXPERTS, num_shared_experts=1, top_k=1), DIM, hidden)
        module = module.to(device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            module.init_weights(0.02, torch.device("cuda"))
        x = torch.randn(tokens // 4096, 4096, DIM, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2 * tokens * DIM * hidden * 3 * 2  # routed + shared, 3 projections each
        return module, x, flops
    module = Projection(case, tokens, hidden).cuda()
    x = torch.randn(tokens, module.in_dim, device="cuda", dtype=torch.bfloat16)
    return module, x, 3 * 2 * tokens * DIM * hidden


def run_impl(case, tokens, impl, hidden, profile=False):
    module, x, flops = build_case(case, tokens, hidden)
    if impl == "torchao":
        module = _to_torchao(module)
    elif impl == "float8_moe":
        module = _to_float8_moe(module)
    x.requires_grad_()
    grad = torch.randn_like(module(x).detach())

    def step():
        out = module(x)
        out.backward(grad)
        return out

    out = step()
    weight = module.experts.w1 if case == "moe_layer" else module.weight
    outputs = (out.detach(), x.grad.detach().clone(), weight.grad.detach().clone())
    x.grad = None
    for p in module.parameters():
        p.grad = None
    ms = do_bench(step, warmup=25, rep=100, grad_to_none=[x, *module.parameters()])
    kernels = kernel_breakdown(step, [x, *module.parameters()]) if profile else None
    return ms, flops, outputs, kernels


def kernel_times(step, tensors, iters: int = 5) -> dict[str, tuple[float, float]]:
    """(GPU ms, launches) per step of every kernel, from the torch profiler; ``tensors``' grads
    are dropped before each step."""
    from torch.profiler import ProfilerActivity, profile

    def fresh_step():
        for t in tensors:
            t.grad = None
        step()

    fresh_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fresh_step()
        torch.cuda.synchronize()
    return {
        e.key: (e.self_device_time_total / iters / 1000, e.count / iters)
        for e in prof.key_averages()
    }


def kernel_breakdown(step, tensors, iters: int = 5, top: int = 12) -> dict[str, float]:
    """GPU time per step of each kernel (ms, largest first), from the torch profiler."""
    times = {name: ms for name, (ms, _) in kernel_times(step, tensors, iters).items()}
    ranked = sorted(((k, v) for k, v in times.items() if v > 0), key=lambda kv: -kv[1])
    breakdown = {name[:100]: round(ms, 3) for name, ms in ranked[:top]}
    breakdown["(all kernels)"] = round(sum(times.values()), 3)
    return breakdown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="M=16384 only, projections only")
    parser.add_argument("--out", default="outputs/benchmarks/h200.json")
    parser.add_argument("--cases", default=None, help="comma-separated subset of the cases")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts M")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also record each implementation's per-kernel GPU time per step",
    )
    parser.add_argument(
        "--tp", type=int, default=1, help="per-rank shapes of tensor parallelism of this degree"
    )
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS)
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="timings per implementation, interleaved; median"
    )
    args = parser.parse_args()
    if args.tp > 1 and (args.cases is None or "moe_layer" in args.cases.split(",")):
        raise SystemExit("--tp: name the projection cases with --cases (not moe_layer)")
    hidden = HIDDEN // args.tp
    impls = args.impls.split(",")
    if "bf16" not in impls or not set(impls) <= set(IMPLS):
        raise SystemExit(f"--impls: a subset of {','.join(IMPLS)} with bf16, the baseline")
    if args.repeat < 1:
        raise SystemExit("--repeat: at least 1")
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    set_token_group_alignment_size_m(16)  # fp8 grouped GEMMs need 16-row token groups
    cases = ["routed_w1", "routed_w2", "shared_grouped", "shared_linear", "moe_layer"]
    token_counts = [16384, 65536]
    if args.quick:
        cases, token_counts = cases[:4], [16384]
    if args.cases:
        cases = args.cases.split(",")
    if args.tokens:
        token_counts = [int(t) for t in args.tokens.split(",")]
    rows = []
    for tokens in token_counts:
        for case in cases:
            results = {impl: [] for impl in impls}
            for run in range(args.repeat):  # bf16, torchao, ours, bf16, ...: drift hits all
                for impl in impls:
                    try:
                        results[impl].append(
                            run_impl(case, tokens, impl, hidden, args.profile and run == 0)
                        )
                    except Exception as e:  # noqa: BLE001 - reported in the table
                        results[impl].append(f"{type(e).__name__}: {str(e)[:160]}")
                    torch.cuda.empty_cache()
            results = {impl: _median_run(runs) for impl, runs in results.items()}
            bf16_ms, _, ref, _, _ = results["bf16"]
            for impl, result in results.items():
                row = {"case": case, "tokens": tokens, "impl": impl}
                if args.tp > 1:
                    row["tp"] = args.tp
                if isinstance(result, str):
                    row.update(ms=None, error=result)
                else:
                    ms, flops, outputs, kernels, all_ms = result
                    row.update(
                        ms=round(ms, 3),
                        ms_runs=[round(t, 3) for t in all_ms],
                        tflops=round(flops / ms / 1e9, 1),
                        speedup_vs_bf16=round(bf16_ms / ms, 3),
                        sqnr_db=sqnr(ref[0], outputs[0]) if impl != "bf16" else math.inf,
                        sqnr_input_grad_db=sqnr(ref[1], outputs[1]) if impl != "bf16" else math.inf,
                        sqnr_weight_grad_db=sqnr(ref[2], outputs[2])
                        if impl != "bf16"
                        else math.inf,
                    )
                    if kernels is not None:
                        row["kernels_ms_per_step"] = kernels
                rows.append(row)
            case_rows = rows[-len(impls) :]
            torchao_ms = next((r["ms"] for r in case_rows if r["impl"] == "torchao"), None)
            for row in case_rows:
                row["speedup_vs_torchao"] = (
                    round(torchao_ms / row["ms"], 3) if torchao_ms and row["ms"] else None
                )
                print(json.dumps(row), flush=True)
            write_json(rows, args.out)  # after every case, so a cut-off run keeps its rows
    print_table(rows)
    plot(rows, Path(args.out).with_suffix(".png"))


def _median_run(runs: list):
    """One implementation's repeats as (median ms, flops, first outputs, first kernels, every
    ms), or the first error."""
    errors = [r for r in runs if isinstance(r, str)]
    if errors:
        return errors[0]
    all_ms = [r[0] for r in runs]
    _, flops, outputs, kernels = runs[0]
    return statistics.median(all_ms), flops, outputs, kernels, all_ms


def write_json(rows, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1).replace("Infinity", '"inf"') + "\n")


def print_table(rows) -> None:
    header = (
        f"{'case':15} {'tokens':>6} {'impl':10} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8} "
        f"{'vs torchao':>10} {'SQNR out/dx/dw (dB)':>22}"
    )
    print(header)
    for r in rows:
        if r["ms"] is None:
            print(f"{r['case']:15} {r['tokens']:>6} {r['impl']:10} {r['error']}")
            continue
        sq = (
            "-"
            if r["impl"] == "bf16"
            else f"{r['sqnr_db']}/{r['sqnr_input_grad_db']}/{r['sqnr_weight_grad_db']}"
        )
        vs_ao = "-" if r["speedup_vs_torchao"] is None else f"{r['speedup_vs_torchao']:.2f}x"
        print(
            f"{r['case']:15} {r['tokens']:>6} {r['impl']:10} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
            f"{r['speedup_vs_bf16']:>7.2f}x {vs_ao:>10} {sq:>22}"
        )


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["case"], r["tokens"]) for r in rows}, key=lambda k: (k[1], k[0]))
    impls = [impl for impl in IMPLS if any(r["impl"] == impl for r in rows)]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.27
    for i, impl in enumerate(impls):
        values = [
            next(
                (
                    r.get("speedup_vs_bf16") or 0
                    for r in rows
                    if (r["case"], r["tokens"]) == label and r["impl"] == impl
                ),
                0,
            )
            for label in labels
        ]
        ax.bar([j + (i - 1) * width for j in range(len(labels))], values, width, label=impl)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [f"{c}\nM={t}" for c, t in labels], fontsize=8)
    ax.set_ylabel("speedup vs bf16 (fwd+bwd)")
    ax.set_title("Llama4 Scout MoE shapes, H200 (0 = unsupported)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
