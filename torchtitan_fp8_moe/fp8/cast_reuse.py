"""An activation's fp8 cast, kept for the next GEMM that casts the same values the same way.

torchtitan's experts multiply the same tokens by w1 and by w3, so the forward casts them twice
with the same rule, and the two weight gradients cast them per group twice in backward (the w3
backward, then SiLU's, then w1's). One slot per process holds the last cast. The next call takes
it if it casts the same memory (same tensor or view of the same base, data pointer, shape,
strides, dtype), unchanged since (the version counter, which views share), with the same cast
function and the same other inputs (by identity); every take empties the slot, hit or miss
(but for a hit on a cast kept for several takes, as ``routed_dispatch.py`` keeps the tokens'
gathered cast for w1 and w3), so the slot holds at most one activation's fp8 copy, until the
next cast that looks in it or the first backward (which drops a forward cast: the last
forward's is never reused); a cast kept in a backward is dropped when that backward ends, so
none lives on into the next step (where it moved the allocator's layout from step to step and
fragmented it). Writes that bypass the version counter (through ``x.data`` or raw pointers)
are not seen: do not make them between two expert GEMMs.

Eager only: a Python side table would break a compiled graph. There the rowwise recipe's CUDA
casts of the tokens are pure custom ops, whose equal calls AOTAutograd merges
(``RowwiseTritonQuantizers.tokens``).
Inference tensors (no version counter) and tensor subclasses are never kept.
"""

import operator
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch


class _Kept(NamedTuple):
    cast: Callable
    base: weakref.ref  # the tensor x views (or x): its memory stays x's while it lives
    layout: tuple
    version: int
    others: tuple
    result: object
    uses: int  # takes that return it before the slot empties


class _Slot:
    kept: _Kept | None = None


# One per process, not per thread: on CUDA the backward runs in autograd's device thread, and it
# must see (and drop) the forward's last cast. Threads that run forward and backward side by
# side (torchtitan's DualPipeV) share it: forwards keep and take only ``rows`` casts, backwards
# only per-group ones, and the key holds the tensor's identity, so neither takes the other's;
# where one replaces or empties the other's, the other casts again (a miss, never a wrong hit).
_slot = _Slot()


def _keepable(x: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and type(x) is torch.Tensor and not x.is_inference()


def _base(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None else x._base


def _layout(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)


def _matches(kept: _Kept | None, cast: Callable, x: torch.Tensor, others: tuple) -> bool:
    return (
        kept is not None
        and kept.cast == cast  # a bound method is a new object at each lookup
        and kept.base() is _base(x)
        and kept.layout == _layout(x)
        and kept.version == x._version
        and len(kept.others) == len(others)
        and all(map(operator.is_, kept.others, others))
    )


def take(cast: Callable, x: torch.Tensor, *others: torch.Tensor):
    """The kept result of ``cast`` on ``x`` (and ``others``), else None; empties the slot."""
    # _keepable first: compiled code must not read the slot.
    if not _keepable(x):
        return None
    kept, _slot.kept = _slot.kept, None
    if not _matches(kept, cast, x, others):
        return None
    if kept.uses > 1:
        _slot.kept = _Kept(*kept[:-1], kept.uses - 1)
    return kept.result


def holds(cast: Callable, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the next ``take`` with these arguments would hit; leaves the slot as it is."""
    return _keepable(x) and _matches(_slot.kept, cast, x, others)


def keep(cast: Callable, x: torch.Tensor, others: tuple, result, uses: int = 1) -> None:
    """Keep ``result``, the output of ``cast`` on ``x`` and ``others``, for the next ``uses``
    takes that match it (a miss still empties the slot)."""
    if not _keepable(x):
        return
    kept = _Kept(cast, weakref.ref(_base(x)), _layout(x), x._version, others, result, uses)
    _slot.kept = kept
    if torch._C._current_graph_task_id() != -1:  # in a backward: drop it when that ends

        def drop():
            if _slot.kept is not None and _slot.kept.result is kept.result:
                _slot.kept = None

        torch.autograd.Variable._execution_engine.queue_callback(drop)


def discard(cast: Callable) -> None:
    """Empty the slot if it holds a result of ``cast``."""
    if torch.compiler.is_compiling():
        return  # compiled code neither reads nor writes the slot
    kept = _slot.kept
    if kept is not None and kept.cast == cast:
        _slot.kept = None


def cast_once(cast: Callable, x: torch.Tensor):
    """``cast(x)``, or its kept result for these values."""
    result = take(cast, x)
    if result is None:
        result = cast(x)
        keep(cast, x, (), result)
    return result
