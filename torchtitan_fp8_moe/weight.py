"""The expert weight tensor: high-precision storage, fp8 rowwise matmuls, FSDP2-safe all-gather.

``Float8MoEWeight`` wraps a plain weight. Every op that only moves or reshapes the weight (views,
copies, FSDP's sharding ops, dtype casts) keeps the wrapper, so the fp8 routing survives
``w.bfloat16().transpose(-2, -1)``, ``w[i]`` and FSDP's chunking. Every matmul it is the right
operand of runs in fp8 rowwise (``fp8/``); a matmul form we do not implement raises instead of
quietly running in high precision. Optimizer states, gradients and anything else computed from the
weight come out as plain tensors.
"""

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._prims_common import suggest_memory_format

from .fp8 import fp8_batched_mm, fp8_grouped_mm, fp8_matmul
from .fp8.weight_cache import CachedWeightQuantizer, WeightQuantCache
from .sharding import padded_shard_shape

aten = torch.ops.aten

# Ops whose result is still the same weight, moved, viewed or re-typed: keep it wrapped. Views and
# casts hold the same values as their source, so they also share its fp8 cache.
_SAME_VALUE_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.unsqueeze.default,
    aten._to_copy.default,
}
_WRAPPED_RESULT_OPS = _SAME_VALUE_OPS | {
    aten.clone.default,
    aten._pin_memory.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}

# Matmuls that must never see the wrapper at dispatch level: reaching them means a call form
# bypassed __torch_function__ and would run in high precision.
_HIGH_PRECISION_MATMULS = {
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten._grouped_mm.default,
}


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


