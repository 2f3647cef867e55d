"""The timing policy across ranks (torchtitan_fp8_moe/measure.py): averaged timings, and a clear
error on every rank, not a hang, where the ranks would time different weights."""

import torch
import torch.distributed as dist

from torchtitan_fp8_moe.measure import WeightCase, time_cases
from torchtitan_fp8_moe.weight import WeightConfig


def suite_measure(mesh) -> dict:
    config = WeightConfig("rowwise", emulate=True)
    cpu = torch.device("cpu")
    cases = {WeightCase(64, (2, 32, 16), "bfloat16"), WeightCase(32, (24, 16), "float32")}
    timed = time_cases(cases, config, None, cpu)
    results = {
        "same_cases": {
            "error": None,
            "timings": [
                [case.rows, list(case.shape), t.bf16_ms, t.fp8_ms]
                for case, t in sorted(timed.items())
            ],
        }
    }
    differing = {WeightCase(64 + 16 * dist.get_rank(), (2, 32, 16), "bfloat16")}
    try:
        time_cases(differing, config, None, cpu)
        results["differing_cases"] = {"error": None}
    except ValueError as e:
        results["differing_cases"] = {"error": str(e)}
    return results
