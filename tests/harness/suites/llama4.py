"""The Llama4 debug model through the real converter and torchtitan's FSDP."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy


def fsdp_llama4(model_name: str, n_layers: int | None = None):
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


def fixed_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


def suite_llama4(mesh) -> dict:
    """A 2-layer Llama4 debug model through the real converter and torchtitan's own apply_fsdp:
    the converter's shard plan must match what each weight pads to at all-gather time, and the
    model must train a step."""
    model, model_args, converter, parallel_dims = fsdp_llama4("llama4", n_layers=2)
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
    loss = model(fixed_tokens(model_args.vocab_size)).float().logsumexp(-1).mean()
    loss.backward()
    grads_finite = all(
        bool(torch.isfinite(p.grad.to_local()).all())
        for p in model.parameters()
        if p.grad is not None
    )
    return {"plan": plan, "loss": loss.item(), "grads_finite": grads_finite}
