"""The test side of the parallelism cases of ``suites/parallel.py`` (``run_parallel_cases``):
the bar every rank's result must meet, for tests/test_parallel.py and
tests/test_blockwise_sharded.py."""

# fp8-noise level, not equality: a shard's scales differ from the unsharded ones where it splits
# a GEMM's contraction dim (measured values: tests/test_parallel.py).
LOSS_GAP, EXPERT_GRAD_DB = 5e-4, 25.0


def assert_matches_unsharded(ranks: list[dict], case: str) -> list[dict]:
    """Assert that ``case`` ran on every rank of ``ranks`` (``dist_results``) and matches the
    unsharded converted model there; each rank's result."""
    case_results = []
    for rank, results in enumerate(ranks):
        assert "error" not in results, f"rank {rank}: {results.get('traceback')}"
        result = results.get(case)
        assert result is not None, f"rank {rank} did not reach {case}"
        assert result.get("error") is None, f"rank {rank}: {result.get('traceback')}"
        # Every expert weight's local shard is still converted: its GEMMs ran in fp8 (any
        # high-precision matmul of it raises).
        assert set(result["expert_weights"].values()) == {"Float8MoEWeight"}, result
        assert abs(result["loss"] - result["reference_loss"]) < LOSS_GAP, result
        assert result["min_expert_grad_sqnr"] > EXPERT_GRAD_DB, result["worst_grads"]
        case_results.append(result)
    return case_results
