"""``Float8GatheredWeight``: the unsharded expert weight that FSDP2 all-gathers as fp8 payloads
(``[float8_moe] fp8_all_gather``), usable as the right operand ``w^T`` of the fp8 matmuls and
nothing else."""

import torch
import torch.utils._pytree as pytree

from ..fp8.weight_cache import WeightPayloads
from .base import Fp8Weight, shape_only, shape_only_operand
from .config import WeightConfig
from .ops import Kind, OpTable


class Float8GatheredWeight(Fp8Weight):
    """The unsharded expert weight ``w [E, out, in]`` that FSDP2 all-gathers with
    ``fp8_all_gather``: the fp8 payloads of both orientations of the matmul operand ``w^T``
    (``fp8/gathered.py``), no high-precision values. It is the right operand ``w^T`` of fp8
    matmuls (``torch._grouped_mm(x, w.transpose(-2, -1), offs)``, 3D x 3D, bmm) and nothing
    else: its views are itself (detach, FSDP's as_strided, ``to_local``'s view_as) and that
    transpose; any other op raises rather than compute without the values (``GATHERED_OPS``).
    Its payloads are its inner tensors, so compiled graphs take it as an input (not as an
    output: a compiled function returning a view of it raises)."""

    # WeightPayloads of w^T, as gathered: forward data [E, in, out], input-gradient data
    # [E, out, in], and their scales as the recipe lays them out.
    forward_data: torch.Tensor
    forward_scales: torch.Tensor
    input_grad_data: torch.Tensor
    input_grad_scales: torch.Tensor
    transposed: bool  # this tensor is w^T, the matmul operand the payloads are of

    @staticmethod
    def __new__(cls, payloads: WeightPayloads, size, stride, dtype, config, transposed):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            size,
            strides=stride,
            dtype=dtype,
            device=payloads.forward_data.device,
            requires_grad=False,
        )

    def __init__(
        self, payloads: WeightPayloads, size, stride, dtype, config: WeightConfig, transposed
    ):
        for name, tensor in payloads._asdict().items():
            setattr(self, name, tensor)
        self.config = config
        self.transposed = transposed

    def _payloads(self) -> WeightPayloads:
        return WeightPayloads(*(getattr(self, name) for name in WeightPayloads._fields))

    def __tensor_flatten__(self):
        return list(WeightPayloads._fields), (self.dtype, self.config, self.transposed)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, flags, outer_size, outer_stride):
        dtype, config, transposed = flags
        payloads = WeightPayloads(**inner_tensors)
        return cls(payloads, outer_size, outer_stride, dtype, config, transposed)

    def _unsupported(self, use: str) -> NotImplementedError:
        return NotImplementedError(
            f"float8_moe: {use} on an expert weight of shape {list(self.shape)} all-gathered as "
            "fp8 payloads (`[float8_moe] fp8_all_gather`), which holds no high-precision "
            "values: only torch._grouped_mm, bmm, matmul or @ with w.transpose(-2, -1) as the "
            "right operand runs on it. Set `[float8_moe] fp8_all_gather = false` for this use."
        )

    def fp8_operand(self, transpose: bool = False) -> tuple[torch.Tensor, WeightPayloads]:
        if transpose:
            raise self._unsupported("F.linear")
        if not self.transposed:
            raise self._unsupported("a matmul with w itself (not w.transpose(-2, -1))")
        return shape_only_operand(self), self._payloads()

    def high_precision(self) -> torch.Tensor:
        raise self._unsupported("high_precision()")

    def __repr__(self) -> str:
        return (
            f"Float8GatheredWeight(shape={list(self.shape)}, dtype={self.dtype}, "
            f"transposed={self.transposed}, {self.config})"
        )

    def _view(self, like: torch.Tensor, transposed: bool) -> "Float8GatheredWeight":
        return Float8GatheredWeight(
            self._payloads(), like.shape, like.stride(), self.dtype, self.config, transposed
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
        return GATHERED_OPS(func, args, kwargs or {})


GATHERED_OPS = OpTable(Float8GatheredWeight)


@GATHERED_OPS.implements(Kind.UNRELATED_VALUES, Kind.NEW_WEIGHT)
def _shape_only(func, args, kwargs, weights):
    # zeros_like (FSDP's zero gradient), empty_like: the shape only, no values.
    plain_args, plain_kwargs = pytree.tree_map_only(
        Float8GatheredWeight, shape_only, (args, kwargs)
    )
    return func(*plain_args, **plain_kwargs)


@GATHERED_OPS.implements(Kind.VIEW)
def _view(func, args, kwargs, weights):
    meta_args, meta_kwargs = pytree.tree_map_only(Float8GatheredWeight, _meta_like, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)
    view = weights[0]._as_view(out) if isinstance(out, torch.Tensor) else None
    if view is None:
        raise weights[0]._unsupported(str(func))
    return view


@GATHERED_OPS.implements(
    Kind.MATMUL, Kind.METADATA_MUTATION, Kind.MUTATION, Kind.COPY, Kind.DERIVED, Kind.OTHER
)
def _unsupported(func, args, kwargs, weights):
    raise weights[0]._unsupported(str(func))


def _swap_last_two(values) -> tuple:
    return (*values[:-2], values[-1], values[-2])


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
