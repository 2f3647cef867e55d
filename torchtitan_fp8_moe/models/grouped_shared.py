"""Llama4's shared expert as torchtitan's original Llama4 stored it (the seed's layout): a
grouped-experts module with one expert, weights ``[1, hidden, dim]`` / ``[1, dim, hidden]``,
run as 3D x 3D ``torch._grouped_mm`` without offsets."""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torchtitan.models.moe.moe import GroupedExperts, MoE, MoEArgs


class GroupedSharedExpert(GroupedExperts):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=1, use_grouped_mm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]``: every token through the one expert."""
        tokens = x.reshape(1, -1, x.shape[-1]).bfloat16()
        w1, w2, w3 = (w.bfloat16().transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
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
