"""scripts/bench_train.py's bookkeeping: speedups by interleaved round, and which runs loaded
their data in a worker (the rows of docs/benchmarks depend on both)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_train import loader_workers, round_ratios, step_records  # noqa: E402


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


def test_step_records_carry_the_allocator_retries_so_far():
    """torchtitan warns with the allocator's retries (a running count) before a step's line; a
    step without a warning had none yet. Taken from a real H100 log of 2026-12-06."""
    log = "\n".join(
        [
            "[rank0]:[titan] - root - INFO - step:  1  loss:  8.10480  grad_norm:  3.2910  "
            "memory: 71.67GiB(90.52%)  tps: 26,924  tflops: 39.61  mfu: 4.00%",
            "[rank0]:[titan] - root - WARNING - 1 CUDA memory allocation retries.",
            "[rank0]:[titan] - root - INFO - step:  2  loss:  8.48733  grad_norm:  8.0910  "
            "memory: 76.63GiB(96.78%)  tps: 42,171  tflops: 62.04  mfu: 6.27%",
            "[rank0]:[titan] - root - WARNING - 12 CUDA memory allocation retries.",
            "[rank0]:[titan] - root - INFO - step: 10  loss:  4.96775  grad_norm:  2.7398  "
            "memory: 77.65GiB(98.07%)  tps: 80,632  tflops: 118.63  mfu: 12.00%",
        ]
    )
    assert step_records(log) == {
        1: (8.1048, 71.67, 26924, 0),
        2: (8.48733, 76.63, 42171, 1),
        10: (4.96775, 77.65, 80632, 12),
    }
