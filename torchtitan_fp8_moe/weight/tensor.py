"""``Float8MoEWeight``: the expert weight tensor, high-precision storage whose matmuls run in fp8.

Every matmul it is the right operand of runs in fp8 by its recipe (``matmuls.py``); no op ever
hands its values to a high-precision matmul. What an op does to the wrapper is decided from the
op's schema and tags (``ops.py``), so a new op falls on the safe side:
- views and aliases (``func.is_view``, or a return that aliases an input: ``squeeze``, ``unbind``,
  ``expand``, ``t``, FSDP's chunks) stay wrapped and share the weight's fp8 cache;
- copies (``_to_copy``, ``clone``, ``*_copy`` ops) stay wrapped, with a cache of their own;
  the forward's cast of an fp32 parameter to bf16 (torchtitan's ``w.bfloat16()`` where no
  FSDP casts) is lazy: it holds the fp32 values, its matmuls' quantizers round them to bf16 as
  they read them (the fp8 copies of a copied cast, bit for bit) and any other op sees them
  rounded to bf16, so no bf16 copy of the weight lives from forward to backward
  (``_lazy_cast_dtype``);
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
values (``fp8/gathered.py``), and the unsharded weight is a ``Float8GatheredWeight``
(``gathered.py``).
"""

from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor

from ..fp8 import gathered
from ..fp8.weight_cache import CachedWeightQuantizer, SourceValuesQuantizer, WeightQuantCache
from ..sharding import padded_shard_shape, sharded_dim
from .base import Fp8Weight, shape_only_operand
from .config import WeightConfig
from .gathered import Float8GatheredWeight, check_views, contiguous_strides
from .ops import Kind, could_feed_a_matmul, dispatch_kind, wrap_floats, written_arguments

aten = torch.ops.aten


