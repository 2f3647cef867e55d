"""``LazyCastWeight``: the forward's cast of an fp32 parameter to bf16, holding no copy.

torchtitan's grouped experts call ``w.bfloat16()`` where FSDP does not cast. The cast holds the
fp32 values; its matmuls' quantizer (``LazyCastQuantizer``) rounds them to bf16 as it reads them
(the fp8 copies of a copied cast, bit for bit) and any other op sees them rounded to bf16, so no
bf16 copy of the weight lives from forward to backward. Views that keep the dtype stay lazy; a
write into the cast raises (it holds nothing to write into), and so does any use of it after its
parameter was written.
"""

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from ..fp8.weight_cache import Quantized, WeightQuantCache
from .base import shape_only_operand
from .config import WeightConfig
from .ops import Kind, OpTable, written_arguments
from .tensor import WEIGHT_OPS, Float8MoEWeight, wrapper_of

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class CastFrom:
    """The parameter a lazy cast was cast from, that parameter's version then, and the cast's
    dtype."""

    parameter: torch.Tensor
    version: int
    dtype: torch.dtype

    def check_unwritten(self) -> None:
        if self.parameter._version != self.version:
            raise RuntimeError(
                f"float8_moe: a {self.dtype} cast of a converted weight of shape "
                f"{list(self.parameter.shape)} was used after the weight was written; the cast "
                "is lazy (it holds no copy of the values). Cast again after the write."
            )


class LazyCastWeight(Float8MoEWeight):
    """A lazy cast or a view of one. ``_data`` holds the parameter's values in this weight's
    layout, in their own dtype; ``_cache`` is the parameter's."""

    _cast_from: CastFrom

    @staticmethod
    def __new__(cls, data, config: WeightConfig, cache, cast_from: CastFrom):
        return wrapper_of(cls, data, cast_from.dtype)

    def __init__(
        self,
        data: torch.Tensor,
        config: WeightConfig,
        cache: WeightQuantCache | None,
        cast_from: CastFrom,
    ):
        self._data, self.config, self._cache, self._cast_from = data, config, cache, cast_from
        if cache is not None:
            cache.watch(data)

    def _lazy_view(self, data: torch.Tensor) -> "LazyCastWeight":
        return LazyCastWeight(data, self.config, self._cache, self._cast_from)

    def _source_values(self) -> torch.Tensor:
        """``_data``, after checking that the parameter was not written since the cast."""
        self._cast_from.check_unwritten()
        return self._data

    def _values(self) -> torch.Tensor:
        return self._source_values().to(self.dtype)  # the cast's copy, made where it is read

    def fp8_operand(self, transpose: bool = False):
        # The GEMM quantizes the parameter's values; b carries the cast's shape and dtype, so
        # the weight gradient comes back in the cast's dtype.
        b, values = shape_only_operand(self), self._data
        if transpose:
            b, values = b.transpose(-2, -1), values.transpose(-2, -1)
        cache = None if torch.compiler.is_compiling() else self._cache
        return b, LazyCastQuantizer(values, self._cast_from, cache)

    def __repr__(self) -> str:
        return f"LazyCastWeight({self.dtype}, {self.config}, data={self._data!r})"

    def __tensor_flatten__(self):
        raise NotImplementedError(
            f"float8_moe: a lazy {self.dtype} cast of a converted weight "
            f"{list(self.shape)} cannot cross a compiled region's boundary (a graph break "
            "between the cast and its matmul); compile the cast with its matmul as one "
            "graph (fullgraph=True, as torchtitan does) or set WeightConfig(lazy_cast=False)"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # torch calls a subclass's first: every op with a lazy cast among its arguments.
        return LAZY_CAST_OPS(func, args, kwargs or {})


class LazyCastQuantizer:
    """The fp8 GEMM's quantizer of a lazy cast's operand ``b`` (which holds only the cast's
    shape and dtype): the parameter's values, rounded to the cast's dtype as they are read,
    through the parameter's cache if it has one, so the fp8 copies are a copied cast's, bit for
    bit."""

    def __init__(self, values: torch.Tensor, cast_from: CastFrom, cache: WeightQuantCache | None):
        self.values = values  # the parameter's values in b's layout
        self.cast_from = cast_from
        self.cache = cache
        self.keeps_copies = cache is not None

    def __call__(self, b: torch.Tensor, orientation: str, quantize) -> Quantized:
        self.cast_from.check_unwritten()
        values = self.values
        if values.dim() == b.dim() - 1 and b.shape[0] == 1:
            values = values.unsqueeze(0)  # fp8_matmul's 2D weight as one group
        if values.shape != b.shape:
            raise AssertionError(
                f"float8_moe: the cast weight's values {list(values.shape)} do not match the "
                f"GEMM operand {list(b.shape)}"
            )

        def quantize_rounded(values):
            return quantize(values, round_to=b.dtype)

        if self.cache is None:
            return quantize_rounded(values)
        # Keyed apart from the unrounded values' own copies (an fp32 matmul of the parameter).
        return self.cache.quantize(values, (orientation, b.dtype), quantize_rounded)


def lazy_cast_dtype(func, args, kwargs) -> torch.dtype | None:
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


def lazy_cast(source: Float8MoEWeight, dtype: torch.dtype) -> LazyCastWeight:
    """The cast of ``source`` to ``dtype``, holding ``source``'s values and fp8 cache."""
    cast_from = CastFrom(source, source._version, dtype)
    return LazyCastWeight(source._data, source.config, source._cache, cast_from)


# What an op with a lazy cast among its arguments does: views and writes here, the rest as
# for any weight (tensor_ops.py), which sees the cast's values.
LAZY_CAST_OPS = OpTable(Float8MoEWeight, fallback=WEIGHT_OPS)


@LAZY_CAST_OPS.implements(Kind.VIEW)
def _view(func, args, kwargs, weights):
    """A view of one lazy cast that keeps the dtype is itself lazy: the view of its ``_data``
    (a shape or stride view picks the same elements in either dtype). Views that read the
    bytes (``view(dtype)``) see the cast values."""
    if len(weights) == 1:
        (source,) = weights
        plain_args, plain_kwargs = pytree.tree_map_only(
            LazyCastWeight, lambda t: t._source_values(), (args, kwargs)
        )
        out = func(*plain_args, **plain_kwargs)
        leaves = pytree.tree_leaves(out)
        if all(isinstance(t, torch.Tensor) and t.dtype == source._data.dtype for t in leaves):
            return pytree.tree_map_only(torch.Tensor, source._lazy_view, out)
    return WEIGHT_OPS.handler(Kind.VIEW)(func, args, kwargs, weights)


@LAZY_CAST_OPS.implements(Kind.MUTATION)
def _write(func, args, kwargs, weights):
    for weight in written_arguments(func, args, kwargs):
        if isinstance(weight, LazyCastWeight):
            raise NotImplementedError(
                f"float8_moe: {func} writes into a {weight.dtype} cast of a converted weight "
                f"{list(weight.shape)}, which holds no copy of its own (the cast is lazy); "
                "write into the weight, or into `.clone()` of the cast"
            )
    return WEIGHT_OPS.handler(Kind.MUTATION)(func, args, kwargs, weights)
