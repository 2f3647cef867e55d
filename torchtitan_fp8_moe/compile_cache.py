"""torch.compile's on-disk caches keyed by what float8_moe converted and by the code that runs it.

torch files a compiled graph under the model's traced code and its inputs' metadata. A converted
weight's fp8 math runs below its tensor subclass, in this package's code, which that key leaves
out; and where expert or tensor parallelism wraps the weight in a DTensor, the key holds only
the DTensor's shape and placements, not what it wraps. So a launch could load a graph compiled
by another version of this package (or a local edit of it) and run it as it was, without a
word; and an fp8 launch that found a bf16 launch's graph of the same model ran it on the
DTensors' fp8 weights and crashed (a segmentation fault on CPU; tests/test_compile_cache.py).
The converter therefore adds a tag to torch's cache keys (``torch.compiler.config.cache_key_tag``)
made from this package's Python sources and from the name, type and configuration of every
weight converted in the process.

torch's own extension point for tensor subclasses, ``_stable_hash_for_caching``, which the weight
classes implement (``weight/base.py``; torch 2.13 and 2.15 call it for a subclass among a graph's
inputs), keys a graph by a weight's class and configuration where the weight is the input; it
cannot cover the two cases above (a DTensor's hash is its own spec's, not the wrapped weight's,
and no key holds the code below the subclass), so the tag stays on every torch.
"""

import functools
import hashlib
from pathlib import Path

import torch
import torch.nn as nn

from .swap import local_tensor
from .weight.base import Fp8Weight

PACKAGE = Path(__file__).resolve().parent
TAG_PREFIX = "float8_moe-"


@functools.cache
def source_digest(package: Path = PACKAGE) -> str:
    """A digest of the Python sources under ``package`` (names relative to it, and contents)."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def converted_weights(model: nn.Module) -> list[tuple[str, str, str]]:
    """(name, weight class, configuration) of each converted parameter of ``model``, also
    inside a DTensor."""
    rows = []
    for name, param in model.named_parameters():
        local = local_tensor(param)
        if isinstance(local, Fp8Weight):
            rows.append((name, type(local).__qualname__, repr(local.config)))
    return rows


# Every weight converted in this process: a graph compiled after the conversion of one model
# part is keyed by all of them, not only by the part converted last.
_CONVERTED: set[tuple[str, str, str]] = set()


def key_compile_caches(model: nn.Module) -> None:
    """Add the tag of the conversions made in this process (``model``'s with the earlier ones)
    to torch's compile cache keys, in place of any earlier float8_moe tag (a user's own tags
    stay)."""
    _CONVERTED.update(converted_weights(model))
    payload = repr((source_digest(), sorted(_CONVERTED))).encode()
    tag = TAG_PREFIX + hashlib.blake2b(payload, digest_size=16).hexdigest()
    kept = [
        part
        for part in torch.compiler.config.cache_key_tag.split("|")
        if part and not part.startswith(TAG_PREFIX)
    ]
    torch.compiler.config.cache_key_tag = "|".join([*kept, tag])
