"""The expert weight tensor: high-precision storage, fp8 rowwise matmuls, FSDP2-safe all-gather.

``Float8MoEWeight`` wraps a plain weight. Every matmul it is the right operand of runs in fp8
rowwise (``fp8/``); no op ever hands its values to a high-precision matmul. What an op does to the
wrapper is decided from the op's schema and tags (``_dispatch_kind``), so a new op falls on the
safe side:
- views and aliases (``func.is_view``, or a return that aliases an input: ``squeeze``, ``unbind``,
  ``expand``, ``t``, FSDP's chunks) stay wrapped and share the weight's fp8 cache;
- copies (``_to_copy``, ``clone``, ``*_copy`` ops) stay wrapped, with a cache of their own;
- pointwise ops (``w * 2``, an optimizer's ``grad + wd * w``), collectives and zero padding
  (DTensor's ``full_tensor()``) give a new wrapped weight, so what is computed from the weight is
  still multiplied in fp8 only;
- ops that write into an argument (in-place, ``out=``, ``copy_``, foreach) run on the plain data;
  a written weight drops its cached fp8 copies;
- results that cannot be a matmul operand (bool or integer tensors, 0-dim statistics such as
  ``w.norm()``, Python scalars) come out plain;
- everything else with a floating-point result (matmuls below ``__torch_function__``,
  convolutions, non-scalar reductions, ``cat``, ``index_select``, collectives) raises.
``high_precision()`` is the explicit, differentiable way to compute with the plain values.

With ``fp8_all_gather`` FSDP2's hooks gather fp8 payloads quantized on the shard instead of the
values (``fp8/gathered.py``), and the unsharded weight is a ``Float8GatheredWeight``: payloads
only, usable as the right operand ``w^T`` of the fp8 matmuls and nothing else.
"""

import functools
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format
from torch.distributed.tensor import DTensor

from .fp8 import fp8_batched_mm, fp8_grouped_mm, fp8_matmul, gathered
from .fp8.weight_cache import (
    CachedWeightQuantizer,
    WeightPayloads,
    WeightQuantCache,
    WeightQuantizer,
)
from .sharding import fp8_all_gather_fallback, padded_shard_shape, sharded_dim

aten = torch.ops.aten


class _Kind(Enum):
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
def _dispatch_kind(func) -> _Kind:
    packet = func.overloadpacket
    if packet in _MATMULS:
        return _Kind.MATMUL
    tags = func.tags
    if torch.Tag.inplace_view in tags and packet is not aten.detach_:
        return _Kind.METADATA_MUTATION
    if func._schema.is_mutable:
        return _Kind.MUTATION
    if (
        func.is_view
        or packet in _ALIASING_OPS
        or any(r.alias_info is not None for r in func._schema.returns)
    ):
        return _Kind.VIEW
    if packet in _COPY_OPS or torch.Tag.view_copy in tags:
        return _Kind.COPY
    if packet in _NEW_WEIGHT_OPS:
        return _Kind.NEW_WEIGHT
    if packet in _UNRELATED_VALUE_OPS:
        return _Kind.UNRELATED_VALUES
    if (
        torch.Tag.pointwise in tags
        or packet.__name__.startswith("_foreach_")
        or func.namespace == "_c10d_functional"  # DTensor's full_tensor, redistribute
        or packet in _PADDING_OPS
    ):
        return _Kind.DERIVED
    return _Kind.OTHER


def _written_arguments(func, args, kwargs) -> list[Any]:
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


