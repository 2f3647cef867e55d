"""scripts/bench_train.py's bookkeeping: speedups by interleaved round, and which runs loaded
their data in a worker (the rows of docs/benchmarks depend on both)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_train import (  # noqa: E402
    loader_workers,
    retries_after_warmup,
    round_ratios,
    step_records,
)


def run(variant, index, tokens=None):
    row = {"variant": variant, "run": index}
    if tokens is not None:
        row["tokens_per_s_median"] = tokens
    return row


RUNS = [
    run("bf16", 0, 100.0),
    run("float8_moe", 0, 115.0),
    run("bf16+compile", 0, 120.0),
    run("float8_moe+compile", 0, 150.0),
    run("bf16", 1, 90.0),
    run("float8_moe", 1, 108.0),
    run("bf16+compile", 1),  # failed: its round has no ratio
    run("float8_moe+compile", 1, 151.0),
    run("bf16", 2, 110.0),
    run("float8_moe", 2, 121.0),
]


def test_each_round_pairs_a_variant_with_bf16_of_its_compile_setting():
    # 1.15, 1.2, 1.1: the median of the rounds, not the ratio of the medians (115 / 100).
    assert round_ratios(RUNS, "float8_moe") == {
        "speedup_rounds": [1.15, 1.2, 1.1],
        "speedup_median_of_rounds": 1.15,
    }
    assert round_ratios(RUNS, "float8_moe+compile") == {
        "speedup_rounds": [1.25],
        "speedup_median_of_rounds": 1.25,
    }
    assert round_ratios(RUNS, "bf16") == {}
    assert round_ratios([run("bf16", 0), run("float8_moe", 0, 1.0)], "float8_moe") == {}


def test_loader_workers_come_from_the_config_or_an_override():
    assert loader_workers("train_configs/llama4_scout_2layers.toml", []) == 1
    assert loader_workers("train_configs/qwen3_30b_a3b_4layers.toml", []) == 1
    assert loader_workers("train_configs/llama4_debug.toml", []) == 0
    override = ["--compile.enable", "--training.dataloader.num_workers=2"]
    assert loader_workers("train_configs/llama4_debug.toml", override) == 2


# Lines of a real H100 run (docs/benchmarks/archive/2026-12-06-first-step-release-h100/batch3/
# new_r1_float8_moe.log, steps 1-3 and 12), and a validation line shaped like torchtitan's.
H100_LOG = """\
[rank0]:[titan] 2026-12-06 05:12:16,841 - root - INFO - step:  1  loss:  8.10480  grad_norm:  3.2910  memory: 71.67GiB(90.52%)  tps: 26,924  tflops: 130.46  mfu: 13.19%
[rank0]:[titan] 2026-12-06 05:12:17,424 - root - INFO - step:  2  loss:  8.48733  grad_norm:  8.0910  memory: 76.63GiB(96.78%)  tps: 42,171  tflops: 204.34  mfu: 20.66%
[rank0]:[titan] 2026-12-06 05:12:17,726 - root - WARNING - 1 CUDA memory allocation retries.
[rank0]:[titan] 2026-12-06 05:12:17,726 - root - INFO - step:  3  loss:  7.48503  grad_norm:  5.4413  memory: 76.63GiB(96.78%)  tps: 81,583  tflops: 395.32  mfu: 39.97%
[rank0]:[titan] 2026-12-06 05:12:20,489 - root - WARNING - 9 CUDA memory allocation retries.
[rank0]:[titan] 2026-12-06 05:12:20,489 - root - INFO - step: 12  loss:  4.96775  grad_norm:  2.7398  memory: 77.65GiB(98.07%)  tps: 80,632  tflops: 390.71  mfu: 39.51%
[rank0]:[titan] 2026-12-06 05:12:20,500 - root - INFO - validate step: 12  loss:  5.0000  memory: 77.70GiB(98.10%)  tps: 1,000
"""  # noqa: E501


def test_step_records_carry_the_allocator_retries_so_far():
    """torchtitan warns with the allocator's retries (a running count) before a step's line; a
    step without a warning had none yet; validation's lines are not steps."""
    assert step_records(H100_LOG) == {
        1: (8.1048, 71.67, 26924, 0),
        2: (8.48733, 76.63, 42171, 0),
        3: (7.48503, 76.63, 81583, 1),
        12: (4.96775, 77.65, 80632, 9),
    }


def test_step_records_follow_one_rank_where_the_log_shows_several():
    """With LOG_RANK=0,1 both ranks' lines interleave: rank 1's retries and steps stay out."""
    rank1 = [line.replace("[rank0]", "[rank1]") for line in H100_LOG.splitlines()]
    rank1[2] = rank1[2].replace("1 CUDA", "5 CUDA")
    mixed = [line for pair in zip(H100_LOG.splitlines(), rank1, strict=True) for line in pair]
    rank1_first = [line for pair in zip(rank1, H100_LOG.splitlines(), strict=True) for line in pair]
    assert step_records("\n".join(mixed)) == step_records(H100_LOG)
    assert step_records("\n".join(rank1_first))[3][3] == 5


def test_retries_after_warmup_count_only_the_timed_steps():
    steps = step_records(H100_LOG)
    assert retries_after_warmup(steps, 2) == 9  # steps 3-12
    assert retries_after_warmup(steps, 3) == 8  # steps 4-12
    assert retries_after_warmup(steps, 0) == 9  # no warm-up logged: every retry
    assert retries_after_warmup(steps, 11) == 8  # step 11 not logged: from step 3's count
