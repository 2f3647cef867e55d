"""Llama4's shared expert as torchtitan's original Llama4 stored it (the seed's layout): a
grouped-experts module with one expert, weights ``[1, hidden, dim]`` / ``[1, dim, hidden]``,
run as 3D x 3D ``torch._grouped_mm`` without offsets.

Under tensor parallelism it is split like the FeedForward shared expert torchtitan's plan splits
(Colwise w1/w3, Rowwise w2): w1/w3 on the hidden dim (1), w2 on the hidden dim (2), so each rank
computes a partial sum of the output from its hidden slice, which is what torchtitan's MoE plan
declares its output to be (``Partial``) before reducing it.
"""

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs


class GroupedSharedExpert(GroupedExperts):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=1, use_grouped_mm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]``: every token through the one expert."""
        tokens = x.reshape(1, -1, x.shape[-1]).bfloat16()
        # Under tensor parallelism each rank multiplies its hidden slice (to_local).
        w1, w2, w3 = (
            (w.to_local() if isinstance(w, DTensor) else w).bfloat16().transpose(-2, -1)
            for w in (self.w1, self.w2, self.w3)
        )
        h = F.silu(torch._grouped_mm(tokens, w1)) * torch._grouped_mm(tokens, w3)
        return torch._grouped_mm(h, w2).view(x.shape).type_as(x)


class GroupedSharedMoE(MoE):
    """torchtitan's MoE with the shared expert at ``shared_expert`` as a ``GroupedSharedExpert``
    in place of the FeedForward at ``shared_experts``."""

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        num_shared = moe_args.num_shared_experts
        super().__init__(replace(moe_args, num_shared_experts=0), dim, hidden_dim)
        self.shared_expert = (
            GroupedSharedExpert(dim, hidden_dim * num_shared) if num_shared > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_expert is None else out + self.shared_expert(x)

    def init_weights(self, init_std: float, buffer_device: torch.device):
        super().init_weights(init_std, buffer_device)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)


def _split_hidden_dim(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if name:  # distribute_module calls this for every submodule; the weights are on the root
        return
    for weight, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
        param = getattr(module, weight)
        module.register_parameter(
            weight, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)]))
        )


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    # Every rank holds all tokens; each rank's input gradient is a partial sum over its hidden
    # slice, reduced over the mesh in backward.
    (x,) = inputs
    x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
    return (x.to_local(grad_placements=(Partial(),)),)


def tensor_parallelize_shared_expert(expert: GroupedSharedExpert, tp_mesh: DeviceMesh) -> None:
    """Split ``expert``'s hidden dim over ``tp_mesh`` (module docstring)."""
    distribute_module(expert, tp_mesh, _split_hidden_dim, _replicated_input)
