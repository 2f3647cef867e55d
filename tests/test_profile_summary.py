"""scripts/profile_summary.py --gaps: GPU idle time owed to the host op that made it, on a small
hand-built Chrome trace whose gaps are known."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from profile_summary import against_baseline, summarize  # noqa: E402


def span(cat, name, ts, dur, tid=1, correlation=None):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def kernel(name, ts, dur, correlation):
    return span("kernel", name, ts, dur, tid=7, correlation=correlation)


def launched(op, ts, correlation):
    """A host op that launches one kernel."""
    return [
        span("cpu_op", op, ts, 20),
        span("cuda_runtime", "cudaLaunchKernel", ts + 5, 5, correlation=correlation),
    ]


def test_gaps_go_to_the_sync_that_drained_the_queue_or_the_late_launch(tmp_path):
    events = [
        span("user_annotation", "ProfilerStep#3", 0, 2000),
        *launched("aten::mm", 10, 1),
        kernel("gemm", 40, 100, 1),
        # The host waits for the GEMM (an .item()), so the GPU idles from 140 to 600.
        span("cpu_op", "aten::item", 50, 500),
        span("cpu_op", "aten::_local_scalar_dense", 55, 490),
        span("cuda_runtime", "cudaStreamSynchronize", 60, 85),
        *launched("aten::silu", 590, 2),
        kernel("silu", 600, 100, 2),
        # No sync: the host reaches the next launch late, 700 -> 1000 idle.
        span("user_annotation", "my_loader", 650, 300),
        *launched("aten::add", 980, 3),
        kernel("add", 1000, 50, 3),
        # Kernels that overlap or touch leave no gap.
        *launched("aten::mul", 1010, 4),
        kernel("mul", 1040, 60, 4),
        # A kernel after the step's end: only the part of its gap inside the step counts.
        *launched("aten::sub", 2100, 5),
        kernel("sub", 2500, 10, 5),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))

    idle = summarize(trace, top=5, gaps=10)["idle"]

    assert idle["gaps_per_step"] == 4
    assert idle["idle_ms_by_owner"] == {
        # 0 -> 10, 30 -> 40, 550 -> 590 and 950 -> 980 between ops; 1100 -> 2000 before the
        # step's end, whose launch comes after it (the part after the step is not counted).
        "host: (no op)": 0.99,
        # The GEMM ends at 140 and the sync returns at 145; the host finishes .item() at 550.
        "host: aten::item": 0.41,
        "host: my_loader": 0.25,
        "host: aten::add": 0.02,
        "host: aten::mm": 0.02,
        "sync cudaStreamSynchronize in aten::_local_scalar_dense": 0.01,
        "host: aten::silu": 0.01,
    }
    longest = idle["longest_gaps"]
    assert [g["idle_us"] for g in longest] == [900.0, 460.0, 300.0, 40.0]
    assert longest[3]["kernel_before"] == "(step start)"
    assert longest[1]["launched_by"] == ["aten::silu"]
    assert longest[1]["kernel_before"] == "gemm" and longest[1]["kernel_after"] == "silu"


def test_a_trace_is_compared_with_the_baseline_by_wall_gpu_busy_and_free_casts():
    baseline = {"step_wall_ms": 400.0, "gpu_busy_ms": 300.0, "families_ms_per_step": {}}
    fp8 = {
        "step_wall_ms": 320.0,
        "gpu_busy_ms": 250.0,
        "families_ms_per_step": {"fp8 GEMM": 100.0, "float8_moe cast": 50.0},
    }
    assert against_baseline(baseline, fp8) == {
        "wall": 1.25,
        "gpu_busy": 1.2,
        "gpu_busy_without_casts": 1.5,
    }
