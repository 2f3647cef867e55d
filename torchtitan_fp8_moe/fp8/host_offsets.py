"""Token-group offsets as host integers, read from the device at most once per tensor.

GEMMs that run one call per group (``kernels/blockwise_cublas.py``) need each group's bounds on
the host. Reading them waits for the GPU; a layer's three projections share one offsets tensor in
forward and backward, so the values are kept per tensor (and its version) and read once. Offsets
that the host made itself (one group of every token, a batch's equal groups: ``equal_groups``)
are remembered as they are made and never read back.
"""

import functools

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .opaque import traced

# offsets tensor -> (its version, its values)
_known = WeakIdKeyDictionary()


def _keepable(offs: torch.Tensor) -> bool:
    """Plain tensors with a version counter (not inference tensors), outside compiled code."""
    return (
        not torch.compiler.is_compiling() and type(offs) is torch.Tensor and not offs.is_inference()
    )


def remember(offs: torch.Tensor, values: list[int]) -> None:
    """Note that ``offs`` holds ``values`` (made on the host)."""
    if _keepable(offs):
        _known[offs] = (offs._version, values)


def values(offs: torch.Tensor) -> list[int]:
    """``offs.tolist()``, from the kept copy while ``offs`` is unchanged (writes bump its
    version; a kernel that writes through a raw pointer does not, so none may write offsets)."""
    if not _keepable(offs):
        return offs.tolist()
    kept = _known.get(offs)
    if kept is not None and kept[0] == offs._version:
        return kept[1]
    result = offs.tolist()
    _known[offs] = (offs._version, result)
    return result


def equal_groups(groups: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The offsets of ``groups`` groups of ``rows`` rows each, on ``like``'s device. For plain
    tensors in eager code, one tensor per (groups, rows, device): two GEMMs of the same tokens
    (a FeedForward shared expert's w1 and w3) then pass the same offsets, which the weight
    gradients' shared cast is keyed by (``cast_reuse.py``: by identity), and no call launches a
    fill. Traced code, stream capture (the fill would not run) and a GPU other than the current
    one (whose capture we cannot see) make their own."""
    if traced(like) or (
        like.is_cuda
        and (
            like.device.index != torch.cuda.current_device()
            or torch.cuda.is_current_stream_capturing()
        )
    ):
        return _made(groups, rows, like.device)
    return _kept(groups, rows, like.device)


def forget_equal_groups() -> None:
    """Free the kept offsets (after ``measure.py``'s timing, which frees what it timed with)."""
    _kept.cache_clear()


def _made(groups: int, rows: int, device: torch.device) -> torch.Tensor:
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
    remember(offs, [rows * group for group in range(1, groups + 1)])
    return offs


@functools.lru_cache(maxsize=64)
def _kept(groups: int, rows: int, device: torch.device) -> torch.Tensor:
    # Not an inference tensor even when first made under inference mode: a later training
    # step saves it for backward.
    with torch.inference_mode(False):
        offs = _made(groups, rows, device)
    if offs.is_cuda:
        # Filled on this stream, read later from any (DualPipeV's, a side stream's): once.
        torch.cuda.current_stream(device).synchronize()
    return offs
