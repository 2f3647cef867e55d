"""Every installed GEMM backend against torch's on a GPU (``fp8/kernels/gemm_backends.py``): the
same products for each GEMM form the rowwise recipe calls, on the operands its CUDA quantizers
write (their layouts and scales; uneven token groups, an empty one, rows of no group); weights
whose GEMMs run on each backend train like torch's, eager and compiled; ``gemm_backend =
"auto"`` times and names its choice. Runs only on CUDA devices with fp8 (sm89+), the cases of a
backend only where it loads."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_fp8_moe import convert
from torchtitan_fp8_moe.fp8.kernels import gemm_backends
from torchtitan_fp8_moe.fp8.kernels.gemm_backends import GemmChoice
from torchtitan_fp8_moe.fp8.recipes import recipe_named
from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS
from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig, fp8_kernels_available

if not (torch.cuda.is_available() and fp8_kernels_available(torch.device("cuda"))):
    pytest.skip("needs a CUDA device with fp8 (sm89+)", allow_module_level=True)

ROWWISE = recipe_named("rowwise")
OTHERS = [name for name in ROWWISE.gemm_backend_names if name != "torch"]
E, N, K, M = 4, 1536, 1024, 4096
OFFS = [512, 512, 2560, 4000]  # an empty group, 96 rows of no group


def _loads(name: str):
    if name not in gemm_backends.available():
        pytest.skip(f"{name} does not load here")


def _operands(groups: int, tokens: int = M):
    torch.manual_seed(0)
    w = torch.randn(groups, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(OFFS if groups > 1 else [tokens], dtype=torch.int32, device="cuda")
    return w, x, grad, offs


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("groups", [E, 1], ids=["m_grouped", "dense"])
def test_each_form_gives_torchs_products(name, groups):
    """Forward, input gradient and (dense) weight gradient on the quantizers' own outputs."""
    _loads(name)
    w, x, grad, offs = _operands(groups)
    rows = int(offs[-1])
    bf16 = torch.bfloat16
    a, a_scale = TRITON_QUANTIZERS.rows(x)
    b, b_scale, amax_over_n = TRITON_QUANTIZERS.weight(w.transpose(-2, -1))
    g, g_scale = TRITON_QUANTIZERS.rows(grad)
    b_t, b_t_scale = TRITON_QUANTIZERS.weight_transposed(w.transpose(-2, -1), amax_over_n)
    gemms = [
        (a, a_scale, b, b_scale),  # forward
        (g, g_scale, b_t, b_t_scale),  # input gradient
    ]
    for operands in gemms:
        want = ROWWISE.grouped_mm(*operands, offs, bf16, False, "torch")
        got = ROWWISE.grouped_mm(*operands, offs, bf16, False, name)
        assert got.shape == want.shape and got.dtype == bf16
        assert sqnr(want[:rows].float(), got[:rows].float()) > 50
    pair = TRITON_QUANTIZERS.per_group_pair(x, grad, offs)
    backend = name if groups == 1 else "torch"  # no k-grouped kernel but torch's
    want = ROWWISE.grouped_wgrad_mm(*pair, offs, bf16, False, "torch")
    got = ROWWISE.grouped_wgrad_mm(*pair, offs, bf16, False, backend)
    assert sqnr(want.float(), got.float()) > 50


def _routed(x, w, offs):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


def _linear(x, w, offs):
    return F.linear(x, w)


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("forward", [_routed, _linear], ids=["routed", "linear"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_weight_on_the_backend_trains_like_torchs(name, forward, compiled):
    _loads(name)
    routed = forward is _routed
    w, x, grad, offs = _operands(E if routed else 1)
    w = w if routed else w[0]
    forms = GemmChoice(name, name, "torch" if routed else name)
    results = []
    for gemm in (GemmChoice(), forms):
        weight = nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(gemm=gemm)))
        xs = x.clone().requires_grad_()
        fn = torch.compile(forward, fullgraph=True) if compiled else forward
        out = fn(xs, weight, offs)
        out.backward(grad)
        results.append((out, xs.grad, weight.grad))
    rows = int(offs[-1])
    for want, got in zip(*results, strict=True):
        if want.shape[0] == x.shape[0]:  # token rows: only those of a group are defined
            want, got = want[:rows], got[:rows]
        assert sqnr(want.float(), got.float()) > 45


def test_auto_times_the_gemms_and_names_its_choice(caplog):
    """Two routed projections and a linear at Qwen3-235B's per-rank width: every converted
    weight's plan row names its GEMMs' backends; with another backend installed, the timed
    shapes are logged."""
    experts = nn.Module()
    experts.w1 = nn.Parameter(torch.randn(E, N, K, device="cuda") * 0.02)
    experts.w2 = nn.Parameter(torch.randn(E, K, N, device="cuda") * 0.02)
    experts.w3 = nn.Parameter(torch.randn(E, N, K, device="cuda") * 0.02)
    model = nn.Module()
    model.experts = experts
    with caplog.at_level(logging.INFO):
        plan = convert(model, fqns=["experts"], emulate=False, policy="always", tokens=M)
    several = len(gemm_backends.available()) > 1
    for row in plan:
        gemm = model.get_parameter(row.fqn).config.gemm
        assert gemm.weight_grad == "torch"
        assert row.path.endswith(gemm.describe()) == several, row.path
    timed = [r.message for r in caplog.records if "gemm_backend auto, m_grouped" in r.message]
    assert len(timed) == (2 if several else 0), timed
