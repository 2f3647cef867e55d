"""Summarize torch profiler traces of trainer steps: where the GPU time goes, bf16 vs float8_moe.

    python scripts/profile_summary.py LABEL=TRACE.json [LABEL=TRACE.json ...] [--top 15]
        [--out docs/benchmarks/....json]

Traces are what torchtitan writes with ``--profiling.enable_profiling`` (Chrome trace JSON,
``<dump>/profile_traces/iteration_N/rank0_trace.json``). Per trace: the profiled steps' wall time
(``ProfilerStep#`` spans), the time the GPU was busy (union of kernel spans) and idle, the GPU time
per kernel family and the top kernels by GPU time. Prints one table per trace and writes JSON.
"""

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

# Kernel families by name, first match wins. fp8 GEMMs: CUTLASS names its e4m3 inputs in the
# template arguments; cuBLAS's nvjet kernels for scaled fp8 inputs carry "qq" and "ovscale".
FAMILIES = [
    ("fp8 GEMM", re.compile(r"e4m3|f8f8|_scaled_mm|nvjet_\w*qq|ovscale", re.I)),
    # Our kernels' names exactly: torchao's cast kernels contain "_per_group_" too.
    (
        "float8_moe cast",
        re.compile(
            r"_rowwise_fp8|_per_group_(whole|amax|cast)|_transposed_fp8|_quantize_(1x128|128x)"
        ),
    ),
    ("torchao cast", re.compile(r"triton_fp8|_fp8_rowwise|_fp8_colwise|fp8_per_group", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("bf16 GEMM", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|cublas|grouped_mm", re.I)),
    ("copy / memset", re.compile(r"memcpy|memset|copy", re.I)),
]


def family(name: str) -> str:
    return next((label for label, pattern in FAMILIES if pattern.search(name)), "other")


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(path: Path, top: int) -> dict:
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    # The host-side step spans; the trace repeats each on the GPU timeline (gpu_user_annotation).
    steps = [
        e
        for e in events
        if e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith("ProfilerStep#")
        and "dur" in e
    ]
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    per_family: dict[str, float] = defaultdict(float)
    for k in kernels:
        per_kernel[k["name"]] += k["dur"]
        calls[k["name"]] += 1
        per_family[family(k["name"])] += k["dur"]
    n_steps = max(len(steps), 1)
    wall_ms = sum(e["dur"] for e in steps) / 1e3 / n_steps
    busy_ms = union_length([(k["ts"], k["ts"] + k["dur"]) for k in kernels]) / 1e3 / n_steps
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1])[:top]
    return {
        "trace": str(path),
        "profiled_steps": len(steps),
        "step_wall_ms": round(wall_ms, 2),
        "gpu_busy_ms": round(busy_ms, 2),
        "gpu_idle_ms": round(wall_ms - busy_ms, 2),
        "kernel_launches_per_step": round(len(kernels) / n_steps),
        "families_ms_per_step": {
            f: round(ms / 1e3 / n_steps, 2)
            for f, ms in sorted(per_family.items(), key=lambda item: -item[1])
        },
        "top_kernels": [
            {
                "name": name[:90],
                "family": family(name),
                "ms_per_step": round(us / 1e3 / n_steps, 2),
                "calls_per_step": round(calls[name] / n_steps, 1),
            }
            for name, us in ranked
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="LABEL=path/to/rank0_trace.json")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    summaries = {}
    for item in args.traces:
        label, _, path = item.partition("=")
        s = summaries[label] = summarize(Path(path), args.top)
        print(
            f"\n== {label}: {s['profiled_steps']} step(s), wall {s['step_wall_ms']} ms/step, "
            f"GPU busy {s['gpu_busy_ms']} ms, idle {s['gpu_idle_ms']} ms, "
            f"{s['kernel_launches_per_step']} kernels/step"
        )
        print("   " + ", ".join(f"{f} {ms}" for f, ms in s["families_ms_per_step"].items()))
        for k in s["top_kernels"]:
            print(
                f"   {k['ms_per_step']:>8.2f} ms {k['calls_per_step']:>7} x  "
                f"{k['family']:<16} {k['name']}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
