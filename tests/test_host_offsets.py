"""``fp8/host_offsets.py``: offsets read to the host once per tensor and version, and offsets the
host made never read back."""

import torch

from torchtitan_fp8_moe.fp8 import host_offsets


class _CountingOffsets(torch.Tensor):
    """An offsets tensor that counts its reads to the host."""

    reads = 0

    def tolist(self):
        type(self).reads += 1
        return super().tolist()


def test_offsets_are_read_once_until_written():
    offs = torch.tensor([3, 7, 7], dtype=torch.int32).as_subclass(_CountingOffsets)
    _CountingOffsets.reads = 0
    assert host_offsets.values(offs) == [3, 7, 7]
    assert host_offsets.values(offs) == [3, 7, 7]
    assert _CountingOffsets.reads == 1
    offs[1] = 5  # a write bumps the version: the kept values are stale
    assert host_offsets.values(offs) == [3, 5, 7]
    assert _CountingOffsets.reads == 2
    other = torch.tensor([3, 7, 7], dtype=torch.int32).as_subclass(_CountingOffsets)
    assert host_offsets.values(other) == [3, 7, 7] and _CountingOffsets.reads == 3


def test_remembered_offsets_are_not_read():
    offs = torch.full((1,), 12, dtype=torch.int32).as_subclass(_CountingOffsets)
    _CountingOffsets.reads = 0
    host_offsets.remember(offs, [12])
    assert host_offsets.values(offs) == [12] and _CountingOffsets.reads == 0
