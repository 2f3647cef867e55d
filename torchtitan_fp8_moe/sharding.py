"""Uneven-shard padding: how FSDP2 splits a weight over its ranks, and the plan we log for it.

FSDP2 splits dim 0 with ``torch.chunk``: every rank gets ``ceil(dim0 / world)`` rows except the
last ones, which get fewer or none, and all-gathers buffers of the full ``ceil(dim0 / world)``
rows. A weight's all-gather input therefore has to be padded with zero rows to that size. Sharding
on a dim other than 0 (what torchtitan does for experts when FSDP x EP exceeds the expert count)
must be even, so it needs no padding. Both the converter's plan and the weight tensor's all-gather
use these functions, so they cannot disagree.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


def rows_per_rank(dim_size: int, world_size: int) -> int:
    """Rows every rank's all-gather input holds along the sharded dim (FSDP2's chunk size)."""
    return math.ceil(dim_size / world_size)


def padded_shard_shape(
    logical_shape: torch.Size, local_shape: torch.Size, world_size: int
) -> torch.Size:
    """The all-gather input shape of a local shard: dim 0 padded to ``rows_per_rank``.

    A local shard whose trailing dims differ from the logical ones is sharded on one of those
    dims, evenly, and is returned unchanged.
    """
    if tuple(local_shape[1:]) != tuple(logical_shape[1:]):
        return torch.Size(local_shape)
    return torch.Size((rows_per_rank(logical_shape[0], world_size), *logical_shape[1:]))


@dataclass(frozen=True)
class ShardPlanRow:
    fqn: str
    shape: tuple[int, ...]  # logical shape FSDP shards (after expert parallelism, if any)
    fsdp_degree: int
    shard_dim: int
    rows_per_rank: int
    padding_only_ranks: int
    padding_bytes: int  # zero rows all-gathered per step, over all ranks
    path: str  # which fp8 implementation runs this weight's matmuls


def plan_weight(
    fqn: str,
    shape: tuple[int, ...],
    fsdp_degree: int,
    shard_dim: int,
    all_gather_itemsize: int,
    path: str,
) -> ShardPlanRow:
    dim_size = shape[shard_dim]
    if shard_dim != 0 and dim_size % fsdp_degree != 0:
        raise ValueError(
            f"{fqn}: FSDP shards shape {list(shape)} on dim {shard_dim}, which must split "
            f"evenly over {fsdp_degree} ranks; change the FSDP or expert-parallel degree"
        )
    rows = rows_per_rank(dim_size, fsdp_degree)
    ranks_with_data = math.ceil(dim_size / rows)
    padding_rows = rows * fsdp_degree - dim_size
    row_numel = math.prod(shape) // dim_size
    return ShardPlanRow(
        fqn=fqn,
        shape=tuple(shape),
        fsdp_degree=fsdp_degree,
        shard_dim=shard_dim,
        rows_per_rank=rows,
        padding_only_ranks=fsdp_degree - ranks_with_data,
        padding_bytes=padding_rows * row_numel * all_gather_itemsize,
        path=path,
    )


def format_plan(rows: list[ShardPlanRow]) -> str:
    header = (
        "FQN",
        "logical shape",
        "FSDP degree",
        "shard dim",
        "rows/rank",
        "padding-only ranks",
        "padding bytes",
        "fp8 path",
    )
    cells = [header] + [
        (
            r.fqn,
            str(list(r.shape)),
            str(r.fsdp_degree),
            str(r.shard_dim),
            str(r.rows_per_rank),
            str(r.padding_only_ranks),
            str(r.padding_bytes),
            r.path,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plan_expert_weight(
    fqn: str,
    shape: tuple[int, ...],
    dims: "ParallelDims",
    is_routed: bool,
    itemsize: int,
    path: str,
) -> ShardPlanRow:
    """How torchtitan's Llama4 parallelization will FSDP-shard one expert weight."""
    shape = list(shape)
    shard_dim = 0
    degree = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    if is_routed and dims.ep_enabled:
        # Routed experts: EP splits the experts, FSDP shards them over the rest (efsdp), on
        # dim 1 when that leaves fewer experts than FSDP ranks (torchtitan's rule).
        degree = dims.dp_shard * dims.cp * dims.tp // (dims.etp * dims.ep)
        if degree * dims.ep > shape[0]:
            shard_dim = 1
        shape[0] //= dims.ep
    return plan_weight(fqn, tuple(shape), degree, shard_dim, itemsize, path)
