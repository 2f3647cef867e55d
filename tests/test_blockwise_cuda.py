"""The blockwise fp8 Triton kernels on a GPU: the casts give the torch rules' fp8 codes and
scales exactly, the GEMMs equal fp64 math on the same fp8 values up to accumulation order, and
end to end (cast + GEMM) they stay close to the unquantized matmuls. Skipped without CUDA fp8
(sm89+)."""

import pytest
import torch
from test_blockwise_kernels_interpreted import (
    close,
    dequantized,
    grouped_reference,
    spread,
    wgrad_reference,
)

from torchtitan_fp8_moe.fp8.sqnr import sqnr

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
    pytest.skip("needs a CUDA device with fp8 (sm89+)", allow_module_level=True)

from torchtitan_fp8_moe.fp8.kernels import triton_blockwise as bq  # noqa: E402
from torchtitan_fp8_moe.fp8.kernels.blockwise_gemm import (  # noqa: E402
    blockwise_grouped_mm,
    blockwise_grouped_mm_wgrad,
    blockwise_mm,
    blockwise_mm_wgrad,
)
from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS as rules  # noqa: E402
from torchtitan_fp8_moe.fp8.recipes.blockwise.triton_quantizers import TRITON_QUANTIZERS as cuda  # noqa: E402

# (M, K, N, group ends): empty groups, rows past the last group, ragged K/N, M below one tile.
GEMM_CASES = [
    (2048, 640, 1000, [0, 300, 300, 1200, 1900]),
    (40, 96, 70, [3, 3, 3, 40]),
    (1024, 2048, 256, [128, 512, 1024]),
]
# Group starts 128-aligned (the weight-gradient kernel's requirement).
WGRAD_CASES = [
    (2048, 640, 1000, [0, 256, 256, 1280, 1900]),
    (40, 70, 150, [40]),
    (1024, 256, 2048, [512, 1024]),
]
# The error allowed against fp64, relative to the sum of |products|: Hopper's fp8 MMA aligns
# the products of each 128-wide step to about 14 bits below the largest and drops the rest, and
# the test data span many decades per block. (A wrong scale, group or block errs by O(1).)
BITS = 8


def _bytes(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.uint8)


@pytest.mark.parametrize("rows,cols", [(2048, 640), (40, 130), (1, 7), (129, 256)])
def test_activation_cast_gives_the_torch_rules_codes(rows, cols):
    x = spread(rows, cols).cuda()
    for operand in (x, x.t().contiguous().t()):  # read through the strides
        (data, scale), (want_data, want_scale) = cuda.rows(operand), rules.rows(x)
        assert torch.equal(scale, want_scale)
        assert torch.equal(_bytes(data), _bytes(want_data))


@pytest.mark.parametrize("m,c,ends", [(2048, 640, [0, 256, 256, 1280, 1900]), (40, 130, [40])])
def test_weight_gradient_casts_give_the_torch_rules_codes(m, c, ends):
    x, grad = spread(m, c).cuda(), spread(m, 70).cuda()
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    got, want = cuda.per_group_pair(x, grad, offs), rules.per_group_pair(x, grad, offs)
    tokens = ends[-1]
    for data, want_data in ((got[0], want[0]), (got[2], want[2])):
        assert data.stride(0) == 1, "token-contiguous"
        assert torch.equal(_bytes(data[:tokens]), _bytes(want_data[:tokens]))
        assert not data[tokens:].float().any(), "rows of no group are 0"
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])


@pytest.mark.parametrize("groups,k,n", [(3, 640, 1000), (1, 128, 256), (2, 5, 1)])
def test_weight_casts_give_the_torch_rules_codes(groups, k, n):
    stored = torch.stack([spread(n, k) for _ in range(groups)]).cuda()  # [G, N, K]
    for w in (stored.transpose(-2, -1), stored.transpose(-2, -1).contiguous()):
        data, scale, state = cuda.weight(w)
        want_data, want_scale, want_state = rules.weight(w)
        assert torch.equal(scale, want_scale)
        assert torch.equal(_bytes(data), _bytes(want_data)) and data.stride(1) == 1
        data_t, scale_t = cuda.weight_transposed(w, state)
        want_data_t, want_scale_t = rules.weight_transposed(w, want_state)
        assert torch.equal(scale_t, want_scale_t)
        assert torch.equal(_bytes(data_t), _bytes(want_data_t)) and data_t.stride(1) == 1
        both = bq.quantize_128x128(w, transposed_too=True)
        assert torch.equal(_bytes(both[0]), _bytes(data))
        assert torch.equal(_bytes(both[2]), _bytes(data_t))


