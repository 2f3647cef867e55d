"""``fp8/host_offsets.py``: offsets read to the host once per tensor and version, and offsets the
host made never read back."""

import pytest
import torch

from torchtitan_fp8_moe.fp8 import host_offsets


@pytest.fixture
def reads(monkeypatch):
    """How often a tensor was read to the host (``tolist``) since the test began."""
    count = [0]
    tolist = torch.Tensor.tolist

    def counting(self):
        count[0] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    return count


def test_offsets_are_read_once_until_written(reads):
    offs = torch.tensor([3, 7, 7], dtype=torch.int32)
    assert host_offsets.values(offs) == [3, 7, 7]
    assert host_offsets.values(offs) == [3, 7, 7]
    assert reads[0] == 1
    offs[1] = 5  # a write bumps the version: the kept values are stale
    assert host_offsets.values(offs) == [3, 5, 7]
    assert reads[0] == 2
    other = torch.tensor([3, 7, 7], dtype=torch.int32)
    assert host_offsets.values(other) == [3, 7, 7] and reads[0] == 3


def test_remembered_offsets_are_not_read(reads):
    offs = torch.full((1,), 12, dtype=torch.int32)
    host_offsets.remember(offs, [12])
    assert host_offsets.values(offs) == [12] and reads[0] == 0


def test_inference_tensors_are_read_and_not_kept(reads):
    """Inference tensors have no version counter: read every time, never kept (not even when
    remembered), and the fp8 matmuls still run under inference mode."""
    from torchtitan_fp8_moe.fp8 import fp8_batched_mm, fp8_matmul, recipe_named

    rowwise = recipe_named("rowwise")
    with torch.inference_mode():
        offs = torch.tensor([4, 9], dtype=torch.int32)
        host_offsets.remember(offs, [4, 9])
        assert host_offsets.values(offs) == [4, 9]
        assert host_offsets.values(offs) == [4, 9] and reads[0] == 2
        x, w = torch.randn(3, 5, 32), torch.randn(32, 16)
        y = fp8_matmul(x, w, rowwise, emulate=True)
        batched = fp8_batched_mm(torch.randn(2, 6, 32), torch.randn(2, 32, 16), rowwise, True)
    assert y.shape == (3, 5, 16) and batched.shape == (2, 6, 16)
    assert (y - x @ w).norm() < 0.1 * (x @ w).norm()
