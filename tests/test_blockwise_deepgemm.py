"""The blockwise recipe's glue to DeepGEMM (``fp8/kernels/blockwise_deepgemm.py``) on a CPU: what
it hands DeepGEMM's two kernels (decode scales, the ``[G, N, K]`` weight, the prefix-sum group
layout, each group's token block) and what it makes of their results (rows of no group 0, the
weight gradient in the weights' layout), against fp32 math on the same fp8 operands; the option's
checks; the backend's absence. DeepGEMM is a GPU package: a fake of its two functions takes its
place at the import boundary only, computing what its documentation says the kernels compute and
writing NaN where they write nothing. ``tests/test_blockwise_deepgemm_cuda.py`` runs the real
kernels."""

import logging
import sys
import types

import pytest
import torch

from torchtitan_fp8_moe import gemm_choice
from torchtitan_fp8_moe.fp8 import recipe_named
from torchtitan_fp8_moe.fp8.kernels import blockwise_deepgemm, gemm_backends
from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE

TILE = 128


def _expand(scale: torch.Tensor, shape, dims) -> torch.Tensor:
    """One scale per 128 elements along ``dims`` of ``shape``, repeated to every element."""
    for dim in dims:
        scale = scale.repeat_interleave(TILE, dim=dim)
    return scale[tuple(slice(0, n) for n in shape)]


def _m_grouped(a, b, d, grouped_layout, disable_ue8m0_cast, use_psum_layout):
    """DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` with the prefix-sum layout: rows
    ``[align(end of g - 1), end of g)`` of ``a [M, K]`` times ``b[g] [N, K]^T``; other rows
    unwritten (NaN here)."""
    (a, sfa), (b, sfb) = a, b
    assert use_psum_layout and disable_ue8m0_cast and grouped_layout.dtype == torch.int32
    assert a.is_contiguous() and b.is_contiguous(), "K-major operands"
    assert sfa.shape == (a.shape[0], a.shape[1] // TILE)
    assert sfb.shape == (b.shape[0], b.shape[1] // TILE, b.shape[2] // TILE)
    a_hp = a.float() * _expand(sfa, a.shape, (1,))
    b_hp = b.float() * _expand(sfb, b.shape, (1, 2))
    d.fill_(float("nan"))
    start = 0
    for group, end in enumerate(grouped_layout.tolist()):
        start = -(-start // TILE) * TILE
        d[start:end] = (a_hp[start:end] @ b_hp[group].t()).to(d.dtype)
        start = end


def _k_grouped(a, b, d, ks, ks_tensor, c):
    """DeepGEMM's ``k_grouped_fp8_gemm_nt_contiguous``: ``d[g] = c[g] + a_g [M, k_g] @ b_g
    [N, k_g]^T``, each group's block one after the other in ``a`` and ``b``, the scales one
    ``[M | N, sum k / 128]`` matrix each."""
    (a, sfa), (b, sfb) = a, b
    assert ks_tensor.tolist() == ks and ks_tensor.dtype == torch.int32
    m, n, start = d.shape[1], d.shape[2], 0
    assert a.numel() == sum(ks) * m and b.numel() == sum(ks) * n
    for group, k in enumerate(ks):
        tiles = slice(start // TILE, (start + k) // TILE)
        a_g = a[start * m : (start + k) * m].view(m, k).float()
        b_g = b[start * n : (start + k) * n].view(n, k).float()
        a_g = a_g * _expand(sfa[:, tiles], (m, k), (1,))
        b_g = b_g * _expand(sfb[:, tiles], (n, k), (1,))
        d[group] = c[group] + a_g @ b_g.t()
        start += k


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    module = types.ModuleType("deep_gemm")
    module.m_grouped_fp8_gemm_nt_contiguous = _m_grouped
    module.k_grouped_fp8_gemm_nt_contiguous = _k_grouped
    monkeypatch.setitem(sys.modules, "deep_gemm", module)


def _fp8(*shape, generator):
    return torch.randn(*shape, generator=generator).to(FP8_DTYPE)


def _multipliers(*shape, generator):
    """The package's scales: powers of 2 that the data were multiplied by."""
    return 2.0 ** torch.randint(-4, 5, shape, generator=generator).float()


ENDS = [0, 256, 256, 640, 896]  # an empty group, two of several tiles, rows of no group
M, K, N = 1024, 384, 256


def test_forward_glue_gives_the_fp32_products(fake_deep_gemm):
    gen = torch.Generator().manual_seed(0)
    a, a_scale = _fp8(M, K, generator=gen), _multipliers(M, K // TILE, generator=gen)
    stored = _fp8(len(ENDS), N, K, generator=gen)  # the weight [G, N, K], read as b [G, K, N]
    b, b_scale = (
        stored.transpose(-2, -1),
        _multipliers(len(ENDS), K // TILE, N // TILE, generator=gen),
    )
    offs = torch.tensor(ENDS, dtype=torch.int32)
    got = blockwise_deepgemm._grouped_mm_by(list, a, a_scale, b, b_scale, offs, torch.bfloat16)
    a_hp = a.float() / _expand(a_scale, a.shape, (1,))
    b_hp = b.float() / _expand(b_scale, b.shape, (1, 2))
    start = 0
    for group, end in enumerate(ENDS):
        want = (a_hp[start:end] @ b_hp[group]).bfloat16()
        torch.testing.assert_close(got[start:end], want, rtol=1e-2, atol=1e-2)
        start = end
    assert not got[ENDS[-1] :].any(), "rows of no group are 0"


def test_weight_grad_glue_gives_the_fp32_products_in_the_weights_layout(fake_deep_gemm):
    gen = torch.Generator().manual_seed(0)
    tiles = -(-M // TILE)
    # The CUDA quantizer's layout: token-contiguous data, scales per global 128-token tile.
    a = _fp8(K, M, generator=gen).t()
    grad = _fp8(N, M, generator=gen).t()
    a_scale, g_scale = _multipliers(tiles, K, generator=gen), _multipliers(tiles, N, generator=gen)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    got = blockwise_deepgemm._wgrad_by(list, a, a_scale, grad, g_scale, offs, torch.bfloat16)
    assert got.shape == (len(ENDS), K, N) and got.stride(1) == 1, "K contiguous: [G, N, K]"
    a_hp = a.float() / _expand(a_scale, a.shape, (0,))
    g_hp = grad.float() / _expand(g_scale, grad.shape, (0,))
    start = 0
    for group, end in enumerate(ENDS):
        want = (a_hp[start:end].t() @ g_hp[start:end]).bfloat16()
        torch.testing.assert_close(got[group], want, rtol=1e-2, atol=1e-2)
        start = end


def test_absent_deepgemm_is_skipped_with_the_install_and_forcing_it_is_an_error(
    monkeypatch, caplog
):
    monkeypatch.setattr(gemm_backends, "_loaded", {"torch": gemm_backends.TorchBackend()})
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm raises
    with caplog.at_level(logging.INFO):
        assert "deepgemm" not in gemm_backends.available()
    [record] = [r for r in caplog.records if "GEMM backend deepgemm skipped" in r.message]
    assert "pip install --no-build-isolation deepinfer-gemm" in record.message
    blockwise = recipe_named("blockwise")
    assert not gemm_choice.has_choices("auto", blockwise)
    with pytest.raises(RuntimeError, match="gemm_backend = 'deepgemm'.*deepinfer-gemm"):
        gemm_choice.choose("deepgemm", blockwise, (4, N, K), M, TILE, None)
