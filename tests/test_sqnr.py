"""The SQNR every numerical bar uses, against its definition computed whole in float64."""

import math

import pytest
import torch

from torchtitan_fp8_moe.fp8 import sqnr as sqnr_module
from torchtitan_fp8_moe.fp8.sqnr import sqnr


def _whole(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.double(), actual.double()
    return (20 * torch.log10(reference.norm() / (reference - actual).norm())).item()


@pytest.mark.parametrize("chunk", [7, 64, 1 << 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_sqnr_equals_the_whole_tensor_formula(chunk, dtype, monkeypatch):
    monkeypatch.setattr(sqnr_module, "CHUNK", chunk)
    torch.manual_seed(0)
    reference = torch.randn(5, 33, 17, dtype=dtype)
    actual = (reference.float() + 0.01 * torch.randn(reference.shape)).to(dtype)
    # A non-contiguous pair too: reshape copies it, and the chunks still pair up element by element.
    for ref, act in ((reference, actual), (reference.transpose(0, 2), actual.transpose(0, 2))):
        assert sqnr(ref, act) == pytest.approx(_whole(ref, act), abs=1e-9)


def test_sqnr_is_inf_for_equal_tensors_and_falls_with_the_noise():
    x = torch.randn(1000, dtype=torch.float64)
    assert sqnr(x, x.clone()) == math.inf
    assert sqnr(x, x * 1.001) == pytest.approx(60.0, abs=1e-6)
    assert sqnr(x, x * 1.1) == pytest.approx(20.0, abs=1e-6)


def test_sqnr_refuses_tensors_of_other_shapes_with_as_many_elements():
    with pytest.raises(ValueError, match="differ in shape"):
        sqnr(torch.randn(2, 3), torch.randn(3, 2))
