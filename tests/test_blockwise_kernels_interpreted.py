"""The blockwise fp8 Triton kernels' logic on CPU, in Triton's interpreter, against the torch
rules of ``fp8/recipes/blockwise/torch_quantizers.py``.

The interpreter does not round to fp8 as a GPU does, so the cast kernels write their scaled,
saturated values to a float32 buffer here: those, cast by torch, must give the torch rules' fp8
codes, with the same scales, in the memory order the GEMMs read fastest. The GEMMs take real fp8
operands (which the interpreter reads exactly) and are checked against dequantized fp32 matmuls,
within fp32 accumulation-order error. (``tests/test_blockwise_cuda.py`` checks the same on a GPU.)
"""

import pytest
import torch
from harness.interpreted import run_interpreted

# (tokens M, K, N, group ends): empty groups (first, middle), rows past the last group, ragged
# K and N, a tile over several groups, M below one tile, a single row group.
GEMM_CASES = [
    (300, 200, 130, [0, 5, 133, 133, 290]),
    (40, 96, 70, [3, 3, 3, 40]),
    (129, 256, 128, [1, 128, 129]),
]
# Weight-gradient cases: group starts 128-aligned (as the CUDA path requires), empty groups,
# rows past the last group within its last block, a group shorter than one block, M below one
# block.
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


def same_codes(values: torch.Tensor, want: torch.Tensor) -> bool:
    """``values`` (fp32, or fp8 on a GPU) cast to fp8 are ``want``'s fp8 codes, bit for bit."""
    from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE

    return torch.equal(values.to(FP8_DTYPE).view(torch.uint8), want.view(torch.uint8))


