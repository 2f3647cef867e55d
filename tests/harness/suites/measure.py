"""The timing policy across ranks (torchtitan_fp8_moe/measure.py): averaged timings, and a clear
error on every rank, not a hang, where the ranks would time different weights."""

import torch
import torch.distributed as dist

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
    scout = _scout()
    plan = convert(scout, emulate=False, tokens=16384, policy="measure")
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


def _scout():
    from dataclasses import replace

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama4")
    with torch.device("meta"):
        return spec.model_cls(replace(spec.model_args["17bx16e"], n_layers=1))
