"""What an op does to a converted weight: its kind, decided from the op's schema and tags, so a
new op falls on the safe side, and ``OpTable``, each weight type's handler per kind
(``tensor_ops.py`` says what each kind does to ``Float8MoEWeight``)."""

import functools
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten


class Kind(Enum):
    MATMUL = "matmul"  # a contraction reached below __torch_function__: refuse
    METADATA_MUTATION = "metadata mutation"  # in-place view ops: the wrapper cannot follow
    MUTATION = "mutation"
    VIEW = "view"
    COPY = "copy"
    NEW_WEIGHT = "new weight"  # storage that becomes a weight (FSDP shards, to_empty)
    UNRELATED_VALUES = "unrelated values"  # takes only the shape: optimizer states
    DERIVED = "derived"  # pointwise math, collectives: a new weight computed from this one
    OTHER = "other"


# Contractions that must never see the wrapper at dispatch level: reaching them means a call form
# bypassed __torch_function__. (Any other op with a floating-point result raises too; this set
# only gives the clearer message.)
_MATMULS = {
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.addbmm,
    aten.baddbmm,
    aten._grouped_mm,
    aten.mv,
    aten.addmv,
    aten.dot,
    aten.vdot,
    aten._scaled_mm,
    aten._scaled_grouped_mm,
    aten.convolution,
    aten._convolution,
}
# Storage that FSDP2 (new_zeros: the padded shard) and Module.to_empty (empty_like) turn into the
# weight itself.
_NEW_WEIGHT_OPS = {aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros}
# Values that do not come from the weight's: optimizer states (zeros_like, full_like) stay plain.
_UNRELATED_VALUE_OPS = {
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.new_ones,
    aten.new_full,
    aten.rand_like,
    aten.randn_like,
    aten.randint_like,
}
# Not views by schema, but alias their input's storage.
_ALIASING_OPS = {aten._unsafe_view}
# The weight's values with zeros around them: DTensor pads an uneven shard (an empty one on a
# rank that holds only FSDP padding) before its collectives, as in full_tensor().
_PADDING_OPS = {aten.constant_pad_nd}
_COPY_OPS = {aten._to_copy, aten.clone, aten._pin_memory}


@functools.cache  # a pure function of the op: read its schema and tags once per process
def dispatch_kind(func) -> Kind:
    packet = func.overloadpacket
    if packet in _MATMULS:
        return Kind.MATMUL
    tags = func.tags
    if torch.Tag.inplace_view in tags and packet is not aten.detach_:
        return Kind.METADATA_MUTATION
    if func._schema.is_mutable:
        return Kind.MUTATION
    if (
        func.is_view
        or packet in _ALIASING_OPS
        or any(r.alias_info is not None for r in func._schema.returns)
    ):
        return Kind.VIEW
    if packet in _COPY_OPS or torch.Tag.view_copy in tags:
        return Kind.COPY
    if packet in _NEW_WEIGHT_OPS:
        return Kind.NEW_WEIGHT
    if packet in _UNRELATED_VALUE_OPS:
        return Kind.UNRELATED_VALUES
    if (
        torch.Tag.pointwise in tags
        or packet.__name__.startswith("_foreach_")
        or func.namespace == "_c10d_functional"  # DTensor's full_tensor, redistribute
        or packet in _PADDING_OPS
    ):
        return Kind.DERIVED
    return Kind.OTHER


def written_arguments(func, args, kwargs) -> list[Any]:
    """The arguments an op writes into, from its schema's alias annotations (``Tensor(a!)``)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            written.append(kwargs[argument.name])
        elif index < len(args) and not argument.kwarg_only:
            written.append(args[index])
    return pytree.tree_leaves(written)


def could_feed_a_matmul(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0


def wrap_floats(out: Any, wrap: Callable, min_dim: int = 0) -> Any:
    """``wrap`` every floating-point tensor of ``out`` with at least ``min_dim`` dims."""
    return pytree.tree_map_only(
        torch.Tensor,
        lambda t: wrap(t) if t.is_floating_point() and t.dim() >= min_dim else t,
        out,
    )


# (func, args, kwargs, the table's weights among the arguments, in order) -> the op's result
Handler = Callable[[Any, tuple, dict, list], Any]


class OpTable:
    """What a weight type does with each ``Kind`` of op, at ``__torch_dispatch__``: a handler
    per kind, registered with ``implements``; a kind without one goes to ``fallback`` (the
    table of the type it refines), and without that raises."""

    def __init__(self, weight_type: type, fallback: "OpTable | None" = None):
        self.weight_type = weight_type  # the tensors handed to handlers as the op's weights
        self.fallback = fallback
        self._handlers: dict[Kind, Handler] = {}

    def implements(self, *kinds: Kind) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            for kind in kinds:
                self._handlers[kind] = handler
            return handler

        return register

    def handler(self, kind: Kind) -> Handler:
        handler = self._handlers.get(kind)
        if handler is not None:
            return handler
        if self.fallback is not None:
            return self.fallback.handler(kind)
        raise NotImplementedError(
            f"float8_moe: no handler for {kind.value} ops on {self.weight_type.__name__}"
        )

    def __call__(self, func, args: tuple, kwargs: dict) -> Any:
        weights = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, self.weight_type)]
        return self.handler(dispatch_kind(func))(func, args, kwargs, weights)
