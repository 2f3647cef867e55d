"""The blockwise recipe on DeepGEMM's kernels (``fp8/kernels/blockwise_deepgemm.py``) on a GPU: the
three GEMMs equal fp64 math on the same fp8 values up to accumulation order and the cuBLAS /
Triton kernels' results within it, on the CUDA quantizers' own outputs (an empty group, rows of
no group); shapes DeepGEMM does not take run on those kernels; eager equals compiled; a layer
whose GEMMs are on DeepGEMM trains like torch's; ``gemm_backend = "auto"`` times it. Runs only
where DeepGEMM loads (sm90)."""

import pytest
import torch
from test_blockwise_kernels_interpreted import (
    close,
    dequantized,
    grouped_reference,
    spread,
    wgrad_reference,
)

from torchtitan_fp8_moe.fp8.kernels import gemm_backends

if "deepgemm" not in gemm_backends.available():
    pytest.skip("DeepGEMM does not load here", allow_module_level=True)

from torchtitan_fp8_moe import gemm_choice  # noqa: E402
from torchtitan_fp8_moe.fp8.kernels import blockwise_cublas, blockwise_deepgemm  # noqa: E402
from torchtitan_fp8_moe.fp8.kernels.gemm_backends import GemmChoice  # noqa: E402
from torchtitan_fp8_moe.fp8.recipes import recipe_named  # noqa: E402
from torchtitan_fp8_moe.fp8.recipes.blockwise.triton_quantizers import (  # noqa: E402
    TRITON_QUANTIZERS as cuda,
)
from torchtitan_fp8_moe.fp8.scaled_grouped_mm import fp8_grouped_mm  # noqa: E402
from torchtitan_fp8_moe.fp8.sqnr import sqnr  # noqa: E402

BF16 = torch.bfloat16
BITS = 8  # test_blockwise_cuda.py's bound against fp64 (Hopper's fp8 MMA accumulation)
BLOCKWISE = recipe_named("blockwise")
# 128-aligned groups: an empty one, rows past the last group; one group of every row.
CASES = [(2048, 640, 1024, [0, 256, 256, 1280, 1792]), (1024, 2048, 256, [1024])]


def _operands(m, k, n, ends):
    torch.manual_seed(0)
    x, dy = spread(m, k).cuda(), spread(m, n).cuda()
    w = torch.stack([spread(n, k) for _ in ends]).cuda().transpose(-2, -1)  # [G, K, N]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    return x, dy, w, offs


@pytest.mark.parametrize("m,k,n,ends", CASES)
def test_forward_and_input_grad_equal_fp64_on_the_fp8_values(m, k, n, ends):
    x, dy, w, offs = _operands(m, k, n, ends)
    (x_data, x_scale), (dy_data, dy_scale) = cuda.rows(x), cuda.rows(dy)
    w_data, w_scale, state = cuda.weight(w)
    w_t_data, w_t_scale = cuda.weight_transposed(w, state)
    x64 = dequantized(x_data, x_scale, (1,)).double()
    dy64 = dequantized(dy_data, dy_scale, (1,)).double()
    w64 = dequantized(w_data, w_scale, (1, 2)).double()
    grouped_mm = blockwise_deepgemm.blockwise_grouped_mm
    for mm in (grouped_mm, torch.compile(grouped_mm)):
        y = mm(x_data, x_scale, w_data, w_scale, offs, BF16)
        want = grouped_reference(x64, w64, ends, m)
        assert close(y, want, grouped_reference(x64.abs(), w64.abs(), ends, m), BITS)
        assert not y[ends[-1] :].any(), "rows of no group are 0"
        theirs = blockwise_cublas.blockwise_grouped_mm(x_data, x_scale, w_data, w_scale, offs, BF16)
        assert sqnr(theirs.float(), y) >= 40
        dx = mm(dy_data, dy_scale, w_t_data, w_t_scale, offs, BF16)
        w_t64, dy64d = w64.transpose(-2, -1), dy64
        want = grouped_reference(dy64d, w_t64, ends, m)
        assert close(dx, want, grouped_reference(dy64d.abs(), w_t64.abs(), ends, m), BITS)