class Float8MoEWeight(torch.Tensor):
    _data: torch.Tensor
    emulate: bool
    # With cache_fp8: the fp8 copies shared by this weight and every view or cast of it, valid
    # while _version_source (the tensor the optimizer updates in place) is unchanged.
    cache_fp8: bool
    _cache: WeightQuantCache | None
    _version_source: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, emulate: bool, cache_fp8: bool = False):
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

    def __init__(self, data: torch.Tensor, emulate: bool, cache_fp8: bool = False):
        self._data = data
        self.emulate = emulate
        self.cache_fp8 = cache_fp8
        self._cache = WeightQuantCache() if cache_fp8 else None
        self._version_source = data

    def _same_value(self, data: torch.Tensor) -> "Float8MoEWeight":
        """A view or cast of this weight: same settings, same fp8 cache."""
        derived = Float8MoEWeight(data, self.emulate)
        derived.cache_fp8, derived._cache = self.cache_fp8, self._cache
        derived._version_source = self._version_source
        return derived

    def __repr__(self) -> str:
        return (
            f"Float8MoEWeight(emulate={self.emulate}, cache_fp8={self.cache_fp8}, "
            f"data={self._data!r})"
        )

    def __tensor_flatten__(self):
        return ["_data"], (self.emulate, self.cache_fp8)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, flags, outer_size, outer_stride):
        return cls(inner_tensors["_data"], *flags)

    # ---- matmuls -----------------------------------------------------------------------------

    def _cached_quantizer(self) -> CachedWeightQuantizer | None:
        # Compiled graphs quantize inline: a Python-side cache would be baked into the trace.
        if self._cache is None or torch.compiler.is_compiling():
            return None
        return CachedWeightQuantizer(self._cache, self._version_source)

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
        if handler is not None and any(isinstance(a, cls) for a in args[:2]):
            a, weight = args[0], args[1]
            if isinstance(a, cls) or not isinstance(weight, cls):
                raise NotImplementedError(
                    f"float8_moe: {func.__name__} with a Float8MoEWeight as its left operand "
                    f"(shape {list(a.shape)}) is not supported; the weight must be the right operand"
                )
            return handler(a, weight, *args[2:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _HIGH_PRECISION_MATMULS:
            shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            raise NotImplementedError(
                f"float8_moe: {func} on operands {shapes} reached a Float8MoEWeight below the "
                "fp8 matmul overrides and would run in high precision; this call form is not "
                "supported. Leave this module out of `float8_moe.fqns`."
            )
        parent = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        in_place = func.overloadpacket.__name__.endswith("_")
        if in_place:
            # The weight is changing (optimizer step, checkpoint load): its fp8 copies are stale.
            # This runs below autograd, where version counters do not move, so clear directly.
            for mutated in pytree.tree_leaves(args[0]):
                if isinstance(mutated, cls) and mutated._cache is not None:
                    mutated._cache.clear()
        unwrapped_args, unwrapped_kwargs = pytree.tree_map_only(
            cls, lambda t: t._data, (args, kwargs or {})
        )
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if in_place and isinstance(args[0], cls):
            return args[0]  # in-place: the wrapper itself was modified
        if func in _SAME_VALUE_OPS:
            return pytree.tree_map_only(torch.Tensor, parent._same_value, out)
        if func in _WRAPPED_RESULT_OPS:
            return pytree.tree_map_only(
                torch.Tensor, lambda t: cls(t, parent.emulate, parent.cache_fp8), out
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
        return (data,), tuple(outer_size)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (gathered,) = all_gather_outputs
        logical_shape = metadata
        # Dim-0 sharding gathers world * rows_per_rank rows: narrow off the padding. Other shard
        # dims arrive in the logical layout, where the narrow is a no-op.
        data = gathered.view(-1, *logical_shape[1:]).narrow(0, 0, logical_shape[0])
        if out is not None:
            # Later steps: FSDP refills the same storage the unsharded weight already views.
            if out._data.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr():
                raise AssertionError(
                    f"float8_moe: unsharded weight {list(logical_shape)} does not view the "
                    "all-gather output; FSDP's buffer reuse changed"
                )
            return
        # FSDP2 calls both hooks on the local shard (self). The unsharded weight shares the
        # shard's fp8 cache and version source: the optimizer's in-place update of the shard
        # clears it, the all-gather refills of the unsharded buffer do not.
        return self._same_value(data), (gathered,)


def _grouped_mm(a, weight, offs=None, bias=None, out_dtype=None):
    if bias is not None or out_dtype is not None:
        raise NotImplementedError(
            "float8_moe: torch._grouped_mm with bias or out_dtype is not supported"
        )
    cuda = weight._uses_cuda_kernels()
    b = _Unwrap.apply(weight)
    cached = weight._cached_quantizer()
    if a.ndim == 2 and b.ndim == 3 and offs is not None:
        return fp8_grouped_mm(a, b, offs, cuda, cached)
    if a.ndim == 3 and b.ndim == 3 and offs is None:
        return fp8_batched_mm(a, b, cuda, cached)
    raise NotImplementedError(
        f"float8_moe: torch._grouped_mm of {list(a.shape)} x {list(b.shape)} "
        f"{'with' if offs is not None else 'without'} offsets is not supported; supported: "
        "2D x 3D with offsets (routed experts) and 3D x 3D without (grouped shared expert)"
    )


def _linear(x, weight, bias=None):
    out = fp8_matmul(
        x, _Unwrap.apply(weight).t(), weight._uses_cuda_kernels(), weight._cached_quantizer()
    )
    return out if bias is None else out + bias


def _matmul(a, weight):
    cuda = weight._uses_cuda_kernels()
    b = _Unwrap.apply(weight)
    cached = weight._cached_quantizer()
    if b.ndim == 2:
        return fp8_matmul(a, b, cuda, cached)
    if a.ndim == 3 and b.ndim == 3:
        return fp8_batched_mm(a, b, cuda, cached)
    raise NotImplementedError(
        f"float8_moe: matmul of {list(a.shape)} x {list(b.shape)} is not supported; "
        "supported: [..., K] x [K, N] and [G, M, K] x [G, K, N]"
    )


_MATMUL_HANDLERS: dict[str, Callable] = {
    "_grouped_mm": _grouped_mm,
    "linear": _linear,
    "matmul": _matmul,
    "mm": _matmul,
    "bmm": _matmul,
    "__matmul__": _matmul,
}
