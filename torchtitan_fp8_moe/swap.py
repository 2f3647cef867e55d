"""Which modules hold expert weights, and swapping their weights for `Float8MoEWeight`.

Expert modules are recognised by what they hold, not by class name, so a user's own MoE module of
the same shape converts like torchtitan's:
- grouped experts: every floating-point ``nn.Parameter`` of 3 or more dims held directly by the
  module is 3D ``[E, out, in]``, with the same expert count E, and there are at least two of them
  (an up and a down projection). torchtitan's ``GroupedExperts`` (``w1/w2/w3``), GPT-OSS's
  ``GptOssGroupedExperts`` (``mlp1_weight/mlp2_weight``; its 2D biases stay plain) and the
  ``[1, out, in]`` grouped shared expert qualify; a ``Conv1d`` (one 3D weight) or a module with
  a 4D parameter does not. The module must use them through ``torch._grouped_mm``, ``bmm`` or
  2D matmuls of ``w[e]``: any other use of a converted weight raises (``weight/``);
- FeedForward-style experts: ``nn.Linear`` children ``w1/w2/w3`` (torchtitan's shared experts).
"""

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import fsdp_shard_buffer
from .fp8.kernels.gemm_backends import GemmChoice
from .tensor_parallel import Float8MoELinear
from .weight import Float8MoEWeight, WeightConfig

_PROJECTIONS = ("w1", "w2", "w3")
# SwiGLU's gate and up projections: both multiply the expert's input tokens.
_GATE_AND_UP = ("w1", "w3")


def grouped_weight_names(module: nn.Module) -> list[str]:
    """Names of the 3D floating-point parameters held directly by ``module``."""
    return [
        name
        for name, param in module.named_parameters(recurse=False)
        if param.ndim == 3 and param.is_floating_point()
    ]


def grouped_experts_mismatch(module: nn.Module) -> str | None:
    """Why ``module`` is not a grouped-experts module (None when it is one)."""
    params = dict(module.named_parameters(recurse=False))
    if not params:
        return "holds no parameters of its own"
    higher = [f"{name} ({p.ndim}D)" for name, p in params.items() if p.ndim > 3]
    if higher:
        return f"has parameters of more than 3 dims: {', '.join(higher)}"
    integer = [name for name, p in params.items() if p.ndim == 3 and not p.is_floating_point()]
    if integer:
        return f"has non-floating-point 3D parameters: {', '.join(integer)}"
    names = grouped_weight_names(module)
    if not names:
        dims = ", ".join(f"{name} {p.ndim}D" for name, p in params.items())
        return f"no 3D [E, out, in] parameters ({dims})"
    if len(names) < 2:
        return f"one 3D parameter ({names[0]}); grouped experts have at least two [E, out, in]"
    expert_counts = {name: params[name].shape[0] for name in names}
    if len(set(expert_counts.values())) > 1:
        counts = ", ".join(f"{name} E={count}" for name, count in expert_counts.items())
        return f"3D parameters with different expert counts ({counts})"
    return None


def is_grouped_experts(module: nn.Module) -> bool:
    """Grouped experts: two or more 3D ``[E, out, in]`` weights with one E (module docstring)."""
    return grouped_experts_mismatch(module) is None


def is_feed_forward(module: nn.Module) -> bool:
    """A SwiGLU feed-forward: ``nn.Linear`` children w1/w2/w3."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in _PROJECTIONS)


def is_expert_module(module: nn.Module) -> bool:
    return is_grouped_experts(module) or is_feed_forward(module)


def num_experts(module: nn.Module) -> int:
    """E of a grouped-experts module; 1 for a feed-forward (one expert of linears)."""
    if is_grouped_experts(module):
        return getattr(module, grouped_weight_names(module)[0]).shape[0]
    return 1


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every grouped-experts or feed-forward module in ``model``."""
    return [(fqn, module) for fqn, module in model.named_modules() if is_expert_module(module)]


