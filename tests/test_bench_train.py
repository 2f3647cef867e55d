"""scripts/bench_train.py's bookkeeping: speedups by interleaved round, and which runs loaded
their data in a worker (the rows of docs/benchmarks depend on both)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_train import loader_workers, round_ratios  # noqa: E402


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
