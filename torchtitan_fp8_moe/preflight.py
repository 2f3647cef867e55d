"""Check a training config for N GPUs on a machine without them, before launching the job.

    python -m torchtitan_fp8_moe.preflight --config FILE --ngpu N [--target cuda] [overrides...]

Runs what torchtitan's trainer runs up to the model conversion, with no process group, device
mesh or GPU: the config through torchtitan's ConfigManager (overrides as in a launch), the
parallel dims for N ranks, the model on the meta device, and the model converters, whose checks
and FSDP shard plan are those of the launch. Then checks, without running them, the layout
rules of what the launch does next: its device mesh, batch sizes, pipeline split and schedule,
torchtitan's parallelization and the first step (torchtitan 0.2.2 and torch's rules, read from
their source). Prints the parallelism, the `float8_moe` shard plan and its totals; exits 0 when
the launch would get past these steps, 2 with the launch's error message, or a clearer one
naming the option, when it would not.
"""

import argparse
import copy
import importlib
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
import torch.nn as nn
from torch.distributed.pipelining import schedules
from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.dual_pipe_v import get_dual_pipe_v_flag
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
from torchtitan.protocols import BaseModelArgs
from torchtitan.protocols.model_converter import (
    ModelConvertersContainer,
    build_model_converters,
)
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import set_default_dtype

from .converter import Float8MoEConverter
from .run_checks import check_cpu_context_parallelism, describe_policy, tokens_per_microbatch
from .run_context import RunContext, planning
from .sharding import expert_fsdp_degree, format_plan, plan_expert_weight

EXIT_OK = 0
EXIT_FAILED = 2

# What torchtitan raises for a config a launch would stop on (it validates with asserts, too).
_CONFIG_ERRORS = (AssertionError, KeyError, NotImplementedError, ValueError)


class PreflightError(Exception):
    """An error the launch would stop on too: printed as a message, without a traceback."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the rest: torchtitan config overrides, passed on as in a launch."""
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_fp8_moe.preflight",
        description="Check a torchtitan config with float8_moe for N GPUs, without GPUs.",
        epilog="Further arguments are torchtitan config overrides, e.g. --float8_moe.fqns=experts",
        allow_abbrev=False,  # so an override is never taken for one of our options
    )
    parser.add_argument("--config", required=True, help="the training TOML file")
    parser.add_argument("--ngpu", type=int, required=True, help="world size of the launch")
    parser.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device of the launch: cuda runs the fp8 kernel path's checks (default: cuda)",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.ngpu < 1:
        parser.error(f"--ngpu must be at least 1, got {args.ngpu}")
    return args, overrides


def load_job_config(config_file: str, overrides: list[str]) -> JobConfig:
    if not os.path.isfile(config_file):
        raise PreflightError(f"config file {config_file} does not exist")
    try:
        return ConfigManager().parse_args([f"--job.config_file={config_file}", *overrides])
    except _CONFIG_ERRORS as e:
        raise PreflightError(f"reading the config: {e}") from e


def build_parallel_dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    """ParallelDims as the trainer builds them (dp_shard = -1 takes the rest), without a mesh."""
    parallelism = job_config.parallelism
    degrees = dict(
        dp_shard=parallelism.data_parallel_shard_degree,
        dp_replicate=parallelism.data_parallel_replicate_degree,
        cp=parallelism.context_parallel_degree,
        tp=parallelism.tensor_parallel_degree,
        pp=parallelism.pipeline_parallel_degree,
        ep=parallelism.expert_parallel_degree,
        etp=parallelism.expert_tensor_parallel_degree,
    )
    try:
        return ParallelDims(**degrees, world_size=world_size)
    except AssertionError as e:
        # Some of ParallelDims' asserts have no message: name the degrees it was given.
        given = ", ".join(f"{name} {degree}" for name, degree in degrees.items())
        raise PreflightError(
            f"parallelism for {world_size} ranks: {str(e) or 'invalid degrees'} ({given})"
        ) from e


