"""Our own Triton kernel for rowwise fp8 quantization along a tensor's contiguous last dim.

torchao's rowwise kernels read each row twice (once for the amax, once for the cast) and reached
about 0.9 TB/s on an H200 for Llama4 activations (docs/benchmarks/README.md). Here one program
holds a whole row in registers, so the row is read once: amax, power-of-2 scale and cast in one
pass. Same rules as ``quantize.py``: the scale is the largest power of two that keeps the row's
amax within fp8 range (taken from the float's exponent bits, so it is exact), values saturate at
+-FP8_MAX, and NaN stays NaN. CUDA only.
"""

import torch
import triton
import triton.language as tl

from .quantize import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from .triton_rules import pow2_scale, saturate

# Rows up to this many elements fit one program's registers; longer rows are not supported here.
MAX_ROW = 16384


@triton.jit
def _rowwise_fp8_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    n_cols,
    FP8_LIMIT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = pow2_scale(amax, FP8_LIMIT, AMAX_FLOOR)
    y = saturate(x * scale, FP8_LIMIT)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


# A custom op, so torch.compile treats the launch as one opaque call instead of tracing into it.
@torch.library.custom_op("torchtitan_fp8_moe::rowwise_fp8", mutates_args=())
def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., C]`` -> fp8 ``[..., C]`` and fp32 scales ``[..., 1]`` (per row over C)."""
    n_cols = x.shape[-1]
    if n_cols > MAX_ROW:
        raise ValueError(f"rowwise_fp8: rows of {n_cols} elements exceed {MAX_ROW}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rowwise_fp8_kernel[(n_rows,)](
            x,
            out,
            scales,
            n_cols,
            FP8_LIMIT=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            BLOCK=block,
            num_warps=max(4, min(16, block // 512)),
        )
    return out, scales


@rowwise_fp8.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
        torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device),
    )
