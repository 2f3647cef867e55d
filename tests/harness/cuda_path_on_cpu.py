"""The CUDA code path on CPU: our Triton kernels in Triton's interpreter, torch's fp8 GEMMs as
their CUDA kernels define them, so that CI runs the path the GPU runs (kernels, layouts, group
ends, padding rows) without a GPU.

``install()`` (in a process with ``TRITON_INTERPRET=1``, before any kernel runs):
- Triton's interpreter converts float32 to fp8 e4m3 with torch's round-to-nearest-even, as the
  GPU does (its own conversion rounds ties up and lets a rounded-up mantissa carry into the
  exponent bits), so an interpreted kernel writes the GPU's fp8 bytes;
- ``torch._scaled_mm`` and ``torch._scaled_grouped_mm`` take CPU tensors: the layouts, dtypes and
  alignments torch's CUDA kernels require are asserted, the products are fp32 sums of the
  dequantized values, and the rows of no group in a token-grouped output are left NaN
  (torch's CUDA kernel leaves them unwritten);
- converted weights on CPU take the CUDA path (``fp8_kernels_available``);
- ``torch.empty`` hands out poisoned memory (NaN, or a large integer), so an output element a
  kernel leaves unwritten shows, as the GPU's reused memory would make it show at random.
"""

import numpy as np
import torch

FP8 = torch.float8_e4m3fn
# torch's fp8 GEMMs read 16-byte rows (cuBLASLt, CUTLASS TMA): fp8 dims are multiples of 16.
ALIGNMENT = 16


def _check_operands(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype) -> None:
    assert a.dtype == b.dtype == FP8, (a.dtype, b.dtype)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert out_dtype == torch.bfloat16, out_dtype
    assert a.stride(-1) == 1, f"a must be row-major, strides {a.stride()}"
    assert b.stride(-2) == 1, f"b must be column-major, strides {b.stride()}"
    # Leading dims of 16 bytes (one byte an element).
    assert a.stride(-2) % ALIGNMENT == 0 and b.stride(-1) % ALIGNMENT == 0, (a.stride(), b.stride())
    assert a.shape[-1] % ALIGNMENT == 0 and b.shape[-1] % ALIGNMENT == 0, (a.shape, b.shape)


def _product(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor):
    """fp32 ``(a * scale_a) @ (b * scale_b)``: torch multiplies by the scales it is given."""
    return (a.float() * scale_a) @ (b.float() * scale_b)


def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, **_):
    """``a [M, K] @ b [K, N]``, rowwise scales ``[M, 1]`` and ``[1, N]``."""
    assert bias is None and scale_result is None
    _check_operands(a, b, scale_a, scale_b, out_dtype)
    assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
    return _product(a, scale_a, b, scale_b).to(out_dtype)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    assert offs.dtype == torch.int32 and offs.dim() == 1, offs
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    assert all(end >= start for start, end in zip(starts, ends, strict=True)), ends
    return list(zip(starts, ends, strict=True))


def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, out_dtype=None, **_):
    """The two forms our recipe calls: token groups (``a [M, K]``, ``b [G, K, N]``, scales
    ``[M]`` and ``[G, N]``) and contraction groups (``a [M, K]``, ``b [K, N]``, scales ``[G *
    M]`` and ``[G * N]``: the weight gradient), groups ending at ``offs``."""
    assert bias is None and offs is not None
    _check_operands(a, b, scale_a, scale_b, out_dtype)
    bounds = _bounds(offs)
    if b.dim() == 3:
        groups, n = b.shape[0], b.shape[2]
        assert len(bounds) == groups and scale_a.shape == (a.shape[0],), scale_a.shape
        assert scale_b.shape == (groups, n), scale_b.shape
        assert bounds[-1][1] <= a.shape[0]
        out = torch.full((a.shape[0], n), float("nan"))
        for g, (start, end) in enumerate(bounds):
            rows = slice(start, end)
            out[rows] = _product(a[rows], scale_a[rows, None], b[g], scale_b[g])
        return out.to(out_dtype)
    m, n, groups = a.shape[0], b.shape[1], len(bounds)
    assert scale_a.shape == (groups * m,) and scale_b.shape == (groups * n,)
    assert bounds[-1][1] <= a.shape[1] == b.shape[0]
    out = torch.empty(groups, m, n)
    for g, (start, end) in enumerate(bounds):
        # TMA needs each group's contraction slice to start on a 16-byte boundary.
        assert g == groups - 1 or (end - start) % ALIGNMENT == 0, (g, start, end)
        k = slice(start, end)
        scales_a, scales_b = scale_a[g * m : (g + 1) * m, None], scale_b[g * n : (g + 1) * n]
        out[g] = _product(a[:, k], scales_a, b[k], scales_b)
    return out.to(out_dtype)


def _install_fp8_rounding() -> None:
    from triton import language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def to_fp8_like_the_gpu(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return values.to(FP8).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = to_fp8_like_the_gpu


def poisoned(empty):
    """``empty`` (``torch.empty``) handing out poisoned memory: NaN, or a large integer, so
    that an element nothing writes shows."""

    def poisoned_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if tensor.dtype.itemsize == 1 and tensor.is_floating_point():
            tensor.view(torch.uint8).fill_(0x7F)  # NaN in fp8 e4m3
        elif tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int32, torch.int64):
            tensor.fill_(-(2**30))
        return tensor

    return poisoned_empty


def install() -> None:
    import triton

    import torchtitan_fp8_moe.weight.base as weight_base

    assert triton.knobs.runtime.interpret, "run with TRITON_INTERPRET=1"
    _install_fp8_rounding()
    torch.empty = poisoned(torch.empty)
    torch._scaled_mm = scaled_mm
    torch._scaled_grouped_mm = scaled_grouped_mm
    weight_base.fp8_kernels_available = lambda device: True
