"""Blockwise fp8 grouped GEMMs through torch's blockwise ``scaled_mm`` (cuBLAS), one dense call
per token group, where the GPU and the shapes allow; ``blockwise_gemm.py``'s Triton kernels
elsewhere.

Same operands and products as the Triton kernels (``blockwise_gemm.py``): on an H200 with torch 2.11
the outputs were equal bit for bit and all three GEMMs (forward, input gradient, weight gradient)
faster at Scout's and DeepSeek-V3's shapes (docs/benchmarks/README.md). cuBLAS wants decode scales
(the inverses of ours, exact for powers of 2) laid out column-major, and each group's bounds on the
host (a copy that waits for the GPU, so this path is not CUDA-graph safe): eager calls read them
once per offsets tensor (``fp8/host_offsets.py``), compiled code (one opaque op) at every call,
since it may hand the op a reused buffer whose new values bumped no version.

Used when: the device runs a blockwise ``scaled_mm`` (probed once per device against fp32 math:
Hopper with a cuBLAS that has it; a warning says when not), the output is bf16, both matrix dims
of the weight are multiples of 128, the weight's data has its contraction dim contiguous (as
``triton_blockwise.py`` writes it), and every group's token count is a multiple of 128 (the
recipe's token alignment on CUDA).
"""

import functools
import warnings
from collections.abc import Callable

import torch
from torch.nn.functional import ScalingType

from .. import host_offsets
from ..opaque import compile_opaque
from ..quantize import FP8_DTYPE
from . import blockwise_gemm
from .triton_blockwise import BLOCK

_TILE_RECIPE = [ScalingType.BlockWise1x128.value]
_BLOCK_RECIPE = [ScalingType.BlockWise128x128.value]
# cuBLAS reads a 128x128 scale's contraction blocks in columns padded to 4 floats (16 bytes).
_BLOCK_SCALE_ROWS = 4


