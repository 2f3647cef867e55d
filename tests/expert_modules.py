"""Small expert modules built from torchtitan's own MoE pieces, with inputs, for the tests."""

from dataclasses import replace

import torch
import torch.nn as nn
from torchtitan.models.moe.moe import (
    FeedForward,
    GroupedExperts,
    _run_experts_for_loop,
    _run_experts_grouped_mm,
)
from torchtitan.protocols.train_spec import get_train_spec

from torchtitan_fp8_moe.models.grouped_shared import GroupedSharedExpert
from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

DIM, HIDDEN, TOKENS = 32, 64, 48


def scout_meta_model(n_layers: int = 1) -> nn.Module:
    """torchtitan's Llama4 Scout (17bx16e) with ``n_layers`` layers, on the meta device: real
    per-GPU shapes to plan and convert without memory."""
    spec = get_train_spec("llama4")
    with torch.device("meta"):
        return spec.model_cls(replace(spec.model_args["17bx16e"], n_layers=n_layers))


# "tiny_routed": every dimension of the weight below the largest world size (8).
TINY_DIM, TINY_HIDDEN = 4, 6


class RoutedExperts(nn.Module):
    """torchtitan's GroupedExperts run through torchtitan's grouped-mm or for-loop expert code
    (the grouped path without the token-padding wrapper, whose index kernel is CUDA-only)."""

    def __init__(self, num_experts: int, grouped: bool, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=grouped)
        self.run = _run_experts_grouped_mm if grouped else _run_experts_for_loop

    def forward(self, x, tokens_per_expert):
        e = self.experts
        return self.run(e.w1, e.w2, e.w3, x, tokens_per_expert)


class SharedExpert(nn.Module):
    def __init__(self, grouped: bool):
        super().__init__()
        self.expert = GroupedSharedExpert(DIM, HIDDEN) if grouped else FeedForward(DIM, HIDDEN)

    def forward(self, x):
        return self.expert(x)


def build_expert_module(kind: str, dim0: int, seed: int = 0) -> nn.Module:
    """kind: routed | tiny_routed | for_loop (dim0 experts) | grouped_shared | linear_shared."""
    torch.manual_seed(seed)
    if kind == "tiny_routed":
        module = RoutedExperts(dim0, grouped=True, dim=TINY_DIM, hidden=TINY_HIDDEN)
    elif kind in ("routed", "for_loop"):
        module = RoutedExperts(dim0, grouped=kind == "routed")
    else:
        module = SharedExpert(grouped=kind == "grouped_shared")
    with torch.no_grad():  # as torchtitan's trainer initializes
        for _, expert in expert_modules(module):
            expert.init_weights(0.02)
    return module


def convert_to_float8_moe(
    module: nn.Module, cache_fp8: bool = False, recipe: str = "rowwise", lazy_cast: bool = True
) -> nn.Module:
    config = WeightConfig(recipe, emulate=True, cache_fp8=cache_fp8, lazy_cast=lazy_cast)
    for _, expert in expert_modules(module):
        swap_expert_weights(expert, config)
    return module


def emulated_and_cuda_path(forward, w: torch.Tensor, x: torch.Tensor, grad: torch.Tensor):
    """``[(out, x.grad, weight.grad) emulated, the same on the CUDA path]`` of ``forward(x,
    weight)`` with ``w`` converted, the output's gradient ``grad``."""
    results = []
    for emulate in (True, False):
        weight = nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(emulate=emulate)))
        xi = x.clone().requires_grad_()
        out = forward(xi, weight)
        out.backward(grad)
        results.append((out, xi.grad, weight.grad))
    return results


