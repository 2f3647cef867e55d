"""What each kind of op (``ops.py``, from its schema and tags) does to a ``Float8MoEWeight``, so a
new op falls on the safe side:
- views and aliases (``func.is_view``, or a return that aliases an input: ``squeeze``, ``unbind``,
  ``expand``, ``t``, FSDP's chunks) stay wrapped and share the weight's fp8 cache;
- copies (``_to_copy``, ``clone``, ``*_copy`` ops) stay wrapped, with a cache of their own; the
  forward's cast of an fp32 parameter to bf16 (torchtitan's ``w.bfloat16()`` where no FSDP
  casts) is lazy (``lazy_cast.py``);
- pointwise ops (``w * 2``, an optimizer's ``grad + wd * w``), collectives and zero padding
  (DTensor's ``full_tensor()``) give a new wrapped weight, so what is computed from the weight is
  still multiplied in fp8 only;
- ops that write into an argument (in-place, ``out=``, ``copy_``, foreach) run on the plain data;
  a written weight drops its cached fp8 copies;
- results that cannot be a matmul operand (bool or integer tensors, 0-dim statistics such as
  ``w.norm()``, Python scalars) come out plain;
- everything else with a floating-point result (matmuls below ``__torch_function__``,
  convolutions, non-scalar reductions, ``cat``, ``index_select``, collectives) raises.
"""

from dataclasses import replace

import torch
import torch.utils._pytree as pytree

from .lazy_cast import lazy_cast, lazy_cast_dtype
from .ops import Kind, could_feed_a_matmul, wrap_floats, written_arguments
from .tensor import WEIGHT_OPS, Float8MoEWeight


def _on_values(func, args, kwargs):
    """``func`` run on the plain values of the weights among its arguments."""
    plain_args, plain_kwargs = pytree.tree_map_only(
        Float8MoEWeight, lambda t: t._values(), (args, kwargs)
    )
    return func(*plain_args, **plain_kwargs)


@WEIGHT_OPS.implements(Kind.MATMUL)
def _matmul(func, args, kwargs, weights):
    raise NotImplementedError(
        f"float8_moe: {func} on a converted weight of shape {list(weights[0].shape)} reached a "
        "matmul below the fp8 overrides and would run in high precision; this call form "
        "is not supported. Supported: torch._grouped_mm, F.linear, matmul/mm/bmm/@ with "
        "the weight as the right operand. Leave this module out of `float8_moe.fqns`."
    )


@WEIGHT_OPS.implements(Kind.METADATA_MUTATION)
def _metadata_mutation(func, args, kwargs, weights):
    raise NotImplementedError(
        f"float8_moe: {func} changes the shape or strides of a converted weight "
        f"{list(weights[0].shape)} in place, which it cannot follow; use the out-of-place op"
    )


@WEIGHT_OPS.implements(Kind.MUTATION)
def _write(func, args, kwargs, weights):
    out = _on_values(func, args, kwargs)
    # The written weights' fp8 copies are stale; hand back the wrappers themselves wherever the
    # op returns a written argument (in-place and out= ops return it).
    written = [w for w in written_arguments(func, args, kwargs) if isinstance(w, Float8MoEWeight)]
    for weight in written:
        if weight._cache is not None:
            weight._cache.invalidate()
    originals = {id(w._data): w for w in written}
    return pytree.tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), out)


@WEIGHT_OPS.implements(Kind.VIEW)
def _view(func, args, kwargs, weights):
    return wrap_floats(_on_values(func, args, kwargs), weights[0]._view)


@WEIGHT_OPS.implements(Kind.COPY)
def _copy(func, args, kwargs, weights):
    source = weights[0]
    dtype = lazy_cast_dtype(func, args, kwargs)
    if dtype is not None:
        return lazy_cast(source, dtype)
    return wrap_floats(_on_values(func, args, kwargs), source._copy)


@WEIGHT_OPS.implements(Kind.NEW_WEIGHT)
def _new_weight(func, args, kwargs, weights):
    config = weights[0].config
    return wrap_floats(_on_values(func, args, kwargs), lambda t: Float8MoEWeight(t, config))


@WEIGHT_OPS.implements(Kind.UNRELATED_VALUES)
def _unrelated_values(func, args, kwargs, weights):
    return _on_values(func, args, kwargs)


@WEIGHT_OPS.implements(Kind.DERIVED)
def _derived(func, args, kwargs, weights):
    # 0-dim results are statistics (a foreach norm), not matmul operands. A value computed from
    # the weight is no weight: no cache, gathered as its values.
    config = replace(weights[0].config, cache_fp8=False, fp8_all_gather=False)
    out = _on_values(func, args, kwargs)
    return wrap_floats(out, lambda t: Float8MoEWeight(t, config), min_dim=1)


@WEIGHT_OPS.implements(Kind.OTHER)
def _other(func, args, kwargs, weights):
    out = _on_values(func, args, kwargs)
    if any(could_feed_a_matmul(t) for t in pytree.tree_leaves(out)):
        shapes = [list(w.shape) for w in weights]
        raise NotImplementedError(
            f"float8_moe: {func} on converted weights {shapes} would give a plain "
            "floating-point tensor that could later multiply in high precision, and "
            "float8_moe does not know this op. Use `weight.high_precision()` (differentiable) "
            "where high precision is meant, or leave the module out of `float8_moe.fqns`."
        )
    return out
