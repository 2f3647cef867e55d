"""The blockwise fp8 Triton kernels' logic on CPU, in Triton's interpreter, against plain fp32
torch math of the blockwise contract.

The interpreter does not round to fp8 as a GPU does, so the cast kernels write their scaled,
saturated values to a float32 buffer here: those, cast by torch, must give the torch rules' fp8
codes. The GEMMs take real fp8 operands (which the interpreter reads exactly) and are checked
against dequantized fp32 matmuls, within fp32 accumulation-order error. The interpreter is chosen
when a kernel is defined, so the checks run in a fresh process. (``tests/test_blockwise_cuda.py``
checks the same on a GPU.)
"""

import os
import subprocess
import sys

import torch

# (tokens M, K, N, group ends): empty groups (first, middle), rows past the last group, ragged
# K and N, a tile over several groups, M below one tile, a single row group.
GEMM_CASES = [
    (300, 200, 130, [0, 5, 133, 133, 290]),
    (40, 96, 70, [3, 3, 3, 40]),
    (129, 256, 128, [1, 128, 129]),
]
# Weight-gradient cases: group starts 128-aligned (as the CUDA path requires), empty groups,
# rows past the last group, a group shorter than one block, M below one block.
WGRAD_CASES = [
    (400, 200, 130, [0, 128, 128, 384, 390]),
    (40, 70, 150, [40]),
    (256, 128, 64, [128, 256]),
]
BLOCK = 128


def spread(rows: int, cols: int) -> torch.Tensor:
    """bf16 values over 12 decades along both dims, so every tile has its own scale, and an
    all-zero row and column."""
    x = torch.randn(rows, cols) * torch.logspace(-6, 6, cols) * torch.logspace(3, -3, rows)[:, None]
    x[0] = 0
    x[:, -1] = 0
    return x.bfloat16()


def expanded(scale: torch.Tensor, shape: tuple, dims: tuple) -> torch.Tensor:
    """Per-tile scales repeated over the elements of their tiles (along ``dims``)."""
    for dim in dims:
        scale = scale.repeat_interleave(BLOCK, dim)
    return scale[tuple(slice(0, size) for size in shape)]


def dequantized(data: torch.Tensor, scale: torch.Tensor, dims: tuple) -> torch.Tensor:
    return data.float() / expanded(scale, data.shape, dims)


def close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, bits: int = 18) -> bool:
    """Equal up to accumulation order and precision: error within 2**-bits of the sum of the
    |products| (``magnitude``)."""
    return bool(((got.double() - want).abs() <= magnitude * 2.0**-bits + 1e-30).all())


def _check_quantize() -> None:
    from torchtitan_fp8_moe.fp8.kernels import blockwise_quantize as bq
    from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE, FP8_MAX

    torch.manual_seed(0)
    for rows, cols in [(300, 200), (40, 130), (1, 7), (129, 256)]:
        x = spread(rows, cols)
        for tiles, kernel, reference, dims in [
            ("1x128", bq.quantize_1x128, bq.quantize_1x128_torch, (1,)),
            ("128x1", bq.quantize_128x1, bq.quantize_128x1_torch, (0,)),
        ]:
            values, scale = kernel(x, torch.float32)
            want_data, want_scale = reference(x)
            assert torch.equal(scale, want_scale), (tiles, rows, cols)
            want = (x.float() * expanded(scale, x.shape, dims)).clamp(-FP8_MAX, FP8_MAX)
            assert torch.equal(values, want), (tiles, rows, cols)
            assert torch.equal(values.to(FP8_DTYPE).view(torch.uint8), want_data.view(torch.uint8))
        assert bq.quantize_128x1(x, torch.float32)[0].stride() == (1, rows), "column-major"
        # A strided input: the kernels read through the view's strides.
        view = x.t().contiguous().t()
        for kernel in (bq.quantize_1x128, bq.quantize_128x1):
            got, want = kernel(view, torch.float32), kernel(x, torch.float32)
            assert all(torch.equal(*pair) for pair in zip(got, want, strict=True))
    for groups, k, n in [(3, 200, 130), (1, 128, 256), (2, 5, 1)]:
        stored = torch.stack([spread(n, k) for _ in range(groups)])  # [G, N, K], used as [G, K, N]
        for w in (stored.transpose(-2, -1), stored.transpose(-2, -1).contiguous()):
            values, scale = bq.quantize_128x128(w, torch.float32)
            want_data, want_scale = bq.quantize_128x128_torch(w)
            assert torch.equal(scale, want_scale), (groups, k, n)
            want = (w.float() * expanded(scale, w.shape, (1, 2))).clamp(-FP8_MAX, FP8_MAX)
            assert torch.equal(values, want), (groups, k, n)
            assert values.stride() == w.stride(), "the weight's memory order"
            assert torch.equal(values.to(FP8_DTYPE).view(torch.uint8), want_data.view(torch.uint8))


def grouped_reference(a, b, ends, rows):
    """fp32 ``a[rows of g] . b[g]``, rows past the last group 0."""
    out = torch.zeros(rows, b.shape[-1], dtype=a.dtype, device=a.device)
    start = 0
    for group, end in enumerate(ends):
        out[start:end] = a[start:end] @ b[group]
        start = end
    return out


