"""The GEMM backend seam's glue on a CPU (``fp8/kernels/gemm_backends.py``, ``gemm_choice.py``):
a backend that does not load is skipped with one log line and the install command, a forced one
is an error naming it, the option's checks, and what ``[float8_moe] gemm_backend`` chooses and
hands each converted weight. fbgemm-gpu-genai is a GPU package: here a fake takes its place at
the import boundary only (a module whose import registers CPU ops of fbgemm's names and
conventions), so the recipe's calls into it, operand layouts and scales included, run as on a
GPU. ``tests/test_gemm_backends_cuda.py`` checks the real kernels against torch's."""

import importlib.util
import logging
import sys
import types

import pytest
import torch
from expert_modules import scout_meta_model

import torchtitan_fp8_moe.conversion as conversion
from torchtitan_fp8_moe import Float8MoEWeight, convert, gemm_choice
from torchtitan_fp8_moe.fp8 import recipe_named
from torchtitan_fp8_moe.fp8.kernels import gemm_backends
from torchtitan_fp8_moe.fp8.kernels.gemm_backends import TORCH_GEMMS, GemmChoice
from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS
from torchtitan_fp8_moe.fp8.sqnr import sqnr

ROWWISE, BLOCKWISE = recipe_named("rowwise"), recipe_named("blockwise")
FBGEMM_MODULE = "fbgemm_gpu.experimental.gen_ai"


@pytest.fixture
def fresh_backends(monkeypatch):
    """Backends loaded anew in this test (the process keeps each load's outcome)."""
    monkeypatch.setattr(gemm_backends, "_loaded", {"torch": gemm_backends.TorchBackend()})
    monkeypatch.setattr(gemm_choice, "_timings", {})


@pytest.fixture
def fbgemm_absent(fresh_backends, monkeypatch):
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # import fbgemm_gpu... raises


def _fake_grouped_stacked(xq, wq, x_scale, w_scale, m_sizes):
    """fbgemm's m-grouped GEMM as its kernel reads its operands: packed row-major ``XQ [M, K]``,
    ``WQ [G, N, K]``, ``x_scale [M]``, ``w_scale [G, N]``, int64 group sizes; rows past the
    groups left unwritten (here: NaN)."""
    for t in (xq, wq, x_scale, w_scale):
        assert t.is_contiguous(), "fbgemm reads packed storage"
    assert xq.dtype == wq.dtype == torch.float8_e4m3fn and m_sizes.dtype == torch.int64
    assert x_scale.shape == xq.shape[:1] and w_scale.shape == wq.shape[:2]
    out = torch.full((xq.shape[0], wq.shape[1]), float("nan"))
    start = 0
    for g, size in enumerate(m_sizes.tolist()):
        rows = slice(start, start + size)
        product = xq[rows].float() @ wq[g].float().t()
        out[rows] = product * x_scale[rows, None] * w_scale[g]
        start += size
    return out.bfloat16()


def _fake_rowwise(xq, wq, x_scale, w_scale, bias=None, use_fast_accum=True):
    """fbgemm's dense GEMM: ``XQ [M, K] x WQ [N, K]``, scales ``[M]`` and ``[N]``."""
    for t in (xq, wq, x_scale, w_scale):
        assert t.is_contiguous(), "fbgemm reads packed storage"
    assert x_scale.shape == xq.shape[:1] and w_scale.shape == wq.shape[:1]
    out = (xq.float() @ wq.float().t()) * x_scale[:, None] * w_scale
    return out.bfloat16()


_FAKE_OPS = []  # the fake's library, registered once per process (ops cannot be redefined)


@pytest.fixture
def fake_fbgemm(fresh_backends, monkeypatch):
    """An importable fbgemm_gpu whose import has registered fbgemm's two ops on CPU, as the
    real one registers its CUDA kernels."""
    if importlib.util.find_spec("fbgemm_gpu") is not None:
        pytest.skip("the real fbgemm_gpu is installed: its ops take the fake's names")
    if not _FAKE_OPS:
        library = torch.library.Library("fbgemm", "FRAGMENT")
        library.define(
            "f8f8bf16_rowwise_grouped_stacked(Tensor XQ, Tensor WQ, Tensor x_scale, "
            "Tensor w_scale, Tensor M_sizes) -> Tensor"
        )
        library.impl("f8f8bf16_rowwise_grouped_stacked", _fake_grouped_stacked, "CPU")
        library.define(
            "f8f8bf16_rowwise(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, "
            "Tensor? bias=None, bool use_fast_accum=True) -> Tensor"
        )
        library.impl("f8f8bf16_rowwise", _fake_rowwise, "CPU")
        _FAKE_OPS.append(library)
    for name in ("fbgemm_gpu", "fbgemm_gpu.experimental", FBGEMM_MODULE):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


