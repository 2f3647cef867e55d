"""The blockwise recipe (emulated): its quantizers and GEMMs against a plain fp32 reference of
the blockwise contract, its SQNR against the rowwise recipe's, and torch.compile(fullgraph)."""

import math

import pytest
import torch
import torch.nn as nn

from torchtitan_fp8_moe.fp8.recipes.blockwise.torch_quantizers import TORCH_QUANTIZERS
from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

BLOCK, FP8_MAX = 128, 448.0
FP8 = torch.float8_e4m3fn


# ---- a plain reference of the contract: loops over blocks, Python math for the scales ---------


def _ref_scale(block: torch.Tensor) -> float:
    amax = max(block.detach().abs().max().item(), 2.0**-100)
    return 2.0 ** math.floor(math.log2(FP8_MAX / amax))


def _ref_quantize(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """The dequantized fp8 values of a 2D ``x`` in blocks of block_rows x block_cols."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for r in range(0, x.shape[0], block_rows):
        for c in range(0, x.shape[1], block_cols):
            block = x[r : r + block_rows, c : c + block_cols].double()
            scale = _ref_scale(block)
            fp8 = (block * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            out[r : r + block_rows, c : c + block_cols] = fp8.double() / scale
    return out


def _ref_grouped(x, w, offs, grad):
    """fwd, dgrad, wgrad of ``_grouped_mm(x, w^T, offs)`` by the contract, in fp64."""
    x_q, g_q = _ref_quantize(x, 1, BLOCK), _ref_quantize(grad, 1, BLOCK)
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        b_q = _ref_quantize(w[g].t(), BLOCK, BLOCK)  # b = w^T [K, N]; dgrad uses its transpose
        out[start:end] = x_q[start:end] @ b_q
        dx[start:end] = g_q[start:end] @ b_q.t()
        # Weight gradient: 128 x 1 tiles of this group's tokens, from its first token.
        xt_q = _ref_quantize(x[start:end].t(), 1, BLOCK).t()
        gt_q = _ref_quantize(grad[start:end].t(), 1, BLOCK).t()
        dw[g] = (xt_q.t() @ gt_q).t()
        start = end
    return out, dx, dw


def _blockwise_weight(w: torch.Tensor, **config) -> nn.Parameter:
    return nn.Parameter(
        Float8MoEWeight(w.clone(), WeightConfig("blockwise", emulate=True, **config))
    )


def _routed(x, weight, offs):
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize(
    "experts, out_features, in_features, counts",
    [
        (3, 200, 136, [130, 0, 150]),  # ragged K and N, groups starting off the 128 grid
        (2, 256, 384, [256, 128]),  # aligned: the CUDA layout
    ],
)
def test_grouped_fwd_dgrad_wgrad_match_the_contract(experts, out_features, in_features, counts):
    torch.manual_seed(0)
    w = torch.randn(experts, out_features, in_features) * 0.02
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    tokens = int(offs[-1]) + 5  # 5 rows of no group
    x = torch.randn(tokens, in_features)
    grad = torch.randn(tokens, out_features)

    weight = _blockwise_weight(w)
    x_fp8 = x.clone().requires_grad_()
    out = _routed(x_fp8, weight, offs)
    out.backward(grad)
    want_out, want_dx, want_dw = _ref_grouped(x, w, offs, grad)
    rows = int(offs[-1])
    # Same fp8 values and scales; only the fp32 accumulation order differs.
    torch.testing.assert_close(out[:rows].double(), want_out[:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_fp8.grad[:rows].double(), want_dx[:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_dw, rtol=1e-5, atol=1e-5)
    assert not out[rows:].any() and not x_fp8.grad[rows:].any()


def test_dense_linear_matches_the_contract():
    torch.manual_seed(1)
    w = torch.randn(200, 136) * 0.02
    x, grad = torch.randn(70, 136), torch.randn(70, 200)
    weight = _blockwise_weight(w)
    x_fp8 = x.clone().requires_grad_()
    out = torch.nn.functional.linear(x_fp8, weight)
    out.backward(grad)
    offs = torch.tensor([70], dtype=torch.int32)
    want_out, want_dx, want_dw = _ref_grouped(x, w[None], offs, grad)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_fp8.grad.double(), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_dw[0], rtol=1e-5, atol=1e-5)


def test_input_gradient_uses_the_forward_blocks_transposed():
    """No second weight quantization: the transposed cast is the forward's fp8 data and scales,
    transposed, bit for bit."""
    b = torch.randn(2, 200, 136).bfloat16()
    data, scales, state = TORCH_QUANTIZERS.weight(b)
    data_t, scales_t = TORCH_QUANTIZERS.weight_transposed(b, state)
    assert torch.equal(data_t.view(torch.uint8), data.transpose(-2, -1).view(torch.uint8))
    assert torch.equal(scales_t, scales.transpose(-2, -1))
    assert scales.shape == (2, 2, 2)


# ---- SQNR against fp32, both recipes, per projection -------------------------------------------

DIM, HIDDEN, EXPERTS = 256, 512, 4
COUNTS = [384, 0, 256, 384]
PROJECTIONS = {"w1": (HIDDEN, DIM), "w2": (DIM, HIDDEN)}  # [out, in] of each expert


def _sqnr_per_gemm(recipe: str, w: torch.Tensor, x: torch.Tensor, grad: torch.Tensor):
    offs = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    w_hp, x_hp = w.clone().requires_grad_(), x.clone().requires_grad_()
    out_hp = _routed(x_hp, w_hp, offs)
    out_hp.backward(grad)
    weight = nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(recipe, emulate=True)))
    x_fp8 = x.clone().requires_grad_()
    out = _routed(x_fp8, weight, offs)
    out.backward(grad)
    return {
        "output": sqnr(out_hp, out),
        "input grad": sqnr(x_hp.grad, x_fp8.grad),
        "weight grad": sqnr(w_hp.grad, weight.grad),
    }


def _normal(projection: str, seed: int):
    torch.manual_seed(seed)
    out_features, in_features = PROJECTIONS[projection]
    w = torch.randn(EXPERTS, out_features, in_features) * 0.02
    x = torch.randn(sum(COUNTS), in_features)
    return w, x, torch.randn(sum(COUNTS), out_features)


def _with_outlier_blocks(projection: str, seed: int):
    """Outlier channel blocks, as in LLM activations: one 128-channel tile of the input 2**14
    times larger for every token, balanced by the weight's columns for those channels
    (2**-14 times smaller), so the product (and the fp32 reference) keeps its scale. A rowwise
    scale spans the whole row (activations) or column (weight), so the outliers flush the rest
    of it towards fp8's subnormals; a blockwise scale spans only its own tile or block."""
    w, x, grad = _normal(projection, seed)
    x[:, :BLOCK] *= 2.0**14
    w[:, :, :BLOCK] *= 2.0**-14
    return w, x, grad


@pytest.mark.parametrize("projection", sorted(PROJECTIONS))
def test_blockwise_sqnr_at_least_rowwise_on_normal_data(projection):
    w, x, grad = _normal(projection, seed=2)
    rowwise = _sqnr_per_gemm("rowwise", w, x, grad)
    blockwise = _sqnr_per_gemm("blockwise", w, x, grad)
    for gemm, db in blockwise.items():
        assert db >= rowwise[gemm] - 0.05, (gemm, db, rowwise[gemm])
    assert blockwise["output"] >= 23 and blockwise["weight grad"] >= 21
    assert blockwise["input grad"] >= 28  # fp8 x fp8 bound on Gaussian data (test_numerics.py)


@pytest.mark.parametrize("projection", sorted(PROJECTIONS))
def test_blockwise_sqnr_clearly_higher_with_outlier_blocks(projection):
    w, x, grad = _with_outlier_blocks(projection, seed=3)
    rowwise = _sqnr_per_gemm("rowwise", w, x, grad)
    blockwise = _sqnr_per_gemm("blockwise", w, x, grad)
    assert blockwise["output"] >= rowwise["output"] + 6, (blockwise, rowwise)
    for gemm, db in blockwise.items():
        assert db >= rowwise[gemm] - 0.05, (gemm, db, rowwise[gemm])
    assert blockwise["output"] >= 23 and blockwise["weight grad"] >= 21


def test_inductor_with_the_emulated_recipe_is_refused():
    """Inductor (torch 2.13, CPU) miscompiles the emulated blockwise GEMMs when the forward
    and both gradients compile together (outputs far from eager's, seen while writing
    test_compiles_fullgraph_like_eager): the converter refuses that combination, naming the
    options that work."""
    from test_converter import CUSTOM_CONFIG, _convert

    args = [CUSTOM_CONFIG, "--model.converters=float8_moe", "--float8_moe.recipe=blockwise"]
    with pytest.raises(ValueError, match='compile.backend = "aot_eager"'):
        _convert([*args, "--compile.enable"])
    _convert([*args, "--compile.enable", "--compile.backend=aot_eager"])  # traced whole: works


def test_compiles_fullgraph_like_eager():
    torch.manual_seed(4)
    w = torch.randn(3, 200, 136) * 0.02
    offs = torch.tensor([130, 130, 280], dtype=torch.int32)
    x, grad = torch.randn(285, 136), torch.randn(285, 200)

    def run(fn):
        weight = _blockwise_weight(w)
        x_fp8 = x.clone().requires_grad_()
        out = fn(x_fp8, weight, offs)
        out.backward(grad)
        return out, x_fp8.grad, weight.grad

    eager = run(_routed)
    compiled = run(torch.compile(_routed, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
