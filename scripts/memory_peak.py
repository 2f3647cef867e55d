"""Where a CUDA memory snapshot's peak comes from: the allocations alive at the peak, by site.

    python scripts/memory_peak.py SNAPSHOT.pickle [SNAPSHOT2.pickle ...] [--top 25] [--out F.json]

Reads snapshots of ``torch.cuda.memory._snapshot()`` taken with
``torch.cuda.memory._record_memory_history`` on (torchtitan writes them with
``--profiling.enable_memory_snapshot``). Replays each trace and reports:

- the peak of allocated memory, and the allocation that reached it;
- the blocks alive at that peak, summed by allocation site (the innermost frames outside
  torch's own modules), blocks made before the trace began counted as one line;
- every growth of reserved memory (segment allocations and mappings), with the allocated
  memory then and the site that asked for it: without ``empty_cache`` reserved memory only
  grows, so the last of these set the run's peak reserved, and a growth while much of the
  reserved memory is free points at fragmentation.

With several snapshots (a bf16 and an fp8 run) the site table has a column for each.
"""

import argparse
import collections
import json
import pickle
from pathlib import Path

GIB = 2**30
# Frames from these parts of torch are the machinery, not the site; autograd, FSDP and the
# optimizer are sites worth naming.
_MACHINERY = ("/torch/_tensor", "/torch/nn/modules/module.py", "/torch/utils/", "/torch/_ops")
_SITE_FRAMES = 3


def _python_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if f.get("filename", "").endswith(".py")]


def site(frames: list[dict]) -> str:
    """The innermost few Python frames that are not torch machinery, innermost first."""
    kept = [f for f in _python_frames(frames) if not any(m in f["filename"] for m in _MACHINERY)]
    parts = []
    for frame in kept[:_SITE_FRAMES]:
        path = frame["filename"]
        for marker in ("torchtitan_fp8_moe/", "torchtitan/", "torch/", "scripts/"):
            if marker in path:
                path = marker + path.split(marker, 1)[1]
                break
        parts.append(f"{path}:{frame['line']} {frame['name']}")
    return " < ".join(parts) or "(no python frames)"


def _frees(trace: list[dict]) -> str:
    actions = {e["action"] for e in trace}
    return "free_completed" if "free_completed" in actions else "free_requested"


_GROW = ("segment_alloc", "segment_map")
_SHRINK = ("segment_free", "segment_unmap")


def analyze(snapshot: dict, device: int = 0) -> dict:
    trace = snapshot["device_traces"][device]
    free_action = _frees(trace)
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    active_at_end = {
        b["address"]: b["size"]
        for s in segments
        for b in s["blocks"]
        if b["state"] == "active_allocated"
    }
    reserved_at_end = sum(s["total_size"] for s in segments)
    # Blocks alive when the trace began: freed in it without being allocated in it, or still
    # alive at the end without an allocation in it.
    allocated_in_trace, before_trace = set(), 0
    for event in trace:
        if event["action"] == "alloc":
            allocated_in_trace.add(event["addr"])
        elif event["action"] == free_action and event["addr"] not in allocated_in_trace:
            before_trace += event["size"]
    before_trace += sum(
        size for addr, size in active_at_end.items() if addr not in allocated_in_trace
    )
    reserved = reserved_at_end - sum(
        e["size"] * (1 if e["action"] in _GROW else -1)
        for e in trace
        if e["action"] in _GROW + _SHRINK
    )
    # First pass: the allocated memory after each event, its peak, the reserved growths.
    allocated, peak_allocated, peak_event, growths = before_trace, before_trace, None, []
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            allocated += event["size"]
            if allocated > peak_allocated:
                peak_allocated, peak_event = allocated, index
        elif action == free_action:
            allocated -= event["size"]
        elif action in _GROW:
            reserved += event["size"]
            growths.append(
                {
                    "event": index,
                    "grew_gib": round(event["size"] / GIB, 3),
                    "reserved_gib": round(reserved / GIB, 3),
                    "allocated_gib": round(allocated / GIB, 3),
                    "site": site(event.get("frames", [])),
                }
            )
        elif action in _SHRINK:
            reserved -= event["size"]
    # Second pass, up to the peak: which blocks were alive there.
    live: dict[int, tuple[int, list]] = {}
    before_at_peak = before_trace
    for event in trace[: 0 if peak_event is None else peak_event + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == free_action:
            if live.pop(event["addr"], None) is None:
                before_at_peak -= event["size"]
    by_site = collections.Counter()
    for size, frames in live.values():
        by_site[site(frames)] += size
    by_site["(alive before the trace began)"] += before_at_peak
    peak_frames = trace[peak_event].get("frames", []) if peak_event is not None else []
    return {
        "events": len(trace),
        "peak_allocated_gib": round(peak_allocated / GIB, 3),
        "peak_event": peak_event,
        "peak_site": site(peak_frames),
        "peak_by_site_gib": {k: round(v / GIB, 3) for k, v in by_site.most_common()},
        "reserved_at_end_gib": round(reserved_at_end / GIB, 3),
        "reserved_growths": growths,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {}
    for path in args.snapshots:
        with open(path, "rb") as f:
            results[path] = analyze(pickle.load(f))
    names = list(results)
    for name, r in results.items():
        print(
            f"{name}: {r['events']} events; peak allocated {r['peak_allocated_gib']} GiB at event "
            f"{r['peak_event']} ({r['peak_site']}); reserved at end {r['reserved_at_end_gib']} GiB"
        )
        print("  reserved grew (largest first):")
        for g in sorted(r["reserved_growths"], key=lambda g: -g["grew_gib"])[:8]:
            print(
                f"    +{g['grew_gib']:7.3f} -> {g['reserved_gib']:8.3f} GiB reserved "
                f"(allocated {g['allocated_gib']:8.3f}) at event {g['event']}: {g['site']}"
            )
    sites = collections.Counter()
    for r in results.values():
        for key, gib in r["peak_by_site_gib"].items():
            sites[key] = max(sites[key], gib)
    print("\nalive at the peak, GiB, by site: " + " | ".join(Path(n).parent.name for n in names))
    for key, _ in sites.most_common(args.top):
        cells = " ".join(f"{results[n]['peak_by_site_gib'].get(key, 0.0):8.3f}" for n in names)
        print(f"{cells}  {key}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
