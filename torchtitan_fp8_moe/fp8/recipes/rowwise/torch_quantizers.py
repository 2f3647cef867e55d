"""The rowwise recipe's quantizers in plain torch ops (any device; the emulated path)."""

import torch

from ...gemm import per_token, token_groups
from ...quantize import amax_along, quantize_rowwise, rounded, scales_from_amax, to_fp8


class RowwiseTorchQuantizers:
    """``interface.Quantizers``: one power-of-2 scale per row along each GEMM's contraction."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
        return quantize_rowwise(x, dim=-1)

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of tokens another GEMM multiplies too (``RowwiseTritonQuantizers.tokens``)."""
        return self.rows(x)

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` -> fp8 ``[G, K, N]``, scales ``[G, 1, N]`` (over K), and the amax over N
        ``[G, K]`` that ``weight_transposed`` scales by (the CUDA kernel takes it in the same
        read); of ``b.to(round_to)``'s values (``quantize.rounded``)."""
        b = rounded(b, round_to)
        return *quantize_rowwise(b, dim=-2), amax_along(b, dim=-1)

    def weight_transposed(
        self, b: torch.Tensor, amax_over_n: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` and its amax over N -> fp8 of ``b^T [G, N, K]``, scales ``[G, 1, K]``."""
        scales = scales_from_amax(amax_over_n).unsqueeze(-2)
        return to_fp8(rounded(b, round_to).transpose(-2, -1), scales), scales

    def per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """Per-group scales over tokens for the weight-gradient GEMM: ``(a_fp8, a_scales [G, K],
        grad_fp8, grad_scales [G, N])``. Rows of no group quantize to zero."""
        groups = token_groups(offs, a.shape[0])
        num_groups = offs.shape[0]
        return (
            *_per_group_along_tokens(a, groups, num_groups),
            *_per_group_along_tokens(grad, groups, num_groups),
        )

    def tokens_per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """``per_group_pair`` of tokens another weight gradient casts too
        (``RowwiseTritonQuantizers.tokens_per_group_pair``)."""
        return self.per_group_pair(a, grad, offs)


TORCH_QUANTIZERS = RowwiseTorchQuantizers()


def _amax_per_group(x: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[G, C]`` amax of |x| over each group's tokens (0 for an empty group): one pass over
    the tokens. NaN propagates, as in ``amax``; rows of no group land in a dropped extra row."""
    magnitude = x.detach().abs().float()
    amax = magnitude.new_zeros((num_groups + 1, x.shape[1]))
    index = groups[:, None].expand_as(magnitude)
    return amax.scatter_reduce(0, index, magnitude, "amax", include_self=True)[:num_groups]


def _per_group_along_tokens(x: torch.Tensor, groups: torch.Tensor, num_groups: int):
    scales = scales_from_amax(_amax_per_group(x, groups, num_groups))
    return to_fp8(x, per_token(scales, groups)), scales