def _operands(m, k, n, groups):
    x_data, x_scale = rules.rows(spread(m, k).cuda())
    stored = torch.stack([spread(n, k) for _ in range(groups)]).cuda()
    w_data, w_scale, _ = cuda.weight(stored.transpose(-2, -1))
    return x_data, x_scale, w_data, w_scale


@pytest.mark.parametrize("m,k,n,ends", GEMM_CASES)
def test_grouped_mm_equals_fp64_on_the_fp8_values(m, k, n, ends):
    torch.manual_seed(0)
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x_data, x_scale, w_data, w_scale = _operands(m, k, n, len(ends))
    x, w = dequantized(x_data, x_scale, (1,)).double(), dequantized(w_data, w_scale, (1, 2))
    w = w.double()
    magnitude = grouped_reference(x.abs(), w.abs(), ends, m)
    for b in (w_data, w_data.contiguous()):
        got = blockwise_grouped_mm(x_data, x_scale, b, w_scale, offs, torch.float32)
        assert close(got, grouped_reference(x, w, ends, m), magnitude, BITS)
        assert not got[ends[-1] :].any(), "rows past the last group are 0"
    # Input gradient: the same blocks transposed, N-major (the CUDA quantizer's) and K-major.
    dy_data, dy_scale = rules.rows(spread(m, n).cuda())
    dy, w_t = dequantized(dy_data, dy_scale, (1,)).double(), w.transpose(-2, -1)
    want = grouped_reference(dy, w_t, ends, m)
    for b_t in (w_data.contiguous().transpose(-2, -1), w_data.transpose(-2, -1)):
        got = blockwise_grouped_mm(
            dy_data, dy_scale, b_t, w_scale.transpose(-2, -1), offs, torch.float32
        )
        assert close(got, want, grouped_reference(dy.abs(), w_t.abs(), ends, m), BITS)
    got = blockwise_mm(x_data, x_scale, w_data[-1], w_scale[-1], torch.float32)
    assert close(got, x @ w[-1], x.abs() @ w[-1].abs(), BITS)


