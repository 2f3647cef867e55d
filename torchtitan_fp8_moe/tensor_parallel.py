"""Tensor parallelism of converted experts: multiply the local shards in fp8.

Under tensor parallelism torchtitan turns expert weights into DTensors over the TP mesh whose
local shards are our ``Float8MoEWeight``. Grouped experts multiply ``w.to_local()`` themselves, so
their local shards reach our fp8 overrides. ``nn.Linear`` multiplies the DTensors, which reaches
the local shards as ``aten.mm`` below those overrides, where the weight tensor refuses it
(``weight/``). ``Float8MoELinear`` is the ``nn.Linear`` of a converted FeedForward: it
multiplies the local shards with ``F.linear`` (fp8 forward, input gradient and weight gradient)
and gives back the DTensor that torchtitan's ``ColwiseParallel`` / ``RowwiseParallel`` expect.

What per-shard scales do to the numbers, per case (fp8 rowwise scales run along each GEMM's
contraction dim, so a case is exact when the shard keeps that dim whole):
- colwise (w1, w3; routed w1/w3 under ETP, sharded on their output dim): forward and weight
  gradient identical to the unsharded model (the contraction dims, input features and tokens,
  are whole); the input gradient contracts over the sharded output features, so each rank
  scales its partial sum over its own features: different rounding, within the SQNR bars.
- rowwise (w2; routed w2 under ETP, sharded on their input dim): the forward contracts over the
  sharded input features (per-shard scales, partial sums: within the bars); input and weight
  gradients identical.
- expert parallelism splits whole experts: identical.
"""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def _is_shard(placement, dim: int, ndim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == dim % ndim


def tensor_parallel_linear(x: DTensor, weight: DTensor) -> DTensor:
    """``F.linear(x, weight)`` of a TP-sharded converted weight, in fp8 on the local shards."""
    if weight.device_mesh.ndim != 1 or not isinstance(x, DTensor):
        raise NotImplementedError(
            f"float8_moe: a converted linear weight {list(weight.shape)} on a "
            f"{weight.device_mesh.ndim}-D mesh with input {type(x).__name__}: only torchtitan's "
            "1-D tensor-parallel plans (ColwiseParallel, RowwiseParallel) are supported"
        )
    (w_placement,), (x_placement,) = weight.placements, x.placements
    if _is_shard(w_placement, 0, 2) and isinstance(x_placement, Replicate):
        # Colwise: every rank has all input features; its output features are its shard. The
        # input gradient is each rank's partial sum over its output features.
        x_local = x.to_local(grad_placements=(Partial(),))
        out_placement = Shard(x.ndim - 1)
    elif _is_shard(w_placement, 1, 2) and _is_shard(x_placement, -1, x.ndim):
        # Rowwise: input features sharded like the weight's; the output is a partial sum.
        x_local = x.to_local()
        out_placement = Partial()
    else:
        raise NotImplementedError(
            f"float8_moe: a converted linear weight {list(weight.shape)} placed {w_placement} "
            f"with input placed {x_placement} is not a colwise or rowwise plan; supported: "
            "weight Shard(0) with input Replicate, weight Shard(1) with input Shard(-1)"
        )
    out = F.linear(x_local, weight.to_local())  # the local shard is a Float8MoEWeight: fp8
    return DTensor.from_local(out, weight.device_mesh, (out_placement,), run_check=False)


class Float8MoELinear(nn.Linear):
    """The ``nn.Linear`` of a converted FeedForward expert (no bias): fp8 also under tensor
    parallelism."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return tensor_parallel_linear(x, self.weight)
        return F.linear(x, self.weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Float8MoELinear":
        """A ``Float8MoELinear`` holding ``linear``'s weight parameter itself. A subclass of
        ``nn.Linear`` (torchtitan 0.3's ``Linear``) keeps its class too, mixed in below this
        one, with its state: 0.3's module protocol, parameter init and sharding config."""
        if linear.bias is not None:
            raise ValueError(
                f"float8_moe: a FeedForward linear with a bias ({list(linear.bias.shape)}) is not "
                "supported; leave the module out of `float8_moe.fqns`"
            )
        if type(linear) is nn.Linear:
            with torch.device("meta"):
                converted = cls(linear.in_features, linear.out_features, bias=False)
            converted.weight = linear.weight
            return converted
        linear.__class__ = _mixed_in(cls, type(linear))
        return linear


@functools.cache
def _mixed_in(converted_cls: type, linear_cls: type) -> type:
    return type(f"Float8MoE{linear_cls.__name__}", (converted_cls, linear_cls), {})
