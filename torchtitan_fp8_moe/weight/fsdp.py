"""FSDP2's all-gather extension for ``Float8MoEWeight`` (its ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``), and how FSDP2 splits a weight over its ranks.

FSDP2 splits dim 0 with ``torch.chunk``: every rank gets ``ceil(dim0 / world)`` rows except the
last ones, which get fewer or none, and all-gathers buffers of the full ``ceil(dim0 / world)``
rows. A weight's all-gather input therefore has to be padded with zero rows to that size. Sharding
on a dim other than 0 (what torchtitan does for experts when FSDP x EP exceeds the expert count)
must be even, so it needs no padding. The converter's shard plan (``sharding.py``) uses the same
functions, so it cannot disagree with the hooks.

With ``fp8_all_gather`` the hooks gather fp8 payloads quantized on the shard instead of the
values (``fp8/gathered.py``), and the unsharded weight is a ``Float8GatheredWeight``
(``gathered.py``).
"""

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from ..fp8 import gathered
from .gathered import Float8GatheredWeight

if TYPE_CHECKING:
    from .tensor import Float8MoEWeight


def rows_per_rank(dim_size: int, world_size: int) -> int:
    """Rows every rank's all-gather input holds along the sharded dim (FSDP2's chunk size)."""
    return math.ceil(dim_size / world_size)


def sharded_dim(logical_shape: torch.Size, local_shape: torch.Size) -> int:
    """The dim FSDP split ``logical_shape`` on to give ``local_shape``: 0 unless a trailing dim
    differs (at world size 1, or for a shard as large as the weight, 0)."""
    for dim in range(1, len(logical_shape)):
        if local_shape[dim] != logical_shape[dim]:
            return dim
    return 0


def padded_shard_shape(
    logical_shape: torch.Size, local_shape: torch.Size, world_size: int
) -> torch.Size:
    """The all-gather input shape of a local shard: dim 0 padded to ``rows_per_rank``.

    A local shard sharded on a trailing dim is sharded evenly, and is returned unchanged.
    """
    if sharded_dim(logical_shape, local_shape) != 0:
        return torch.Size(local_shape)
    return torch.Size((rows_per_rank(logical_shape[0], world_size), *logical_shape[1:]))


def gathers_fp8(weight: "Float8MoEWeight", outer_size: torch.Size, world_size: int) -> bool:
    """Whether the shard ``weight`` all-gathers fp8 payloads (the rule the converter's plan
    logs)."""
    shard_dim = sharded_dim(outer_size, weight.shape)
    recipe = weight.config.fp8_recipe
    fallback = recipe.rules.all_gather_fallback(tuple(outer_size), shard_dim, world_size)
    return weight.config.fp8_all_gather and fallback is None


def pre_all_gather(weight: "Float8MoEWeight", mesh, outer_size, outer_stride, module, mp_policy):
    data = weight._data
    if mp_policy.param_dtype is not None:
        data = data.to(mp_policy.param_dtype)
    padded_shape = padded_shard_shape(outer_size, data.shape, mesh.size())
    if data.shape != padded_shape:
        padded = data.new_zeros(padded_shape)
        padded[: data.shape[0]].copy_(data)
        data = padded
    if gathers_fp8(weight, outer_size, mesh.size()):
        # The padding rows quantize too: zeros with finite scales, narrowed off afterwards.
        recipe, emulate = weight.fp8_path()
        payloads = gathered.quantize_shard(data, recipe, emulate, weight._cached_quantizer())
        return gathered.all_gather_inputs(
            payloads, tuple(outer_size), data.dtype, mesh.size(), recipe
        )
    return (data,), tuple(outer_size)


def post_all_gather(
    weight: "Float8MoEWeight",
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
):
    if isinstance(metadata, gathered.GatherLayout):
        return _post_fp8_all_gather(weight, all_gather_outputs, metadata, out)
    (all_gathered,) = all_gather_outputs
    logical_shape = metadata
    # Dim-0 sharding gathers world * rows_per_rank rows: narrow off the padding. Other shard
    # dims arrive in the logical layout, where the narrow is a no-op.
    data = all_gathered.view(-1, *logical_shape[1:]).narrow(0, 0, logical_shape[0])
    if out is not None:
        # Later steps: FSDP refills the same storage the unsharded weight already views.
        # (Under tensor parallelism the unsharded weight is a DTensor around the wrapper.)
        unsharded = out.to_local() if isinstance(out, DTensor) else out
        _check_views(unsharded._data, all_gathered, logical_shape)
        # The shard may be a new tensor since the last gather (a checkpoint load with
        # assign=True, to_empty): follow its cache.
        unsharded._cache = weight._cache
        return
    # FSDP2 calls both hooks on the local shard (``weight``). The unsharded weight holds the
    # shards' values, so it shares the shard's fp8 cache: a write into the shard (optimizer
    # step, checkpoint load) invalidates it, the all-gather's refills of the buffer do not.
    return weight._derived(data, weight._cache, watch=False), (all_gathered,)


def _post_fp8_all_gather(
    weight: "Float8MoEWeight",
    all_gather_outputs: tuple[torch.Tensor, ...],
    layout: gathered.GatherLayout,
    out: torch.Tensor | None,
):
    if out is not None:
        # Later gathers refill the buffers that the unsharded weight's payloads view.
        unsharded = out.to_local() if isinstance(out, DTensor) else out
        forward_data, input_grad_data, scales = all_gather_outputs
        _check_views(unsharded.forward_data, forward_data, layout.logical_shape)
        _check_views(unsharded.input_grad_data, input_grad_data, layout.logical_shape)
        _check_views(unsharded.forward_scales, scales, layout.logical_shape)
        return
    payloads = gathered.unpack(all_gather_outputs, layout)
    unsharded = Float8GatheredWeight(
        payloads,
        layout.logical_shape,
        _contiguous_strides(layout.logical_shape),
        layout.dtype,
        weight.config,
        transposed=False,
    )
    return unsharded, all_gather_outputs


def _check_views(view: torch.Tensor, output: torch.Tensor, logical_shape) -> None:
    if view.untyped_storage().data_ptr() != output.untyped_storage().data_ptr():
        raise AssertionError(
            f"float8_moe: unsharded weight {list(logical_shape)} does not view the all-gather "
            "output; FSDP's buffer reuse changed"
        )


def _contiguous_strides(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
