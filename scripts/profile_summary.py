"""Summarize torch profiler traces of trainer steps: where the GPU time goes, bf16 vs float8_moe.

    python scripts/profile_summary.py LABEL=TRACE.json [LABEL=TRACE.json ...] [--top 15] [--gaps N]
        [--out outputs/benchmarks/profile.json]

Traces are what torchtitan writes with ``--profiling.enable_profiling`` (Chrome trace JSON,
``<dump>/profile_traces/iteration_N/rank0_trace.json``, or that file gzipped). Per trace: the
profiled steps' wall time (``ProfilerStep#`` spans), the time the GPU was busy (union of kernel
spans) and idle, the GPU time per kernel family and the top kernels by GPU time. Prints one table
per trace and writes JSON.

``--gaps N`` also says where the GPU sat idle inside the profiled steps and what the host did
meanwhile: a gap that opens while the host waits in a synchronizing call (``.item()``, a
device-to-host copy) is the sync's until it returns; the rest of it, and any gap without a sync,
is owed to the host's outermost ops that ran before the next kernel's launch (a data loader, the
optimizer, Python). Prints idle ms per step by owner and the N longest gaps.

Each trace after the first is compared with the first (the baseline, bf16): how much faster its
step is by wall time, by GPU-busy time (the bound once the host keeps the GPU fed), and by
GPU-busy time without float8_moe's casts (the bound if they cost nothing).
"""

import argparse
import bisect
import gzip
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


def busy_intervals(kernels: list[dict]) -> list[list]:
    """When the GPU was busy: disjoint ``[start, end, first kernel, last kernel]``, in time
    order; kernels that overlap or touch share one, which the last-ending of them ends."""
    intervals: list[list] = []
    for k in sorted(kernels, key=lambda e: e["ts"]):
        end = k["ts"] + k["dur"]
        if intervals and k["ts"] <= intervals[-1][1]:
            if end > intervals[-1][1]:
                intervals[-1][1], intervals[-1][3] = end, k
        else:
            intervals.append([k["ts"], end, k, k])
    return intervals


def _is_step(event: dict) -> bool:
    return str(event.get("name", "")).startswith("ProfilerStep#")


def summarize(path: Path, top: int, gaps: int = 0) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    # The host-side step spans; the trace repeats each on the GPU timeline (gpu_user_annotation).
    steps = [e for e in events if e.get("cat") == "user_annotation" and _is_step(e) and "dur" in e]
    per_kernel: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    per_family: dict[str, float] = defaultdict(float)
    for k in kernels:
        per_kernel[k["name"]] += k["dur"]
        calls[k["name"]] += 1
        per_family[family(k["name"])] += k["dur"]
    n_steps = max(len(steps), 1)
    wall_ms = sum(e["dur"] for e in steps) / 1e3 / n_steps
    intervals = busy_intervals(kernels)
    busy_ms = sum(end - start for start, end, _, _ in intervals) / 1e3 / n_steps
    ranked = sorted(per_kernel.items(), key=lambda item: -item[1])[:top]
    summary = {
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
    if gaps:
        summary["idle"] = idle_gaps(events, intervals, steps, gaps)
    return summary


HOST_CATEGORIES = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}
RUNTIME = ("cuda_runtime", "cuda_driver")
SYNCING = re.compile(r"Synchronize|cudaMemcpy(Async)?$|cudaMemcpy2D|cudaStreamQuery")


class HostStacks:
    """The host events of each thread, nested, so that the stack at a time is a walk up parents,
    and each thread's outermost ops (under the profiler's step span) in order."""

    def __init__(self, events: list[dict]):
        self.by_thread: dict = defaultdict(list)
        for e in events:
            if e.get("cat") in HOST_CATEGORIES and "dur" in e:
                self.by_thread[e["tid"]].append(e)
        self.starts, self.outermost, self.outermost_starts = {}, {}, {}
        for tid, spans in self.by_thread.items():
            spans.sort(key=lambda e: (e["ts"], -e["dur"]))
            open_spans: list[dict] = []
            for e in spans:
                while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] < e["ts"]:
                    open_spans.pop()
                e["_parent"] = open_spans[-1] if open_spans else None
                open_spans.append(e)
            self.starts[tid] = [e["ts"] for e in spans]
            self.outermost[tid] = [
                e
                for e in spans
                if not _is_step(e) and (e["_parent"] is None or _is_step(e["_parent"]))
            ]
            self.outermost_starts[tid] = [e["ts"] for e in self.outermost[tid]]

    def stack(self, tid, at: float) -> list[dict]:
        """Host events of ``tid`` open at time ``at``, outermost first."""
        spans = self.by_thread.get(tid, [])
        index = bisect.bisect_right(self.starts.get(tid, []), at) - 1
        event = spans[index] if index >= 0 else None
        while event is not None and event["ts"] + event["dur"] < at:
            event = event["_parent"]
        chain = []
        while event is not None:
            chain.append(event)
            event = event["_parent"]
        return chain[::-1]

    def busy(self, tid, start: float, stop: float) -> list[tuple[str, float, float]]:
        """The outermost ops of ``tid`` that ran between ``start`` and ``stop``, with the part
        of that interval each ran in."""
        ops = self.outermost.get(tid, [])
        index = max(0, bisect.bisect_right(self.outermost_starts.get(tid, []), start) - 1)
        found = []
        while index < len(ops) and ops[index]["ts"] < stop:
            e = ops[index]
            low, high = max(start, e["ts"]), min(stop, e["ts"] + e["dur"])
            if high > low and e.get("cat") not in RUNTIME:
                found.append((str(e["name"]), low, high))
            index += 1
        return found


