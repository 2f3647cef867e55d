"""The seed's failure with torchao's own wrapper (tests/test_torchao_seed_bug.py)."""

import datetime

import torch.distributed as dist
from expert_modules import build_expert_module, expert_inputs
from torch.distributed.fsdp import fully_shard

SEED_BUG_TIMEOUT_S = 10


def suite_torchao_seed(mesh) -> dict:
    """The seed's failure: torchao 0.18's own wrapper on a [1, H, D] weight, unevenly sharded.
    Rank 0 holds the whole weight and waits in the all-gather for the other ranks, which fail:
    a short timeout ends that wait (the suite runs last in its launch)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=SEED_BUG_TIMEOUT_S), None)
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.conversion_utils import _swap_params

    module = build_expert_module("grouped_shared", 1)
    _swap_params(module, config=Float8TrainingOpConfig())
    fully_shard(module, mesh=mesh)
    x, routing, _ = expert_inputs("grouped_shared", 1, 0)
    module(x, *routing).sum().backward()
    return {"trained": True}
