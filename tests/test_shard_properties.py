"""Property tests: for random (dim 0, world size), the shard plan and the weight tensor's
all-gather padding agree with FSDP2's own chunking."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from torchtitan_fp8_moe.sharding import plan_weight
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig


class _Mesh:
    """What fsdp_pre_all_gather reads of the shard mesh: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@settings(max_examples=300, deadline=None)
@given(dim0=st.integers(1, 64), world=st.integers(1, 16), rest=st.sampled_from([(2, 3), (4,)]))
def test_plan_and_all_gather_padding_match_fsdp_chunking(dim0, world, rest):
    full = torch.arange(dim0 * torch.Size(rest).numel(), dtype=torch.float32).view(dim0, *rest)
    chunks = _chunk_with_empty(full, world, dim=0)  # FSDP2: rank r holds chunks[r]
    padded_rows = chunks[0].shape[0]  # FSDP2 pads every rank to chunk 0's size
    row = plan_weight("w", tuple(full.shape), world, 0, 2, "emulated")
    assert row.rows_per_rank == padded_rows
    assert row.padding_only_ranks == sum(c.shape[0] == 0 for c in chunks)
    assert row.padding_bytes == (padded_rows * world - dim0) * torch.Size(rest).numel() * 2
    gathered, start = [], 0
    for rank in range(world):
        # FSDP2's local shard: its chunk's rows of the weight (zero rows on padding-only ranks).
        rows = chunks[rank].shape[0]
        shard = full.narrow(0, start, rows)
        start += rows
        local = Float8MoEWeight(shard, WeightConfig(emulate=True))
        (data,), metadata = local.fsdp_pre_all_gather(
            _Mesh(world), full.shape, None, None, MixedPrecisionPolicy()
        )
        assert data.shape == (padded_rows, *rest)
        assert torch.equal(data[:rows], chunks[rank].view(rows, *rest))
        assert not data[rows:].any()
        gathered.append(data)
    # What the all-gather would deliver, narrowed back by fsdp_post_all_gather.
    out, _ = local.fsdp_post_all_gather((torch.cat(gathered),), metadata, torch.float32)
    assert torch.equal(out._data, full)
