"""The shard plan we log: how tensor, expert and FSDP2 parallelism split each expert weight, and
the uneven-shard padding that costs. How FSDP2 splits and pads a shard is ``weight/fsdp.py``'s,
the same functions the weight's all-gather hooks use, so the plan cannot disagree with them.
"""

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .fp8 import gathered
from .fp8.recipes import Recipe
from .weight.fsdp import rows_per_rank

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


@dataclass(frozen=True)
class ShardPlanRow:
    fqn: str
    shape: tuple[int, ...]  # the shape FSDP shards: after tensor and expert parallelism
    fsdp_degree: int
    shard_dim: int
    rows_per_rank: int
    padding_only_ranks: int
    padding_bytes: int  # zero rows all-gathered per step, over all ranks
    path: str  # which fp8 implementation runs this weight's matmuls, or why bf16 (policy.py)
    model_parallel: str = "-"  # the TP / EP mesh dims splitting the weight, and on which dims
    local_shape: tuple[int, ...] = ()  # what each rank multiplies (FSDP gathers the rest)
    # with fp8_all_gather, what FSDP all-gathers: "fp8" payloads, or the dtype and why
    all_gather: str = "-"
    fp8: bool = True  # False: the auto policy keeps the weight bf16 (policy.py)
    # why fp8 cannot multiply this weight's shards (a TP split into unequal shares), if planned
    # with ``even_tp=False``; torchtitan runs such a split in bf16
    uneven_tp: str = ""
    tp_dim: int | None = None  # the dim tensor parallelism splits, if it does
    timed_on: str = ""  # the GPU the policy timed this weight on (measure.py), if it did


def plan_weight(
    fqn: str,
    shape: tuple[int, ...],
    fsdp_degree: int,
    shard_dim: int,
    all_gather_itemsize: int,
    path: str,
    model_parallel: str = "-",
) -> ShardPlanRow:
    dim_size = shape[shard_dim]
    if shard_dim != 0 and dim_size % fsdp_degree != 0:
        raise ValueError(
            f"{fqn}: FSDP shards shape {list(shape)} on dim {shard_dim}, which must split "
            f"evenly over {fsdp_degree} ranks (FSDP2 shards dims other than 0 only evenly: "
            f'"FSDP does not support uneven sharding on dim {shard_dim}"); change the FSDP or '
            "expert-parallel degree"
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
        model_parallel=model_parallel,
        local_shape=tuple(shape),
    )