def check_sizes(job_config: JobConfig, dims: ParallelDims) -> None:
    """The batch and sequence sizes the launch builds its data loader and model from (and the
    float8_moe converter its tokens per micro-batch): each at least 1."""
    training = job_config.training
    try:
        tokens_per_microbatch(
            training.local_batch_size,
            training.seq_len,
            job_config.parallelism.pipeline_parallel_microbatch_size,
            dims.pp,
            dims.cp,
        )
    except ValueError as e:
        raise PreflightError(str(e)) from e


def build_meta_model(job_config: JobConfig) -> tuple[nn.Module, BaseModelArgs]:
    """The model and its args as the trainer builds them, on the meta device."""
    name, flavor = job_config.model.name, job_config.model.flavor
    try:
        train_spec = get_train_spec(name)
    except ValueError as e:
        raise PreflightError(f"model.name: {e}") from e
    if flavor not in train_spec.model_args:
        raise PreflightError(
            f"model.flavor {flavor!r} is not a flavor of {name}: {list(train_spec.model_args)}"
        )
    # A copy: the trainer updates the registered flavor in place, a preflight must not.
    model_args = copy.deepcopy(train_spec.model_args[flavor])
    try:
        model_args.update_from_config(job_config)
    except _CONFIG_ERRORS as e:
        raise PreflightError(f"model args from the config: {e}") from e
    with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
        model = train_spec.model_cls(model_args)
    return model, model_args


def planning_for(target: str) -> AbstractContextManager[RunContext]:
    """Have the float8_moe converters built inside plan the fp8 path of `target`, whatever this
    machine has."""
    return planning(RunContext(plan_target=target))


def convert(
    job_config: JobConfig, parallel_dims: ParallelDims, model: nn.Module, target: str
) -> ModelConvertersContainer:
    """The trainer's model conversion, so the converters' own checks and messages apply."""
    with planning_for(target):
        try:
            converters = build_model_converters(job_config, parallel_dims)
            converters.convert(model)
        except KeyError as e:
            raise PreflightError(f"model.converters: no converter is registered as {e}") from e
        except _CONFIG_ERRORS as e:
            raise PreflightError(str(e)) from e
    return converters


def check_device_mesh(dims: ParallelDims) -> None:
    """The mesh the launch builds next (ParallelDims.build_mesh), where expert parallelism takes
    its ranks."""
    try:
        expert_fsdp_degree(dims)
    except ValueError as e:
        raise PreflightError(str(e)) from e


def check_batch(job_config: JobConfig, dims: ParallelDims) -> None:
    """The trainer's batch asserts: a set global batch is whole local batches of every
    data-parallel rank."""
    training = job_config.training
    global_batch = training.global_batch_size
    if global_batch < 0:  # the default: one local batch per data-parallel rank
        return
    per_step = training.local_batch_size * dims.dp_replicate * dims.dp_shard
    if global_batch == 0 or global_batch % per_step:
        raise PreflightError(
            f"training.global_batch_size = {global_batch} must be a positive multiple of "
            f"training.local_batch_size {training.local_batch_size} x the data-parallel degree "
            f"{dims.dp_replicate * dims.dp_shard} (dp_replicate x dp_shard) = {per_step}; "
            "torchtitan asserts it at start-up"
        )


def _stages_per_rank(job_config: JobConfig, dims: ParallelDims, n_layers: int, single: bool):
    """pipeline_llm's virtual stages per pipeline rank: set by
    pipeline_parallel_layers_per_stage, else 1 for single-stage schedules and 2 for looped."""
    parallelism = job_config.parallelism
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is None:
        return 1 if single else 2
    edge_layers = (
        parallelism.pipeline_parallel_first_stage_less_layers
        + parallelism.pipeline_parallel_last_stage_less_layers
    )
    stages = math.ceil((n_layers + edge_layers) / layers_per_stage)
    given = (
        f"parallelism.pipeline_parallel_layers_per_stage = {layers_per_stage} gives {stages} "
        f"stages for {n_layers} layers and {edge_layers} for the embeddings and the output"
    )
    if stages % dims.pp:
        raise PreflightError(f"{given}, which pipeline_parallel_degree {dims.pp} must divide")
    if single and stages != dims.pp:
        raise PreflightError(f"{given}: a single-stage schedule needs exactly 1 per rank")
    if not single and stages < 2 * dims.pp:
        raise PreflightError(f"{given}: a looped schedule needs at least 2 per rank")
    return stages // dims.pp


