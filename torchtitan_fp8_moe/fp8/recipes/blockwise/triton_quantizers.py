"""The blockwise recipe's quantizers on CUDA: ``torch_quantizers.py``'s rules and signatures as
the Triton casts of ``kernels/triton_blockwise.py``, bit for bit the same fp8 values and scales.

The data come laid out as the blockwise GEMMs read them fastest (the contraction dim contiguous):
activations row-major, the forward weight K-major, its transposed copy N-major, the weight
gradient's operands token-major. The weight gradient's 128-token blocks are the global ones,
each group's own since the CUDA recipe aligns group starts to 128 tokens.
"""

import torch

from ...kernels.triton_blockwise import (
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    quantize_128x128_transposed,
)
from ...quantize import rounded


class BlockwiseTritonQuantizers:
    """``interface.Quantizers`` on CUDA: ``BlockwiseTorchQuantizers``' values, in our kernels."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, C]`` -> fp8 ``[M, C]`` row-major, scales ``[M, ceil(C / 128)]`` (1 x 128
        tiles)."""
        return quantize_1x128(x)

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of tokens another GEMM multiplies too (``RowwiseTritonQuantizers.tokens``)."""
        return self.rows(x)

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` -> fp8 ``[G, K, N]`` (K contiguous), scales ``[G, ceil(K / 128),
        ceil(N / 128)]``, and the scales again: what ``weight_transposed`` casts by. (The
        transposed copy is not made here: the backward would keep it, the weight's size in fp8,
        from the forward on.) Of ``b.to(round_to)``'s values (``quantize.rounded``)."""
        data, scales, _ = quantize_128x128(rounded(b, round_to))
        return data, scales, scales

    def weight_transposed(
        self, b: torch.Tensor, scales: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 of ``b^T [G, N, K]`` (N contiguous) with scales ``[G, ceil(N / 128),
        ceil(K / 128)]``: the forward's fp8 blocks transposed, bit for bit."""
        data_t = quantize_128x128_transposed(rounded(b, round_to), scales)
        return data_t, scales.transpose(-2, -1)

    def per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """128 x 1 tiles over each group's tokens: ``(a_fp8, a_scales [slots, K], grad_fp8,
        grad_scales [slots, N])``, data token-contiguous, rows of no group 0."""
        return (*quantize_128x1(a, offs), *quantize_128x1(grad, offs))

    def tokens_per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """``per_group_pair`` of tokens another weight gradient casts too
        (``RowwiseTritonQuantizers.tokens_per_group_pair``)."""
        return self.per_group_pair(a, grad, offs)


TRITON_QUANTIZERS = BlockwiseTritonQuantizers()
