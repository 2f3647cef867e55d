"""What the suites share: comparisons, shards as FSDP2 splits them, state dicts and
checkpoints, and running a suite's cases by name."""

import contextlib
import os
import shutil
import tempfile
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def shard_rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's rows of ``t`` as FSDP2 splits dim 0 (torch.chunk, trailing ranks may be empty)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def local_values(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t._data if hasattr(t, "_data") else t


def taken_state_dicts(module) -> dict[str, dict]:
    """The state dicts a trainer takes once, before its first step, and saves from ever after:
    torchtitan's (``get_model_state_dict``) and ``Module.state_dict()``."""
    return {"get_model_state_dict": get_model_state_dict(module), "state_dict": module.state_dict()}


def stale_entries(module, state_dicts: dict[str, dict]) -> list[str]:
    """The entries whose local values are not the live parameter's."""
    return [
        f"{kind}[{name}]"
        for kind, state_dict in state_dicts.items()
        for name, param in module.named_parameters()
        if not torch.equal(local_values(state_dict[name]), local_values(param))
    ]


@contextlib.contextmanager
def host_pinning():
    """Pinned host memory as FSDP2's CPU offload asks for it. Without an accelerator torch cannot
    pin (``pin_memory()`` raises), so there pinning does what it does on a GPU machine but for
    the page-locking itself: it copies the tensor into new memory, which alone counts as pinned
    (``is_pinned``); with CUDA, torch's own."""
    if torch.accelerator.is_available():
        yield
        return
    pinned = weakref.WeakValueDictionary()  # data pointer -> the storage pinning made

    def pin(tensor, device=None):
        copy = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        pinned[copy.untyped_storage().data_ptr()] = copy.untyped_storage()
        return copy

    def is_pinned(tensor, device=None):
        return tensor.untyped_storage().data_ptr() in pinned

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_pin_memory", pin, "CPU")
        lib.impl("is_pinned", is_pinned, "CPU")
        yield
    finally:
        lib._destroy()


def shared_folder() -> str:
    """A new temporary folder, the same on every rank."""
    folder = [tempfile.mkdtemp(prefix="dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def saved_and_reloaded(module, state_dict: dict) -> dict[str, torch.Tensor]:
    """Save ``state_dict`` with DCP, read the checkpoint back as whole plain tensors (what a
    model without the plugin loads), overwrite the live weights, and load the checkpoint into
    ``state_dict`` and the module as torchtitan's resume does (``dcp.load`` into the saved
    state dict, then ``set_model_state_dict``)."""
    folder = shared_folder()
    dcp.save(state_dict, checkpoint_id=folder)
    dist.barrier()
    whole = f"{folder}-rank{dist.get_rank()}.pt"
    dcp_to_torch_save(folder, whole)
    saved = torch.load(whole, weights_only=True)
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(-3.0)
    dcp.load(state_dict, checkpoint_id=folder)
    set_model_state_dict(module, state_dict)
    os.remove(whole)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return saved


def error_report(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def run_cases(cases: list[dict], run_case, mesh) -> dict:
    """``run_case(case, mesh)`` for each case, by name; a case that raises ends the suite (the
    other ranks are then out of step)."""
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, mesh)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            results[case["name"]] = error_report(e)
            break
    return results