def _named_ops(stack: list[dict]) -> list[str]:
    """The stack's op names, without the runtime calls and the profiler's step span."""
    return [str(e["name"]) for e in stack if e.get("cat") not in RUNTIME and not _is_step(e)]


def idle_gaps(events: list[dict], intervals: list[list], steps: list[dict], longest: int) -> dict:
    """Where the GPU sat idle inside the profiled steps, and what the host did meanwhile.

    A gap that opens while the host waits in a synchronizing call is the sync's until the call
    returns (the queue ran dry); from then on, and for a gap with no sync, it is owed to the host
    ops that ran before the launch of the kernel that closes it (the host was late).
    ``intervals``: ``busy_intervals`` of the trace's kernels."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in RUNTIME and "correlation" in e.get("args", {})
    }
    syncs = sorted(
        (e for e in events if e.get("cat") in RUNTIME and SYNCING.search(e["name"])),
        key=lambda e: e["ts"],
    )
    sync_starts = [e["ts"] for e in syncs]
    stacks = HostStacks(events)
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]

    def in_steps(start: float, stop: float) -> float:
        return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in windows)

    gaps = []
    # The GPU is idle from the first step's start until its first kernel, too.
    busy_until = min((a for a, _ in windows), default=None)
    previous = {"name": "(step start)"}
    for start, end, first, last in intervals:
        if busy_until is not None and start > busy_until and in_steps(busy_until, start) > 0:
            gaps.append((busy_until, start, previous, first))
        if busy_until is None or end > busy_until:
            busy_until, previous = end, last
    owed: dict[str, float] = defaultdict(float)
    listed = []
    for start, stop, before, after in gaps:
        index = bisect.bisect_right(sync_starts, start) - 1
        waiting = next(
            (e for e in syncs[max(0, index - 50) : index + 1][::-1] if e["ts"] + e["dur"] >= start),
            None,
        )
        launch = launches.get(after.get("args", {}).get("correlation"))
        owners = []
        late_from = start
        if waiting is not None:
            late_from = min(stop, waiting["ts"] + waiting["dur"])
            inner = _named_ops(stacks.stack(waiting["tid"], waiting["ts"]))
            where = inner[-1] if inner else "(no host op)"
            owners.append((f"sync {waiting['name']} in {where}", in_steps(start, late_from)))
        if late_from < stop:
            tid = (launch or waiting or {}).get("tid")
            ran = stacks.busy(tid, late_from, stop)
            owners += [(f"host: {name}", in_steps(low, high)) for name, low, high in ran]
            unowned = in_steps(late_from, stop) - sum(in_steps(low, high) for _, low, high in ran)
            if unowned > 0:
                owners.append(("host: (no op)", unowned))
        owners = [(name, us) for name, us in owners if us > 0]
        for name, us in owners:
            owed[name] += us
        launch_stack = _named_ops(stacks.stack(launch["tid"], launch["ts"])) if launch else []
        listed.append(
            {
                "idle_us": round(in_steps(start, stop), 1),
                "owed_us": {name: round(us, 1) for name, us in owners},
                "launched_by": [name[:80] for name in launch_stack[-6:]],
                "kernel_before": before["name"][:80],
                "kernel_after": after["name"][:80],
            }
        )
    n_steps = max(len(steps), 1)
    ranked = sorted(owed.items(), key=lambda item: -item[1])[:25]
    return {
        "gaps_per_step": round(len(gaps) / n_steps),
        "idle_ms_by_owner": {name[:100]: round(us / 1e3 / n_steps, 2) for name, us in ranked},
        "longest_gaps": sorted(listed, key=lambda g: -g["idle_us"])[:longest],
    }


def print_idle(idle: dict) -> None:
    print(f"   GPU idle, {idle['gaps_per_step']} gaps/step; ms/step by what the host did:")
    for name, ms in idle["idle_ms_by_owner"].items():
        print(f"   {ms:>8.2f} ms  {name}")
    for gap in idle["longest_gaps"]:
        owed = ", ".join(f"{name} {us} us" for name, us in gap["owed_us"].items())
        launcher = " > ".join(gap["launched_by"])
        print(f"   gap {gap['idle_us']:>8.1f} us: {owed}; launched by {launcher}")


def against_baseline(baseline: dict, other: dict) -> dict:
    """How much faster ``other``'s step is than ``baseline``'s: by wall time, by GPU-busy time
    (the bound once the host keeps the GPU fed), and by GPU-busy time without float8_moe's casts
    (the bound if they cost nothing)."""
    casts = other["families_ms_per_step"].get("float8_moe cast", 0.0)
    return {
        "wall": round(baseline["step_wall_ms"] / other["step_wall_ms"], 3),
        "gpu_busy": round(baseline["gpu_busy_ms"] / other["gpu_busy_ms"], 3),
        "gpu_busy_without_casts": round(
            baseline["gpu_busy_ms"] / (other["gpu_busy_ms"] - casts), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="LABEL=path/to/rank0_trace.json")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--gaps", type=int, default=0, help="list the N longest GPU idle gaps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    summaries = {}
    for item in args.traces:
        label, _, path = item.partition("=")
        s = summaries[label] = summarize(Path(path), args.top, args.gaps)
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
        if "idle" in s:
            print_idle(s["idle"])
    baseline, *others = summaries
    for label in others:
        ratios = summaries[label]["speedup_vs_" + baseline] = against_baseline(
            summaries[baseline], summaries[label]
        )
        print(
            f"\n{label} vs {baseline}: wall {ratios['wall']}x, GPU busy {ratios['gpu_busy']}x, "
            f"GPU busy with free float8_moe casts {ratios['gpu_busy_without_casts']}x"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
