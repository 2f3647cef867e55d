"""Runs one suite of multi-process FSDP2 cases in a single torchrun launch (gloo, CPU).

    torchrun --nproc_per_node=W tests/dist_worker.py SUITE OUT_DIR

Each rank writes OUT_DIR/rank{r}.json: {case name: {"error": str|None, ...measurements}}.
The pytest files launch this once per (suite, world size) and assert on the JSON, so a failing
case shows up as a failing test with its rank and message.
"""

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from expert_modules import (  # noqa: E402
    build_expert_module,
    convert_to_float8_moe,
    expert_inputs,
    fsdp_cases,
)

STEPS, MICRO_BATCHES = 2, 2


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _shard(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's rows of ``t`` as FSDP2 splits dim 0 (torch.chunk, trailing ranks may be empty)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t._data if hasattr(t, "_data") else t


def _run_fsdp_case(case: dict, mesh) -> dict:
    """Train a converted expert module sharded and unsharded side by side and measure the gap."""
    rank, world = dist.get_rank(), dist.get_world_size()
    param_dtype = getattr(torch, case["param_dtype"])
    ref = convert_to_float8_moe(build_expert_module(case["kind"], case["dim0"]))
    sharded = convert_to_float8_moe(
        build_expert_module(case["kind"], case["dim0"]), cache_fp8=case["cache_fp8"]
    )
    fully_shard(
        sharded,
        mesh=mesh,
        reshard_after_forward=case["reshard_after_forward"],
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    names = [n for n, _ in ref.named_parameters()]
    result = {"padded_rows": {}, "gathered_bitwise": True}
    diffs = {"out": 0.0, "input_grad": 0.0, "weight_grad": 0.0, "param": 0.0, "gathered": 0.0}

    def check_gathered(exact: bool):
        sharded.unshard()
        for name, ref_param in ref.named_parameters():
            gathered = _local(sharded.get_parameter(name))
            expected = ref_param.detach()._data.to(param_dtype)
            if exact:
                result["gathered_bitwise"] &= torch.equal(gathered, expected)
            diffs["gathered"] = max(diffs["gathered"], _max_diff(gathered, expected))
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

    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):  # gradient accumulation
            x, routing, target = expert_inputs(case["kind"], case["dim0"], step * 2 + micro)
            x_ref = x.to(param_dtype).detach().requires_grad_()
            x_sharded = x.clone().requires_grad_()
            cast = {n: p.to(param_dtype) for n, p in ref.named_parameters()}
            out_ref = torch.func.functional_call(ref, cast, (x_ref, *routing))
            out = sharded(x_sharded, *routing)
            (out_ref.float() * target).sum().backward()
            (out.float() * target).sum().backward()
            diffs["out"] = max(diffs["out"], _max_diff(out, out_ref))
            diffs["input_grad"] = max(diffs["input_grad"], _max_diff(x_sharded.grad, x_ref.grad))
        for name, ref_param in ref.named_parameters():
            local_grad = _local(sharded.get_parameter(name).grad)
            expected = _shard(ref_param.grad, world, rank)
            diffs["weight_grad"] = max(diffs["weight_grad"], _max_diff(local_grad, expected))
        ref_opt.step()
        sharded_opt.step()
        ref_opt.zero_grad()
        sharded_opt.zero_grad()
        for name, ref_param in ref.named_parameters():
            expected = _shard(ref_param.detach()._data, world, rank)
            diffs["param"] = max(
                diffs["param"], _max_diff(_local(sharded.get_parameter(name)), expected)
            )
    check_gathered(exact=False)
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
    results = {}
    for case in fsdp_cases(dist.get_world_size()):
        try:
            results[case["name"]] = _run_fsdp_case(case, mesh)
        except Exception as e:  # noqa: BLE001 - the other ranks are now out of step: stop
            results[case["name"]] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            break
    return results


def suite_torchao_seed(mesh) -> dict:
    """The seed's failure: torchao 0.18's own wrapper on a [1, H, D] weight, unevenly sharded."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.conversion_utils import _swap_params

    module = build_expert_module("grouped_shared", 1)
    _swap_params(module, config=Float8TrainingOpConfig())
    fully_shard(module, mesh=mesh)
    x, routing, _ = expert_inputs("grouped_shared", 1, 0)
    module(x, *routing).sum().backward()
    return {"trained": True}


def _fsdp_llama4(model_name: str, n_layers: int | None = None):
    """A converted Llama4 debug model through the real converter and torchtitan's own
    apply_fsdp over all ranks, on CPU. Returns (model, model_args, converter, parallel_dims)."""
    from dataclasses import replace

    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama4.infra.parallelize import apply_fsdp
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_fp8_moe import cpu

    cpu.select_cpu_device()
    cpu.enable_moe_ops()
    job_config = ConfigManager().parse_args(
        [
            "--job.custom_config_module=torchtitan_fp8_moe.config",
            "--model.converters=float8_moe",
        ]
    )
    spec = get_train_spec(model_name)
    model_args = spec.model_args["debugmodel"]
    if n_layers is not None:
        model_args = replace(model_args, n_layers=n_layers)
    model_args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    parallel_dims = ParallelDims(
        dp_replicate=1,
        dp_shard=-1,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        etp=1,
        world_size=dist.get_world_size(),
    )
    converters = build_model_converters(job_config, parallel_dims)
    converters.convert(model)
    (converter,) = converters.converters
    apply_fsdp(
        model, parallel_dims.get_mesh("fsdp"), torch.bfloat16, torch.float32, pp_enabled=False
    )
    cpu.use_sum_reductions(model)
    model.to_empty(device="cpu")
    return model, model_args, converter, parallel_dims


def _fixed_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


def suite_llama4(mesh) -> dict:
    """A 2-layer Llama4 debug model through the real converter and torchtitan's own apply_fsdp:
    the converter's shard plan must match what each weight pads to at all-gather time, and the
    model must train a step."""
    model, model_args, converter, parallel_dims = _fsdp_llama4("llama4", n_layers=2)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    plan = {}
    for row in converter.shard_plan:
        param = model.get_parameter(row.fqn)
        (padded,), _ = param.to_local().fsdp_pre_all_gather(
            parallel_dims.get_mesh("fsdp"),
            param.shape,
            None,
            model,
            MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        )
        plan[row.fqn] = {
            "plan_rows": row.rows_per_rank,
            "all_gather_rows": padded.shape[0],
            "wrapped": type(param.to_local()).__name__,
        }
    loss = model(_fixed_tokens(model_args.vocab_size)).float().logsumexp(-1).mean()
    loss.backward()
    grads_finite = all(
        bool(torch.isfinite(p.grad.to_local()).all())
        for p in model.parameters()
        if p.grad is not None
    )
    return {"plan": plan, "loss": loss.item(), "grads_finite": grads_finite}


def suite_reshape(mesh) -> dict:
    """Load the trainer's checkpoint at $CHECKPOINT (written at another world size) into the
    converted, FSDP-sharded seed-layout model; report the loss on a fixed batch and whether
    the sharded weights reassemble into the checkpoint's values."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torchtitan.protocols.train_spec import get_train_spec

    checkpoint = os.environ["CHECKPOINT"]
    model, model_args, _, _ = _fsdp_llama4("llama4_grouped_shared")
    with torch.no_grad():  # for the buffers (rope); the checkpoint holds every parameter
        model.init_weights(buffer_device=torch.device("cpu"))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    # The same checkpoint, unsharded, into the plain model (no converter, no FSDP).
    spec = get_train_spec("llama4_grouped_shared")
    plain = spec.model_cls(model_args)
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=checkpoint)
    matches = all(
        torch.equal(_local(p.full_tensor() if isinstance(p, DTensor) else p), plain_state[name])
        for name, p in model.named_parameters()
    )
    tokens = _fixed_tokens(model_args.vocab_size)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return {"loss": loss.item(), "weights_match_checkpoint": matches}


SUITES = {
    "fsdp": suite_fsdp,
    "torchao_seed": suite_torchao_seed,
    "llama4": suite_llama4,
    "reshape": suite_reshape,
}


def main() -> None:
    suite, out_dir = sys.argv[1], sys.argv[2]
    timeout = datetime.timedelta(seconds=int(os.environ.get("DIST_TIMEOUT_S", "120")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    try:
        results = SUITES[suite](mesh)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        results = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    # Skip teardown collectives: a rank that failed cannot join them, and gloo's shutdown
    # after a failed collective aborts the process.
    os._exit(0)


if __name__ == "__main__":
    main()