class _Unwrap(torch.autograd.Function):
    """The wrapped high-precision tensor, with gradients flowing back to the wrapper."""

    @staticmethod
    def forward(ctx, weight: "Float8MoEWeight") -> torch.Tensor:
        # A new tensor object (same memory): autograd gives the output a grad_fn, which set on
        # ``_data`` itself made a cycle through C++ (data -> node -> the weight's gradient
        # accumulator -> weight -> data) that no garbage collection frees.
        return weight._values().detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Float8MoEWeight(Fp8Weight):
    _data: torch.Tensor
    # With config.cache_fp8: the fp8 copies shared by this weight and every view of it
    # (fp8/weight_cache.py says when they are valid).
    _cache: WeightQuantCache | None
    # A lazy cast (and its views): the parameter it was cast from and that parameter's version
    # then. ``_data`` holds the parameter's values in this weight's layout, in their own dtype.
    _cast_from: tuple[torch.Tensor, int] | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, config: WeightConfig, dtype: torch.dtype | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            memory_format=suggest_memory_format(data),
            dtype=dtype or data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, config: WeightConfig, dtype: torch.dtype | None = None):
        self._data = data
        self.config = config
        self._cache = None
        self._cast_from = None
        if config.cache_fp8:
            self._cache = WeightQuantCache()
            self._cache.watch(data)

    @property
    def cache_fp8(self) -> bool:
        return self.config.cache_fp8

    @property
    def fp8_all_gather(self) -> bool:
        return self.config.fp8_all_gather

    def _derived(
        self,
        data: torch.Tensor,
        cache: WeightQuantCache | None,
        watch: bool = True,
        lazy_cast: tuple[torch.dtype, tuple] | None = None,
    ) -> "Float8MoEWeight":
        """A weight computed from this one: same config, the given fp8 cache, which treats a
        write into ``data`` as a change of the values if ``watch``; with ``lazy_cast`` (its
        dtype, ``_cast_from``) a lazy cast holding ``data``."""
        dtype = None if lazy_cast is None else lazy_cast[0]
        derived = Float8MoEWeight(data, replace(self.config, cache_fp8=False), dtype)
        derived.config, derived._cache = self.config, cache
        if lazy_cast is not None:
            derived._cast_from = lazy_cast[1]
        if cache is not None and watch:
            cache.watch(data)
        return derived

    def _source_values(self) -> torch.Tensor:
        """A lazy cast's ``_data``, after checking that its parameter was not written since."""
        parameter, version = self._cast_from
        if parameter._version != version:
            raise RuntimeError(
                f"float8_moe: a {self.dtype} cast of a converted weight of shape "
                f"{list(parameter.shape)} was used after the weight was written; the cast is "
                "lazy (it holds no copy of the values). Cast again after the write."
            )
        return self._data

    def _values(self) -> torch.Tensor:
        """The plain values this weight holds: a lazy cast makes its copy here."""
        if self._cast_from is None:
            return self._data
        return self._source_values().to(self.dtype)

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
        return f"Float8MoEWeight({self.config}, data={self._data!r})"

    def __tensor_flatten__(self):
        if self._cast_from is not None:
            raise NotImplementedError(
                f"float8_moe: a lazy {self.dtype} cast of a converted weight "
                f"{list(self.shape)} cannot cross a compiled region's boundary (a graph break "
                "between the cast and its matmul); compile the cast with its matmul as one "
                "graph (fullgraph=True, as torchtitan does) or set WeightConfig(lazy_cast=False)"
            )
        return ["_data"], self.config

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, config, outer_size, outer_stride):
        return cls(inner_tensors["_data"], config)

    # ---- matmuls -----------------------------------------------------------------------------

    def _cached_quantizer(self) -> CachedWeightQuantizer | None:
        # Compiled graphs quantize inline: a Python-side cache would be baked into the trace.
        if self._cache is None or torch.compiler.is_compiling():
            return None
        return CachedWeightQuantizer(self._cache)

    def fp8_operand(self, transpose: bool = False):
        def oriented(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(-2, -1) if transpose else t

        if self._cast_from is None:
            return oriented(_Unwrap.apply(self)), self._cached_quantizer()
        # A lazy cast: the GEMM quantizes the parameter's values; b carries the cast's shape
        # and dtype, so the weight gradient comes back in the cast's dtype.
        cache = None if torch.compiler.is_compiling() else self._cache
        quantizer = SourceValuesQuantizer(lambda: oriented(self._source_values()), cache)
        return oriented(shape_only_operand(self)), quantizer

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = dispatch_kind(func)
        weights = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls)]
        shapes = [list(w.shape) for w in weights]
        if kind is Kind.MATMUL:
            raise NotImplementedError(
                f"float8_moe: {func} on a converted weight of shape {shapes[0]} reached a "
                "matmul below the fp8 overrides and would run in high precision; this call form "
                "is not supported. Supported: torch._grouped_mm, F.linear, matmul/mm/bmm/@ with "
                "the weight as the right operand. Leave this module out of `float8_moe.fqns`."
            )
        if kind is Kind.METADATA_MUTATION:
            raise NotImplementedError(
                f"float8_moe: {func} changes the shape or strides of a converted weight "
                f"{shapes[0]} in place, which it cannot follow; use the out-of-place op"
            )
        source = weights[0]
        if kind is Kind.COPY:
            lazy_dtype = _lazy_cast_dtype(func, args, kwargs)
            if lazy_dtype is not None:
                return source._derived(
                    source._data, source._cache, lazy_cast=(lazy_dtype, (source, source._version))
                )
        if source._cast_from is not None:
            if kind is Kind.MUTATION and any(
                w is source for w in written_arguments(func, args, kwargs)
            ):
                raise NotImplementedError(
                    f"float8_moe: {func} writes into a {source.dtype} cast of a converted "
                    f"weight {shapes[0]}, which holds no copy of its own (the cast is lazy); "
                    "write into the weight, or into `.clone()` of the cast"
                )
            if kind is Kind.VIEW and len(weights) == 1:
                view = _lazy_cast_view(func, args, kwargs, source)
                if view is not None:
                    return view
        plain_args, plain_kwargs = pytree.tree_map_only(cls, lambda t: t._values(), (args, kwargs))
        out = func(*plain_args, **plain_kwargs)
        if kind is Kind.MUTATION:
            # The written weights' fp8 copies are stale; hand back the wrappers themselves
            # wherever the op returns a written argument (in-place and out= ops return it).
            written = written_arguments(func, args, kwargs)
            for weight in written:
                if isinstance(weight, cls) and weight._cache is not None:
                    weight._cache.invalidate()
            originals = {id(w._data): w for w in written if isinstance(w, cls)}
            return pytree.tree_map_only(torch.Tensor, lambda t: originals.get(id(t), t), out)
        if kind is Kind.VIEW:
            return wrap_floats(out, source._view)
        if kind is Kind.COPY:
            return wrap_floats(out, source._copy)
        if kind is Kind.NEW_WEIGHT:
            return wrap_floats(out, lambda t: cls(t, source.config))
        if kind is Kind.DERIVED:
            # 0-dim results are statistics (a foreach norm), not matmul operands. A value
            # computed from the weight is no weight: no cache, gathered as its values.
            config = replace(source.config, cache_fp8=False, fp8_all_gather=False)
            return wrap_floats(out, lambda t: cls(t, config), min_dim=1)
        if kind is not Kind.UNRELATED_VALUES and any(
            could_feed_a_matmul(t) for t in pytree.tree_leaves(out)
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
            recipe, emulate = self.fp8_path()
            payloads = gathered.quantize_shard(data, recipe, emulate, self._cached_quantizer())
            return gathered.all_gather_inputs(
                payloads, tuple(outer_size), data.dtype, mesh.size(), recipe
            )
        return (data,), tuple(outer_size)

    def _gathers_fp8(self, outer_size: torch.Size, world_size: int) -> bool:
        """Whether this shard all-gathers fp8 payloads (the rule the converter's plan logs)."""
        shard_dim = sharded_dim(outer_size, self.shape)
        recipe = self.config.fp8_recipe
        fallback = recipe.rules.all_gather_fallback(tuple(outer_size), shard_dim, world_size)
        return self.config.fp8_all_gather and fallback is None

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
            check_views(unsharded._data, all_gathered, logical_shape)
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
            check_views(unsharded.forward_data, forward_data, layout.logical_shape)
            check_views(unsharded.input_grad_data, input_grad_data, layout.logical_shape)
            check_views(unsharded.forward_scales, scales, layout.logical_shape)
            return
        payloads = gathered.unpack(all_gather_outputs, layout)
        unsharded = Float8GatheredWeight(
            payloads,
            layout.logical_shape,
            contiguous_strides(layout.logical_shape),
            layout.dtype,
            self.config,
            transposed=False,
        )
        return unsharded, all_gather_outputs


def _lazy_cast_dtype(func, args, kwargs) -> torch.dtype | None:
    """bf16 where ``func`` casts an fp32 weight that takes gradients to bf16 in a forward that
    autograd records and changes nothing else: the cast torchtitan's grouped experts make where
    FSDP does not cast (one device, DDP, FSDP with fp32 parameters). Eagerly the weight must be
    a parameter (a tensor-parallel weight's local tensor is none); in compiled code, any such
    weight in AOTAutograd's trace, where the cast and its matmuls are one functional graph.
    Else None, and the cast makes a copy: ``model.to(torch.bfloat16)`` runs without grad,
    dynamo's fake run flattens its results (which a lazy cast cannot be), and
    ``WeightConfig.lazy_cast`` may turn it off."""
    if func is not aten._to_copy.default or len(args) != 1:
        return None
    (source,) = args
    if not (
        kwargs.get("dtype") is torch.bfloat16
        and source.dtype is torch.float32
        and set(kwargs) <= {"dtype", "device", "layout", "memory_format", "non_blocking"}
        and kwargs.get("device") in (None, source.device)
        and kwargs.get("layout") in (None, torch.strided)
        and kwargs.get("memory_format") in (None, torch.preserve_format)
    ):
        return None
    if not (torch.is_grad_enabled() and source.requires_grad and source.config.lazy_cast):
        return None
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None:
        return torch.bfloat16  # AOTAutograd's trace
    if isinstance(source._data, FakeTensor) or torch.compiler.is_compiling():
        return None  # dynamo's fake run
    return torch.bfloat16 if isinstance(source, torch.nn.Parameter) else None


def _lazy_cast_view(func, args, kwargs, source: Float8MoEWeight) -> Float8MoEWeight | None:
    """A view of the lazy cast ``source``, itself lazy: the view of its ``_data``, where the
    view keeps the dtype (a shape or stride view picks the same elements in either dtype);
    None for views that read the bytes (``view(dtype)``), which see the cast values."""
    plain_args, plain_kwargs = pytree.tree_map_only(
        Float8MoEWeight, lambda t: t._source_values(), (args, kwargs)
    )
    out = func(*plain_args, **plain_kwargs)
    leaves = pytree.tree_leaves(out)
    if not all(isinstance(t, torch.Tensor) and t.dtype == source._data.dtype for t in leaves):
        return None
    lazy_cast = (source.dtype, source._cast_from)
    return pytree.tree_map_only(
        torch.Tensor, lambda t: source._derived(t, source._cache, lazy_cast=lazy_cast), out
    )
