"""The timing policy across ranks (torchtitan_fp8_moe/measure.py): averaged timings, and a clear
error on every rank, not a hang, where the ranks would time different weights."""

import torch
import torch.distributed as dist
from expert_modules import scout_meta_model

from torchtitan_fp8_moe import convert
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
    # A plan for CUDA made on these CPUs (no GPU to time on): the cost model's verdicts, and no
    # rank waits for another
    plan = convert(scout_meta_model(), emulate=False, tokens=16384, policy="measure")
    results["planned_without_gpu"] = {
        "error": None,
        "paths": sorted({row.path.split(" ms")[0] for row in plan}),
    }
    differing = {WeightCase(64 + 16 * dist.get_rank(), (2, 32, 16), "bfloat16")}
    try:
        time_cases(differing, config, None, cpu)
        results["differing_cases"] = {"error": None}
    except ValueError as e:
        results["differing_cases"] = {"error": str(e)}
    return results