def _could_feed_a_matmul(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0


def fp8_kernels_available(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA sm89 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class _Unwrap(torch.autograd.Function):
    """The wrapped high-precision tensor, with gradients flowing back to the wrapper."""

    @staticmethod
    def forward(ctx, weight: "Float8MoEWeight") -> torch.Tensor:
        return weight._data

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Fp8Weight(torch.Tensor):
    """What the converted weights share: the right operand of every matmul they reach is
    multiplied in fp8 (``_MATMUL_HANDLERS``), with the operand ``_fp8_operand`` gives."""

    emulate: bool

    def _fp8_operand(self) -> tuple[torch.Tensor, bool, WeightQuantizer | WeightPayloads | None]:
        """(the matmul's right operand ``b``, whether it runs CUDA kernels, where its fp8 copies
        come from: a weight quantizer, the payloads, or None to quantize ``b``)."""
        raise NotImplementedError

    def _uses_cuda_kernels(self) -> bool:
        if self.emulate:
            return False
        if fp8_kernels_available(self.device):
            return True
        raise RuntimeError(
            f"float8_moe: a weight of shape {list(self.shape)} on {self.device} has no fp8 "
            "kernels (they need CUDA sm89+). Set `[float8_moe] emulate = true` to run the "
            "emulated fp8 path, or leave it out of `float8_moe.fqns`."
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _MATMUL_HANDLERS.get(getattr(func, "__name__", None))
        if handler is not None and any(isinstance(a, _Fp8Weight) for a in args[:2]):
            a, weight = args[0], args[1]
            if isinstance(a, _Fp8Weight) or not isinstance(weight, _Fp8Weight):
                raise NotImplementedError(
                    f"float8_moe: {func.__name__} with a Float8MoEWeight as its left operand "
                    f"(shape {list(a.shape)}) is not supported; the weight must be the right "
                    "operand"
                )
            return handler(a, weight, *args[2:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class Float8MoEWeight(_Fp8Weight):
    _data: torch.Tensor
    cache_fp8: bool
    # Under FSDP2: all-gather fp8 payloads quantized on the shard where it can (config.py).
    fp8_all_gather: bool
    # With cache_fp8: the fp8 copies shared by this weight and every view of it
    # (fp8/weight_cache.py says when they are valid).
    _cache: WeightQuantCache | None

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, emulate: bool, cache_fp8: bool = False, fp8_all_gather=False
    ):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            memory_format=suggest_memory_format(data),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(
        self, data: torch.Tensor, emulate: bool, cache_fp8: bool = False, fp8_all_gather=False
    ):
        self._data = data
        self.emulate = emulate
        self.cache_fp8 = cache_fp8
        self.fp8_all_gather = fp8_all_gather
        self._cache = None
        if cache_fp8:
            self._cache = WeightQuantCache()
            self._cache.watch(data)

    def _derived(
        self, data: torch.Tensor, cache: WeightQuantCache | None, watch: bool = True
    ) -> "Float8MoEWeight":
        """A weight computed from this one: same settings, the given fp8 cache, which treats a
        write into ``data`` as a change of the values if ``watch``."""
        derived = Float8MoEWeight(data, self.emulate, fp8_all_gather=self.fp8_all_gather)
        derived.cache_fp8, derived._cache = self.cache_fp8, cache
        if cache is not None and watch:
            cache.watch(data)
        return derived

    def _view(self, data: torch.Tensor) -> "Float8MoEWeight":
        """A view of this weight (same values): it shares the fp8 cache."""
        return self._derived(data, self._cache)

    def _copy(self, data: torch.Tensor) -> "Float8MoEWeight":
        """A cast or clone of this weight: its cache is shared with other copies of the same
        kind made while this weight is unchanged."""
        if self._cache is None:
            return self._derived(data, None)
        kind = (
            data.dtype,
            data.device,
            data.shape,
            data.stride(),
            self.shape,
            self.stride(),
            self.storage_offset(),
        )
        return self._derived(data, self._cache.cache_of_copy(kind))

    def high_precision(self) -> torch.Tensor:
        """The plain high-precision values, differentiable: for math that is meant to run in
        high precision (a regularizer, a statistic). Nothing computed from it is fp8."""
        return _Unwrap.apply(self)

    def __repr__(self) -> str:
        return (
            f"Float8MoEWeight(emulate={self.emulate}, cache_fp8={self.cache_fp8}, "
            f"fp8_all_gather={self.fp8_all_gather}, data={self._data!r})"
        )

    def __tensor_flatten__(self):
        return ["_data"], (self.emulate, self.cache_fp8, self.fp8_all_gather)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, flags, outer_size, outer_stride):
        return cls(inner_tensors["_data"], *flags)

    # ---- matmuls -----------------------------------------------------------------------------

    def _cached_quantizer(self) -> CachedWeightQuantizer | None:
        # Compiled graphs quantize inline: a Python-side cache would be baked into the trace.
        if self._cache is None or torch.compiler.is_compiling():
            return None
        return CachedWeightQuantizer(self._cache)

    def _fp8_operand(self) -> tuple[torch.Tensor, bool, WeightQuantizer | None]:
        return _Unwrap.apply(self), self._uses_cuda_kernels(), self._cached_quantizer()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _dispatch_kind(func)
        weights = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls)]
        shapes = [list(w.shape) for w in weights]
        if kind is _Kind.MATMUL:
            raise NotImplementedError(
                f"float8_moe: {func} on a converted weight of shape {shapes[0]} reached a "
                "matmul below the fp8 overrides and would run in high precision; this call form "
                "is not supported. Supported: torch._grouped_mm, F.linear, matmul/mm/bmm/@ with "
                "the weight as the right operand. Leave this module out of `float8_moe.fqns`."
            )
        if kind is _Kind.METADATA_MUTATION:
            raise NotImplementedError(
                f"float8_moe: {func} changes the shape or strides of a converted weight "
                f"{shapes[0]} in place, which it cannot follow; use the out-of-place op"
            )
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if kind is _Kind.MUTATION:
            # The written weights' fp8 copies are stale; hand back the wrappers themselves
            # wherever the op returns a written argument (in-place and out= ops return it).
            written = _written_arguments(func, args, kwargs)
            for weight in written:
                if isinstance(weight, cls) and weight._cache is not None:
                    weight._cache.invalidate()
            originals = {id(w._data): w for w in written if isinstance(w, cls)}
            return pytree.tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), out)
        source = weights[0]
        if kind is _Kind.VIEW:
            return _wrap_floats(out, source._view)
        if kind is _Kind.COPY:
            return _wrap_floats(out, source._copy)
        if kind is _Kind.NEW_WEIGHT:
            return _wrap_floats(
                out, lambda t: cls(t, source.emulate, source.cache_fp8, source.fp8_all_gather)
            )
        if kind is _Kind.DERIVED:
            # 0-dim results are statistics (a foreach norm), not matmul operands.
            return _wrap_floats(out, lambda t: cls(t, source.emulate), min_dim=1)
        if kind is not _Kind.UNRELATED_VALUES and any(
            _could_feed_a_matmul(t) for t in pytree.tree_leaves(out)
        ):
            raise NotImplementedError(
                f"float8_moe: {func} on converted weights {shapes} would give a plain "
                "floating-point tensor that could later multiply in high precision, and "
                "float8_moe does not know this op. Use `weight.high_precision()` (differentiable) "
                "where high precision is meant, or leave the module out of `float8_moe.fqns`."
            )
        return out

    # ---- FSDP2 all-gather extension ----------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = self._data
        if mp_policy.param_dtype is not None:
            data = data.to(mp_policy.param_dtype)
        padded_shape = padded_shard_shape(outer_size, data.shape, mesh.size())
        if data.shape != padded_shape:
            padded = data.new_zeros(padded_shape)
            padded[: data.shape[0]].copy_(data)
            data = padded
        if self._gathers_fp8(outer_size, mesh.size()):
            # The padding rows quantize too: zeros with finite scales, narrowed off afterwards.
            payloads = gathered.quantize_shard(
                data, self._uses_cuda_kernels(), self._cached_quantizer()
            )
            return gathered.all_gather_inputs(payloads, tuple(outer_size), data.dtype, mesh.size())
        return (data,), tuple(outer_size)

    def _gathers_fp8(self, outer_size: torch.Size, world_size: int) -> bool:
        """Whether this shard all-gathers fp8 payloads (the rule the converter's plan logs)."""
        shard_dim = sharded_dim(outer_size, self.shape)
        fallback = fp8_all_gather_fallback(tuple(outer_size), shard_dim, world_size)
        return self.fp8_all_gather and fallback is None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        if isinstance(metadata, gathered.GatherLayout):
            return self._post_fp8_all_gather(all_gather_outputs, metadata, out)
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
            unsharded._cache = self._cache
            return
        # FSDP2 calls both hooks on the local shard (self). The unsharded weight holds the
        # shards' values, so it shares the shard's fp8 cache: a write into the shard (optimizer
        # step, checkpoint load) invalidates it, the all-gather's refills of the buffer do not.
        return self._derived(data, self._cache, watch=False), (all_gathered,)

    def _post_fp8_all_gather(
        self,
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
            self.emulate,
            transposed=False,
        )
        return unsharded, all_gather_outputs


