"""The blockwise recipe's grouped GEMMs on DeepGEMM's sm90 fp8 kernels (``deepinfer-gemm``, built
against the running torch), with the operands and scales of the blockwise recipe's quantizers
(``fp8/recipes/blockwise/``).

- Forward and input gradient: ``m_grouped_fp8_gemm_nt_contiguous`` with the prefix-sum group
  layout, which is our ``offs`` as it is (no row-to-group index, no host read): ``a [M, K]``
  row-major with 1x128 tile scales, ``b[g]`` read as ``[N, K]`` (K contiguous, as the recipe's
  weight copies are laid out) with 128x128 block scales. Each group must start at a multiple of
  128 rows (the recipe's token alignment on CUDA); rows past ``offs[-1]`` come out 0, as from
  ``blockwise_gemm.py``.
- Weight gradient: ``k_grouped_fp8_gemm_nt_contiguous`` (sm90's k-grouped form, ``nt``): per group
  ``g_g^T [N, T_g] x a_g [T_g, K]`` into fp32, both operands 1x128 along the group's tokens. The
  kernel reads each group's ``[N, T_g]`` and ``[K, T_g]`` blocks one after the other, so the
  token-contiguous operands are laid out per group first, and it takes the groups' token counts
  on the host (``host_offsets``).

DeepGEMM multiplies by decode scales (the inverses of ours: exact, powers of 2). Shapes it does not
take (a matrix dim of the weight not a multiple of 128, output not bf16, groups not 128-aligned)
run on ``blockwise_cublas.py``'s kernels: the same products up to accumulation order.
"""

import functools
from collections.abc import Callable

import torch

from .. import host_offsets
from ..opaque import compile_opaque
from . import blockwise_cublas, blockwise_gemm
from .triton_blockwise import BLOCK


def _deep_gemm():
    import deep_gemm  # imported by ``gemm_backends`` when the backend loads

    return deep_gemm


def _spans(ends: list[int]) -> list[tuple[int, int]] | None:
    """Each group's (start, end) tokens, or None where a group is no multiple of 128 tokens."""
    spans = list(zip([0, *ends[:-1]], ends, strict=True)) if ends else []
    return spans if spans and all((e - s) % BLOCK == 0 for s, e in spans) else None


def _serves(k: int, n: int, out_dtype: torch.dtype) -> bool:
    return k % BLOCK == 0 and n % BLOCK == 0 and out_dtype == torch.bfloat16


def _grouped_mm_by(read_ends: Callable, a, a_scale, b, b_scale, offs, out_dtype) -> torch.Tensor:
    blockwise_gemm.check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    k, n = b.shape[-2:]
    ends = read_ends(offs) if a.stride(-1) == 1 and _serves(k, n, out_dtype) else []
    if not _spans(ends):
        return blockwise_cublas.blockwise_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype)
    out = torch.empty((a.shape[0], n), dtype=out_dtype, device=a.device)
    _deep_gemm().m_grouped_fp8_gemm_nt_contiguous(
        (a, a_scale.reciprocal()),
        # [G, N, K] K-major: the weight copy as it is where it has K contiguous, else copied.
        (b.transpose(-2, -1).contiguous(), b_scale.transpose(-2, -1).reciprocal().contiguous()),
        out,
        offs,
        disable_ue8m0_cast=True,
        use_psum_layout=True,
    )
    out[ends[-1] :].zero_()  # rows of no group
    return out


def _per_group_blocks(t: torch.Tensor, spans) -> torch.Tensor:
    """``t [C, M]`` (token-contiguous data, transposed) as each group's ``[C, T_g]`` block, one
    after the other, flat: one copy of each group's tokens, 8 bytes at a time where the rows
    allow (torch copies fp8 one byte per element)."""
    columns, width = t.shape
    # Every group is a multiple of 128 tokens (``_spans``): whole words.
    word = 8 if width % 8 == 0 else 1
    source = t.view(torch.int64) if word == 8 else t
    blocks = source.new_empty(spans[-1][1] * columns // word)
    for start, end in spans:
        block = blocks[start * columns // word : end * columns // word]
        block.view(columns, (end - start) // word).copy_(source[:, start // word : end // word])
    return blocks.view(t.dtype)


def _wgrad_by(read_ends: Callable, a, a_scale, g, g_scale, offs, out_dtype) -> torch.Tensor:
    blockwise_gemm.check_wgrad_operands(a, a_scale, g, g_scale, offs)
    k, n = a.shape[1], g.shape[1]
    ends = read_ends(offs) if _serves(k, n, out_dtype) else []
    spans = _spans(ends)
    if not spans or ends[-1] == 0:
        return blockwise_cublas.blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale, offs, out_dtype)
    tiles = ends[-1] // BLOCK  # the global 128-token tiles, each within one group
    sizes = [end - start for start, end in spans]
    # [G, N, K]: the layout of torchtitan's expert weights, so autograd accumulates it as is.
    out = torch.zeros((len(spans), n, k), dtype=torch.float32, device=a.device)
    _deep_gemm().k_grouped_fp8_gemm_nt_contiguous(
        (_per_group_blocks(g.t(), spans), g_scale[:tiles].t().reciprocal().contiguous()),
        (_per_group_blocks(a.t(), spans), a_scale[:tiles].t().reciprocal().contiguous()),
        out,
        sizes,
        torch.diff(offs, prepend=offs.new_zeros(1)),  # the same sizes, on the device
        out,
    )
    return out.to(out_dtype).transpose(-2, -1)


def _read(offs: torch.Tensor) -> list[int]:
    return offs.tolist()


def _grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``blockwise_gemm.blockwise_grouped_mm``'s contract on DeepGEMM."""
    return _grouped_mm_by(_read, a, a_scale, b, b_scale, offs, out_dtype)


def _wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``blockwise_gemm.blockwise_grouped_mm_wgrad``'s contract on DeepGEMM."""
    return _wgrad_by(_read, a, a_scale, g, g_scale, offs, out_dtype)


def _grouped_mm_fake(a, a_scale, b, b_scale, offs, out_dtype):
    blockwise_gemm.check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)


def _wgrad_fake(a, a_scale, g, g_scale, offs, out_dtype):
    blockwise_gemm.check_wgrad_operands(a, a_scale, g, g_scale, offs)
    return blockwise_gemm.empty_wgrad(offs.shape[0], a.shape[1], g.shape[1], out_dtype, a.device)


# The GEMMs of ``blockwise_cublas.py``'s signatures; eager calls keep the offsets' host values per
# tensor, compiled code reads them at every call (one opaque op).
blockwise_grouped_mm = compile_opaque(
    "blockwise_deepgemm_grouped_mm",
    _grouped_mm,
    _grouped_mm_fake,
    eager=functools.partial(_grouped_mm_by, host_offsets.values),
)
blockwise_grouped_mm_wgrad = compile_opaque(
    "blockwise_deepgemm_grouped_mm_wgrad",
    _wgrad,
    _wgrad_fake,
    eager=functools.partial(_wgrad_by, host_offsets.values),
)
