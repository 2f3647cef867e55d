"""scripts/memory_peak.py on a hand-made snapshot whose peak and sites are known."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import memory_peak  # noqa: E402

GIB = 2**30


def _frames(line: int) -> list[dict]:
    return [
        {"filename": "/site/torch/_tensor.py", "line": 1, "name": "machinery"},
        {"filename": "/x/torchtitan_fp8_moe/fp8/cast.py", "line": line, "name": "cast"},
        {"filename": "??", "line": 0, "name": "c++ frame"},
    ]


def _snapshot() -> dict:
    # Before the trace: block 100 (1 GiB, alive at the end) and block 200 (2 GiB, freed in it).
    trace = [
        {"action": "segment_map", "addr": 0, "size": 4 * GIB, "frames": _frames(1)},
        {"action": "alloc", "addr": 1, "size": 3 * GIB, "frames": _frames(2)},
        {"action": "alloc", "addr": 2, "size": 1 * GIB, "frames": _frames(3)},
        {"action": "free_requested", "addr": 1, "size": 3 * GIB, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 3 * GIB, "frames": []},
        {"action": "free_completed", "addr": 200, "size": 2 * GIB, "frames": []},
        {"action": "alloc", "addr": 3, "size": 4 * GIB, "frames": _frames(4)},
        {"action": "free_completed", "addr": 2, "size": 1 * GIB, "frames": []},
    ]
    blocks = [
        {"address": 100, "size": GIB, "state": "active_allocated"},
        {"address": 3, "size": 4 * GIB, "state": "active_allocated"},
        {"address": 7, "size": GIB, "state": "inactive"},
    ]
    segments = [{"device": 0, "total_size": 10 * GIB, "blocks": blocks}]
    return {"segments": segments, "device_traces": [trace]}


def test_peak_and_sites():
    result = memory_peak.analyze(_snapshot())
    # Allocated: 3 before, +3 = 6, +1 = 7 (the peak), -3 = 4, -2 = 2, +4 = 6, -1 = 5.
    assert result["peak_allocated_gib"] == 7.0
    assert result["peak_event"] == 2
    assert result["peak_site"] == "torchtitan_fp8_moe/fp8/cast.py:3 cast"
    assert result["peak_by_site_gib"] == {
        "(alive before the trace began)": 3.0,
        "torchtitan_fp8_moe/fp8/cast.py:2 cast": 3.0,
        "torchtitan_fp8_moe/fp8/cast.py:3 cast": 1.0,
    }
    # Reserved: 10 at the end, 4 mapped in the trace, so 6 before it.
    [growth] = result["reserved_growths"]
    assert growth["reserved_gib"] == 10.0 and growth["allocated_gib"] == 3.0