def dense_feed_forwards(model: nn.Module) -> list[str]:
    """FQNs of the feed-forwards that are no MoE experts: a shared expert sits beside grouped
    experts (torchtitan's MoE holds ``experts`` and ``shared_experts``; 0.3's holds them one
    level down, ``routed_experts.inner_experts``), per-expert feed-forwards sit in a list of
    several; a transformer block's ``feed_forward`` does neither."""
    modules = dict(model.named_modules())
    dense = []
    for fqn, module in modules.items():
        if not is_feed_forward(module) or is_grouped_experts(module):
            continue
        parent = modules[fqn.rpartition(".")[0]] if fqn else None
        siblings = list(parent.children()) if parent is not None else []
        beside_grouped = any(
            is_grouped_experts(m) or any(map(is_grouped_experts, m.children())) for m in siblings
        )
        one_of_several = sum(is_feed_forward(m) for m in siblings) > 1 and isinstance(
            parent, nn.ModuleList | nn.ModuleDict
        )
        if not (beside_grouped or one_of_several):
            dense.append(fqn)
    return dense


def describe_non_experts(model: nn.Module, max_fqns: int = 3) -> list[str]:
    """One line per (class, reason) for the modules holding parameters that are not expert
    modules: ``Linear x12 (layers.0.attention.wq, ...): no 3D [E, out, in] parameters (...)``,
    and the dense feed-forwards (``dense_feed_forwards``). Modules holding none (containers)
    are left out; the linears of a feed-forward too."""
    dense = set(dense_feed_forwards(model))
    feed_forward_linears = {
        id(getattr(module, name))
        for _, module in expert_modules(model)
        if is_feed_forward(module)
        for name in _PROJECTIONS
    }
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for fqn, module in model.named_modules():
        if fqn in dense:
            reason = "a dense feed-forward, no expert module (no grouped experts beside it)"
        elif is_expert_module(module) or id(module) in feed_forward_linears:
            continue
        elif not any(True for _ in module.parameters(recurse=False)):
            continue
        else:
            reason = grouped_experts_mismatch(module)
        groups[(type(module).__name__, reason)].append(fqn or "<root>")
    return [
        f"{cls} x{len(fqns)} ({compact_fqns(fqns, max_fqns)}): {reason}"
        for (cls, reason), fqns in groups.items()
    ]


def compact_fqns(fqns: list[str], max_fqns: int = 3) -> str:
    """At most ``max_fqns`` FQNs and the last one, for messages about many layers."""
    if len(fqns) <= max_fqns + 1:
        return ", ".join(fqns)
    return f"{', '.join(fqns[:max_fqns])}, ... {fqns[-1]} ({len(fqns) - max_fqns - 1} more)"


def expert_weight_names(module: nn.Module) -> list[str]:
    """The names ``swap_expert_weights`` gives ``module``'s expert weights, relative to it: its
    3D parameters for grouped experts (``w1``, ``mlp1_weight``), ``w1.weight`` for linears."""
    if is_grouped_experts(module):
        return grouped_weight_names(module)
    if is_feed_forward(module):
        return [f"{name}.weight" for name in _PROJECTIONS]
    raise TypeError(
        f"float8_moe: {type(module).__name__} is not an expert module: it is no "
        f"feed-forward (nn.Linear w1/w2/w3) and no grouped experts "
        f"({grouped_experts_mismatch(module)})"
    )


def same_input_weights(names: list[str]) -> set[str]:
    """Those of an expert module's weight ``names`` that multiply the same tokens side by side:
    its gate and up projections (``w1``, ``w3`` or ``w1.weight``, ``w3.weight``) where it has
    both; else none."""
    gate_and_up = {name for name in names if name.split(".")[0] in _GATE_AND_UP}
    return gate_and_up if len(gate_and_up) == len(_GATE_AND_UP) else set()


