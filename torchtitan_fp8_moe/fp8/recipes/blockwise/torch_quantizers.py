"""The blockwise recipe's quantizers in plain torch ops (any device; the emulated path).

Same scale and cast rules as ``quantize.py``, over blocks of BLOCK = 128
(``docs/numerics.md``, the blockwise contract):
- activations and output gradients ``[M, C]``: 1 x 128 tiles along C (the contraction),
  scales ``[M, ceil(C / 128)]``;
- weights ``b [G, K, N]``: 128 x 128 blocks of each expert, scales ``[G, ceil(K / 128),
  ceil(N / 128)]``; the input gradient multiplies the same fp8 blocks transposed;
- the weight gradient's operands ``[M, C]``: 128 x 1 tiles along the tokens, each group's blocks
  starting at its own first token, scales ``[blocks, C]``.
A partial block at a ragged edge is a smaller block (its amax is over the elements that exist).
Nothing reads the group offsets on the host, so these trace under torch.compile(fullgraph=True).
"""

import torch
import torch.nn.functional as F

from ...gemm import token_groups
from ...quantize import amax_along, rounded, scales_from_amax, to_fp8

BLOCK = 128


def _padded_to_blocks(x: torch.Tensor, *dims: int) -> torch.Tensor:
    """``x`` zero-padded at the end of each of ``dims`` (negative) to a multiple of BLOCK.
    Zeros change no amax (a partial block's amax is over its own elements)."""
    pad = [0] * (2 * x.dim())
    for dim in dims:
        pad[2 * (-dim - 1) + 1] = -x.shape[dim] % BLOCK
    return F.pad(x, pad) if any(pad) else x


def _block_of(size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(size, device=device) // BLOCK


# Gathers, not repeat_interleave and a slice: inductor (torch 2.13, CPU) lowered that form of a
# ragged last tile wrongly (the second tile's elements got other scales).
def expand_tiles(scales: torch.Tensor, size: int) -> torch.Tensor:
    """Scales of 1 x 128 tiles ``[..., ceil(size / 128)]`` as one per element ``[..., size]``."""
    return scales[..., _block_of(size, scales.device)]


def expand_blocks(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Scales of 128 x 128 blocks ``[G, ceil(rows / 128), ceil(cols / 128)]`` as one per
    element ``[G, rows, cols]``."""
    per_row = scales[..., _block_of(rows, scales.device), :]
    return per_row[..., _block_of(cols, scales.device)]


def token_blocks(offs: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
    """``[M]`` index of each token's 128-token block, the blocks of each group starting at its
    first token and numbered in token order, and the number of block slots (an upper bound,
    static: ``tokens // 128 + groups``; tokens of no group get that index, one past the last)."""
    groups = token_groups(offs, tokens)
    num_groups = offs.shape[0]
    slots = tokens // BLOCK + num_groups
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    blocks_per_group = (ends - starts + BLOCK - 1) // BLOCK
    first_block = torch.cumsum(blocks_per_group, 0) - blocks_per_group
    group = groups.clamp(max=num_groups - 1)  # tokens of no group are masked below
    token = torch.arange(tokens, device=offs.device)
    block = first_block[group] + (token - starts[group]) // BLOCK
    return torch.where(groups < num_groups, block, slots), slots


def per_block_token_scales(scales: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[M, C]``: row m holds the scales ``[slots, C]`` of token m's block (0 for tokens of no
    group, index ``slots``)."""
    no_group = scales.new_zeros((1, scales.shape[1]))
    return torch.cat([scales, no_group])[blocks]


def _per_token_block(x: torch.Tensor, blocks: torch.Tensor, slots: int):
    magnitude = x.detach().abs().float()
    amax = magnitude.new_zeros((slots + 1, x.shape[1]))
    index = blocks[:, None].expand_as(magnitude)
    amax = amax.scatter_reduce(0, index, magnitude, "amax", include_self=True)[:slots]
    scales = scales_from_amax(amax)
    return to_fp8(x, per_block_token_scales(scales, blocks)), scales


class BlockwiseTorchQuantizers:
    """``interface.Quantizers``: 1 x 128 activation tiles, 128 x 128 weight blocks, 128 x 1
    tiles of each group's tokens."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, C]`` -> fp8 ``[M, C]``, scales ``[M, ceil(C / 128)]`` (1 x 128 tiles)."""
        tokens, size = x.shape
        tiles = _padded_to_blocks(x, -1).view(tokens, -1, BLOCK)
        scales = scales_from_amax(amax_along(tiles, dim=-1))
        return to_fp8(x, expand_tiles(scales, size)), scales

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of tokens another GEMM multiplies too (``RowwiseTritonQuantizers.tokens``)."""
        return self.rows(x)

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` -> fp8 ``[G, K, N]``, scales ``[G, ceil(K / 128), ceil(N / 128)]``, and the
        scales again: what ``weight_transposed`` casts the transposed blocks by; of
        ``b.to(round_to)``'s values (``quantize.rounded``)."""
        b = rounded(b, round_to)
        groups, k, n = b.shape
        blocks = _padded_to_blocks(b.detach(), -2, -1)
        blocks = blocks.view(
            groups, blocks.shape[1] // BLOCK, BLOCK, blocks.shape[2] // BLOCK, BLOCK
        )
        amax = blocks.abs().amax(dim=(2, 4)).float()  # NaN propagates, as in amax_along
        scales = scales_from_amax(amax)
        return to_fp8(b, expand_blocks(scales, k, n)), scales, scales

    def weight_transposed(
        self, b: torch.Tensor, scales: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``b [G, K, N]`` and its block scales -> fp8 of ``b^T [G, N, K]`` with scales
        ``[G, ceil(N / 128), ceil(K / 128)]``: the forward's fp8 blocks transposed, bit for bit
        (each element is cast with the same multiplier)."""
        scales_t = scales.transpose(-2, -1)
        b = rounded(b, round_to)
        _, k, n = b.shape
        return to_fp8(b.transpose(-2, -1), expand_blocks(scales_t, n, k)), scales_t

    def per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """128 x 1 tiles over each group's tokens for the weight-gradient GEMM: ``(a_fp8,
        a_scales [slots, K], grad_fp8, grad_scales [slots, N])`` (``token_blocks`` numbers the
        slots). Rows of no group quantize to zero."""
        blocks, slots = token_blocks(offs, a.shape[0])
        return (*_per_token_block(a, blocks, slots), *_per_token_block(grad, blocks, slots))

    def tokens_per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """``per_group_pair`` of tokens another weight gradient casts too
        (``RowwiseTritonQuantizers.tokens_per_group_pair``)."""
        return self.per_group_pair(a, grad, offs)


TORCH_QUANTIZERS = BlockwiseTorchQuantizers()