def column_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its second-to-last dim contiguous (same values)."""
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


def contraction_contiguous(x: torch.Tensor, dim: int) -> bool:
    return x.stride(dim) == 1


def _check_quantize() -> None:
    from torchtitan_fp8_moe.fp8.kernels import triton_blockwise as bq
    from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules

    torch.manual_seed(0)
    for rows, cols in [(300, 200), (1, 7), (129, 256)]:
        x = spread(rows, cols)
        values, scale = bq.quantize_1x128(x, torch.float32)
        want, want_scale = rules.rows(x)
        assert torch.equal(scale, want_scale) and same_codes(values, want), (rows, cols)
        assert contraction_contiguous(values, 1)
        strided = bq.quantize_1x128(column_major(x), torch.float32)  # read through the strides
        assert torch.equal(strided[0], values) and torch.equal(strided[1], scale)
    for groups, k, n in [(3, 200, 130), (2, 5, 1)]:
        stored = torch.stack([spread(n, k) for _ in range(groups)])  # [G, N, K], used as [G, K, N]
        for w in (stored.transpose(-2, -1), stored.transpose(-2, -1).contiguous()):
            values, scale, values_t = bq.quantize_128x128(w, torch.float32, transposed_too=True)
            want, want_scale, state = rules.weight(w)
            want_t, want_t_scale = rules.weight_transposed(w, state)
            assert torch.equal(scale, want_scale), (groups, k, n)
            assert same_codes(values, want) and same_codes(values_t, want_t), (groups, k, n)
            assert contraction_contiguous(values, 1) and contraction_contiguous(values_t, 1)
            alone = bq.quantize_128x128_transposed(w, scale, torch.float32)
            assert torch.equal(alone, values_t) and alone.stride() == values_t.stride()
            assert bq.quantize_128x128(w, torch.float32)[2] is None
    for m, c, ends in [(400, 200, [0, 128, 128, 384, 390]), (40, 130, [40]), (256, 64, [128, 256])]:
        x, offs = spread(m, c), torch.tensor(ends, dtype=torch.int32)
        values, scale = bq.quantize_128x1(x, offs, torch.float32)
        want, want_scale, _, _ = rules.per_group_pair(x, x, offs)
        assert torch.equal(scale, want_scale), (m, c, ends)
        # Rows of no group are 0 in both (torch's may be -0).
        tokens = ends[-1]
        assert same_codes(values[:tokens], want[:tokens]) and not values[tokens:].any()
        assert contraction_contiguous(values, 0), "token-contiguous"
        global_blocks = bq.quantize_128x1(x[:tokens], None, torch.float32)
        assert torch.equal(global_blocks[0], values[:tokens])
        assert torch.equal(global_blocks[1], scale[: -(-tokens // BLOCK)])
    _check_recipe_quantizers()


def _check_recipe_quantizers() -> None:
    """The CUDA recipe's quantizers: the torch rules' signatures and scales, the GEMMs' layouts
    (fp8 codes are checked above, on the kernels' fp32 outputs)."""
    from torchtitan_fp8_moe.fp8.recipes import recipe_named
    from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules

    recipe = recipe_named("blockwise")
    assert recipe.quantizers(emulate=True) is rules
    cuda = recipe.quantizers(emulate=False)
    x, grad = spread(300, 200), spread(300, 130)
    offs = torch.tensor([128, 128, 290], dtype=torch.int32)
    b = torch.stack([spread(130, 200) for _ in range(3)]).transpose(-2, -1)  # [G, K, N]
    data, scale = cuda.rows(x)
    assert torch.equal(scale, rules.rows(x)[1]) and contraction_contiguous(data, 1)
    data, scale, state = cuda.weight(b)
    assert torch.equal(scale, rules.weight(b)[1]) and contraction_contiguous(data, 1)
    data_t, scale_t = cuda.weight_transposed(b, state)
    assert torch.equal(scale_t, rules.weight_transposed(b, state)[1])
    assert data_t.shape == (3, 130, 200) and contraction_contiguous(data_t, 1)
    got, want = cuda.per_group_pair(x, grad, offs), rules.per_group_pair(x, grad, offs)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
    assert contraction_contiguous(got[0], 0) and contraction_contiguous(got[2], 0)


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
    from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import blockwise_grouped_mm, blockwise_mm
    from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules

    torch.manual_seed(0)
    for m, k, n, ends in GEMM_CASES:
        groups = len(ends)
        offs = torch.tensor(ends, dtype=torch.int32)
        x_data, x_scale = rules.rows(spread(m, k))
        b = torch.stack([spread(n, k) for _ in range(groups)]).transpose(-2, -1)  # [G, K, N]
        w_data, w_scale, state = rules.weight(b)
        x, w = dequantized(x_data, x_scale, (1,)), dequantized(w_data, w_scale, (1, 2))
        want = grouped_reference(x, w, ends, m)
        magnitude = grouped_reference(x.abs(), w.abs(), ends, m)
        for operand in (column_major(w_data), w_data.contiguous()):  # K-major and row-major
            got = blockwise_grouped_mm(x_data, x_scale, operand, w_scale, offs, torch.float32)
            assert close(got, want, magnitude), (m, k, n, ends)
            assert torch.equal(got[ends[-1] :], torch.zeros_like(got[ends[-1] :]))
        bf16 = blockwise_grouped_mm(x_data, x_scale, w_data, w_scale, offs)
        assert bf16.dtype == torch.bfloat16
        assert torch.allclose(bf16.float(), got, rtol=2**-7, atol=1e-30)
        # Input gradient: dy [M, N] (1x128 tiles along N) times the same blocks, transposed,
        # N-major (what the CUDA quantizer writes) and K-major.
        dy_data, dy_scale = rules.rows(spread(m, n))
        dy = dequantized(dy_data, dy_scale, (1,))
        w_t_data, w_t_scale = rules.weight_transposed(b, state)
        w_t = w.transpose(-2, -1)
        want = grouped_reference(dy, w_t, ends, m)
        magnitude = grouped_reference(dy.abs(), w_t.abs(), ends, m)
        for operand in (column_major(w_t_data), w_t_data.contiguous()):
            got = blockwise_grouped_mm(dy_data, dy_scale, operand, w_t_scale, offs, torch.float32)
            assert close(got, want, magnitude), (m, k, n, ends)
        # Dense: one group of every row.
        got = blockwise_mm(x_data, x_scale, w_data[-1], w_scale[-1], torch.float32)
        assert close(got, x @ w[-1], x.abs() @ w[-1].abs()), (m, k, n)


def _check_wgrad() -> None:
    from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (
        blockwise_grouped_mm_wgrad,
        blockwise_mm_wgrad,
    )
    from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules

    torch.manual_seed(0)
    for m, k, n, ends in WGRAD_CASES:
        offs = torch.tensor(ends, dtype=torch.int32)
        x_data, x_scale, dy_data, dy_scale = rules.per_group_pair(spread(m, k), spread(m, n), offs)
        # Group starts are 128-aligned: the global blocks are the groups' blocks.
        x_scale, dy_scale = x_scale[: -(-m // BLOCK)], dy_scale[: -(-m // BLOCK)]
        x, dy = dequantized(x_data, x_scale, (0,)), dequantized(dy_data, dy_scale, (0,))
        want = wgrad_reference(x, dy, ends)
        magnitude = wgrad_reference(x.abs(), dy.abs(), ends)
        # Rows of no group hold values the kernel must leave out.
        x_data.view(torch.uint8)[ends[-1] :] = 0x38
        # Token-contiguous operands (what the CUDA quantizer writes) and row-major.
        for a, g in ((column_major(x_data), column_major(dy_data)), (x_data, dy_data)):
            got = blockwise_grouped_mm_wgrad(a, x_scale, g, dy_scale, offs)
            assert got.dtype == torch.float32 and got.shape == (len(ends), k, n)
            # N-major, the layout of a [G, N, K] weight read transposed: no copy to accumulate.
            assert got.transpose(-2, -1).is_contiguous()
            assert close(got, want, magnitude), (m, k, n, ends)
        empty = [group for group, end in enumerate(ends) if end == ([0] + ends)[group]]
        assert all(torch.equal(got[group], torch.zeros(k, n)) for group in empty)
        bf16 = blockwise_grouped_mm_wgrad(x_data, x_scale, dy_data, dy_scale, offs, torch.bfloat16)
        assert torch.allclose(bf16.float(), got, rtol=2**-7, atol=1e-30)
        assert bf16.transpose(-2, -1).is_contiguous()
        tokens, token_blocks = slice(0, ends[-1]), slice(0, -(-ends[-1] // BLOCK))
        dense = blockwise_mm_wgrad(
            x_data[tokens], x_scale[token_blocks], dy_data[tokens], dy_scale[token_blocks]
        )
        x, dy = x[tokens], dy[tokens]
        assert close(dense, x.t() @ dy, x.t().abs() @ dy.abs()), (m, k, n)
        assert dense.t().is_contiguous()


def _fp8_rounded_by_torch(kernel, data_outputs):
    """``kernel`` writing fp32 values that torch casts to fp8 (the interpreter's fp8 stores do
    not round as a GPU's do), strides kept."""
    from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE

    def cast(*args):
        outputs = kernel(*args, out_dtype=torch.float32)
        if not isinstance(outputs, tuple):
            return outputs.to(FP8_DTYPE)
        return tuple(
            t.to(FP8_DTYPE) if i in data_outputs and t is not None else t
            for i, t in enumerate(outputs)
        )

    return cast


def _check_autograd_on_kernels() -> None:
    """``fp8_grouped_mm`` with the recipe's kernels (``emulate=False``) against its emulation:
    the layouts the quantizers hand the GEMMs, forward and both gradients, equal up to
    accumulation order."""
    from torchtitan_fp8_moe.fp8 import fp8_grouped_mm, recipe_named
    from torchtitan_fp8_moe.fp8.kernels import triton_blockwise as bq
    from torchtitan_fp8_moe.fp8.recipes.blockwise import triton_quantizers as cuda

    cuda.quantize_1x128 = _fp8_rounded_by_torch(bq.quantize_1x128, (0,))
    cuda.quantize_128x1 = _fp8_rounded_by_torch(bq.quantize_128x1, (0,))
    cuda.quantize_128x128 = _fp8_rounded_by_torch(bq.quantize_128x128, (0, 2))
    cuda.quantize_128x128_transposed = _fp8_rounded_by_torch(bq.quantize_128x128_transposed, ())
    torch.manual_seed(0)
    recipe = recipe_named("blockwise")
    offs = torch.tensor([128, 128, 300], dtype=torch.int32)  # 128-aligned starts, an empty group
    x = torch.randn(320, 200, dtype=torch.bfloat16)
    stored = (torch.randn(3, 130, 200) * 0.02).bfloat16()  # [E, out, in], as torchtitan holds it
    grad = torch.randn(320, 130, dtype=torch.bfloat16)
    results = []
    for emulate in (True, False):
        a, w = x.clone().requires_grad_(), stored.clone().requires_grad_()
        out = fp8_grouped_mm(a, w.transpose(-2, -1), offs, recipe, emulate)
        out.backward(grad)
        results.append((out.float(), a.grad.float(), w.grad.float()))
    for want, got in zip(*results, strict=True):
        assert (got - want).norm() <= 2**-7 * want.norm(), (got - want).norm() / want.norm()
    assert not results[1][0][300:].any() and not results[1][1][300:].any()


def _run_interpreted(check: str) -> None:
    run_interpreted("test_blockwise_kernels_interpreted", check)


# About 7 s each in Triton's interpreter: out of the fast loop, which stays under 2 minutes.
@pytest.mark.slow
def test_blockwise_quantize_kernels_in_triton_interpreter():
    """1x128, 128x1 (per group) and 128x128 (both orientations) casts: the torch rules' fp8
    codes and scales, ragged edges, empty groups, rows of no group; the CUDA recipe's
    quantizers."""
    _run_interpreted("_check_quantize")


@pytest.mark.slow
def test_blockwise_grouped_mm_in_triton_interpreter():
    """Forward and input-gradient forms, empty groups, rows past the last group, ragged K/N."""
    _run_interpreted("_check_grouped_mm")


@pytest.mark.slow
def test_blockwise_wgrad_in_triton_interpreter():
    """Per-group contraction over 128-token blocks, empty groups give 0."""
    _run_interpreted("_check_wgrad")


@pytest.mark.slow
def test_blockwise_autograd_on_kernels_in_triton_interpreter():
    """The CUDA recipe end to end (quantizers, GEMMs, the autograd function) equals its
    emulation."""
    _run_interpreted("_check_autograd_on_kernels")


def test_blockwise_gemms_have_shape_rules():
    """torch.compile and meta tensors see the GEMMs' custom ops and get their shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_fp8_moe.fp8.kernels import blockwise_cublas
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
        # The cuBLAS op's own shape rule: the strides of its real output (N-major), which
        # inductor's generated code checks.
        cublas = blockwise_cublas.blockwise_grouped_mm_wgrad(
            a, torch.empty(3, 200), g, torch.empty(3, 130), offs, torch.bfloat16
        )
        assert cublas.shape == (4, 200, 130) and cublas.transpose(-2, -1).is_contiguous()


def test_cuda_recipe_traces_under_fake_tensors():
    """The blockwise recipe's CUDA path (casts and GEMMs, forward and backward) on fake tensors,
    as torch.compile runs it first: every kernel is behind an op with a shape rule. (The casts
    launched their kernels directly, which read a fake tensor's data: the first compiled
    blockwise step on CUDA failed.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_fp8_moe.fp8 import fp8_grouped_mm, recipe_named

    with FakeTensorMode():
        a = torch.empty(1024, 256, dtype=torch.bfloat16, requires_grad=True)
        b = torch.empty(4, 256, 512, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.empty(4, dtype=torch.int32)
        out = fp8_grouped_mm(a, b, offs, recipe_named("blockwise"), emulate=False)
        out.sum().backward()
        assert out.shape == (1024, 512) and out.dtype == torch.bfloat16
        assert a.grad.shape == a.shape and b.grad.shape == b.shape
