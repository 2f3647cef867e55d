"""Our Triton kernel for the expert weight's input-gradient copy: ``b [G, K, N]`` -> fp8 of
``b^T [G, N, K]`` with one scale per (group, k) over N, stored column-major for the GEMM.

The scales come from an amax along N that the forward cast took in its own read of the weight
(``triton_rowwise.py``), so this kernel reads the weight once. torchao 0.18's transposing cast
reads it twice (an amax pass with atomics, then the cast), the slower way (timings of both:
docs/benchmarks/README.md). Same rules as
``quantize.py``. CUDA only.
"""

import torch
import triton
import triton.language as tl

from ..opaque import compile_triton, launcher
from ..quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from .triton_rules import as_float32, pow2_scale, saturate

# Tile of BLOCK_K x BLOCK_N weight elements per program: read along the weight's contiguous dim,
# written transposed, along N.
BLOCK_K, BLOCK_N, NUM_WARPS = 64, 128, 4


@triton.jit
def _transposed_fp8_kernel(
    b_ptr,
    amax_ptr,
    out_ptr,
    scale_ptr,
    n_k,
    n_n,
    stride_g,
    stride_k,
    stride_n,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_TO_BF16: tl.constexpr,
):
    group = tl.program_id(2).to(tl.int64)
    # int64: one expert's matrix may exceed 2**31 elements.
    ks = (tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    ns = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k_mask = ks < n_k
    mask = k_mask[:, None] & (ns < n_n)[None, :]
    amax = tl.load(amax_ptr + group * n_k + ks, mask=k_mask, other=0.0)
    scale = pow2_scale(amax, FP8_LIMIT, AMAX_FLOOR)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + group * n_k + ks, scale, mask=k_mask)
    x = tl.load(
        b_ptr + group * stride_g + ks[:, None] * stride_k + ns[None, :] * stride_n,
        mask=mask,
        other=0.0,
    )
    y = saturate(as_float32(x, ROUND_TO_BF16) * scale[:, None], FP8_LIMIT)
    # b^T [G, N, K] column-major: element (g, n, k) at (g * K + k) * N + n.
    out_offsets = (group * n_k + ks)[:, None] * n_n + ns[None, :]
    tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def cast_transposed(
    b: torch.Tensor,
    amax_over_n: torch.Tensor,
    out_dtype: torch.dtype = FP8_DTYPE,
    round_to_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``b [G, K, N]`` (any strides) and its amax over N ``[G, K]`` -> ``out_dtype`` ``b^T
    [G, N, K]`` column-major and fp32 scales ``[G, K]``; with ``round_to_bf16``, of
    ``b.bfloat16()``'s values (``amax_over_n`` then theirs). ``out_dtype`` other than fp8 keeps
    the scaled, saturated values uncast (for Triton's CPU interpreter in the tests)."""
    groups, n_k, n_n = b.shape
    out = torch.empty((groups, n_k, n_n), dtype=out_dtype, device=b.device).transpose(-2, -1)
    scales = torch.empty((groups, n_k), dtype=torch.float32, device=b.device)
    if b.numel():
        grid = (triton.cdiv(n_k, BLOCK_K), triton.cdiv(n_n, BLOCK_N), groups)
        launcher(_transposed_fp8_kernel, b)[grid](
            b,
            amax_over_n.contiguous(),
            out,
            scales,
            n_k,
            n_n,
            *b.stride(),
            FP8_LIMIT=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            BLOCK_K=BLOCK_K,
            BLOCK_N=BLOCK_N,
            ROUND_TO_BF16=round_to_bf16,
            num_warps=NUM_WARPS,
        )
    return out, scales


def _transposed_fp8(
    b: torch.Tensor, amax_over_n: torch.Tensor, round_to_bf16: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``b^T [G, N, K]`` (column-major) and scales ``[G, K]`` from ``b [G, K, N]`` and its
    amax over N."""
    return cast_transposed(b, amax_over_n, round_to_bf16=round_to_bf16)


transposed_fp8 = compile_triton("transposed_fp8", _transposed_fp8)
