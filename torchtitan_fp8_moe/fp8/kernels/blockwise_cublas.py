"""Blockwise fp8 grouped GEMMs through torch's blockwise ``scaled_mm`` (cuBLAS), one dense call
per token group, where the GPU and the shapes allow; ``blockwise_gemm.py``'s Triton kernels
elsewhere.

Same operands and products as the Triton kernels (``blockwise_gemm.py``): on an H200 with torch
2.11 the outputs were equal bit for bit and the GEMMs faster: forward 1.4x-1.5x, input gradient
1.3x-1.5x, weight gradient 1.5x-1.8x at Scout's and DeepSeek-V3's shapes
(docs/benchmarks/archive/2026-12-04-cublas-blockwise/). cuBLAS wants decode scales (the inverses
of ours, exact for powers of 2) laid out column-major, and each group's bounds on the host
(``fp8/host_offsets.py``: read once per offsets tensor, a copy that waits for the GPU, so this
path is not CUDA-graph safe); under torch.compile it is one opaque op.

Used when: the device runs a blockwise ``scaled_mm`` (probed once per device: Hopper with a
cuBLAS that has it), the output is bf16, both matrix dims of the weight are multiples of 128,
the weight's data has its contraction dim contiguous (as ``blockwise_quantize.py`` writes it),
and every group's token count is a multiple of 128 (the recipe's token alignment on CUDA).
"""

import functools

import torch
from torch.nn.functional import ScalingType

from .. import host_offsets
from ..opaque import compile_opaque
from . import blockwise_gemm
from .blockwise_quantize import BLOCK

_TILE = [ScalingType.BlockWise1x128.value]
_BLOCK = [ScalingType.BlockWise128x128.value]
# cuBLAS reads a 128x128 scale's contraction blocks in columns padded to 4 floats (16 bytes).
_BLOCK_SCALE_ROWS = 4


def _inverse_column_major(scale: torch.Tensor, rows_multiple: int = 1) -> torch.Tensor:
    """``1 / scale`` with its last two dims column-major, as cuBLAS reads block scales; the rows
    (a 128x128 scale's contraction blocks) padded to ``rows_multiple``, as cuBLAS wants them."""
    rows, cols = scale.shape[-2:]
    padded = -(-rows // rows_multiple) * rows_multiple
    make = torch.empty if padded == rows else torch.ones  # the padding is never read
    inverse = make((*scale.shape[:-2], cols, padded), dtype=scale.dtype, device=scale.device)
    torch.reciprocal(scale.transpose(-2, -1), out=inverse[..., :rows])
    return inverse.transpose(-2, -1)


@functools.cache
def _device_has_blockwise_scaled_mm(device: torch.device) -> bool:
    """Whether torch's blockwise ``scaled_mm`` runs here (cuBLAS 12.9+ on Hopper): one small
    call. Anything else (an older cuBLAS, another GPU's scale layouts, an older torch) raises."""
    fp8 = torch.ones(BLOCK, BLOCK, device=device).to(torch.float8_e4m3fn)
    ones = torch.ones(BLOCK, 1, device=device)
    block_scale = _inverse_column_major(ones[:1], _BLOCK_SCALE_ROWS)
    try:
        torch._scaled_mm_v2(
            fp8, fp8.t(), [_inverse_column_major(ones)], _TILE, [], [block_scale], _BLOCK, [],
            None, torch.bfloat16, [], False,
        )  # fmt: skip
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        return False
    return True


def _usable(a: torch.Tensor, k: int, n: int, out_dtype: torch.dtype, spans) -> bool:
    """The rules of the module docstring that hold for both GEMMs, for a ``[K, N]`` weight."""
    return (
        a.is_cuda
        and out_dtype == torch.bfloat16
        and k % BLOCK == 0
        and n % BLOCK == 0
        and all((end - start) % BLOCK == 0 for start, end in spans)
        and _device_has_blockwise_scaled_mm(a.device)
    )


def _spans(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = host_offsets.values(offs)
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``blockwise_gemm.blockwise_grouped_mm``'s contract: ``a [M, K]`` row-major, ``b [G, K, N]``
    with K contiguous for cuBLAS (else the Triton kernel runs)."""
    blockwise_gemm.check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    spans = _spans(offs)
    k, n = b.shape[-2:]
    layout = a.stride(-1) == 1 and b.stride(-2) == 1
    if not (layout and _usable(a, k, n, out_dtype, spans)):
        return blockwise_gemm.blockwise_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype)
    out = torch.empty((a.shape[0], n), dtype=out_dtype, device=a.device)
    b_inverse = _inverse_column_major(b_scale, _BLOCK_SCALE_ROWS)
    for group, (start, end) in enumerate(spans):
        if end > start:
            torch.ops.aten._scaled_mm_v2.out(
                a[start:end], b[group], [_inverse_column_major(a_scale[start:end])], _TILE, [],
                [b_inverse[group]], _BLOCK, [], None, out_dtype, [], False, out=out[start:end],
            )  # fmt: skip
    out[spans[-1][1] :].zero_()  # rows of no group, 0 as the Triton kernel writes them
    return out


def _grouped_mm_wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``blockwise_gemm.blockwise_grouped_mm_wgrad``'s contract: ``[G, K, N]``, each group's
    ``a_g^T . g_g`` as ``scaled_mm(a_g^T [K, M_g], g_g [M_g, N])`` with 1x128 tiles along the
    tokens on both; for cuBLAS the operands token-contiguous (strides ``(1, M)``)."""
    blockwise_gemm.check_wgrad_operands(a, a_scale, g, g_scale, offs)
    spans = _spans(offs)
    k, n = a.shape[1], g.shape[1]
    layout = a.stride(0) == 1 and g.stride(0) == 1
    if not (layout and _usable(a, k, n, out_dtype, spans)):
        return blockwise_gemm.blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale, offs, out_dtype)
    out = torch.empty((len(spans), k, n), dtype=out_dtype, device=a.device)
    a_inverse, g_inverse = a_scale.reciprocal().t(), g_scale.reciprocal().t()  # column-major
    for group, (start, end) in enumerate(spans):
        if end == start:
            out[group].zero_()
            continue
        tiles = slice(start // BLOCK, end // BLOCK)
        torch.ops.aten._scaled_mm_v2.out(
            a[start:end].t(), g[start:end], [a_inverse[:, tiles]], _TILE, [],
            [g_inverse[:, tiles]], _TILE, [], None, out_dtype, [], False, out=out[group],
        )  # fmt: skip
    return out


def _grouped_mm_fake(a, a_scale, b, b_scale, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)


def _wgrad_fake(a, a_scale, g, g_scale, offs, out_dtype):
    return a.new_empty((offs.shape[0], a.shape[1], g.shape[1]), dtype=out_dtype)


# ``blockwise_gemm.py``'s two GEMMs, same arguments (all positional): ``blockwise_grouped_mm(a,
# a_scale, b, b_scale, offs, out_dtype)`` and ``blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale,
# offs, out_dtype)``.
blockwise_grouped_mm = compile_opaque("blockwise_cublas_grouped_mm", _grouped_mm, _grouped_mm_fake)
blockwise_grouped_mm_wgrad = compile_opaque(
    "blockwise_cublas_grouped_mm_wgrad", _grouped_mm_wgrad, _wgrad_fake
)
