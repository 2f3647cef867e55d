"""Tensor, expert and expert-tensor parallelism against the unsharded model
(tests/test_parallel.py)."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.tensor import DTensor

from harness.suites.common import error_report

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
    from torch.distributed.checkpoint.state_dict import StateDictOptions
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


def _reference(model_name, num_experts, job_config, tokens, converted: bool, recipe: str) -> dict:
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
            swap_expert_weights(module, WeightConfig(recipe, emulate=True))
    loss, grads = _loss_and_grads(model, tokens)
    return {"weights": weights, "loss": loss, "grads": grads}


def suite_parallel(mesh) -> dict:
    """Every tensor / expert parallelism case of PARALLEL_CASES against the unsharded model."""
    return run_parallel_cases(PARALLEL_CASES, "rowwise")


def run_parallel_cases(cases, recipe: str) -> dict:
    """Each case (PARALLEL_CASES' form) with the ``recipe`` against the unsharded model."""
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
            f"--float8_moe.recipe={recipe}",
        ]
    )
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    references = {}
    results = {}
    for case in cases:
        name, model_name, *_, num_experts = case
        key = (model_name, num_experts)
        try:
            if key not in references:
                references[key] = _reference(
                    model_name, num_experts, job_config, tokens, True, recipe
                )
                bf16 = _reference(model_name, num_experts, job_config, tokens, False, recipe)
                references[key]["bf16_loss"] = bf16["loss"]
            results[name] = _run_parallel_case(case, references[key], job_config, tokens)
        except Exception as e:  # noqa: BLE001 - the other ranks are now out of step: stop
            results[name] = error_report(e)
            break
    return results