def test_a_backend_that_does_not_load_is_skipped_with_one_log_line(fbgemm_absent, caplog):
    with caplog.at_level(logging.INFO):
        assert gemm_backends.available() == ["torch"]
        assert gemm_backends.available() == ["torch"]
    [record] = [r for r in caplog.records if "GEMM backend fbgemm skipped" in r.message]
    assert "pip install fbgemm-gpu-genai==1.6.0" in record.message
    assert not gemm_choice.has_choices("auto", ROWWISE)


def test_a_forced_backend_that_does_not_load_is_an_error_naming_the_install(fbgemm_absent):
    with pytest.raises(RuntimeError, match=r"gemm_backend = 'fbgemm'.*pip install fbgemm-gpu"):
        gemm_backends.backend("fbgemm")
    model = scout_meta_model()
    with pytest.raises(RuntimeError, match="pip install fbgemm-gpu-genai"):
        convert(model, emulate=False, policy="always", gemm_backend="fbgemm")


@pytest.mark.parametrize(
    "option, recipe, error",
    [
        ("cutlass", ROWWISE, "gemm_backend 'cutlass' is not one of"),
        (
            "fbgemm",
            BLOCKWISE,
            "recipe 'blockwise' runs its GEMMs on \\['torch', 'deepgemm'\\] only",
        ),
        ("deepgemm", ROWWISE, "recipe 'rowwise' runs its GEMMs on \\['torch', 'fbgemm'\\] only"),
    ],
)
def test_the_option_is_checked(option, recipe, error):
    with pytest.raises(ValueError, match=error):
        gemm_choice.check_option(option, recipe)
    gemm_choice.check_option("auto", recipe)
    gemm_choice.check_option("torch", recipe)


def test_auto_without_another_backend_keeps_torch_and_says_nothing(fbgemm_absent, monkeypatch):
    """No GEMM is timed, the plan rows read as before, every weight carries torch's GEMMs."""
    monkeypatch.setattr(gemm_choice, "_time", _unreachable)
    model = scout_meta_model()
    plan = convert(model, emulate=False, policy="always", tokens=16384)
    assert all("GEMMs" not in row.path for row in plan)
    assert {model.get_parameter(r.fqn).config.gemm for r in plan} == {TORCH_GEMMS}


def _unreachable(*args):
    raise AssertionError("timed a GEMM")


def test_forced_fbgemm_runs_every_form_it_has(fake_fbgemm):
    """Grouped experts: forward and input gradient (m-grouped), torch's weight gradient
    (fbgemm has no k-grouped fp8 kernel); one group (a shared expert): all three dense."""
    choose = gemm_choice.choose
    assert choose("fbgemm", ROWWISE, (4, 48, 32), 256, 16, None) == GemmChoice(
        "fbgemm", "fbgemm", "torch"
    )
    assert choose("fbgemm", ROWWISE, (48, 32), 256, 16, None) == GemmChoice(*["fbgemm"] * 3)
    assert choose("torch", ROWWISE, (4, 48, 32), 256, 16, None) == TORCH_GEMMS
    # auto needs a GPU and the rows to time at
    assert choose("auto", ROWWISE, (4, 48, 32), 256, 16, None) == TORCH_GEMMS
    assert choose("auto", ROWWISE, (4, 48, 32), None, 16, torch.device("cpu")) == TORCH_GEMMS


def test_convert_hands_each_weight_its_gemms_and_the_plan_names_them(fake_fbgemm):
    model = scout_meta_model()
    plan = convert(model, emulate=False, policy="always", tokens=16384, gemm_backend="fbgemm")
    for row in plan:
        weight = model.get_parameter(row.fqn)
        assert isinstance(weight, Float8MoEWeight)
        grouped = weight.ndim == 3 and weight.shape[0] > 1
        want = GemmChoice("fbgemm", "fbgemm", "torch" if grouped else "fbgemm")
        assert weight.config.gemm == want, row.fqn
        assert row.path.endswith(want.describe()), row.path
        # w1 and w3 still share their input's casts
        assert weight.config.shares_input == (".w2" not in row.fqn), row.fqn


