"""Writes into FSDP-sharded weights invalidate their fp8 caches."""

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from expert_modules import build_expert_module, convert_to_float8_moe, expert_inputs
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def suite_cache_writes(mesh) -> dict:
    """Under FSDP2 the unsharded weight's fp8 copies follow writes into the shard: a write into
    the shard's plain data (what a DCP load does) and a DCP load itself, each after a forward
    that filled the cache. Each forward is compared with a module without the cache."""

    def build(cache_fp8: bool):
        module = convert_to_float8_moe(build_expert_module("routed", 4), cache_fp8=cache_fp8)
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        return module

    cached, fresh = build(True), build(False)
    x, routing, _ = expert_inputs("routed", 4, 0)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        # Every rank writes into its own temporary folder: rank 0's holds the checkpoint.
        checkpoint = [folder]
        dist.broadcast_object_list(checkpoint, src=0)
        dcp.save(fresh.state_dict(), checkpoint_id=checkpoint[0])
        for name, write in (
            # the plain shard the state dict hands out, as a checkpoint load writes into it
            ("shard plain data", lambda m: m.state_dict()["experts.w1"].to_local().mul_(3)),
            ("dcp load", lambda m: dcp.load(m.state_dict(), checkpoint_id=checkpoint[0])),
        ):
            before = cached(x, *routing).detach()
            with torch.no_grad():
                for module in (cached, fresh):
                    module.reshard()  # the root keeps its weights gathered after a forward
                    write(module)
            after, expected = cached(x, *routing).detach(), fresh(x, *routing).detach()
            results[name] = {
                "changed": not torch.equal(before, after),
                "matches_uncached": torch.equal(after, expected),
            }
        dist.barrier()
    # DTensor's full_tensor() of a converted weight gathers it as a converted weight.
    cached.reshard()
    fresh.reshard()
    full = cached.experts.w1.full_tensor()
    results["full_tensor"] = {
        "type": type(full).__name__,
        "values_equal": torch.equal(full._data, fresh.experts.w1.full_tensor()),
    }
    return results
