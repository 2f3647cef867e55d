"""Runs suites of multi-process FSDP2 cases in a single launch (gloo, CPU).

    python tests/harness/fork_launch.py --nproc=W tests/harness/dist_worker.py SUITE[+SUITE...] OUT

Each rank writes OUT/rank{r}.json: {suite: {case name: {"error": str|None, ...}}}. The pytest
files launch this once per world size and group of suites (tests/conftest.py) and assert on the
JSON, so a failing case shows up as a failing test with its rank and message. A suite that
raises leaves the ranks out of step: the suites after it do not run. The suites live in
``suites/``, one module each.
"""

import datetime
import json
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# The tests folder: expert_modules and this package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torchtitan_fp8_moe.config  # noqa: E402, F401 - registers float8_moe and the bundled models
from harness.suites import (  # noqa: E402
    blockwise,
    cache_writes,
    fp8_all_gather,
    fsdp,
    llama4,
    measure,
    parallel,
    reshape,
    torchao_seed,
)
from harness.suites.common import error_report  # noqa: E402

SUITES = {
    "fsdp": fsdp.suite_fsdp,
    "torchao_seed": torchao_seed.suite_torchao_seed,
    "llama4": llama4.suite_llama4,
    "measure": measure.suite_measure,
    "reshape": reshape.suite_reshape,
    "parallel": parallel.suite_parallel,
    "cache_writes": cache_writes.suite_cache_writes,
    "fp8_all_gather": fp8_all_gather.suite_fp8_all_gather,
    "blockwise_parallel": blockwise.suite_blockwise_parallel,
}


def main() -> None:
    suites, out_dir = sys.argv[1].split("+"), sys.argv[2]
    timeout = datetime.timedelta(seconds=int(os.environ.get("DIST_TIMEOUT_S", "120")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for suite in suites:
        try:
            results[suite] = SUITES[suite](mesh)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            results[suite] = error_report(e)
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    # Skip teardown collectives: a rank that failed cannot join them, and gloo's shutdown
    # after a failed collective aborts the process.
    os._exit(0)


if __name__ == "__main__":
    main()
