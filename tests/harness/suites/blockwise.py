"""The blockwise recipe under tensor parallelism (TP 2, 128-aligned local shards) and
expert-tensor parallelism, against the unsharded model (tests/test_blockwise_sharded.py)."""

from harness.suites.parallel import run_parallel_cases

# (name, model, tp, ep, etp, dp_shard, num_experts), as PARALLEL_CASES; launched on 2 ranks.
BLOCKWISE_PARALLEL_CASES = [
    ("tp2", "llama4", 2, 1, 1, 1, None),
    ("tp2-grouped_shared", "llama4_grouped_shared", 2, 1, 1, 1, None),
]


def suite_blockwise_parallel(mesh) -> dict:
    return run_parallel_cases(BLOCKWISE_PARALLEL_CASES, "blockwise")