class _ShapeOnly(torch.autograd.Function):
    """A plain tensor of the gathered weight's shape and dtype holding no values (one element,
    expanded), for the fp8 GEMM to return the weight gradient through."""

    @staticmethod
    def forward(ctx, weight: "Float8GatheredWeight") -> torch.Tensor:
        return _shape_only(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Float8GatheredWeight(_Fp8Weight):
    """The unsharded expert weight ``w [E, out, in]`` that FSDP2 all-gathers with
    ``fp8_all_gather``: the fp8 payloads of both orientations of the matmul operand ``w^T``
    (``fp8/gathered.py``), no high-precision values. It is the right operand ``w^T`` of fp8
    matmuls (``torch._grouped_mm(x, w.transpose(-2, -1), offs)``, 3D x 3D, bmm) and nothing
    else: its views are itself (detach, FSDP's as_strided, ``to_local``'s view_as) and that
    transpose; any other op raises rather than compute without the values. Its payloads are
    its inner tensors, so compiled graphs take it as an input (not as an output: a compiled
    function returning a view of it raises)."""

    # WeightPayloads of w^T, as gathered: forward data [E, in, out] and scales [E, 1, out],
    # input-gradient data [E, out, in] and scales [E, 1, in].
    forward_data: torch.Tensor
    forward_scales: torch.Tensor
    input_grad_data: torch.Tensor
    input_grad_scales: torch.Tensor
    transposed: bool  # this tensor is w^T, the matmul operand the payloads are of

    @staticmethod
    def __new__(cls, payloads: WeightPayloads, size, stride, dtype, emulate, transposed):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            size,
            strides=stride,
            dtype=dtype,
            device=payloads.forward_data.device,
            requires_grad=False,
        )

    def __init__(self, payloads: WeightPayloads, size, stride, dtype, emulate, transposed):
        for name, tensor in payloads._asdict().items():
            setattr(self, name, tensor)
        self.emulate = emulate
        self.transposed = transposed

    def _payloads(self) -> WeightPayloads:
        return WeightPayloads(*(getattr(self, name) for name in WeightPayloads._fields))

    def __tensor_flatten__(self):
        return list(WeightPayloads._fields), (self.dtype, self.emulate, self.transposed)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, flags, outer_size, outer_stride):
        dtype, emulate, transposed = flags
        payloads = WeightPayloads(**inner_tensors)
        return cls(payloads, outer_size, outer_stride, dtype, emulate, transposed)

    def _unsupported(self, use: str) -> NotImplementedError:
        return NotImplementedError(
            f"float8_moe: {use} on an expert weight of shape {list(self.shape)} all-gathered as "
            "fp8 payloads (`[float8_moe] fp8_all_gather`), which holds no high-precision "
            "values: only torch._grouped_mm, bmm, matmul or @ with w.transpose(-2, -1) as the "
            "right operand runs on it. Set `[float8_moe] fp8_all_gather = false` for this use."
        )

    def _fp8_operand(self) -> tuple[torch.Tensor, bool, WeightPayloads]:
        if not self.transposed:
            raise self._unsupported("a matmul with w itself (not w.transpose(-2, -1))")
        return _ShapeOnly.apply(self), self._uses_cuda_kernels(), self._payloads()

    def high_precision(self) -> torch.Tensor:
        raise self._unsupported("high_precision()")

    def __repr__(self) -> str:
        return (
            f"Float8GatheredWeight(shape={list(self.shape)}, dtype={self.dtype}, "
            f"transposed={self.transposed}, emulate={self.emulate})"
        )

    def _view(self, like: torch.Tensor, transposed: bool) -> "Float8GatheredWeight":
        return Float8GatheredWeight(
            self._payloads(), like.shape, like.stride(), self.dtype, self.emulate, transposed
        )

    def _as_view(self, out: torch.Tensor) -> "Float8GatheredWeight | None":
        """This weight or its transpose, as which a view op's (meta) result ``out`` lies over
        the same elements; None for any other view."""
        if out.storage_offset() != 0:
            return None
        layout = (tuple(out.shape), out.stride())
        if layout == (tuple(self.shape), self.stride()):
            return self._view(out, self.transposed)
        if layout == (_swap_last_two(self.shape), _swap_last_two(self.stride())):
            return self._view(out, not self.transposed)
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        kind = _dispatch_kind(func)
        if kind in (_Kind.UNRELATED_VALUES, _Kind.NEW_WEIGHT):
            # zeros_like (FSDP's zero gradient), empty_like: the shape only, no values.
            plain = pytree.tree_map_only(cls, _shape_only, (args, kwargs))
            return func(*plain[0], **plain[1])
        if kind is _Kind.VIEW:
            meta_args, meta_kwargs = pytree.tree_map_only(cls, _meta_like, (args, kwargs))
            out = func(*meta_args, **meta_kwargs)
            view = source._as_view(out) if isinstance(out, torch.Tensor) else None
            if view is not None:
                return view
        raise source._unsupported(str(func))


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s shape, dtype and device holding no values (one element,
    expanded)."""
    return torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def _swap_last_two(values) -> tuple:
    return (*values[:-2], values[-1], values[-2])


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _check_views(view: torch.Tensor, output: torch.Tensor, logical_shape) -> None:
    if view.untyped_storage().data_ptr() != output.untyped_storage().data_ptr():
        raise AssertionError(
            f"float8_moe: unsharded weight {list(logical_shape)} does not view the all-gather "
            "output; FSDP's buffer reuse changed"
        )


def _contiguous_strides(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _wrap_floats(out: Any, wrap: Callable, min_dim: int = 0) -> Any:
    """``wrap`` every floating-point tensor of ``out`` with at least ``min_dim`` dims."""
    return pytree.tree_map_only(
        torch.Tensor,
        lambda t: wrap(t) if t.is_floating_point() and t.dim() >= min_dim else t,
        out,
    )


def _grouped_mm(a, weight, offs=None, bias=None, out_dtype=None):
    if bias is not None or out_dtype is not None:
        raise NotImplementedError(
            "float8_moe: torch._grouped_mm with bias or out_dtype is not supported"
        )
    b, cuda, cached = weight._fp8_operand()
    if a.ndim == 2 and b.ndim == 3 and offs is not None:
        return fp8_grouped_mm(a, b, offs, cuda, cached)
    if a.ndim == 3 and b.ndim == 3 and offs is None:
        return fp8_batched_mm(a, b, cuda, cached)
    raise NotImplementedError(
        f"float8_moe: torch._grouped_mm of {list(a.shape)} x {list(b.shape)} "
        f"{'with' if offs is not None else 'without'} offsets is not supported; supported: "
        "2D x 3D with offsets (routed experts) and 3D x 3D without (grouped shared expert)"
    )


def _unsupported_form(name: str, a: torch.Tensor, weight: torch.Tensor, supported: str):
    return NotImplementedError(
        f"float8_moe: {name} of {list(a.shape)} x converted weight {list(weight.shape)} is not "
        f"supported in fp8; supported: {supported}"
    )


def _linear(x, weight, bias=None):
    if weight.ndim != 2:
        raise _unsupported_form("F.linear", x, weight, "a 2D weight [N, K]")
    b, cuda, cached = weight._fp8_operand()
    out = fp8_matmul(x, b.t(), cuda, cached)
    return out if bias is None else out + bias


def _batched(a, weight) -> bool:
    return a.ndim == 3 and weight.ndim == 3 and a.shape[0] == weight.shape[0]


def _fp8_matmul_of(a, weight):
    b, cuda, cached = weight._fp8_operand()
    if b.ndim == 2:
        return fp8_matmul(a, b, cuda, cached)
    return fp8_batched_mm(a, b, cuda, cached)


def _matmul(a, weight):
    if not (weight.ndim == 2 and a.ndim >= 1) and not _batched(a, weight):
        raise _unsupported_form("matmul", a, weight, "[..., K] x [K, N] and [G, M, K] x [G, K, N]")
    return _fp8_matmul_of(a, weight)


def _mm(a, weight):
    if not (a.ndim == 2 and weight.ndim == 2):
        raise _unsupported_form("mm", a, weight, "[M, K] x [K, N]")
    return _fp8_matmul_of(a, weight)


def _bmm(a, weight):
    if not _batched(a, weight):
        raise _unsupported_form("bmm", a, weight, "[G, M, K] x [G, K, N]")
    return _fp8_matmul_of(a, weight)


_MATMUL_HANDLERS: dict[str, Callable] = {
    "_grouped_mm": _grouped_mm,
    "linear": _linear,
    "matmul": _matmul,
    "__matmul__": _matmul,
    "mm": _mm,
    "bmm": _bmm,
}