def with_all_gather(
    row: ShardPlanRow, dtype: torch.dtype | None, fp8_all_gather: bool, recipe: Recipe
) -> ShardPlanRow:
    """``row`` with what FSDP all-gathers for the weight with ``fp8_all_gather``: its fp8
    payloads (laid out by ``recipe``) where the shard can quantize them, else its ``dtype``
    values and why (None: no FSDP, nothing gathered), and the padding bytes of that."""
    if dtype is None or not fp8_all_gather:
        return row
    name = str(dtype).removeprefix("torch.")
    reason = recipe.rules.all_gather_fallback(row.shape, row.shard_dim, row.fsdp_degree)
    if reason is not None:
        return replace(row, all_gather=f"{name} ({reason})")
    padding_rows = row.rows_per_rank * row.fsdp_degree - row.shape[0]
    pad = gathered.uneven(row.shape[0], row.fsdp_degree)
    row_bytes = gathered.row_bytes(row.shape[1:], pad, recipe)
    return replace(row, all_gather="fp8", padding_bytes=padding_rows * row_bytes)


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
        "TP/EP",
        "local shape",
        "all-gather",
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
            r.model_parallel,
            str(list(r.local_shape)),
            r.all_gather,
        )
        for r in rows
    ]
    if all(r.all_gather == "-" for r in rows):  # fp8_all_gather off: the column says nothing
        cells = [row[:-1] for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# Which dim tensor parallelism splits, per kind of expert weight and projection (torchtitan 0.2.2's
# plans: TensorParallel / ExpertTensorParallel for grouped [E, out, in] weights, Colwise / Rowwise
# for linears [out, in]). Up projections (w1, w3, mlp1) are split on their output dim, down
# projections (w2, mlp2) on their input dim.
_TP_DIM = {("grouped", "up"): 1, ("grouped", "down"): 2, ("linear", "up"): 0, ("linear", "down"): 1}


def projection(fqn: str) -> str:
    """ "down" for a down projection (``w2``, ``mlp2_weight``; torchtitan 0.3's ``w2_EDF``,
    ``mlp2_weight_EDF``), else "up"."""
    name = fqn.split(".")[-1] if not fqn.endswith(".weight") else fqn.split(".")[-2]
    return "down" if name.split("_")[0] in ("w2", "mlp2") else "up"


def expert_fsdp_degree(dims: "ParallelDims") -> int:
    """torchtitan's efsdp: the FSDP degree of routed experts, dp_shard x cp x tp / (ep x etp).

    Its device mesh takes the ep x etp ranks of expert parallelism from dp_shard x cp x tp
    (never from dp_replicate or pp), so they must divide it: otherwise the launch's mesh fails
    at start-up (torch's unflatten: "The product of mesh_sizes=... is ...")."""
    borrowed = dims.dp_shard * dims.cp * dims.tp
    expert_ranks = dims.ep * dims.etp
    if borrowed % expert_ranks:
        mesh_sizes = (dims.pp, dims.dp_replicate, borrowed // expert_ranks, dims.ep, dims.etp)
        raise ValueError(
            f"parallelism.expert_parallel_degree = {dims.ep} x expert_tensor_parallel_degree "
            f"= {dims.etp} must divide the {borrowed} ranks expert parallelism is built from "
            f"(data_parallel_shard_degree {dims.dp_shard} x context_parallel_degree {dims.cp} "
            f"x tensor_parallel_degree {dims.tp}); torchtitan's device mesh fails at start-up: "
            f'"The product of mesh_sizes={mesh_sizes} is {math.prod(mesh_sizes)}, but the '
            f'original dimension at dim=0 has size {dims.world_size}". Set '
            f"expert_parallel_degree x expert_tensor_parallel_degree to a divisor of {borrowed}"
        )
    return borrowed // expert_ranks


def check_expert_split(fqn: str, num_experts: int, dims: "ParallelDims") -> None:
    """Expert parallelism needs the same number of routed experts on every EP rank: torchtitan
    splits them with torch.chunk, and its token all-to-all splits the per-expert counts evenly
    over the EP ranks."""
    if not dims.ep_enabled or num_experts % dims.ep == 0:
        return
    per_rank = [len(c) for c in torch.arange(num_experts).chunk(dims.ep)]
    per_rank += [0] * (dims.ep - len(per_rank))
    # Degrees that divide the experts and fit the mesh (which dp_shard x cp x tp / etp bounds).
    mesh_ranks = dims.dp_shard * dims.cp * dims.tp // dims.etp
    fitting = [d for d in range(1, num_experts + 1) if num_experts % d == 0 == mesh_ranks % d]
    raise ValueError(
        f"{fqn}: parallelism.expert_parallel_degree = {dims.ep} must divide its {num_experts} "
        f"routed experts, which EP would split {per_rank} over its ranks; the launch fails at "
        'start-up ("Shard(1) requires even sharding") or at step 1 ("Split sizes doesn\'t '
        f'match total dim 0 size"). Set expert_parallel_degree to one of {fitting}'
    )


def plan_expert_weight(
    fqn: str,
    shape: tuple[int, ...],
    dims: "ParallelDims",
    kind: str,
    itemsize: int,
    path: str,
    even_tp: bool = True,
) -> ShardPlanRow:
    """How torchtitan's Llama4 parallelization will split one expert weight: tensor and expert
    parallelism first, then FSDP over what each rank holds. ``kind``: "routed" (grouped experts
    with E > 1), "grouped" (a grouped [1, out, in] shared expert) or "linear". ``even_tp``:
    refuse a tensor-parallel split that leaves ranks unequal shares (what fp8 weights need;
    torchtitan splits a plain weight unevenly, and the row then holds the largest share).
    ``dims.routed_dim1_without_ep`` (torchtitan 0.3's dims view, ``torchtitan_v03/run.py``):
    FSDP shards routed experts on dim 1 whenever its degree exceeds the expert count, also
    without EP (0.2.2 does so under EP only)."""
    local = list(shape)
    splits = []
    uneven_tp = ""
    routed = kind == "routed"
    if routed and dims.ep_enabled:
        check_expert_split(fqn, shape[0], dims)
        local[0] //= dims.ep
        splits.append(f"ep {dims.ep} (dim 0)")
    # TP splits the routed experts unless it is borrowed for EP (ep > 1, etp = 1); it splits
    # every shared expert.
    tp_degree = dims.etp if routed and dims.ep_enabled else dims.tp
    tp_dim = None
    if tp_degree > 1:
        tp_dim = _TP_DIM[("linear" if kind == "linear" else "grouped", projection(fqn))]
        if local[tp_dim] % tp_degree:
            uneven_tp = (
                f"float8_moe: {fqn} of shape {list(shape)} splits dim {tp_dim} over tensor "
                f"parallelism of degree {tp_degree}, which must divide it evenly; change "
                "parallelism.tensor_parallel_degree"
            )
            if even_tp:
                raise ValueError(uneven_tp)
        local[tp_dim] = rows_per_rank(local[tp_dim], tp_degree)
        mesh = "etp" if routed and dims.ep_enabled else "tp"
        splits.append(f"{mesh} {tp_degree} (dim {tp_dim})")
    shard_dim = 0
    degree = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    if routed and dims.ep_enabled:
        # Routed experts under EP: FSDP over the rest (efsdp), on dim 1 when that leaves fewer
        # experts than FSDP ranks (torchtitan's rule).
        degree = expert_fsdp_degree(dims)
        if degree * dims.ep > shape[0]:
            shard_dim = 1
    elif routed and getattr(dims, "routed_dim1_without_ep", False):
        # 0.3 compares the whole data-parallel mesh FSDP is given (HSDP: replicate x shard).
        if degree * dims.dp_replicate > shape[0]:
            shard_dim = 1
    row = plan_weight(
        fqn, tuple(local), degree, shard_dim, itemsize, path, ", ".join(splits) or "-"
    )
    return replace(row, uneven_tp=uneven_tp, tp_dim=tp_dim)