@pytest.mark.parametrize("m,k,n,ends", CASES)
def test_weight_grad_equals_fp64_on_the_fp8_values(m, k, n, ends):
    x, dy, _, offs = _operands(m, k, n, ends)
    x_data, x_scale, dy_data, dy_scale = cuda.per_group_pair(x, dy, offs)
    tiles = -(-m // 128)
    operands = (x_data, x_scale[:tiles], dy_data, dy_scale[:tiles], offs)
    x64 = dequantized(x_data, x_scale[:tiles], (0,)).double()
    dy64 = dequantized(dy_data, dy_scale[:tiles], (0,)).double()
    want = wgrad_reference(x64, dy64, ends)
    magnitude = wgrad_reference(x64.abs(), dy64.abs(), ends)
    wgrad = blockwise_deepgemm.blockwise_grouped_mm_wgrad
    for mm in (wgrad, torch.compile(wgrad)):
        got = mm(*operands, BF16)
        assert close(got, want, magnitude, BITS)
        reference = blockwise_cublas.blockwise_grouped_mm_wgrad(*operands, BF16)
        assert got.stride() == reference.stride(), "the weights' layout"
        for group, end in enumerate(ends):
            if end == ([0, *ends])[group]:
                assert not got[group].any(), "an empty group's gradient is 0"


def test_shapes_deepgemm_does_not_take_run_on_the_other_kernels():
    """N = 1000 (no multiple of 128), groups of 300 tokens, an fp32 output."""
    m, k, n, ends = 2048, 640, 1000, [0, 300, 300, 1200, 1900]
    x, _, w, offs = _operands(m, k, n, ends)
    a, a_scale = cuda.rows(x)
    b, b_scale, _ = cuda.weight(w)
    for out_dtype in (BF16, torch.float32):
        got = blockwise_deepgemm.blockwise_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype)
        want = blockwise_cublas.blockwise_grouped_mm(a, a_scale, b, b_scale, offs, out_dtype)
        assert torch.equal(got, want)


def test_a_layer_on_deepgemm_trains_like_torchs():
    """Forward and both gradients of ``fp8_grouped_mm`` with every GEMM on DeepGEMM against the
    same on torch's kernels, and against fp32 math on the bf16 operands (the blockwise bars of
    ``test_blockwise_cuda.py``)."""
    torch.manual_seed(0)
    ends = [1024, 1024, 2560, 4096]
    offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
    x = torch.randn(4096, 1024, device="cuda", dtype=BF16)
    stored = (torch.randn(len(ends), 2048, 1024, device="cuda") * 0.02).to(BF16)
    dy = torch.randn(4096, 2048, device="cuda", dtype=BF16)
    results = {}
    for name in ("torch", "deepgemm"):
        xg, wg = x.clone().requires_grad_(), stored.clone().requires_grad_()
        gemm = GemmChoice(name, name, name)
        y = fp8_grouped_mm(xg, wg.transpose(-2, -1), offs, BLOCKWISE, False, gemm=gemm)
        y.backward(dy)
        results[name] = (y, xg.grad, wg.grad)
    x32, w32 = x.float(), stored.float().transpose(-2, -1)
    want = (
        grouped_reference(x32, w32, ends, 4096),
        grouped_reference(dy.float(), w32.transpose(-2, -1), ends, 4096),
        wgrad_reference(x32, dy.float(), ends).transpose(-2, -1),
    )
    pairs = zip(results["deepgemm"], results["torch"], want, (23, 26, 21), strict=True)
    for got, theirs, reference, bar in pairs:
        assert sqnr(reference, got) >= bar
        assert sqnr(theirs.float(), got) >= 35
    assert results["deepgemm"][2].stride() == results["torch"][2].stride()


def test_auto_times_deepgemm_and_names_its_choice(caplog):
    with caplog.at_level("INFO"):
        choice = gemm_choice.choose(
            "auto", BLOCKWISE, (16, 2048, 7168), 16 * 1024, 128, torch.device("cuda")
        )
    assert "deepgemm" in caplog.text and "blockwise_k_grouped" in caplog.text
    assert set(vars(choice).values()) <= {"torch", "deepgemm"}
