"""fp8 copies of a weight, kept from first use until the weight's values may have changed.

Within one optimizer step a weight is the same in every forward, activation-checkpoint recompute
and gradient-accumulation micro-batch, so its fp8 copy (one per orientation: forward and input
gradient) can be computed once and reused. A ``WeightQuantCache`` belongs to one set of tensors
that hold the same values: a weight, its views, and under FSDP2 its local shard and the unsharded
weight all-gathered from the shards (whose values change only when a shard changes).

An entry is valid while all of these hold, so no change of the values can reach a stale copy:
- no op that writes into the weight or one of its views ran since the entry was made. The weight
  tensor's op table (``weight/tensor_ops.py``) sees every such op and calls ``invalidate``; what
  counts as a write comes from the op's schema (in-place, ``out=``, ``copy_``, the optimizer's
  foreach ops);
- no plain tensor behind the weight or one of its views (``watch``) has a new version. This
  catches writes that bypass the weight tensor: checkpoint loads (DCP copies into the plain
  tensors that the state dict hands out, which are these), writes into ``_data``. Each is watched
  on its own: a view made at dispatch level does not share its source's version counter. (Writes
  through the weight tensor itself run below autograd, where version counters do not move: that
  is why the first rule exists.) FSDP's refills of the unsharded weight's buffer are not watched:
  they bring back the same values.
- the quantized tensor has the entry's dtype, device, shape, strides and storage offset.
``clear_all`` drops every entry after each optimizer step and checkpoint load, which also frees
their memory.

A cast or clone of the weight (``w.bfloat16()`` in a forward) holds values computed from it: its
entries live in a child cache, made once per kind of copy and reused by later copies of the same
kind while the parent is unchanged. A write into a copy invalidates the copy's cache and detaches
it, so later copies get a fresh one.
"""

import weakref
from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

import torch

_live_caches: "weakref.WeakSet[WeightQuantCache]" = weakref.WeakSet()

Quantized = tuple[torch.Tensor, ...]  # fp8 data, scales (, the amax of the other orientation)


class WeightQuantizer(Protocol):
    """What the fp8 GEMM calls for its weight's fp8 copy: (b, orientation, quantize) ->
    ``quantize`` of the values b stands for, or an equal copy it already holds. ``quantize``
    takes the values and ``round_to``: the dtype to round them to first (a cast's, or None)."""

    keeps_copies: bool  # its copies outlive the GEMM (then the backward's order rule counts them)

    def __call__(
        self, b: torch.Tensor, orientation: str, quantize: Callable[..., Quantized]
    ) -> Quantized: ...


class WeightPayloads(NamedTuple):
    """Both fp8 copies of a GEMM's weight operand ``b [G, K, N]``, made before the GEMM (an fp8
    all-gather brings them, ``gathered.py``): tensors, so compiled graphs take them as inputs."""

    forward_data: torch.Tensor  # b's fp8 data [G, K, N]
    forward_scales: torch.Tensor  # [G, 1, N]
    input_grad_data: torch.Tensor  # b^T's fp8 data [G, N, K]
    input_grad_scales: torch.Tensor  # [G, 1, K]


class WeightQuantCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[int, Quantized]] = {}
        self._generation = 0  # moves on every write into the values
        self._watched: dict[int, tuple[weakref.ref, int]] = {}  # id -> (tensor, its version)
        self._parent: WeightQuantCache | None = None
        self._parent_generation: int | None = None
        self._copies: dict[tuple, WeightQuantCache] = {}
        self.quantizations = 0  # misses of this cache and its copies' caches, for tests and logs
        _live_caches.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def watch(self, data: torch.Tensor) -> None:
        """Treat a write into ``data`` (a plain tensor holding these values) as a change."""
        self._watched[id(data)] = (weakref.ref(data), data._version)

    def _check_watched(self) -> None:
        live = {}
        written = False
        for key, (ref, version) in self._watched.items():
            data = ref()
            if data is not None:
                written |= data._version != version
                live[key] = (ref, data._version)
        self._watched = live
        if written:
            self.invalidate()

    def _current_generation(self) -> int:
        self._check_watched()
        return self._generation

    def quantize(
        self, b: torch.Tensor, orientation: Hashable, quantize: Callable[..., Quantized]
    ) -> Quantized:
        """``quantize(b)``, from the cache while the weight is unchanged; ``orientation`` (with
        b's layout) keys the copy."""
        key = (orientation, b.dtype, b.device, tuple(b.shape), b.stride(), b.storage_offset())
        generation = self._current_generation()
        entry = self._entries.get(key)
        if entry is not None and entry[0] == generation:
            return entry[1]
        result = quantize(b)
        cache = self
        while cache is not None:
            cache.quantizations += 1
            cache = cache._parent
        self._entries[key] = (generation, result)
        return result

    def invalidate(self) -> None:
        """The values changed: drop every fp8 copy, and leave the parent's copies if this is
        the cache of a cast or clone."""
        self._generation += 1
        self.clear()
        if self._parent is not None:
            self._parent._copies = {k: c for k, c in self._parent._copies.items() if c is not self}
            self._parent = None

    def cache_of_copy(self, kind: tuple) -> "WeightQuantCache":
        """The cache for a copy of this weight of ``kind`` (dtype, device, ...), shared by every
        such copy made while this weight is unchanged."""
        generation = self._current_generation()
        child = self._copies.get(kind)
        if child is None or child._parent_generation != generation:
            child = WeightQuantCache()
            child._parent, child._parent_generation = self, generation
            self._copies[kind] = child
        return child

    def clear(self) -> None:
        self._entries.clear()
        self._copies.clear()


def clear_all() -> None:
    """Drop every cached fp8 weight (after each optimizer step and checkpoint load)."""
    for cache in list(_live_caches):
        cache.clear()


class CachedWeightQuantizer:
    """One weight's cache, handed to the fp8 matmul."""

    keeps_copies = True

    def __init__(self, cache: WeightQuantCache):
        self.cache = cache

    def __call__(self, b: torch.Tensor, orientation: str, quantize) -> Quantized:
        return self.cache.quantize(b, orientation, quantize)