def _schedule_error(schedule, microbatches: int, stages: int, local_stages: int, pp: int):
    """What the launch raises building its schedule: torchtitan's assert for v schedules, then
    torch's schedule class (None: nothing)."""
    if schedule in (schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV):
        if local_stages != 2:
            return f"v schedules assume 2 stages per rank, got {local_stages}."
    if schedule in (schedules.Schedule1F1B, schedules.ScheduleDualPipeV) and microbatches < stages:
        return (
            f"Number of microbatches ({microbatches}) must be greater than or equal to the "
            f"number of stages ({stages})."
        )
    interleaved = (schedules.ScheduleInterleaved1F1B, schedules.ScheduleInterleavedZeroBubble)
    rounds = max(1, microbatches // pp)
    if schedule in interleaved and microbatches % rounds:
        return (
            "Interleaved schedules require the number of microbatches to be a multiple of "
            f"the number of rounds ({rounds}), but got {microbatches}."
        )
    return None


def check_pipeline(job_config: JobConfig, dims: ParallelDims, model_args: BaseModelArgs) -> None:
    """torchtitan's pipeline_llm and build_pipeline_schedule, and the checks of torch's schedule
    class: how the launch splits the model into stages and its batch into microbatches."""
    parallelism, name = job_config.parallelism, job_config.model.name
    if not get_train_spec(name).pipelining_fn:
        raise PreflightError(f"Pipeline Parallel is enabled but {name} does not support pipelining")
    try:
        schedule = schedules.get_schedule_class(parallelism.pipeline_parallel_schedule)
        single = issubclass(schedule, schedules.PipelineScheduleSingle)
        per_rank = _stages_per_rank(job_config, dims, model_args.n_layers, single)
        stage_modules = parallelism.module_fqns_per_model_part or generate_llm_fqn_per_model_part(
            dims.pp * per_rank,
            model_args.n_layers,
            parallelism.pipeline_parallel_first_stage_less_layers,
            parallelism.pipeline_parallel_last_stage_less_layers,
        )
    except ValueError as e:
        raise PreflightError(f"pipeline split: {e}") from e
    stages = len(stage_modules)
    if stages % dims.pp:
        raise PreflightError(
            f"parallelism.module_fqns_per_model_part: num_stages {stages} must be evenly "
            f"divisible by pp_degree {dims.pp}"
        )
    batch = job_config.training.local_batch_size
    microbatch = parallelism.pipeline_parallel_microbatch_size
    if batch % microbatch:
        raise PreflightError(
            f"training.local_batch_size {batch} must be divisible by "
            f"parallelism.pipeline_parallel_microbatch_size {microbatch}"
        )
    error = _schedule_error(schedule, batch // microbatch, stages, stages // dims.pp, dims.pp)
    if error:
        raise PreflightError(
            f"pipeline schedule {parallelism.pipeline_parallel_schedule}, {stages} stages over "
            f"pipeline_parallel_degree {dims.pp}, {batch // microbatch} microbatches "
            f"(training.local_batch_size {batch} / pipeline_parallel_microbatch_size "
            f"{microbatch}): the launch fails at start-up: {error} Change the batch, "
            "microbatch or pipeline degree, or the schedule"
        )


def check_sequence_split(job_config: JobConfig, dims: ParallelDims) -> None:
    """parallelize_llama's first assert: TP shards the sequence, CP splits it in 2 x cp chunks."""
    seq_len = job_config.training.seq_len
    if seq_len % dims.seq_len_divisor:
        raise PreflightError(
            f"training.seq_len {seq_len} must be divisible by tensor_parallel_degree "
            f"({dims.tp}) x 2 x context_parallel_degree ({dims.cp}) = {dims.seq_len_divisor}; "
            "torchtitan asserts it at start-up"
        )


def _is_ddp(dims: ParallelDims) -> bool:
    """Replicas without FSDP: torchtitan wraps the model in torch's DDP (replicate)."""
    return dims.dp_replicate_enabled and not dims.fsdp_enabled and not dims.ep_enabled


def check_data_parallel_meshes(dims: ParallelDims) -> None:
    """parallelize_llama's FSDP / DDP: EP always goes through FSDP, and DDP only runs alone."""
    if dims.ep_enabled and not dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else ["fsdp"]
        raise PreflightError(
            f"parallelism.expert_parallel_degree = {dims.ep} needs FSDP "
            "(data_parallel_shard_degree x context_parallel_degree > 1, here "
            f"{dims.dp_shard} x {dims.cp}): torchtitan shards the routed experts with FSDP "
            f"whenever EP is on, and fails at start-up: \"Mesh '{names}' is not available. "
            'Ensure the corresponding parallelism dimension is all enabled." Give '
            "data_parallel_shard_degree some of the ranks"
        )
    if _is_ddp(dims) and dims.world_size != dims.dp_replicate:
        raise PreflightError(
            f"parallelism.data_parallel_replicate_degree = {dims.dp_replicate} without FSDP "
            "(data_parallel_shard_degree 1) is DDP, which torchtitan runs only over all ranks: "
            'with tensor or pipeline parallelism it fails at start-up ("DDP has not supported '
            '> 1D parallelism"). Set data_parallel_shard_degree > 1 (HSDP)'
        )


def check_attention_heads(dims: ParallelDims, model_args: BaseModelArgs) -> None:
    """Tensor parallelism splits the attention projections by rows: each rank's share must be
    whole heads, or the first step's reshape into heads fails ("shape '[...]' is invalid")."""
    n_heads = getattr(model_args, "n_heads", None)
    if not dims.tp_enabled or n_heads is None:
        return
    n_kv_heads = getattr(model_args, "n_kv_heads", None) or n_heads
    if n_heads % dims.tp or n_kv_heads % dims.tp:
        raise PreflightError(
            f"parallelism.tensor_parallel_degree = {dims.tp} must divide the model's {n_heads} "
            f"attention heads and {n_kv_heads} key/value heads: each rank reshapes its share of "
            "the projections into whole heads, which fails at step 1"
        )


def check_context_parallel(dims: ParallelDims, target: str) -> None:
    """For launches without float8_moe too (its converter checks it as well)."""
    if target == "cpu":
        check_cpu_context_parallelism(dims)


def check_dual_pipe_v(job_config: JobConfig, dims: ParallelDims) -> None:
    try:
        get_dual_pipe_v_flag(job_config, dims)
    except NotImplementedError as e:
        raise PreflightError(str(e)) from e


def routed_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules torchtitan's expert parallelism splits: each MoE block's ``moe.experts``."""
    for name, block in getattr(model, "layers", nn.ModuleDict()).named_children():
        if getattr(block, "moe_enabled", False):
            yield f"layers.{name}.moe.experts", block.moe.experts


def check_routed_experts(model: nn.Module, dims: ParallelDims, converted: set[str]) -> None:
    """EP and FSDP rules for the routed expert weights that float8_moe left alone (the
    converter checked its own): planning their split raises where the launch would fail."""
    for fqn, experts in routed_experts(model):
        for name, weight in experts.named_parameters():
            weight_fqn = f"{fqn}.{name}"
            if weight.ndim != 3 or weight_fqn in converted:
                continue
            try:
                plan_expert_weight(
                    weight_fqn, tuple(weight.shape), dims, "routed", 2, "-", even_tp=False
                )
            except ValueError as e:
                raise PreflightError(str(e)) from e


def describe_parallelism(dims: ParallelDims) -> list[str]:
    return [
        f"parallelism: world size {dims.world_size} = dp_replicate {dims.dp_replicate} x "
        f"dp_shard {dims.dp_shard} x cp {dims.cp} x tp {dims.tp} x pp {dims.pp}",
        f"  FSDP degree {dims.dp_shard * dims.cp if dims.fsdp_enabled else 1} (dp_shard x cp), "
        f"ep {dims.ep}, etp {dims.etp}",
    ]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} B"


def describe_model(job_config: JobConfig, model: nn.Module, model_args: BaseModelArgs) -> list[str]:
    parameters = sum(p.numel() for p in model.parameters())
    lines = [
        f"model: {job_config.model.name} {job_config.model.flavor}, "
        f"{_count(parameters)} parameters, built on the meta device",
        # No model's args read the tokenizer (torchtitan 0.2.2), so it is not loaded here.
        f"  vocab_size {model_args.vocab_size} from the flavor; the tokenizer is not loaded",
    ]
    assets = job_config.model.hf_assets_path
    if not os.path.exists(assets):
        lines.append(
            f"  note: model.hf_assets_path {assets} does not exist here; the launch reads its "
            "tokenizer from there"
        )
    return lines


def describe_pipeline(dims: ParallelDims) -> list[str]:
    if not dims.pp_enabled:
        return []
    return [
        f"pipeline: the trainer converts the whole model, as here, then splits it into "
        f"{dims.pp} stages; each stage FSDP-shards only its own weights of the plan below"
    ]


def float8_moe_converter(converters: ModelConvertersContainer) -> Float8MoEConverter | None:
    float8_moe = [c for c in converters.converters if isinstance(c, Float8MoEConverter)]
    return float8_moe[0] if float8_moe else None


def describe_float8_moe(converter: Float8MoEConverter | None, dims: ParallelDims) -> list[str]:
    if converter is None:
        return ["float8_moe: not in model.converters; nothing to plan"]
    plan = converter.shard_plan
    padding_bytes = sum(row.padding_bytes for row in plan)
    converted = sum(row.fp8 for row in plan)
    kept = (
        f" ({len(plan) - converted} kept in bf16 by the {converter.policy} policy)"
        if converted < len(plan)
        else ""
    )
    policy = describe_policy(converter.policy, converter.path, plan)
    return [
        f"float8_moe: {converter.recipe.description}, fqns {converter.fqns}, {converter.path} "
        f"path ({converter.path_reason}), {policy}; "
        f"FSDP shard plan for {dims.world_size} ranks:",
        format_plan(plan),
        f"totals: {converted} converted weights{kept}, {padding_bytes} padding bytes "
        f"({_size(padding_bytes)}) all-gathered per step over all ranks",
    ]


def check_launch(
    job_config: JobConfig,
    dims: ParallelDims,
    model: nn.Module,
    model_args: BaseModelArgs,
    converted: set[str],
    target: str,
) -> None:
    """What the trainer does after the conversion, in its order: the batch sizes, the pipeline
    split, torchtitan's parallelize_fn (each stage's), the pipeline schedule, the first step.
    ``converted``: the FQNs of the weights float8_moe converted."""
    check_batch(job_config, dims)
    if dims.pp_enabled:
        check_pipeline(job_config, dims, model_args)
    check_sequence_split(job_config, dims)
    check_dual_pipe_v(job_config, dims)
    check_data_parallel_meshes(dims)
    check_routed_experts(model, dims, converted)
    check_attention_heads(dims, model_args)
    check_context_parallel(dims, target)


def run(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """All checks in launch order. Prints each step's summary as it passes (so a failure shows
    how far the launch got) and returns the plan's report; raises PreflightError."""
    job_config = load_job_config(args.config, overrides)
    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as the trainer does
    dims = build_parallel_dims(job_config, args.ngpu)
    check_device_mesh(dims)
    print("\n".join(describe_parallelism(dims)), flush=True)
    check_sizes(job_config, dims)
    model, model_args = build_meta_model(job_config)
    print("\n".join(describe_model(job_config, model, model_args)), flush=True)
    float8_moe = float8_moe_converter(convert(job_config, dims, model, args.target))
    converted = {row.fqn for row in float8_moe.shard_plan if row.fp8} if float8_moe else set()
    check_launch(job_config, dims, model, model_args, converted, args.target)
    return describe_pipeline(dims) + describe_float8_moe(float8_moe, dims)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    print(f"preflight: {args.config} on {args.ngpu} ranks, target {args.target}", flush=True)
    try:
        report = run(args, overrides)
    except PreflightError as e:
        print(f"preflight FAILED: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except SystemExit as e:  # torchtitan's config parser has printed why
        print("preflight FAILED: the config or its overrides", file=sys.stderr, flush=True)
        return e.code if isinstance(e.code, int) and e.code else EXIT_FAILED
    print("\n".join(report))
    print(f"preflight OK ({time.perf_counter() - started:.1f} s)", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