def _decode_scales(scale: torch.Tensor, rows_multiple: int = 1) -> torch.Tensor:
    """``1 / scale`` (what cuBLAS multiplies by) with its last two dims column-major, the rows
    (a 128x128 scale's contraction blocks) padded to ``rows_multiple``. The padding is filled
    with ones: cuBLAS reads past the blocks it needs only up to that padding."""
    rows, cols = scale.shape[-2:]
    padded = -(-rows // rows_multiple) * rows_multiple
    make = torch.empty if padded == rows else torch.ones
    inverse = make((*scale.shape[:-2], cols, padded), dtype=scale.dtype, device=scale.device)
    torch.reciprocal(scale.transpose(-2, -1), out=inverse[..., :rows])
    return inverse.transpose(-2, -1)


def _probe_error(device: torch.device) -> str | None:
    """Why torch's blockwise ``scaled_mm`` cannot serve here, or None: both scale pairings the
    GEMMs use, on random fp8 data and power-of-2 scales, against fp32 math."""
    gen = torch.Generator(device=device).manual_seed(0)
    size, blocks = 2 * BLOCK, 2

    def fp8(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(FP8_DTYPE)

    def multipliers(*shape):  # the package's scales: powers of 2 that the data was multiplied by
        exponents = torch.randint(-3, 4, shape, device=device, generator=gen)
        return torch.pow(2.0, exponents.float())

    a, b = fp8(size, size), fp8(size, size)  # a [M, K]; b [N, K], the GEMM's b^T
    a_scale = multipliers(size, blocks)
    a_values = a.float() / a_scale.repeat_interleave(BLOCK, 1)
    tiles = multipliers(size, blocks)  # b's 1x128 tiles: [N, Kb]
    block_scale = multipliers(blocks, blocks)  # b's 128x128 blocks: [Kb, Nb]
    block_values = block_scale.t().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    pairings = {  # name: (b's decode scales, their recipe, b's values)
        "1x128 x 1x128": (
            _decode_scales(tiles),
            _TILE_RECIPE,
            b.float() / tiles.repeat_interleave(BLOCK, 1),
        ),
        "1x128 x 128x128": (
            _decode_scales(block_scale, _BLOCK_SCALE_ROWS),
            _BLOCK_RECIPE,
            b.float() / block_values,
        ),
    }
    for name, (b_scale, b_recipe, b_values) in pairings.items():
        try:
            out = torch._scaled_mm_v2(
                a, b.t(), [_decode_scales(a_scale)], _TILE_RECIPE, [], [b_scale], b_recipe, [],
                None, torch.bfloat16, [], False,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, NotImplementedError, AttributeError) as error:
            return f"{name}: {type(error).__name__}: {str(error)[:200]}"
        want = a_values @ b_values.t()
        if (out.float() - want).norm() > 1e-2 * want.norm():
            return f"{name}: results differ from fp32 math (a scale layout this code does not know)"
    return None


@functools.cache
def _device_has_blockwise_scaled_mm(device: torch.device) -> bool:
    error = _probe_error(device)
    if error is not None:
        warnings.warn(
            f"float8_moe: blockwise fp8 GEMMs on {torch.cuda.get_device_name(device)} run on the "
            f"Triton kernels (fp8/kernels/blockwise_gemm.py), slower than cuBLAS's: torch's "
            f"blockwise scaled_mm is not usable here ({error})",
            stacklevel=2,
        )
    return error is None


def _cublas_serves(a: torch.Tensor, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """The rules of the module docstring that need no host read, for a ``[K, N]`` weight."""
    return (
        a.is_cuda
        and out_dtype == torch.bfloat16
        and k % BLOCK == 0
        and n % BLOCK == 0
        and _device_has_blockwise_scaled_mm(a.device)
    )


def _token_groups(offs: torch.Tensor, read_ends: Callable) -> list[tuple[int, int]] | None:
    """Each group's (start, end) tokens, or None where a group is no multiple of 128 tokens (or
    there is none)."""
    ends = read_ends(offs)
    spans = list(zip([0, *ends[:-1]] if ends else [], ends, strict=True))
    if spans and all((end - start) % BLOCK == 0 for start, end in spans):
        return spans
    return None


def _grouped_mm_by(read_ends, a, a_scale, b, b_scale, offs, out_dtype) -> torch.Tensor:
    blockwise_gemm.check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    k, n = b.shape[-2:]
    spans = None
    if a.stride(-1) == 1 and b.stride(-2) == 1 and _cublas_serves(a, k, n, out_dtype):
        spans = _token_groups(offs, read_ends)
    if spans is None:
        return blockwise_gemm.blockwise_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype)
    out = torch.empty((a.shape[0], n), dtype=out_dtype, device=a.device)
    b_decode = _decode_scales(b_scale, _BLOCK_SCALE_ROWS)
    for group, (start, end) in enumerate(spans):
        if end > start:
            torch.ops.aten._scaled_mm_v2.out(
                a[start:end], b[group], [_decode_scales(a_scale[start:end])], _TILE_RECIPE, [],
                [b_decode[group]], _BLOCK_RECIPE, [], None, out_dtype, [], False,
                out=out[start:end],
            )  # fmt: skip
    out[spans[-1][1] :].zero_()  # rows of no group, 0 as the Triton kernel writes them
    return out


def _wgrad_by(read_ends, a, a_scale, g, g_scale, offs, out_dtype) -> torch.Tensor:
    blockwise_gemm.check_wgrad_operands(a, a_scale, g, g_scale, offs)
    k, n = a.shape[1], g.shape[1]
    spans = None
    if a.stride(0) == 1 and g.stride(0) == 1 and _cublas_serves(a, k, n, out_dtype):
        spans = _token_groups(offs, read_ends)
    if spans is None:
        return blockwise_gemm.blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale, offs, out_dtype)
    out_t = blockwise_gemm.empty_wgrad(len(spans), k, n, out_dtype, a.device).transpose(-2, -1)
    a_decode, g_decode = _decode_scales(a_scale.t()), _decode_scales(g_scale.t())  # [K|N, tiles]
    for group, (start, end) in enumerate(spans):
        if end == start:
            out_t[group].zero_()
            continue
        tiles = slice(start // BLOCK, end // BLOCK)
        # Each group's product as (g_g^T a_g)^T, into the N-major layout: the same sums.
        torch.ops.aten._scaled_mm_v2.out(
            g[start:end].t(), a[start:end], [g_decode[:, tiles]], _TILE_RECIPE, [],
            [a_decode[:, tiles]], _TILE_RECIPE, [], None, out_dtype, [], False, out=out_t[group],
        )  # fmt: skip
    return out_t.transpose(-2, -1)


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
    """``blockwise_gemm.blockwise_grouped_mm``'s contract: ``a [M, K]`` row-major, ``b [G, K, N]``
    with K contiguous for cuBLAS (else the Triton kernel runs)."""
    return _grouped_mm_by(_read, a, a_scale, b, b_scale, offs, out_dtype)


def _wgrad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    g: torch.Tensor,
    g_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``blockwise_gemm.blockwise_grouped_mm_wgrad``'s contract: ``[G, K, N]`` N-major, each
    group's ``a_g^T . g_g`` as ``scaled_mm(g_g^T [N, M_g], a_g [M_g, K])^T`` with 1x128 tiles
    along the tokens on both; for cuBLAS the operands token-contiguous (strides ``(1, M)``)."""
    return _wgrad_by(_read, a, a_scale, g, g_scale, offs, out_dtype)


def _grouped_mm_fake(a, a_scale, b, b_scale, offs, out_dtype):
    blockwise_gemm.check_grouped_mm_operands(a, a_scale, b, b_scale, offs)
    return a.new_empty((a.shape[0], b.shape[-1]), dtype=out_dtype)


def _wgrad_fake(a, a_scale, g, g_scale, offs, out_dtype):
    blockwise_gemm.check_wgrad_operands(a, a_scale, g, g_scale, offs)
    return blockwise_gemm.empty_wgrad(offs.shape[0], a.shape[1], g.shape[1], out_dtype, a.device)


# ``blockwise_gemm.py``'s two GEMMs, all arguments given positionally: ``blockwise_grouped_mm(a,
# a_scale, b, b_scale, offs, out_dtype)`` and ``blockwise_grouped_mm_wgrad(a, a_scale, g, g_scale,
# offs, out_dtype)``. Eager calls keep the offsets' host values per tensor.
blockwise_grouped_mm = compile_opaque(
    "blockwise_cublas_grouped_mm",
    _grouped_mm,
    _grouped_mm_fake,
    eager=functools.partial(_grouped_mm_by, host_offsets.values),
)
blockwise_grouped_mm_wgrad = compile_opaque(
    "blockwise_cublas_grouped_mm_wgrad",
    _wgrad,
    _wgrad_fake,
    eager=functools.partial(_wgrad_by, host_offsets.values),
)
