"""torchtitan's real trainer through scripts/run_train.sh on CPU (gloo, emulated fp8)."""

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.slow  # trainer launches: minutes

REPO = Path(__file__).resolve().parent.parent
SEED_CONFIG = "train_configs/llama4_grouped_shared_debug.toml"
SMALL = [
    "--training.seq_len=64",
    "--training.local_batch_size=2",
    "--metrics.disable_color_printing",
]
CURVE_STEPS = 24
# The bf16-vs-fp8 curves: 2 ranks x 4 x 128 tokens a step at lr 1e-3 (the debug config's 4e-3
# on 2 x 64 tokens is so noisy that single loss spikes land on different steps in two runs).
CURVE = [
    "--training.seq_len=128",
    "--training.local_batch_size=4",
    "--optimizer.lr=1e-3",
    f"--training.steps={CURVE_STEPS}",
]


def run_train(ngpu: int, config: str, *overrides: str, log_rank: int = 0) -> str:
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=config, LOG_RANK=str(log_rank))
    proc = subprocess.run(
        ["./scripts/run_train.sh", *SMALL, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    return log


def losses(log: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step: +(\d+) +loss: +(\S+)", log)}


def bf16_config(tmp_path: Path, config: str = SEED_CONFIG) -> str:
    """A config (the seed-layout debug config by default) without the converter: the bf16
    baseline."""
    text = (REPO / config).read_text()
    assert 'converters = ["float8_moe"]' in text
    path = tmp_path / "bf16.toml"
    path.write_text(text.replace('converters = ["float8_moe"]', "converters = []"))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """bf16 and float8_moe on the seed layout, 2 ranks, same seed and data, with checkpoints."""
    tmp = tmp_path_factory.mktemp("train")
    bf16 = run_train(
        2,
        bf16_config(tmp),
        *CURVE,
        f"--job.dump_folder={tmp / 'bf16'}",
        "--checkpoint.enable",
        f"--checkpoint.interval={CURVE_STEPS}",
    )
    fp8 = run_train(
        2,
        SEED_CONFIG,
        *CURVE,
        f"--job.dump_folder={tmp / 'fp8'}",
        "--checkpoint.enable",
        f"--checkpoint.interval={CURVE_STEPS}",
    )
    return {"tmp": tmp, "bf16": bf16, "fp8": fp8}


SEED_STEPS = 5


@pytest.fixture(scope="module")
def seed_8_ranks(tmp_path_factory):
    """The seed's run on 8 ranks, with a checkpoint at its last step."""
    dump = tmp_path_factory.mktemp("seed8")
    log = run_train(
        8,
        SEED_CONFIG,
        f"--training.steps={SEED_STEPS}",
        "--float8_moe.fqns=experts,shared_expert",
        f"--job.dump_folder={dump}",
        "--checkpoint.enable",
        f"--checkpoint.interval={SEED_STEPS}",
    )
    return {"log": log, "checkpoint": dump / "checkpoint" / f"step-{SEED_STEPS}"}


def test_seed_layout_trains_on_8_ranks(seed_8_ranks):
    """The seed: NGPU=8, Llama4 with a [1, hidden, dim] grouped shared expert, both kinds of
    expert converted. Every step logs a finite loss, the loss goes down, and the shard plan shows
    the shared expert's weights padded on 7 of 8 ranks."""
    log = seed_8_ranks["log"]
    curve = losses(log)
    assert sorted(curve) == [1, 2, 3, 4, 5]
    assert all(torch.isfinite(torch.tensor(v)) for v in curve.values())
    assert curve[5] < curve[1] - 0.5
    assert "running on CPU" in log and "emulated path (no CUDA device)" in log
    shared_rows = re.findall(
        r"layers\.\d+\.moe\.shared_expert\.w\d +\[1, \d+, \d+\] +8 +0 +1 +7 ", log
    )
    assert len(shared_rows) == 9, "3 MoE layers x w1/w2/w3, each 1 row/rank, 7 padding-only ranks"
    routed_rows = re.findall(r"layers\.\d+\.moe\.experts\.w\d +\[8, \d+, \d+\] +8 +0 +1 +0 ", log)
    assert len(routed_rows) == 9


def test_checkpoint_from_8_ranks_gives_the_same_loss_at_3_and_2(seed_8_ranks, dist_results):
    """Reshape: the 8-rank checkpoint loaded into the converted model sharded over 8, 3 and 2
    ranks (torchtitan's apply_fsdp) gives the same loss on a fixed batch, and the 8 ranks' shards
    reassemble into the checkpoint's exact values."""
    checkpoint = str(seed_8_ranks["checkpoint"])
    results = {w: dist_results("reshape", w, env={"CHECKPOINT": checkpoint}) for w in (8, 3, 2)}
    for world, ranks in results.items():
        for rank, r in enumerate(ranks):
            assert r.get("error") is None, f"world {world} rank {rank}: {r.get('traceback')}"
            assert r["weights_match_checkpoint"], f"world {world} rank {rank}"
    loss8 = results[8][0]["loss"]
    assert torch.isfinite(torch.tensor(loss8))
    for world in (3, 2):
        for r in results[world]:
            assert abs(r["loss"] - loss8) < 1e-5, (world, r["loss"], loss8)


def test_training_resumes_at_3_ranks_from_an_8_rank_checkpoint(seed_8_ranks, tmp_path):
    """torchtitan's own resume at a different world size: steps 6-7 on 3 ranks from step 5.
    torchtitan cannot reshard the data loader's state ("dataloader resharding is not supported
    yet"), so the run skips it as torchtitan's option allows; model, optimizer, schedule and
    step are loaded and resharded."""
    shutil.copytree(seed_8_ranks["checkpoint"], tmp_path / "checkpoint" / f"step-{SEED_STEPS}")
    log = run_train(
        3,
        SEED_CONFIG,
        f"--training.steps={SEED_STEPS + 2}",
        f"--job.dump_folder={tmp_path}",
        "--checkpoint.enable",
        "--checkpoint.interval=100",
        "--checkpoint.exclude_from_loading=dataloader",
    )
    curve = losses(log)
    assert sorted(curve) == [SEED_STEPS + 1, SEED_STEPS + 2]
    assert f"Loading the checkpoint from {tmp_path / 'checkpoint' / f'step-{SEED_STEPS}'}" in log
    assert all(torch.isfinite(torch.tensor(v)) for v in curve.values())
    assert curve[SEED_STEPS + 1] < losses(seed_8_ranks["log"])[1] - 0.5


def test_fp8_loss_tracks_bf16(runs):
    """Same seed and data, 24 steps. Tolerance 0.02 per step: 0.3% of the loss and a tenth of
    the run's own step-to-step movement (0.20), yet 5x the gap fp8 rounding causes here.
    Measured (CPU, final code): max gap 0.0033, mean 0.0009."""
    bf16, fp8 = losses(runs["bf16"]), losses(runs["fp8"])
    assert sorted(bf16) == sorted(fp8) == list(range(1, CURVE_STEPS + 1))
    gaps = {s: round(abs(bf16[s] - fp8[s]), 5) for s in bf16}
    assert max(gaps.values()) < 0.02, (gaps, bf16, fp8)
    assert gaps[1] > 0, "identical first losses: the fp8 path did not run"
    assert fp8[CURVE_STEPS] < fp8[1] - 1.0


def _process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts its workers in sessions of their own,
    so killing torchrun's process group would leave them training)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def test_killed_run_resumes_from_its_last_checkpoint(runs, tmp_path):
    """SIGKILL the launcher and every worker once step 10 is logged (checkpoints every 4 steps),
    start it again with the same command: it resumes from the last checkpoint on disk, redoes
    only the steps after it, and its losses from there on equal the uninterrupted run's."""
    dump = f"--job.dump_folder={tmp_path}"
    args = [
        "./scripts/run_train.sh",
        *SMALL,
        *CURVE,
        dump,
        "--checkpoint.enable",
        "--checkpoint.interval=4",
    ]
    env = dict(os.environ, NGPU="2", CONFIG_FILE=SEED_CONFIG)
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed_log = []
    try:
        for line in proc.stdout:
            killed_log.append(line)
            if re.search(r"step: +10 +loss", line):
                for pid in _process_tree(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").glob("step-*"))
    last = saved[-1]
    assert 8 <= last < CURVE_STEPS, saved
    log = run_train(2, SEED_CONFIG, *CURVE, dump, "--checkpoint.enable", "--checkpoint.interval=4")
    resumed, uninterrupted = losses(log), losses(runs["fp8"])
    assert f"Loading the checkpoint from {tmp_path / 'checkpoint' / f'step-{last}'}" in log
    assert sorted(resumed) == list(range(last + 1, CURVE_STEPS + 1))
    assert resumed == {s: uninterrupted[s] for s in resumed}


def _debug_model(converted: bool):
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_fp8_moe import Float8MoEWeight
    from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights

    spec = get_train_spec("llama4_grouped_shared")
    model = spec.model_cls(spec.model_args["debugmodel"])
    if converted:
        for _, module in expert_modules(model):
            swap_expert_weights(module, emulate=True)
        assert any(isinstance(p, Float8MoEWeight) for p in model.parameters())
    return model


@pytest.mark.parametrize("run", ["fp8", "bf16"])
def test_checkpoints_hold_plain_tensors_and_load_either_way(runs, run):
    """A float8_moe checkpoint loads into a model without the converter, and a bf16 checkpoint
    into a converted one, with identical values; the expert weights are stored as plain
    float32 tensors."""
    path = runs["tmp"] / run / "checkpoint" / f"step-{CURVE_STEPS}"
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name in ("layers.1.moe.shared_expert.w1", "layers.1.moe.experts.w2"):
        assert type(metadata[name]).__name__ == "TensorStorageMetadata"
        assert metadata[name].properties.dtype == torch.float32
    plain, converted = _debug_model(converted=False), _debug_model(converted=True)
    plain_sd, converted_sd = plain.state_dict(), converted.state_dict()
    dcp.load(plain_sd, checkpoint_id=str(path))
    dcp.load(converted_sd, checkpoint_id=str(path))
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, converted.state_dict()[name]), name
    shared = converted.layers["1"].moe.shared_expert.w1
    assert type(shared).__name__ == "Float8MoEWeight"
    assert torch.equal(shared._data, plain.layers["1"].moe.shared_expert.w1)
    assert not torch.equal(shared._data, torch.zeros_like(shared._data))


def test_default_config_trains_stock_llama4_eager_and_compiled():
    """The README's main job: run_train.sh with its default config (stock llama4, FeedForward
    shared experts), converted routed and shared experts, on the bundled tokenizer and corpus;
    and the same with torch.compile (torchtitan compiles each block with fullgraph=True).
    Compiled vs eager: within 0.005 (inductor reorders the attention and norm math; measured
    5e-4 on CPU)."""
    log = run_train(2, "train_configs/llama4_debug.toml", "--training.steps=3")
    curve = losses(log)
    assert sorted(curve) == [1, 2, 3] and curve[3] < curve[1]
    assert "converted 18 expert weights of 6 modules" in log
    assert re.search(r"layers\.1\.moe\.shared_experts\.w1\.weight +\[512, 256\] +2 ", log)
    compiled_log = run_train(
        2, "train_configs/llama4_debug.toml", "--training.steps=3", "--compile.enable"
    )
    assert "Compiling each TransformerBlock with torch.compile" in compiled_log
    compiled = losses(compiled_log)
    assert sorted(compiled) == [1, 2, 3]
    assert max(abs(compiled[s] - curve[s]) for s in curve) < 0.005, (curve, compiled)


COMPOSITIONS = {
    "ac_none": ["--activation_checkpoint.mode=none"],
    "ac_full": ["--activation_checkpoint.mode=full"],
    "ac_selective_layer": [
        "--activation_checkpoint.mode=selective",
        "--activation_checkpoint.selective_ac_option=2",
    ],
    "reshard_always": ["--parallelism.fsdp_reshard_after_forward=always"],
    "reshard_never": ["--parallelism.fsdp_reshard_after_forward=never"],
    "fp8_weight_cache": ["--float8_moe.cache_fp8_weights"],
    "fp8_weight_cache_ac_full": [
        "--float8_moe.cache_fp8_weights",
        "--activation_checkpoint.mode=full",
    ],
}


@pytest.fixture(scope="module")
def default_losses():
    """The default config (selective op AC, default resharding), 2 ranks, 2 steps."""
    return losses(run_train(2, "train_configs/llama4_debug.toml", "--training.steps=2"))


@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_composition_trains_with_the_same_losses(default_losses, composition):
    """Activation checkpointing and FSDP resharding change what is recomputed and when weights
    are all-gathered, not the math: the losses equal the default run's."""
    log = run_train(
        2, "train_configs/llama4_debug.toml", "--training.steps=2", *COMPOSITIONS[composition]
    )
    curve = losses(log)
    assert sorted(curve) == [1, 2]
    assert max(abs(curve[s] - default_losses[s]) for s in curve) < 1e-4, (curve, default_losses)


def test_hsdp_replicate_x_shard():
    """HSDP, 2 replicas x 2 shards on 4 ranks: FSDP shards the experts over the shard dim only
    (the plan says degree 2: the [1, ...] shared expert pads 1 of 2 ranks), and it trains.
    (Its losses are not comparable with 4-way FSDP: torchtitan initializes the weights through
    a different mesh.)"""
    log = run_train(
        4,
        SEED_CONFIG,
        "--training.steps=3",
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
    )
    curve = losses(log)
    assert sorted(curve) == [1, 2, 3] and curve[3] < curve[1]
    assert re.search(r"layers\.1\.moe\.shared_expert\.w1 +\[1, 512, 256\] +2 +0 +1 +1 ", log)


def test_pipeline_parallel_with_fsdp_tracks_bf16(tmp_path):
    """PP=2 x FSDP=2 on 4 ranks (1F1B, 2 micro-batches): the converter plans FSDP degree 2 for
    each stage's experts and the losses, logged by the last stage, stay within fp8 rounding of
    the same run in bf16 (gap seen with PP 2 alone on 2 ranks: 0.0008)."""
    pp = ["--training.steps=2", "--parallelism.pipeline_parallel_degree=2"]
    fp8_log = run_train(4, "train_configs/llama4_debug.toml", *pp, log_rank=3)
    bf16_log = run_train(
        4, bf16_config(tmp_path, "train_configs/llama4_debug.toml"), *pp, log_rank=3
    )
    assert "pipeline schedule 1F1B with 2 microbatches and 2 stages" in fp8_log
    assert re.search(r"layers\.\d+\.moe\.experts\.w1 +\[8, 512, 256\] +2 +0 +4 ", fp8_log)
    fp8, bf16 = losses(fp8_log), losses(bf16_log)
    assert sorted(fp8) == sorted(bf16) == [1, 2]
    assert max(abs(fp8[s] - bf16[s]) for s in fp8) < 0.01, (fp8, bf16)
