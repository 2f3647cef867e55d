"""Runs suites of multi-process FSDP2 cases in a single launch (gloo, CPU).

    python tests/fork_launch.py --nproc=W tests/dist_worker.py SUITE[+SUITE...] OUT_DIR

Each rank writes OUT_DIR/rank{r}.json: {suite: {case name: {"error": str|None, ...}}}. The
pytest files launch this once per world size and group of suites (tests/conftest.py) and assert
on the JSON, so a failing case shows up as a failing test with its rank and message. A suite
that raises leaves the ranks out of step: the suites after it do not run.
"""

import datetime
import json
import os
import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
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
SEED_BUG_TIMEOUT_S = 10


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _shard(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank's rows of ``t`` as FSDP2 splits dim 0 (torch.chunk, trailing ranks may be empty)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t._data if hasattr(t, "_data") else t


def _state_dicts(module) -> dict[str, dict]:
    """The state dicts a trainer takes once, before its first step, and saves from ever after:
    torchtitan's (``get_model_state_dict``) and ``Module.state_dict()``."""
    return {"get_model_state_dict": get_model_state_dict(module), "state_dict": module.state_dict()}


def _stale_entries(module, state_dicts: dict[str, dict]) -> list[str]:
    """The entries whose local values are not the live parameter's."""
    return [
        f"{kind}[{name}]"
        for kind, state_dict in state_dicts.items()
        for name, param in module.named_parameters()
        if not torch.equal(_local(state_dict[name]), _local(param))
    ]


def _shared_folder() -> str:
    """A new temporary folder, the same on every rank."""
    folder = [tempfile.mkdtemp(prefix="dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def _saved_and_reloaded(module, state_dict: dict) -> dict[str, torch.Tensor]:
    """Save ``state_dict`` with DCP, read the checkpoint back as whole plain tensors (what a
    model without the plugin loads), overwrite the live weights, and load the checkpoint into
    ``state_dict`` and the module as torchtitan's resume does (``dcp.load`` into the saved
    state dict, then ``set_model_state_dict``)."""
    folder = _shared_folder()
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
    # Taken before the first forward (FSDP's lazy init), as torchtitan's checkpointer does.
    state_dicts = _state_dicts(sharded)
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

    def train_step(step: int):
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

    for step in range(STEPS):
        train_step(step)
    result["stale_after_training"] = _stale_entries(sharded, state_dicts)
    saved = _saved_and_reloaded(sharded, state_dicts["get_model_state_dict"])
    diffs["saved"] = max(_max_diff(saved[n], p.detach()._data) for n, p in ref.named_parameters())
    train_step(STEPS)  # a step after the load: the state dicts must follow it too
    result["stale_after_load"] = _stale_entries(sharded, state_dicts)
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
        diffs["full_tensor"] = max(diffs["full_tensor"], _max_diff(_local(full), ref_param._data))
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


def _error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _run_cases(cases: list[dict], run_case, mesh) -> dict:
    """``run_case(case, mesh)`` for each case, by name; a case that raises ends the suite (the
    other ranks are then out of step)."""
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case, mesh)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            results[case["name"]] = _error(e)
            break
    return results


def suite_fsdp(mesh) -> dict:
    return _run_cases(fsdp_cases(dist.get_world_size()), _run_fsdp_case, mesh)


def suite_torchao_seed(mesh) -> dict:
    """The seed's failure: torchao 0.18's own wrapper on a [1, H, D] weight, unevenly sharded.
    Rank 0 holds the whole weight and waits in the all-gather for the other ranks, which fail:
    a short timeout ends that wait (the suite runs last in its launch)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=SEED_BUG_TIMEOUT_S), None)
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
    # The trainer run's flavor: two of the debug model's layers (tests/trainer_batch.py).
    model, model_args, _, _ = _fsdp_llama4("llama4_grouped_shared", n_layers=2)
    with torch.no_grad():  # for the buffers (rope); the checkpoint holds every parameter
        model.init_weights(buffer_device=torch.device("cpu"))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    # The same checkpoint, unsharded, into the plain model (no converter, no FSDP).
    spec = get_train_spec("llama4_grouped_shared")
    plain = spec.model_cls(model_args)
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=checkpoint)
    # The stored values, gathered from every rank's shard (a list, not all(): every rank must
    # join every collective).
    gathered = {
        name: t.full_tensor() if isinstance(t, DTensor) else t
        for name, t in model.state_dict().items()
        if name in plain_state
    }
    matches = all([torch.equal(t, plain_state[name]) for name, t in gathered.items()])
    tokens = _fixed_tokens(model_args.vocab_size)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return {"loss": loss.item(), "weights_match_checkpoint": matches}


# (name, model, tp, ep, etp, dp_shard, num_experts or None for the flavor's): 4 ranks each.
PARALLEL_CASES = [
    ("tp2-fsdp2", "llama4", 2, 1, 1, 2, None),
    ("tp2-fsdp2-grouped_shared", "llama4_grouped_shared", 2, 1, 1, 2, None),
    ("tp2-etp2-fsdp2", "llama4", 2, 1, 2, 2, None),
    ("ep2-fsdp4", "llama4_grouped_shared", 1, 2, 1, 4, None),
    ("ep2-fsdp4-dim1", "llama4", 1, 2, 1, 4, 2),  # efsdp 2 x ep 2 > 2 experts: FSDP on dim 1
    ("ep2-etp2-fsdp2", "llama4", 2, 2, 2, 2, None),
    ("ep2-tp2-borrowed", "llama4", 2, 2, 1, 2, None),
]


def _parallel_model_args(model_name: str, num_experts: int | None, job_config):
    from dataclasses import replace

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(model_name)
    model_args = replace(spec.model_args["debugmodel"], n_layers=2)
    if num_experts is not None:
        model_args = replace(
            model_args, moe_args=replace(model_args.moe_args, num_experts=num_experts)
        )
    model_args.update_from_config(job_config)
    return spec, model_args


def _loss_and_grads(model, tokens) -> tuple[float, dict[str, torch.Tensor]]:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).float()
    return loss.item(), grads


def _run_parallel_case(case, reference_state, job_config, tokens) -> dict:
    """The converted model under one parallelism (torchtitan's own parallelize_fn), loaded with
    the reference's weights: its loss and gradients against the unsharded converted model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    from torchtitan_fp8_moe import cpu
    from torchtitan_fp8_moe.fp8.sqnr import sqnr

    name, model_name, tp, ep, etp, dp_shard, num_experts = case
    spec, model_args = _parallel_model_args(model_name, num_experts, job_config)
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=dp_shard,
        cp=1,
        tp=tp,
        pp=1,
        ep=ep,
        etp=etp,
        world_size=dist.get_world_size(),
    )
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    converters = build_model_converters(job_config, dims)
    converters.convert(model)
    (converter,) = converters.converters
    spec.parallelize_fn(model, dims, job_config)
    cpu.use_sum_reductions(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))  # buffers (rope)
    # A copy: set_model_state_dict replaces the values of the dict it is given.
    set_model_state_dict(
        model, dict(reference_state["weights"]), options=StateDictOptions(full_state_dict=True)
    )
    loss, grads = _loss_and_grads(model, tokens)
    # Every data-parallel rank trained on the same tokens and FSDP sums their gradients.
    grads = {n: g / (dp_shard * dims.cp) for n, g in grads.items()}
    ref_grads = reference_state["grads"]
    grad_sqnr = {n: sqnr(ref_grads[n], g) for n, g in grads.items() if ref_grads[n].any()}
    expert_grad_sqnr = {n: v for n, v in grad_sqnr.items() if ".moe." in n and ".router." not in n}
    local_types = {
        n: type(p.to_local() if isinstance(p, DTensor) else p).__name__
        for n, p in model.named_parameters()
        if ".moe." in n and "router" not in n
    }
    plan = {
        r.fqn: {
            "model_parallel": r.model_parallel,
            "local_shape": list(r.local_shape),
            "shard_dim": r.shard_dim,
            "fsdp_degree": r.fsdp_degree,
        }
        for r in converter.shard_plan
    }
    actual = {}
    for fqn in plan:
        param = model.get_parameter(fqn)
        shape, fsdp_dims = list(param.shape), []
        for mesh_dim, placement in zip(
            param.device_mesh.mesh_dim_names, param.placements, strict=True
        ):
            if getattr(placement, "dim", None) is None:  # Replicate (Shard, _StridedShard: dim)
                continue
            if mesh_dim in ("tp", "ep", "etp"):
                shape[placement.dim] //= param.device_mesh[mesh_dim].size()
            else:
                fsdp_dims.append(placement.dim)
        actual[fqn] = {"local_shape": shape, "fsdp_dims": fsdp_dims}
    return {
        "loss": loss,
        "reference_loss": reference_state["loss"],
        "bf16_loss": reference_state["bf16_loss"],
        "min_expert_grad_sqnr": min(expert_grad_sqnr.values()),
        "min_grad_sqnr": min(grad_sqnr.values()),
        "worst_grads": sorted(grad_sqnr.items(), key=lambda kv: kv[1])[:3],
        "expert_weights": local_types,
        "plan": plan,
        "actual": actual,
    }


def _reference(model_name, num_experts, job_config, tokens, converted: bool) -> dict:
    """The unsharded model, seeded, on every rank: weights, loss, gradients."""
    from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights
    from torchtitan_fp8_moe.weight import WeightConfig

    spec, model_args = _parallel_model_args(model_name, num_experts, job_config)
    torch.manual_seed(0)
    model = spec.model_cls(model_args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if converted:
        for _, module in expert_modules(model):
            swap_expert_weights(module, WeightConfig(emulate=True))
    loss, grads = _loss_and_grads(model, tokens)
    return {"weights": weights, "loss": loss, "grads": grads}


def suite_parallel(mesh) -> dict:
    """Every tensor / expert parallelism case of PARALLEL_CASES against the unsharded model."""
    from torchtitan.config import ConfigManager

    from torchtitan_fp8_moe import cpu

    cpu.select_cpu_device()
    cpu.enable_moe_ops()
    from torchtitan.models.llama4.model import args as llama4_args

    llama4_args.has_cuda_capability = lambda major, minor: True  # the grouped-mm path on CPU
    job_config = ConfigManager().parse_args(
        [
            "--job.custom_config_module=torchtitan_fp8_moe.config",
            "--model.converters=float8_moe",
            "--activation_checkpoint.mode=none",
            "--training.seq_len=64",
            # The unsharded reference computes in float32: so does FSDP here.
            "--training.mixed_precision_param=float32",
        ]
    )
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    references = {}
    results = {}
    for case in PARALLEL_CASES:
        name, model_name, *_, num_experts = case
        key = (model_name, num_experts)
        try:
            if key not in references:
                references[key] = _reference(model_name, num_experts, job_config, tokens, True)
                bf16 = _reference(model_name, num_experts, job_config, tokens, False)
                references[key]["bf16_loss"] = bf16["loss"]
            results[name] = _run_parallel_case(case, references[key], job_config, tokens)
        except Exception as e:  # noqa: BLE001 - the other ranks are now out of step: stop
            results[name] = _error(e)
            break
    return results


def suite_cache_writes(mesh) -> dict:
    """Under FSDP2 the unsharded weight's fp8 copies follow writes into the shard: a write into
    the shard's plain data (what a DCP load does) and a DCP load itself, each after a forward
    that filled the cache. Each forward is compared with a module without the cache."""
    import tempfile

    import torch.distributed.checkpoint as dcp

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


def fp8_all_gather_cases(world_size: int) -> list[dict]:
    """Converted expert modules under FSDP2 with `fp8_all_gather`, each against the same with it
    off: evenly and unevenly split experts, ranks holding only padding, the fallbacks (2D
    weights, FSDP on dim 1) and tensor parallelism (world size 2 only)."""
    # (reshard_after_forward, cache_fp8, activation checkpointing around the experts)
    combos = [(True, False, False), (False, True, False), (True, True, True), (False, False, True)]
    if world_size == 2:
        shapes = [("routed", 4, combos), ("routed", 3, combos[2:3])]
        shapes += [("grouped_shared", 1, combos[:1] + combos[3:])]
        shapes += [("linear_shared", 64, combos[:1]), ("routed", 4, combos[1:2], "dim1")]
        shapes += [("routed", 4, combos[:1], "tp"), ("grouped_shared", 1, combos[1:2], "tp")]
    else:
        shapes = [("routed", 8, combos), ("grouped_shared", 1, combos[:1] + combos[3:])]
        shapes += [("tiny_routed", 2, combos[2:3]), ("linear_shared", 64, combos[1:2])]
    cases = []
    for kind, dim0, kind_combos, *layout in shapes:
        for reshard, cache_fp8, ac in kind_combos:
            layout_name = layout[0] if layout else "dim0"
            cases.append(
                {
                    "name": f"{kind}-{dim0}-{layout_name}-reshard={reshard}"
                    + ("-cache" if cache_fp8 else "")
                    + ("-ac" if ac else ""),
                    "kind": kind,
                    "dim0": dim0,
                    "layout": layout_name,
                    "reshard_after_forward": reshard,
                    "cache_fp8": cache_fp8,
                    "ac": ac,
                    # dim-1 sharding and 2D weights gather bf16 (the fallback)
                    "fp8_gathered": layout_name != "dim1" and kind != "linear_shared",
                }
            )
    return cases


def _experts_of(module):
    return module.experts if hasattr(module, "experts") else module.expert


def _fp8_all_gather_module(case: dict, mesh, fp8_all_gather: bool):
    """The case's converted module, split like torchtitan's tensor parallelism with layout
    "tp" (a 2 FSDP x 1 TP mesh), FSDP-sharded."""
    from torch.distributed.tensor import Shard

    from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights
    from torchtitan_fp8_moe.weight import WeightConfig

    module = build_expert_module(case["kind"], case["dim0"])
    for _, expert in expert_modules(module):
        swap_expert_weights(
            expert,
            WeightConfig(emulate=True, cache_fp8=case["cache_fp8"], fp8_all_gather=fp8_all_gather),
        )
    fsdp_mesh = mesh
    if case["layout"] == "tp":
        # TP degree 1: DTensor weights over a TP mesh dim (FSDP2 gathers nothing at degree 1)
        mesh_2d = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
        fsdp_mesh = mesh_2d["dp"]
        if case["kind"] == "routed":
            module = _LocalWeightExperts(module.experts)
        _split_like_tensor_parallelism(_experts_of(module), mesh_2d["tp"])
    placement = (lambda p: Shard(1)) if case["layout"] == "dim1" else None
    fully_shard(
        module,
        mesh=fsdp_mesh,
        reshard_after_forward=case["reshard_after_forward"],
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        shard_placement_fn=placement,
    )
    return module


def _split_like_tensor_parallelism(experts, tp_mesh) -> None:
    """torchtitan's TP split of grouped experts (w1/w3 on dim 1, w2 on dim 2) into DTensors
    whose local shards are converted weights, as converting before parallelizing gives."""
    from torch.distributed.tensor import Shard

    for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
        chunks = getattr(experts, name).detach().chunk(tp_mesh.size(), dim=dim)
        local = chunks[tp_mesh.get_local_rank()]
        distributed = DTensor.from_local(local.clone(), tp_mesh, [Shard(dim)], run_check=False)
        experts.register_parameter(name, torch.nn.Parameter(distributed))


class _LocalWeightExperts(torch.nn.Module):
    """torchtitan's grouped-mm expert function on the TP-local weights, as GroupedExperts runs
    it (without its token padding)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, tokens_per_expert):
        from torchtitan.models.moe.moe import _run_experts_grouped_mm

        e = self.experts
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (e.w1, e.w2, e.w3)]
        return _run_experts_grouped_mm(*weights, x, tokens_per_expert)


def _unsharded_weights(experts) -> dict:
    return {n: _local_tensor(p) for n, p in experts.named_parameters()}


def _local_tensor(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _gather_report(module) -> dict:
    """What FSDP gathers and holds: the dtypes of each weight's all-gather inputs (FSDP's own
    call of the hook), and the types and large payloads of the unsharded weights."""
    import torch.utils._pytree as pytree

    experts = _experts_of(module)
    report = {"input_dtypes": {}, "unsharded": {}}
    fsdp_params = module._get_fsdp_state()._fsdp_param_group.fsdp_params
    for (name, _), fsdp_param in zip(module.named_parameters(), fsdp_params, strict=True):
        report["input_dtypes"][name] = [str(t.dtype) for t in fsdp_param.all_gather_inputs]
    module.unshard()
    for name, weight in _unsharded_weights(experts).items():
        large = [
            str(t.dtype)
            for t in pytree.tree_leaves(vars(weight))
            if isinstance(t, torch.Tensor) and t.numel() >= weight.numel()
        ]
        report["unsharded"][name] = {"type": type(weight).__name__, "large_payloads": large}
    return report


def _fail_closed_report(module) -> dict:
    """Non-matmul uses of an unsharded fp8-gathered weight: each must raise NotImplementedError
    naming the option."""
    module.unshard()
    w = _local_tensor(_experts_of(module).w1)
    x = torch.randn(4, w.shape[-1]).bfloat16()
    offs = torch.tensor([4] * w.shape[0], dtype=torch.int32)
    uses = {
        "sum(1)": lambda: w.sum(1),
        "w + 1 then matmul": lambda: torch._grouped_mm(x, (w + 1).transpose(-2, -1), offs=offs),
        "high_precision()": lambda: w.high_precision(),
        "einsum": lambda: torch.einsum("eoi,ti->eto", w, x),
        "grouped_mm of w, not w^T": lambda: torch._grouped_mm(x, w, offs=offs),
        "w[0]": lambda: w[0],
        "float()": lambda: w.float(),
        "mul_": lambda: _in_place(w),
    }
    report = {}
    for use, run in uses.items():
        try:
            run()
            report[use] = "ran"
        except NotImplementedError as e:
            report[use] = "raised" if "fp8_all_gather" in str(e) else f"message: {e}"
        except Exception as e:  # noqa: BLE001 - the test names it
            report[use] = f"{type(e).__name__}: {e}"
    module.reshard()
    return report


def _in_place(w) -> None:
    with torch.no_grad():
        w.mul_(2)


def _train_fp8_all_gather(case: dict, module, steps: int = 3, micro_batches: int = 2) -> dict:
    """Outputs, input grads, weight grad shards and weights of every step and micro-batch."""
    from torch.utils.checkpoint import checkpoint

    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    history = {"out": [], "input_grad": [], "weight_grad": [], "param": []}
    experts = _experts_of(module)
    for step in range(steps):
        for micro in range(micro_batches):
            x, routing, target = expert_inputs(case["kind"], case["dim0"], step * 2 + micro)
            x = x.bfloat16().requires_grad_()
            if case["ac"]:
                out = checkpoint(module, x, *routing, use_reentrant=False)
            else:
                out = module(x, *routing)
            (out.float() * target).sum().backward()
            history["out"].append(out.detach())
            history["input_grad"].append(x.grad)
        history["weight_grad"] += [_local(p.grad).clone() for p in experts.parameters()]
        opt.step()
        opt.zero_grad()
        history["param"] += [_local(p).clone() for p in experts.parameters()]
    return history


def _run_fp8_all_gather_case(case: dict, mesh) -> dict:
    off = _fp8_all_gather_module(case, mesh, False)
    on = _fp8_all_gather_module(case, mesh, True)
    state_dicts = _state_dicts(on)  # before the first forward, as torchtitan's checkpointer
    expected, actual = _train_fp8_all_gather(case, off), _train_fp8_all_gather(case, on)
    result = {
        "stale_state_dict_entries": _stale_entries(on, state_dicts),
        "equal": {
            what: all(torch.equal(a, b) for a, b in zip(expected[what], actual[what], strict=True))
            for what in expected
        },
    }
    if case["cache_fp8"]:
        result["fp8_cache_quantizations"] = {
            n: _local_tensor(p)._cache.quantizations for n, p in _experts_of(on).named_parameters()
        }
    result["report"] = _gather_report(on)
    on.reshard()
    if case["fp8_gathered"]:
        result["fail_closed"] = _fail_closed_report(on)
    return result


def suite_fp8_all_gather(mesh) -> dict:
    return _run_cases(fp8_all_gather_cases(dist.get_world_size()), _run_fp8_all_gather_case, mesh)


SUITES = {
    "fsdp": suite_fsdp,
    "torchao_seed": suite_torchao_seed,
    "llama4": suite_llama4,
    "reshape": suite_reshape,
    "parallel": suite_parallel,
    "cache_writes": suite_cache_writes,
    "fp8_all_gather": suite_fp8_all_gather,
}


def main() -> None:
    suites, out_dir = sys.argv[1].split("+"), sys.argv[2]
    timeout = datetime.timedelta(seconds=int(os.environ.get("DIST_TIMEOUT_S", "120")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for suite in suites:
        try:
            results[suite] = SUITES[suite](mesh)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            results[suite] = _error(e)
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    # Skip teardown collectives: a rank that failed cannot join them, and gloo's shutdown
    # after a failed collective aborts the process.
    os._exit(0)


if __name__ == "__main__":
    main()
