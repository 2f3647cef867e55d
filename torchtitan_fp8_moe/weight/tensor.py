"""``Float8MoEWeight``: the expert weight tensor, high-precision storage whose matmuls run in fp8.

Every matmul it is the right operand of runs in fp8 by its recipe (``matmuls.py``); no op ever
hands its values to a high-precision matmul. What any other op does to it is its op table's
(``tensor_ops.py``), by the op's kind (``ops.py``). The forward's cast of an fp32 parameter to
bf16 is a ``LazyCastWeight`` (``lazy_cast.py``), FSDP2's all-gather hooks are ``fsdp.py``'s.
``high_precision()`` is the explicit, differentiable way to compute with the plain values.
"""

from dataclasses import replace

import torch
from torch._prims_common import suggest_memory_format

from ..fp8.weight_cache import CachedWeightQuantizer, WeightQuantCache
from . import fsdp
from .base import Fp8Weight
from .config import WeightConfig
from .ops import OpTable


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


def wrapper_of(cls: type, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``cls`` wrapper tensor with ``data``'s shape, strides and device and ``dtype``."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        data.size(),
        strides=data.stride(),
        storage_offset=data.storage_offset(),
        memory_format=suggest_memory_format(data),
        dtype=dtype,
        layout=data.layout,
        device=data.device,
        requires_grad=data.requires_grad,
    )


class Float8MoEWeight(Fp8Weight):
    _data: torch.Tensor
    # With config.cache_fp8: the fp8 copies shared by this weight and every view of it
    # (fp8/weight_cache.py says when they are valid).
    _cache: WeightQuantCache | None

    @staticmethod
    def __new__(cls, data: torch.Tensor, config: WeightConfig):
        return wrapper_of(cls, data, data.dtype)

    def __init__(self, data: torch.Tensor, config: WeightConfig):
        self._data = data
        self.config = config
        self._cache = None
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
        self, data: torch.Tensor, cache: WeightQuantCache | None, watch: bool = True
    ) -> "Float8MoEWeight":
        """A weight computed from this one: same config, the given fp8 cache, which treats a
        write into ``data`` as a change of the values if ``watch``."""
        derived = Float8MoEWeight(data, replace(self.config, cache_fp8=False))
        derived.config, derived._cache = self.config, cache
        if cache is not None and watch:
            cache.watch(data)
        return derived

    def _values(self) -> torch.Tensor:
        """The plain values this weight holds."""
        return self._data

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
        return ["_data"], self.config

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, config, outer_size, outer_stride):
        return cls(inner_tensors["_data"], config)

    def _cached_quantizer(self) -> CachedWeightQuantizer | None:
        """This weight's fp8 cache as the fp8 GEMM's quantizer, where it has one."""
        # Compiled graphs quantize inline: a Python-side cache would be baked into the trace.
        if self._cache is None or torch.compiler.is_compiling():
            return None
        return CachedWeightQuantizer(self._cache)

    def fp8_operand(self, transpose: bool = False):
        b = _Unwrap.apply(self)
        return (b.transpose(-2, -1) if transpose else b), self._cached_quantizer()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return WEIGHT_OPS(func, args, kwargs or {})

    fsdp_pre_all_gather = fsdp.pre_all_gather
    fsdp_post_all_gather = fsdp.post_all_gather


# What each kind of op does to a weight; the handlers are tensor_ops.py's.
WEIGHT_OPS = OpTable(Float8MoEWeight)
