"""fp8 copies of a weight, kept from first use until the weight changes.

Within one optimizer step a weight is the same in every forward, activation-checkpoint recompute
and gradient-accumulation micro-batch, so its fp8 copy (one per orientation: forward and input
gradient) can be computed once and reused. An entry is valid while its *version source* (the
tensor the optimizer updates in place: the parameter, or under FSDP2 the local shard) has the
version counter it had when the entry was made; ``clear_all`` drops every entry at the end of a
step. The cost is memory: the fp8 copies of every cached weight live until they are cleared.
"""

import weakref
from typing import Callable

import torch

_live_caches: "weakref.WeakSet[WeightQuantCache]" = weakref.WeakSet()

Quantized = tuple[torch.Tensor, torch.Tensor]


class WeightQuantCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[weakref.ref, int, Quantized]] = {}
        self.quantizations = 0  # cache misses, for tests and logs
        _live_caches.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def quantize(
        self,
        b: torch.Tensor,
        orientation: str,
        version_source: torch.Tensor,
        quantize: Callable[[torch.Tensor], Quantized],
    ) -> Quantized:
        """``quantize(b)``, from the cache while ``version_source`` is unchanged."""
        key = (orientation, b.dtype, tuple(b.shape), tuple(b.stride()), b.storage_offset())
        entry = self._entries.get(key)
        if (
            entry is not None
            and entry[0]() is version_source
            and entry[1] == version_source._version
        ):
            return entry[2]
        result = quantize(b)
        self.quantizations += 1
        self._entries[key] = (weakref.ref(version_source), version_source._version, result)
        return result

    def clear(self) -> None:
        self._entries.clear()


def clear_all() -> None:
    """Drop every cached fp8 weight (call after each optimizer step)."""
    for cache in list(_live_caches):
        cache.clear()


class CachedWeightQuantizer:
    """One weight's cache and version source, handed to the fp8 matmul."""

    def __init__(self, cache: WeightQuantCache, version_source: torch.Tensor):
        self.cache, self.version_source = cache, version_source

    def __call__(self, b: torch.Tensor, orientation: str, quantize) -> Quantized:
        return self.cache.quantize(b, orientation, self.version_source, quantize)
