"""Which modules hold expert weights, and swapping their weights for `Float8MoEWeight`."""

import torch.nn as nn
from torch.distributed.tensor import DTensor

from .weight import Float8MoEWeight

_PROJECTIONS = ("w1", "w2", "w3")


def is_grouped_experts(module: nn.Module) -> bool:
    """A grouped-experts module: 3D parameters w1/w2/w3 (``[E, H, D]``, ``[E, D, H]``, ``[E, H, D]``)."""
    return all(
        isinstance(getattr(module, name, None), nn.Parameter)
        and getattr(module, name).ndim == 3
        for name in _PROJECTIONS
    )


def is_feed_forward(module: nn.Module) -> bool:
    """A SwiGLU feed-forward: ``nn.Linear`` children w1/w2/w3."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in _PROJECTIONS)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every grouped-experts or feed-forward module in ``model``."""
    return [
        (fqn, module)
        for fqn, module in model.named_modules()
        if is_grouped_experts(module) or is_feed_forward(module)
    ]


def swap_expert_weights(
    module: nn.Module, emulate: bool, cache_fp8: bool = False
) -> list[tuple[str, nn.Parameter]]:
    """Wrap the w1/w2/w3 weights of an expert module in place; returns (name, new parameter)
    with names relative to ``module`` (``w1`` for grouped experts, ``w1.weight`` for linears)."""
    if is_grouped_experts(module):
        owners = [(name, module, name) for name in _PROJECTIONS]
    elif is_feed_forward(module):
        owners = [(f"{name}.weight", getattr(module, name), "weight") for name in _PROJECTIONS]
        for name, linear, _ in owners:
            if type(linear) is not nn.Linear:
                raise ValueError(
                    f"float8_moe: {name} of {type(module).__name__} is already a "
                    f"{type(linear).__name__} (converted by another converter); exclude this "
                    "module from one of the two converters"
                )
    else:
        raise TypeError(f"float8_moe: {type(module).__name__} is not an expert module")
    swapped = []
    for name, owner, attr in owners:
        param = getattr(owner, attr)
        if isinstance(param, Float8MoEWeight):
            raise ValueError(f"float8_moe: {name} of {type(module).__name__} is already converted")
        new_param = nn.Parameter(
            Float8MoEWeight(param.data, emulate, cache_fp8), requires_grad=param.requires_grad
        )
        setattr(owner, attr, new_param)
        swapped.append((name, new_param))
    module.register_state_dict_post_hook(_plain_state_dict)
    module.register_load_state_dict_post_hook(_invalidate_fp8_caches)
    return swapped


def _plain(tensor):
    if isinstance(tensor, DTensor) and isinstance(_local(tensor), Float8MoEWeight):
        return DTensor.from_local(
            tensor.to_local()._data,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return tensor._data if isinstance(tensor, Float8MoEWeight) else tensor


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _invalidate_fp8_caches(module, incompatible_keys) -> None:
    """A checkpoint was loaded into ``module``: its weights' fp8 copies are stale. (The load's
    in-place copies already invalidate them; this also covers writes that bypass the weights.)"""
    for param in module.parameters():
        weight = _local(param)
        if isinstance(weight, Float8MoEWeight) and weight._cache is not None:
            weight._cache.invalidate()


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State dicts hold plain tensors that share storage with the weights, so checkpoints load
    without this package and in-place loads (DCP) still land in the weights."""
    for key, value in state_dict.items():
        if key.startswith(prefix):
            state_dict[key] = _plain(value)