def wgrad_reference(x, dy, ends):
    """fp32 ``x_g^T . dy_g`` per group -> ``[G, K, N]``; empty groups 0."""
    out = torch.zeros(len(ends), x.shape[1], dy.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for group, end in enumerate(ends):
        out[group] = x[start:end].t() @ dy[start:end]
        start = end
    return out


def _check_grouped_mm() -> None:
    from torchtitan_fp8_moe.fp8.kernels import blockwise_quantize as bq
    from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import blockwise_grouped_mm, blockwise_mm

    torch.manual_seed(0)
    for m, k, n, ends in GEMM_CASES:
        groups = len(ends)
        offs = torch.tensor(ends, dtype=torch.int32)
        x_data, x_scale = bq.quantize_1x128_torch(spread(m, k))
        stored = torch.stack([spread(n, k) for _ in range(groups)])  # [G, N, K]
        w_data, w_scale = bq.quantize_128x128_torch(stored.transpose(-2, -1))
        x, w = dequantized(x_data, x_scale, (1,)), dequantized(w_data, w_scale, (1, 2))
        want = grouped_reference(x, w, ends, m)
        magnitude = grouped_reference(x.abs(), w.abs(), ends, m)
        for b in (w_data, w_data.contiguous()):  # K-major (torchtitan's layout) and row-major
            got = blockwise_grouped_mm(x_data, x_scale, b, w_scale, offs, torch.float32)
            assert close(got, want, magnitude), (m, k, n, ends)
            assert torch.equal(got[ends[-1] :], torch.zeros_like(got[ends[-1] :]))
        bf16 = blockwise_grouped_mm(x_data, x_scale, w_data, w_scale, offs)
        assert bf16.dtype == torch.bfloat16
        assert torch.allclose(bf16.float(), got, rtol=2**-7, atol=1e-30)
        # Input gradient: dy [M, N] (1x128 tiles along N) times the same blocks, transposed.
        dy_data, dy_scale = bq.quantize_1x128_torch(spread(m, n))
        dy = dequantized(dy_data, dy_scale, (1,))
        w_t = w.transpose(-2, -1)
        got = blockwise_grouped_mm(
            dy_data, dy_scale, w_data.transpose(-2, -1), w_scale.transpose(-2, -1), offs,
            torch.float32,
        )  # fmt: skip
        assert close(got, grouped_reference(dy, w_t, ends, m), magnitude=grouped_reference(
            dy.abs(), w_t.abs(), ends, m)), (m, k, n, ends)  # fmt: skip
        # Dense: one group of every row.
        got = blockwise_mm(x_data, x_scale, w_data[-1], w_scale[-1], torch.float32)
        assert close(got, x @ w[-1], x.abs() @ w[-1].abs()), (m, k, n)


def _check_wgrad() -> None:
    from torchtitan_fp8_moe.fp8.kernels import blockwise_quantize as bq
    from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (
        blockwise_grouped_mm_wgrad,
        blockwise_mm_wgrad,
    )

    torch.manual_seed(0)
    for m, k, n, ends in WGRAD_CASES:
        offs = torch.tensor(ends, dtype=torch.int32)
        x_data, x_scale = bq.quantize_128x1_torch(spread(m, k))
        dy_data, dy_scale = bq.quantize_128x1_torch(spread(m, n))
        x, dy = dequantized(x_data, x_scale, (0,)), dequantized(dy_data, dy_scale, (0,))
        want = wgrad_reference(x, dy, ends)
        magnitude = wgrad_reference(x.abs(), dy.abs(), ends)
        # Column-major operands (what quantize_128x1 gives) and row-major.
        column_major = (x_data.t().contiguous().t(), dy_data.t().contiguous().t())
        for a, g in (column_major, (x_data, dy_data)):
            got = blockwise_grouped_mm_wgrad(a, x_scale, g, dy_scale, offs)
            assert got.dtype == torch.float32 and got.shape == (len(ends), k, n)
            assert close(got, want, magnitude), (m, k, n, ends)
        empty = [group for group, end in enumerate(ends) if end == ([0] + ends)[group]]
        assert all(torch.equal(got[group], torch.zeros(k, n)) for group in empty)
        bf16 = blockwise_grouped_mm_wgrad(x_data, x_scale, dy_data, dy_scale, offs, torch.bfloat16)
        assert torch.allclose(bf16.float(), got, rtol=2**-7, atol=1e-30)
        dense = blockwise_mm_wgrad(x_data, x_scale, dy_data, dy_scale)
        assert close(dense, x.t() @ dy, x.t().abs() @ dy.abs()), (m, k, n)


def _run_interpreted(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = f"import test_blockwise_kernels_interpreted as t; t.{check}()"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_blockwise_quantize_kernels_in_triton_interpreter():
    """1x128, 128x1 and 128x128 casts: the torch rules' scales and values, ragged edges."""
    _run_interpreted("_check_quantize")


def test_blockwise_grouped_mm_in_triton_interpreter():
    """Forward and input-gradient forms, empty groups, rows past the last group, ragged K/N."""
    _run_interpreted("_check_grouped_mm")


def test_blockwise_wgrad_in_triton_interpreter():
    """Per-group contraction over 128-token blocks, empty groups give 0."""
    _run_interpreted("_check_wgrad")


def test_blockwise_gemms_have_shape_rules():
    """torch.compile and meta tensors see the GEMMs' custom ops and get their shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (
        blockwise_grouped_mm,
        blockwise_grouped_mm_wgrad,
    )
    from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE

    with FakeTensorMode():
        a = torch.empty(300, 200, dtype=FP8_DTYPE)
        b = torch.empty(4, 130, 200, dtype=FP8_DTYPE).transpose(-2, -1)
        offs = torch.empty(4, dtype=torch.int32)
        out = blockwise_grouped_mm(a, torch.empty(300, 2), b, torch.empty(4, 2, 2), offs)
        assert (out.shape, out.dtype) == ((300, 130), torch.bfloat16)
        g = torch.empty(300, 130, dtype=FP8_DTYPE)
        wgrad = blockwise_grouped_mm_wgrad(a, torch.empty(3, 200), g, torch.empty(3, 130), offs)
        assert (wgrad.shape, wgrad.dtype) == ((4, 200, 130), torch.float32)
