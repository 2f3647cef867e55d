"""The rowwise recipe behind the recipe seam gives, bit for bit, what its fp8 ops give called
directly (the pre-seam computation): the rowwise quantizers of ``RowwiseTorchQuantizers``, exact
dequantization and the fp32 grouped GEMMs, for the forward, input and weight gradients."""

import torch
import torch.nn as nn

from torchtitan_fp8_moe.fp8 import gemm
from torchtitan_fp8_moe.fp8.quantize import dequantize
from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig


def _direct(x, w, offs, grad):
    """fwd, dgrad, wgrad of ``_grouped_mm(x, w^T, offs)`` from the fp8 ops themselves."""
    b = w.transpose(-2, -1)
    x_fp8, x_scale = TORCH_QUANTIZERS.rows(x)
    b_fp8, b_scale, amax_over_n = TORCH_QUANTIZERS.weight(b)
    out = gemm.grouped_mm_fp32(dequantize(x_fp8, x_scale), dequantize(b_fp8, b_scale), offs)
    g_fp8, g_scale = TORCH_QUANTIZERS.rows(grad)
    bt_fp8, bt_scale = TORCH_QUANTIZERS.weight_transposed(b, amax_over_n)
    dx = gemm.grouped_mm_fp32(dequantize(g_fp8, g_scale), dequantize(bt_fp8, bt_scale), offs)
    a_fp8, a_scales, gr_fp8, gr_scales = TORCH_QUANTIZERS.per_group_pair(x, grad, offs)
    groups = gemm.token_groups(offs, x.shape[0])
    a_hp = a_fp8.float() * gemm.per_token(a_scales.reciprocal(), groups)
    gr_hp = gr_fp8.float() * gemm.per_token(gr_scales.reciprocal(), groups)
    db = gemm.grouped_wgrad_mm_fp32(a_hp, gr_hp, offs)
    return out.bfloat16(), dx.bfloat16(), db.bfloat16().transpose(-2, -1)


def test_rowwise_through_the_seam_is_bit_identical_to_its_fp8_ops():
    torch.manual_seed(0)
    experts, out_features, in_features, tokens = 4, 48, 40, 70
    w = (torch.randn(experts, out_features, in_features) * 0.02).bfloat16()
    x = torch.randn(tokens, in_features).bfloat16()
    offs = torch.tensor([20, 20, 50, 64], dtype=torch.int32)  # an empty group, 6 rows of none
    grad = torch.randn(tokens, out_features).bfloat16()

    weight = nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(recipe="rowwise", emulate=True)))
    x_seam = x.clone().requires_grad_()
    out = torch._grouped_mm(x_seam, weight.transpose(-2, -1), offs=offs)
    out.backward(grad)

    want_out, want_dx, want_dw = _direct(x, w, offs, grad)
    assert torch.equal(out, want_out)
    assert torch.equal(x_seam.grad, want_dx)
    assert torch.equal(weight.grad, want_dw)