@pytest.mark.parametrize("m,k,n,ends", WGRAD_CASES)
def test_wgrad_equals_fp64_on_the_fp8_values(m, k, n, ends):
    torch.manual_seed(0)
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x_data, x_scale, dy_data, dy_scale = cuda.per_group_pair(
        spread(m, k).cuda(), spread(m, n).cuda(), offs
    )
    x_scale, dy_scale = x_scale[: -(-m // 128)], dy_scale[: -(-m // 128)]
    x = dequantized(x_data, x_scale, (0,)).double()
    dy = dequantized(dy_data, dy_scale, (0,)).double()
    got = blockwise_grouped_mm_wgrad(x_data, x_scale, dy_data, dy_scale, offs)
    magnitude = wgrad_reference(x.abs(), dy.abs(), ends)
    assert close(got, wgrad_reference(x, dy, ends), magnitude, BITS)
    for group, end in enumerate(ends):
        if end == ([0] + ends)[group]:
            assert not got[group].any(), "an empty group's gradient is 0"
    tokens, token_blocks = slice(0, ends[-1]), slice(0, -(-ends[-1] // 128))
    got = blockwise_mm_wgrad(
        x_data[tokens], x_scale[token_blocks], dy_data[tokens], dy_scale[token_blocks]
    )
    x, dy = x[tokens], dy[tokens]
    assert close(got, x.t() @ dy, x.t().abs() @ dy.abs(), BITS)


def test_blockwise_training_gemms_stay_close_to_bf16():
    """Cast + GEMM against fp32 math on the unquantized bf16 operands. The contract's
    quantization itself gives about 28.5 dB for each GEMM on Gaussian data (its torch rules
    on CPU), below the project's 29 dB input-gradient bar: the bars here are output 23 dB,
    input gradient 26 dB, weight gradient 21 dB."""
    torch.manual_seed(0)
    m, k, n = 4096, 1024, 2048
    ends = [1024, 1024, 2560, 4096]  # one empty group; starts 128-aligned
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda").bfloat16()
    stored = (torch.randn(len(ends), n, k, device="cuda") * 0.02).bfloat16()
    w = stored.transpose(-2, -1)
    dy = torch.randn(m, n, device="cuda").bfloat16()
    w_data, w_scale, state = cuda.weight(w)
    y = blockwise_grouped_mm(*cuda.rows(x), w_data, w_scale, offs)
    assert sqnr(grouped_reference(x.float(), w.float(), ends, m), y) >= 23
    dx = blockwise_grouped_mm(*cuda.rows(dy), *cuda.weight_transposed(w, state), offs)
    want_dx = grouped_reference(dy.float(), w.float().transpose(-2, -1), ends, m)
    assert sqnr(want_dx, dx) >= 26
    x_data, x_scale, dy_data, dy_scale = cuda.per_group_pair(x, dy, offs)
    blocks = m // 128
    dw = blockwise_grouped_mm_wgrad(x_data, x_scale[:blocks], dy_data, dy_scale[:blocks], offs)
    assert sqnr(wgrad_reference(x.float(), dy.float(), ends), dw) >= 21
    assert not dw[1].any()


def test_grouped_mm_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) calls the custom ops: offs is never read on the host."""
    m, k, n, ends = GEMM_CASES[0]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x_data, x_scale, w_data, w_scale = _operands(m, k, n, len(ends))

    def forward(a, a_scale, b, b_scale, offs):
        return blockwise_grouped_mm(a, a_scale, b, b_scale, offs) * 2

    compiled = torch.compile(forward, fullgraph=True)
    want = forward(x_data, x_scale, w_data, w_scale, offs)
    assert torch.equal(compiled(x_data, x_scale, w_data, w_scale, offs), want)
    x_data, x_scale = bq.quantize_128x1(spread(m, k).cuda())
    g_data, g_scale = bq.quantize_128x1(spread(m, n).cuda())
    wgrad = torch.compile(blockwise_grouped_mm_wgrad, fullgraph=True)
    offs = torch.tensor([0, 256, 256, 1280, 1900], dtype=torch.int32, device="cuda")
    want = blockwise_grouped_mm_wgrad(x_data, x_scale, g_data, g_scale, offs)
    assert torch.equal(wgrad(x_data, x_scale, g_data, g_scale, offs), want)


# Shapes cuBLAS takes: weight dims multiples of 128, 128-aligned groups (an empty one, rows past
# the last group in the first case).
CUBLAS_CASES = [(2048, 640, 1024, [0, 256, 256, 1280, 1792]), (1024, 2048, 256, [1024])]


@pytest.mark.parametrize("m,k,n,ends", CUBLAS_CASES)
def test_cublas_gemms_equal_the_triton_kernels_bit_for_bit(m, k, n, ends, monkeypatch):
    """The recipe's CUDA GEMMs on cuBLAS's blockwise scaled_mm per group (on a GPU that has it,
    as an H200 with torch 2.11 does) give the Triton kernels' bf16 results exactly: forward,
    input gradient, weight gradient, eager and compiled. The Triton kernels give the wanted
    results and may not run in the cuBLAS calls."""
    from torchtitan_fp8_moe.fp8.kernels import blockwise_cublas

    device = torch.device("cuda", torch.cuda.current_device())
    if not blockwise_cublas._device_has_blockwise_scaled_mm(device):
        assert torch.cuda.get_device_capability() != (9, 0), "Hopper should have it"
        pytest.skip("no blockwise scaled_mm in this GPU's cuBLAS")
    torch.manual_seed(0)
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x, dy = torch.randn(m, k, device="cuda"), torch.randn(m, n, device="cuda")
    w = (torch.randn(len(ends), n, k, device="cuda") * 0.02).transpose(-2, -1)
    (x_data, x_scale), (dy_data, dy_scale) = cuda.rows(x), cuda.rows(dy)
    w_data, w_scale, state = cuda.weight(w)
    bf16 = torch.bfloat16
    w_t = cuda.weight_transposed(w, state)
    want_y = blockwise_grouped_mm(x_data, x_scale, w_data, w_scale, offs, bf16)
    want_dx = blockwise_grouped_mm(dy_data, dy_scale, *w_t, offs, bf16)
    pair = cuda.per_group_pair(x, dy, offs)
    blocks = -(-m // 128)
    x_c, x_c_scale, dy_c, dy_c_scale = pair[0], pair[1][:blocks], pair[2], pair[3][:blocks]
    want = blockwise_grouped_mm_wgrad(x_c, x_c_scale, dy_c, dy_c_scale, offs, bf16)

    def no_triton(*args):
        raise AssertionError("the Triton kernel ran where cuBLAS should")

    monkeypatch.setattr(blockwise_cublas.blockwise_gemm, "blockwise_grouped_mm", no_triton)
    monkeypatch.setattr(blockwise_cublas.blockwise_gemm, "blockwise_grouped_mm_wgrad", no_triton)
    eager_mm = blockwise_cublas.blockwise_grouped_mm
    for cublas_mm in (eager_mm, torch.compile(eager_mm)):
        got = cublas_mm(x_data, x_scale, w_data, w_scale, offs, bf16)
        assert torch.equal(got, want_y) and not got[ends[-1] :].any()
        assert torch.equal(cublas_mm(dy_data, dy_scale, *w_t, offs, bf16), want_dx)
    for wgrad in (
        blockwise_cublas.blockwise_grouped_mm_wgrad,
        torch.compile(blockwise_cublas.blockwise_grouped_mm_wgrad),
    ):
        got = wgrad(x_c, x_c_scale, dy_c, dy_c_scale, offs, bf16)
        assert torch.equal(got, want) and got.stride() == want.stride()


def test_weight_gradient_comes_in_the_weights_layout():
    """torchtitan's expert weights are [G, N, K] and read transposed: the recipe's weight
    gradient must arrive in that layout, as the rowwise recipe's does, or autograd copies every
    expert's gradient to accumulate it (a large share of a Scout layer call;
    docs/benchmarks/README.md)."""
    from torchtitan_fp8_moe.fp8.recipes import recipe_named
    from torchtitan_fp8_moe.fp8.scaled_grouped_mm import fp8_grouped_mm

    torch.manual_seed(0)
    ends = [256, 256, 1024]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x = torch.randn(ends[-1], 640, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(ends), 384, 640, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    incoming = []
    w.register_hook(incoming.append)
    fp8_grouped_mm(x, w.transpose(-2, -1), offs, recipe_named("blockwise"), False).sum().backward()
    assert incoming[0].is_contiguous(), incoming[0].stride()
    want = wgrad_reference(x.float(), torch.ones(ends[-1], 384, device="cuda"), ends)
    assert sqnr(want.transpose(-2, -1), w.grad) >= 21


def test_cublas_path_runs_the_triton_kernels_where_cublas_cannot():
    """Weight dims that are no multiples of 128, groups that are no multiple of 128 tokens, an
    fp32 output: the Triton kernels' results, not an error."""
    from torchtitan_fp8_moe.fp8.kernels import blockwise_cublas

    m, k, n, ends = GEMM_CASES[0]  # N = 1000, groups of 300 tokens
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x_data, x_scale, w_data, w_scale = _operands(m, k, n, len(ends))
    for out_dtype in (torch.bfloat16, torch.float32):
        got = blockwise_cublas.blockwise_grouped_mm(
            x_data, x_scale, w_data, w_scale, offs, out_dtype
        )
        want = blockwise_grouped_mm(x_data, x_scale, w_data, w_scale, offs, out_dtype)
        assert torch.equal(got, want)
    m, k, n, ends = CUBLAS_CASES[0]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    pair = cuda.per_group_pair(spread(m, k).cuda(), spread(m, n).cuda(), offs)
    blocks = -(-m // 128)
    operands = (pair[0], pair[1][:blocks], pair[2], pair[3][:blocks], offs, torch.float32)
    got = blockwise_cublas.blockwise_grouped_mm_wgrad(*operands)
    assert torch.equal(got, blockwise_grouped_mm_wgrad(*operands))