def tokens_per_expert(num_experts: int, tokens: int = TOKENS) -> torch.Tensor:
    """A fixed uneven split with an empty expert whenever there are 3 or more."""
    counts = [tokens // num_experts] * num_experts
    counts[-1] += tokens - sum(counts)
    if num_experts >= 3:
        counts[-1] += counts[1]
        counts[1] = 0
    return torch.tensor(counts, dtype=torch.int64)


def expert_inputs(kind: str, dim0: int, step: int):
    """(x, routing args, loss weights), the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    dim = TINY_DIM if kind == "tiny_routed" else DIM
    x = torch.randn(TOKENS, dim, generator=gen)
    target = torch.randn(TOKENS, dim, generator=gen)
    routing = (tokens_per_expert(dim0),) if kind in ("routed", "tiny_routed", "for_loop") else ()
    return x, routing, target


# (reshard_after_forward, param dtype, fp8 weight cache on the sharded module)
_COMBOS = [
    (True, "bfloat16", False),
    (False, "float32", True),
    (True, "float32", True),
    (False, "bfloat16", False),
]


def _case(kind, dim0, combo, recipe="rowwise", offload=False):
    reshard, dtype, cache_fp8 = combo
    return {
        "name": f"{kind}-dim0={dim0}-reshard={reshard}-{dtype}"
        + ("-cache" if cache_fp8 else "")
        + ("" if recipe == "rowwise" else f"-{recipe}")
        + ("-offload" if offload else ""),
        "recipe": recipe,
        "offload": offload,
        "kind": kind,
        "dim0": dim0,
        "reshard_after_forward": reshard,
        "param_dtype": dtype,
        "cache_fp8": cache_fp8,
    }


def fsdp_cases(world_size: int) -> list[dict]:
    """Every uneven kind at every world size: dim0 < world, dim0 % world != 0, and even."""
    cases = [_case("routed", d, _COMBOS[i % 4]) for i, d in enumerate([1, 2, 3, 5, 8, 16])]
    cases += [_case("grouped_shared", 1, combo) for combo in _COMBOS]
    cases += [_case("linear_shared", HIDDEN, combo) for combo in _COMBOS[:2]]
    cases += [_case("for_loop", 3, combo) for combo in _COMBOS[2:]]
    cases += [_case("tiny_routed", 2, _COMBOS[0])]  # world sizes above every weight dim
    # The blockwise recipe: an uneven expert split (5 over 2-4 ranks) and the 2D shared expert.
    cases += [_case("routed", 5, _COMBOS[1], "blockwise")]
    cases += [_case("linear_shared", HIDDEN, _COMBOS[0], "blockwise")]
    # FSDP2's CPU offload (torchtitan's --training.enable_cpu_offload): pinned host shards.
    cases += [_case("routed", 5, _COMBOS[0], offload=True)]
    cases += [_case("grouped_shared", 1, _COMBOS[1], offload=True)]
    cases += [_case("linear_shared", HIDDEN, _COMBOS[2], "blockwise", offload=True)]
    return cases


class _FsdpMesh:
    """What the all-gather hooks read of FSDP2's mesh: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def gathered_by_hand(
    weight: torch.Tensor, world: int, emulate: bool, recipe: str = "rowwise"
) -> torch.Tensor:
    """``weight [E, out, in]`` unsharded as FSDP2 does it with ``fp8_all_gather`` over ``world``
    dim-0 shards, the all-gather done by hand (FSDP2 concatenates each input along dim 0): the
    shards' pre-all-gather hooks, then the post-all-gather hook."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from torchtitan_fp8_moe.weight import Float8MoEWeight

    rows = -(-weight.shape[0] // world)
    shards = [
        Float8MoEWeight(
            weight[r * rows : (r + 1) * rows].clone(),
            WeightConfig(recipe, emulate=emulate, fp8_all_gather=True),
        )
        for r in range(world)
    ]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    inputs = [
        s.fsdp_pre_all_gather(_FsdpMesh(world), weight.shape, weight.stride(), None, policy)
        for s in shards
    ]
    assert inputs[0][0][0].dtype == torch.float8_e4m3fn
    outputs = tuple(torch.cat(parts) for parts in zip(*(i[0] for i in inputs), strict=True))
    unsharded, _ = shards[0].fsdp_post_all_gather(outputs, inputs[0][1], torch.bfloat16)
    return unsharded


def shared_token_cast_calls(code: str) -> tuple[int, int]:
    """How many calls inductor's ``code`` makes of the two casts of tokens that w1 and w3 share
    (``RowwiseTritonQuantizers.tokens``): the forward's row cast, the weight gradient's per-group
    cast."""
    ops = ("tokens_rowwise_fp8", "per_group_colwise_fp8_shared")
    return tuple(code.count(f"torchtitan_fp8_moe.{op}.default(") for op in ops)
