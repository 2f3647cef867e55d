"""Token-group offsets as host integers, read from the device at most once per tensor.

GEMMs that run one call per group (``kernels/blockwise_cublas.py``) need each group's bounds on
the host. Reading them waits for the GPU; a layer's three projections share one offsets tensor in
forward and backward, so the values are kept per tensor (and its version) and read once. Offsets
that the host made itself (one group of every token, a batch's equal groups) are remembered as
they are made and never read back.
"""

import torch
from torch.utils.weak import WeakIdKeyDictionary

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
