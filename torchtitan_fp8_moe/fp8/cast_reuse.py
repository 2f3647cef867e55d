"""An activation's fp8 cast, kept for the next GEMM that casts the same tensor the same way.

torchtitan's experts multiply the same routed tokens by w1 and by w3, so the forward casts them
twice with the same rule, and the two weight gradients cast them per group twice in backward
(the w3 backward, then SiLU's, then w1's). One slot holds the last cast: a call that casts the
same tensor object, unchanged since (its version counter), with the same cast and the same other
inputs (by identity) takes it, and a hit empties the slot. Any other eager cast replaces it, so
the slot never holds more than one activation's fp8 copy, and only until the next cast.

Eager only: under torch.compile the graph dedupes equal casts itself, and a Python side table
would break the graph. Inference tensors (no version counter) and tensor subclasses are never
kept.
"""

import weakref
from collections.abc import Callable

import torch

_slot: tuple | None = None  # (cast, weakref to x, x's version, other inputs, result)


def _keepable(x: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and type(x) is torch.Tensor and not x.is_inference()


def take(cast: Callable, x: torch.Tensor, *others: torch.Tensor):
    """The kept result of ``cast`` on ``x`` (and ``others``), emptying the slot; else None."""
    global _slot
    # _keepable first: compiled code must not read (and so guard on) the slot.
    if not _keepable(x) or _slot is None:
        return None
    kept_cast, source, version, kept_others, result = _slot
    if (
        kept_cast is cast
        and source() is x
        and version == x._version
        and len(kept_others) == len(others)
        and all(a is b for a, b in zip(kept_others, others, strict=True))
    ):
        _slot = None
        return result
    return None


def keep(cast: Callable, x: torch.Tensor, others: tuple, result) -> None:
    """Keep ``result``, the output of ``cast`` on ``x`` and ``others``, for the next ``take``."""
    global _slot
    if _keepable(x):
        _slot = (cast, weakref.ref(x), x._version, others, result)


def cast_once(cast: Callable, x: torch.Tensor):
    """``cast(x)``, or its kept result for this ``x``."""
    if not _keepable(x):
        return cast(x)
    result = take(cast, x)
    if result is None:
        result = cast(x)
        keep(cast, x, (), result)
    return result
