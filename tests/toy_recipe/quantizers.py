"""The per-tensor recipe's quantizers (plain torch ops, the emulated path)."""

import torch

from torchtitan_fp8_moe.fp8.quantize import rounded, scales_from_amax, to_fp8


def _per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``x`` and its one scale ``[1, 1]``."""
    scale = scales_from_amax(x.detach().abs().amax()).reshape(1, 1)
    return to_fp8(x, scale), scale


class PerTensorQuantizers:
    """``Quantizers``: one scale per activation tensor, one per expert of a weight."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _per_tensor(x)

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(x)

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``b [G, K, N]``, scales ``[G, 1, 1]``, which ``weight_transposed`` casts by too."""
        b = rounded(b, round_to)
        scales = scales_from_amax(b.detach().abs().amax(dim=(-2, -1), keepdim=True))
        return to_fp8(b, scales), scales, scales

    def weight_transposed(
        self, b: torch.Tensor, scales: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return to_fp8(rounded(b, round_to).transpose(-2, -1), scales), scales

    def per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        return (*_per_tensor(a), *_per_tensor(grad))

    def tokens_per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        return self.per_group_pair(a, grad, offs)
