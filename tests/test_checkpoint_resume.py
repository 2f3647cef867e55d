"""Checkpoints at world sizes whose expert shards are uneven (CPU, gloo, emulated fp8): a run
resumed from its step-4 checkpoint trains steps 5-6 with exactly the losses of the run that was
never interrupted, and saves the same step-6 checkpoint. Before the fix, every checkpoint held
the initial values of the rows on ranks whose shard is partly padding (torchtitan takes its
checkpoint state dict once, and FSDP2 moved those shards at the first forward:
torchtitan_fp8_moe/fsdp_shard_buffer.py)."""

import pytest
import torch
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from trainer_runs import TWO_LAYERS, losses, needs, trainer_run

pytestmark = pytest.mark.slow  # trainer launches

CONFIG = "train_configs/llama4_debug.toml"
STEPS, INTERVAL, RESUME_STEP = 6, 2, 4
# (name, ranks, overrides). The 2-layer llama4 debug model has 8 routed experts: 3 ranks hold
# 3/3/2 of them, 5-7 ranks leave trailing ranks only padding; its dense and shared-expert 2D
# weights split unevenly too. EP 2 on 6 ranks shards 4 local experts over 3 FSDP ranks; TP 2 on
# 6 ranks leaves FSDP 3 ranks.
LAYOUTS = [
    ("w3", 3, ()),
    ("w5", 5, ()),
    ("w6", 6, ()),
    ("w7", 7, ()),
    (
        "w6_ep2",
        6,
        ("--parallelism.expert_parallel_degree=2", "--activation_checkpoint.mode=none"),
    ),
    ("w6_tp2", 6, ("--parallelism.tensor_parallel_degree=2",)),
]
CHECKPOINTING = ("--checkpoint.enable", f"--checkpoint.interval={INTERVAL}", TWO_LAYERS)
RUNS = {}
for name, ranks, overrides in LAYOUTS:
    straight = trainer_run(
        f"resume_{name}_straight",
        ranks,
        CONFIG,
        f"--training.steps={STEPS}",
        *CHECKPOINTING,
        *overrides,
    )
    resumed = trainer_run(
        f"resume_{name}_resumed",
        ranks,
        CONFIG,
        f"--training.steps={STEPS}",
        *CHECKPOINTING,
        *overrides,
        after=(straight,),
        copy=(
            f"{{out[{straight}]}}/checkpoint/step-{RESUME_STEP}",
            f"{{out}}/checkpoint/step-{RESUME_STEP}",
        ),
    )
    RUNS[name] = (straight, resumed)


def _saved_tensors(checkpoint, tmp_path) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights and optimizer states as whole plain tensors, by path."""
    whole = tmp_path / f"{checkpoint.parent.parent.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    saved = torch.load(whole, weights_only=False)
    saved.pop("dataloader")
    leaves, _ = pytree.tree_flatten_with_path(saved)
    return {pytree.keystr(path): v for path, v in leaves if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=needs(*RUNS[n])) for n, _, _ in LAYOUTS], ids=str
)
def test_resume_at_uneven_world_size_trains_as_if_never_stopped(trainer_log, tmp_path, layout):
    straight_name, resumed_name = RUNS[layout]
    straight, resumed = trainer_log(straight_name), trainer_log(resumed_name)
    checkpoint = resumed.out / "checkpoint" / f"step-{RESUME_STEP}"
    assert f"Loading the checkpoint from {checkpoint}" in resumed.text
    expected, actual = losses(straight.text), losses(resumed.text)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert sorted(actual) == list(range(RESUME_STEP + 1, STEPS + 1))
    assert actual == {s: expected[s] for s in actual}, (actual, expected)
    final = f"checkpoint/step-{STEPS}"
    before = _saved_tensors(straight.out / final, tmp_path)
    after = _saved_tensors(resumed.out / final, tmp_path)
    experts = [
        k for k in before if k.startswith(("['layers.1.moe.experts", "['layers.1.moe.shared"))
    ]
    assert len(experts) == 6, experts  # routed and shared w1/w2/w3
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
