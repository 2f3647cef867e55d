"""`[float8_moe] fp8_all_gather`: FSDP2 (gloo, 2 and 3 ranks) gathers fp8 payloads quantized on
each shard, and training is bit-identical to gathering bf16: outputs, input gradients, weight
gradient shards after the reduce-scatter and weights after each of 3 AdamW steps (2 micro-batches
each), with and without the fp8 weight cache, resharding after forward or not, with activation
checkpointing, with ranks holding only padding, DTensor (TP-mesh) weights, and the fallbacks to
bf16 (2D weights, FSDP on dim 1). The gathered weight holds fp8 payloads only and refuses any
other use; state dicts taken before training hold the live weights after it. One world-size-2
case is in the fast loop; every case runs in the two launches."""

import logging

import pytest
from harness.suites.fp8_all_gather import fp8_all_gather_cases
from test_converter import CUSTOM_CONFIG, _convert, _parallel_dims

FAST_CASE = "routed-4-dim0-reshard=True"
STEPS = 3  # _train_fp8_all_gather's
FP8 = "torch.float8_e4m3fn"
# fp32 scales; their bytes in an integer carrier of the padded shard shape when dim 0 is uneven
SCALE_DTYPES = {"torch.float32", "torch.uint8", "torch.int16", "torch.int32", "torch.int64"}
CASES = [(w, case) for w in (2, 3) for case in fp8_all_gather_cases(w)]


def _check_case(ranks: list[dict], case: dict) -> None:
    for rank, results in enumerate(ranks):
        assert "error" not in results, f"rank {rank}: {results.get('traceback')}"
        result = results.get(case["name"])
        assert result is not None, f"rank {rank} did not reach {case['name']}"
        assert result.get("error") is None, f"rank {rank}: {result.get('traceback')}"
        assert all(result["equal"].values()), f"rank {rank}: differs from bf16: {result['equal']}"
        assert result["stale_state_dict_entries"] == [], f"rank {rank}: not the live weights"
        report = result["report"]
        for name, dtypes in report["input_dtypes"].items():
            if case["fp8_gathered"]:
                assert dtypes[:2] == [FP8, FP8] and dtypes[2] in SCALE_DTYPES, (rank, name, dtypes)
            else:
                assert dtypes == ["torch.bfloat16"], (rank, name, dtypes)
        for name, unsharded in report["unsharded"].items():
            expected = "Float8GatheredWeight" if case["fp8_gathered"] else "Float8MoEWeight"
            assert unsharded["type"] == expected, (rank, name, unsharded)
            if case["fp8_gathered"]:
                # no tensor of the weight's size other than the two fp8 payloads
                assert unsharded["large_payloads"] == [FP8, FP8], (rank, name, unsharded)
        if case["fp8_gathered"]:
            for use, outcome in result["fail_closed"].items():
                assert outcome == "raised", f"rank {rank}: {use}: {outcome}"
        if case["cache_fp8"]:
            # one quantization per orientation and optimizer step, on the shard
            for name, count in result["fp8_cache_quantizations"].items():
                assert count == STEPS * 2, f"rank {rank}: {name} quantized {count}x"


def test_fp8_all_gather_matches_bf16_fast(dist_results):
    (case,) = [c for c in fp8_all_gather_cases(2) if c["name"] == FAST_CASE]
    _check_case(dist_results("fp8_all_gather", 2), case)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case", CASES, ids=[f"w{w}-{c['name']}" for w, c in CASES])
def test_fp8_all_gather_matches_bf16(dist_results, world_size, case):
    _check_case(dist_results("fp8_all_gather", world_size), case)


def test_shard_plan_logs_fp8_and_bf16_fallbacks(caplog):
    """16 ranks, EP 8 over 8 experts: FSDP (efsdp 2) shards the routed experts on dim 1; the
    shared FeedForward's weights are 2D. Both gather bf16, and the plan says why."""
    args = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fp8_all_gather"]
    with caplog.at_level(logging.INFO):
        _convert(args, _parallel_dims(world_size=16, dp_shard=16, ep=8))
    (message,) = [r.getMessage() for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    assert "fp8 all-gather on" in message
    lines = message.splitlines()
    routed = [line for line in lines if ".moe.experts.w" in line]
    shared = [line for line in lines if ".shared_experts.w" in line]
    assert routed and all("bfloat16 (FSDP shards dim 1" in line for line in routed), routed
    assert shared and all("bfloat16 (2D weight" in line for line in shared), shared


def test_shard_plan_logs_fp8_for_dim0_experts(caplog):
    args = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fp8_all_gather"]
    with caplog.at_level(logging.INFO):
        _convert(args + ["--float8_moe.fqns=experts"], _parallel_dims(world_size=8))
    (message,) = [r.getMessage() for r in caplog.records if "FSDP shard plan" in r.getMessage()]
    routed = [line for line in message.splitlines() if ".moe.experts.w" in line]
    assert routed and all(line.rstrip().endswith("fp8") for line in routed), routed


def test_fp8_all_gather_refuses_another_all_gather_dtype():
    """All-gathers in another dtype than the bf16 that torchtitan's experts cast to: refused at
    start-up, naming both options."""
    args = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.fp8_all_gather"]
    with pytest.raises(ValueError) as error:
        _convert(args + ["--training.mixed_precision_param=float32"])
    for name in ["fp8_all_gather", "mixed_precision_param"]:
        assert name in str(error.value)
