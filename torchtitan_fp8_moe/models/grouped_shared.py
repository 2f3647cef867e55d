"""Llama4's shared expert as torchtitan's original Llama4 stored it (the seed's layout): a
grouped-experts module with one expert, weights ``[1, hidden, dim]`` / ``[1, dim, hidden]``,
run as 3D x 3D ``torch._grouped_mm`` without offsets."""

import torch
import torch.nn.functional as F
from torchtitan.models.moe.moe import GroupedExperts


class GroupedSharedExpert(GroupedExperts):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=1, use_grouped_mm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> ``[..., dim]``: every token through the one expert."""
        tokens = x.reshape(1, -1, x.shape[-1]).bfloat16()
        w1, w2, w3 = (w.bfloat16().transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch._grouped_mm(tokens, w1)) * torch._grouped_mm(tokens, w3)
        return torch._grouped_mm(h, w2).view(x.shape).type_as(x)