def swap_expert_weights(
    module: nn.Module,
    config: WeightConfig,
    names: set[str] | None = None,
    gemms: Mapping[str, GemmChoice] | None = None,
) -> list[tuple[str, nn.Parameter]]:
    """Wrap the expert weights of an expert module in place (other parameters such as biases
    stay plain), each carrying ``config``, with ``shares_input`` (if ``config`` has it) only
    where both the gate and the up projection are converted (``same_input_weights``, by name:
    w1 and w3); returns (name, new parameter) with ``expert_weight_names``' names. ``names``:
    only these of them. ``gemms``: the GEMM backends of each name, where not ``config``'s."""
    owners = []  # (name, the module holding the parameter, its attribute there)
    for name in expert_weight_names(module):
        prefix, _, attr = name.rpartition(".")
        owners.append((name, module.get_submodule(prefix), attr))
    if is_feed_forward(module):
        for name, linear, _ in owners:
            # A subclass computing the nn.Linear forward is plain (torchtitan 0.3's Linear);
            # one with its own forward was converted by another converter.
            if type(linear).forward is not nn.Linear.forward:
                raise ValueError(
                    f"float8_moe: {name} of {type(module).__name__} is already a "
                    f"{type(linear).__name__} (converted by another converter); exclude this "
                    "module from one of the two converters"
                )
    if names is not None:
        owners = [owner for owner in owners if owner[0] in names]
    partners = same_input_weights([name for name, _, _ in owners])  # both converted
    if owners:
        # Uneven FSDP2 shards of converted weights keep their storage (state dicts stay live).
        fsdp_shard_buffer.install()
    swapped = []
    for name, owner, attr in owners:
        param = getattr(owner, attr)
        if isinstance(param, Float8MoEWeight):
            raise ValueError(f"float8_moe: {name} of {type(module).__name__} is already converted")
        shares_input = config.shares_input and name in partners
        gemm = (gemms or {}).get(name, config.gemm)
        new_param = nn.Parameter(
            Float8MoEWeight(param.data, replace(config, shares_input=shares_input, gemm=gemm)),
            requires_grad=param.requires_grad,
        )
        setattr(owner, attr, new_param)
        swapped.append((name, new_param))
    if is_feed_forward(module):
        # Float8MoELinear multiplies in fp8 under tensor parallelism too (tensor_parallel.py).
        for name, linear, _ in owners:
            setattr(module, name.removesuffix(".weight"), Float8MoELinear.from_linear(linear))
    module.register_state_dict_post_hook(_plain_state_dict)
    module.register_load_state_dict_post_hook(_invalidate_fp8_caches)
    return swapped


def local_tensor(tensor):
    """``tensor``'s local part if it is a DTensor, else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _plain(param):
    """The plain tensor holding a converted parameter's values: the data of the parameter's own
    (local) weight tensor, not of a view made for the state dict, so a write into it (a DCP
    load) is seen by the weight's fp8 cache, which watches that tensor's version."""
    if isinstance(param, DTensor) and isinstance(param._local_tensor, Float8MoEWeight):
        return DTensor.from_local(
            param._local_tensor._data,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return param._data if isinstance(param, Float8MoEWeight) else param


def _invalidate_fp8_caches(module, incompatible_keys) -> None:
    """A checkpoint was loaded into ``module``: its weights' fp8 copies are stale. (The load's
    in-place copies already invalidate them; this also covers writes that bypass the weights.)"""
    for param in module.parameters():
        weight = local_tensor(param)
        if isinstance(weight, Float8MoEWeight) and weight._cache is not None:
            weight._cache.invalidate()


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State dicts hold plain tensors that share storage with the weights, so checkpoints load
    without this package and in-place loads (DCP) still land in the weights."""
    for name, param in module.named_parameters():
        key = prefix + name
        if key in state_dict and isinstance(local_tensor(param), Float8MoEWeight):
            state_dict[key] = _plain(param)
