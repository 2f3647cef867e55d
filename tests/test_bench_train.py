"""scripts/bench_train.py's bookkeeping: speedups by interleaved round, which runs loaded their
data in a worker (the rows of docs/benchmarks depend on both), the numbers read from torchtitan's
metrics event file, and the progress line per step."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from bench_train import (  # noqa: E402
    METRIC_TAGS,
    Progress,
    loader_workers,
    metric_records,
    retries_after_warmup,
    round_ratios,
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


# Lines of a real H100 run (a float8_moe trainer log of 2026-12-06, steps 1-3 and 12), and a
# validation line shaped like torchtitan's.
H100_LOG = """\
[rank0]:[titan] 2026-12-06 05:12:16,841 - root - INFO - step:  1  loss:  8.10480  grad_norm:  3.2910  memory: 71.67GiB(90.52%)  tps: 26,924  tflops: 130.46  mfu: 13.19%
[rank0]:[titan] 2026-12-06 05:12:17,424 - root - INFO - step:  2  loss:  8.48733  grad_norm:  8.0910  memory: 76.63GiB(96.78%)  tps: 42,171  tflops: 204.34  mfu: 20.66%
[rank0]:[titan] 2026-12-06 05:12:17,726 - root - WARNING - 1 CUDA memory allocation retries.
[rank0]:[titan] 2026-12-06 05:12:17,726 - root - INFO - step:  3  loss:  7.48503  grad_norm:  5.4413  memory: 76.63GiB(96.78%)  tps: 81,583  tflops: 395.32  mfu: 39.97%
[rank0]:[titan] 2026-12-06 05:12:20,489 - root - WARNING - 9 CUDA memory allocation retries.
[rank0]:[titan] 2026-12-06 05:12:20,489 - root - INFO - step: 12  loss:  4.96775  grad_norm:  2.7398  memory: 77.65GiB(98.07%)  tps: 80,632  tflops: 390.71  mfu: 39.51%
[rank0]:[titan] 2026-12-06 05:12:20,500 - root - INFO - validate step: 12  loss:  5.0000  memory: 77.70GiB(98.10%)  tps: 1,000
"""  # noqa: E501


def test_progress_shows_each_step_of_one_rank_as_it_is_logged():
    """A line per training step of the first rank whose steps the log shows (LOG_RANK=0,1 shows
    both ranks' lines interleaved); validation's lines are not steps."""
    progress = Progress("float8_moe (run 1 of 3)", 12)
    rank1 = [line.replace("[rank0]", "[rank1]") for line in H100_LOG.splitlines()]
    mixed = [line for pair in zip(H100_LOG.splitlines(), rank1, strict=True) for line in pair]
    shown = [text for line in mixed if (text := progress.line(line))]
    assert shown == [
        "float8_moe (run 1 of 3): step 1/12  loss 8.10480  26,924 tokens/s  71.67 GiB reserved",
        "float8_moe (run 1 of 3): step 2/12  loss 8.48733  42,171 tokens/s  76.63 GiB reserved",
        "float8_moe (run 1 of 3): step 3/12  loss 7.48503  81,583 tokens/s  76.63 GiB reserved",
        "float8_moe (run 1 of 3): step 12/12  loss 4.96775  80,632 tokens/s  77.65 GiB reserved",
    ]


def _write_metrics(folder: Path, steps: dict[int, tuple[float, float, float, int]]) -> None:
    """Event files as torchtitan's TensorBoard logger writes them (SummaryWriter.add_scalar),
    one with the old and one with the new scalar encoding, and a metric bench_train ignores."""
    from torch.utils.tensorboard import SummaryWriter

    for style, subfolder in ((False, "20261206-0512"), (True, "20261206-0513")):
        writer = SummaryWriter(str(folder / subfolder))
        for step, record in steps.items():
            if (step % 2 == 0) != style:
                continue
            for tag, value in zip(METRIC_TAGS.values(), record, strict=True):
                writer.add_scalar(tag, value, step, new_style=style)
            writer.add_scalar("grad_norm", 1.0, step, new_style=style)
        writer.close()


def test_metric_records_read_torchtitans_event_files(tmp_path):
    """Loss, peak reserved GiB, tokens/s per device and the allocator's retries so far, by step,
    from the event files under the run's metrics folder; the same tuples the old console
    parser gave, tokens/s unrounded (to 0.1)."""
    steps = {
        1: (8.1048, 71.67, 26924.4, 0),
        2: (8.48733, 76.63, 42171.0, 0),
        3: (7.5, 76.6, 81583.0, 1),
    }
    _write_metrics(tmp_path, steps)
    records = metric_records(tmp_path)
    assert sorted(records) == [1, 2, 3]
    for step, (loss, reserved, tps, retries) in records.items():
        want = steps[step]
        assert (loss, reserved) == pytest.approx(want[:2]) and tps == pytest.approx(
            want[2], abs=0.1
        )
        assert retries == want[3]
    assert metric_records(tmp_path / "absent") == {}


def test_retries_after_warmup_count_only_the_timed_steps():
    steps = {1: (8.1, 71.7, 26924, 0), 2: (8.5, 76.6, 42171, 0), 3: (7.5, 76.6, 81583, 1)}
    steps[12] = (4.97, 77.65, 80632, 9)
    assert retries_after_warmup(steps, 2) == 9  # steps 3-12
    assert retries_after_warmup(steps, 3) == 8  # steps 4-12
    assert retries_after_warmup(steps, 0) == 9  # no warm-up logged: every retry
    assert retries_after_warmup(steps, 11) == 8  # step 11 not logged: from step 3's count