def test_auto_times_each_gemm_shape_once_and_picks_by_the_margin(fake_fbgemm, monkeypatch):
    timed = []

    def fake_time(form, dims, names, alignment, device):
        timed.append((form, dims))
        assert names == ["torch", "fbgemm"] and alignment == 16
        # fbgemm 10% faster on the grouped forms, 1% on the dense ones (under MARGIN)
        fbgemm = 0.99 if form == "dense" else 0.9
        return {"torch": 1.0, "fbgemm": fbgemm}

    monkeypatch.setattr(gemm_choice, "_time", fake_time)
    monkeypatch.setattr(conversion, "_gemm_timing_device", lambda: torch.device("cpu"))
    model = scout_meta_model()
    plan = convert(model, emulate=False, policy="always", tokens=16384)
    routed = model.get_parameter("layers.0.moe.experts.w1").config.gemm
    assert routed == GemmChoice("fbgemm", "fbgemm", "torch")
    shared = model.get_parameter("layers.0.moe.shared_experts.w1.weight").config.gemm
    assert shared == TORCH_GEMMS
    assert len(timed) == len(set(timed))  # w1 / w3 and every layer share their shapes' timing
    # routed: w2's forward is w1's input gradient and back (2 m-grouped shapes); shared: the
    # same for the forward and input gradient, and two weight gradients (4 dense shapes)
    assert len(timed) == 6
    assert all("GEMMs forward" in row.path for row in plan)


@pytest.mark.parametrize(
    "times, pick",
    [
        ({"torch": 1.0, "fbgemm": 0.97}, "fbgemm"),
        ({"torch": 1.0, "fbgemm": 0.99}, "torch"),
        ({"torch": 1.0, "fbgemm": 1.2}, "torch"),
        ({"torch": 1.0}, "torch"),  # fbgemm failed on this shape
    ],
)
def test_another_backend_than_torch_must_save_the_margin(times, pick):
    assert gemm_choice._pick(times) == pick


def _operands(groups, n, k, tokens, offs):
    """The rowwise quantizers' fp8 operands of a forward and a weight gradient, with the CUDA
    path's layouts: weights column-major, as the CUDA quantizers write them."""
    torch.manual_seed(0)
    w = torch.randn(groups, n, k) * 0.02
    x = torch.randn(tokens, k)
    grad = torch.randn(tokens, n)
    a, a_scale = TORCH_QUANTIZERS.rows(x)
    b, b_scale, _ = TORCH_QUANTIZERS.weight(w.transpose(-2, -1))
    b = b.transpose(-2, -1).contiguous().transpose(-2, -1)
    pair = TORCH_QUANTIZERS.per_group_pair(x, grad, offs)
    return a, a_scale, b, b_scale, pair


@pytest.mark.parametrize("groups", [4, 1])
def test_the_recipes_cuda_calls_into_fbgemm_give_the_emulated_products(fake_fbgemm, groups):
    """Scales inverted and reshaped, offsets turned into int64 group sizes, operands laid out
    as fbgemm reads them: the products of the emulation on every row of a group (an empty group,
    rows of no group)."""
    offs = torch.tensor([20, 20, 48, 64] if groups > 1 else [64], dtype=torch.int32)
    a, a_scale, b, b_scale, pair = _operands(groups, 48, 32, 70, offs)
    bf16 = torch.bfloat16
    want = ROWWISE.grouped_mm(a, a_scale, b, b_scale, offs, bf16, emulate=True)
    got = ROWWISE.grouped_mm(a, a_scale, b, b_scale, offs, bf16, False, backend="fbgemm")
    rows = int(offs[-1])
    assert sqnr(want[:rows].float(), got[:rows].float()) > 40
    if groups == 1:  # the dense form serves one group's weight gradient too
        want = ROWWISE.grouped_wgrad_mm(*pair, offs, bf16, emulate=True)
        got = ROWWISE.grouped_wgrad_mm(*pair, offs, bf16, False, backend="fbgemm")
        assert got.shape == want.shape and sqnr(want.float(), got.float()) > 40


def test_the_log_line_names_the_gemm_backend_on_the_cuda_path_only():
    """The emulated path multiplies in fp32 math: no kernels to name."""
    from torchtitan_fp8_moe import Float8MoESettings
    from torchtitan_fp8_moe.run_checks import conversion_message

    settings = Float8MoESettings(policy="always", gemm_backend="fbgemm")

    def line(path):
        _, text = conversion_message([], 0, settings, path, "why", None)
        return text.splitlines()[0]

    assert ", GEMM backend fbgemm, fp8 weight cache off" in line("cuda")
    assert "GEMM backend" not in line("emulated") and ", policy always" in line("emulated")
