"""Uneven FSDP2 shards of converted expert modules train like the module unsharded
(tests/test_fsdp_uneven.py)."""

import torch
import torch.distributed as dist
from expert_modules import build_expert_module, convert_to_float8_moe, expert_inputs, fsdp_cases
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from harness.suites.common import (
    host_pinning,
    local_values,
    max_diff,
    run_cases,
    saved_and_reloaded,
    shard_rows,
    stale_entries,
    taken_state_dicts,
)

STEPS, MICRO_BATCHES = 2, 2


def _run_fsdp_case(case: dict, mesh) -> dict:
    """Train a converted expert module sharded and unsharded side by side and measure the gap."""
    if not case["offload"]:
        return _train_side_by_side(case, mesh, OffloadPolicy())
    with host_pinning():
        return _train_side_by_side(case, mesh, CPUOffloadPolicy())  # pinned, as torchtitan's


def _train_side_by_side(case: dict, mesh, offload_policy: OffloadPolicy) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    param_dtype = getattr(torch, case["param_dtype"])
    recipe = case["recipe"]
    ref = convert_to_float8_moe(build_expert_module(case["kind"], case["dim0"]), recipe=recipe)
    sharded = convert_to_float8_moe(
        build_expert_module(case["kind"], case["dim0"]), case["cache_fp8"], recipe
    )
    fully_shard(
        sharded,
        mesh=mesh,
        reshard_after_forward=case["reshard_after_forward"],
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        offload_policy=offload_policy,
    )
    # Taken before the first forward (FSDP's lazy init), as torchtitan's checkpointer does.
    state_dicts = taken_state_dicts(sharded)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    names = [n for n, _ in ref.named_parameters()]
    result = {"padded_rows": {}, "gathered_bitwise": True}
    diffs = {"out": 0.0, "input_grad": 0.0, "weight_grad": 0.0, "param": 0.0, "gathered": 0.0}

    def check_gathered(exact: bool):
        sharded.unshard()
        for name, ref_param in ref.named_parameters():
            gathered = local_values(sharded.get_parameter(name))
            expected = ref_param.detach()._data.to(param_dtype)
            if exact:
                result["gathered_bitwise"] &= torch.equal(gathered, expected)
            diffs["gathered"] = max(diffs["gathered"], max_diff(gathered, expected))
        sharded.reshard()

    check_gathered(exact=True)
    for name in names:
        local = sharded.get_parameter(name).to_local()
        (padded,), _ = local.fsdp_pre_all_gather(
            mesh,
            ref.get_parameter(name).shape,
            None,
            sharded,
            MixedPrecisionPolicy(param_dtype=param_dtype),
        )
        result["padded_rows"][name] = padded.shape[0]

    def train_step(step: int):
        for micro in range(MICRO_BATCHES):  # gradient accumulation
            x, routing, target = expert_inputs(case["kind"], case["dim0"], step * 2 + micro)
            x_ref = x.to(param_dtype).detach().requires_grad_()
            x_sharded = x.clone().requires_grad_()
            # FSDP's bf16 mixed precision casts the values (a bf16 copy): clone() makes the
            # reference's cast a copy too, where a bare cast of a parameter is lazy. With fp32
            # parameters both hand the parameter itself to the module.
            cast = {
                n: p if p.dtype == param_dtype else p.to(param_dtype).clone()
                for n, p in ref.named_parameters()
            }
            out_ref = torch.func.functional_call(ref, cast, (x_ref, *routing))
            out = sharded(x_sharded, *routing)
            (out_ref.float() * target).sum().backward()
            (out.float() * target).sum().backward()
            diffs["out"] = max(diffs["out"], max_diff(out, out_ref))
            diffs["input_grad"] = max(diffs["input_grad"], max_diff(x_sharded.grad, x_ref.grad))
        for name, ref_param in ref.named_parameters():
            local_grad = local_values(sharded.get_parameter(name).grad)
            expected = shard_rows(ref_param.grad, world, rank)
            diffs["weight_grad"] = max(diffs["weight_grad"], max_diff(local_grad, expected))
        ref_opt.step()
        sharded_opt.step()
        ref_opt.zero_grad()
        sharded_opt.zero_grad()
        for name, ref_param in ref.named_parameters():
            expected = shard_rows(ref_param.detach()._data, world, rank)
            diffs["param"] = max(
                diffs["param"], max_diff(local_values(sharded.get_parameter(name)), expected)
            )

    for step in range(STEPS):
        train_step(step)
    result["stale_after_training"] = stale_entries(sharded, state_dicts)
    saved = saved_and_reloaded(sharded, state_dicts["get_model_state_dict"])
    diffs["saved"] = max(max_diff(saved[n], p.detach()._data) for n, p in ref.named_parameters())
    train_step(STEPS)  # a step after the load: the state dicts must follow it too
    result["stale_after_load"] = stale_entries(sharded, state_dicts)
    check_gathered(exact=False)
    # DTensor.full_tensor(), a collective that every rank joins (padding-only ranks too): the
    # whole weight without the padding, still converted.
    result["full_tensor_converted"] = True
    diffs["full_tensor"] = 0.0
    for name, ref_param in ref.named_parameters():
        full = sharded.get_parameter(name).full_tensor()
        result["full_tensor_converted"] &= (
            type(full).__name__ == "Float8MoEWeight" and full.shape == ref_param.shape
        )
        diffs["full_tensor"] = max(
            diffs["full_tensor"], max_diff(local_values(full), ref_param._data)
        )
    result["scale"] = max(p.detach()._data.abs().max().item() for p in ref.parameters())
    result.update(diffs)
    if case["cache_fp8"]:
        result["fp8_cache_quantizations"] = {
            n: sharded.get_parameter(n).to_local()._cache.quantizations for n in names
        }
    result["wrapped_after_step"] = all(
        type(sharded.get_parameter(n).to_local()).__name__ == "Float8MoEWeight" for n in names
    )
    return result


def suite_fsdp(mesh) -> dict:
    return run_cases(fsdp_cases(dist.get_world_size()), _run_fsdp_case, mesh)
