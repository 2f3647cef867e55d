"""Check a training config for N GPUs on a machine without them, before launching the job.

    python -m torchtitan_fp8_moe.preflight --config FILE --ngpu N [--target cuda] [overrides...]

Runs what torchtitan's trainer runs up to the model conversion, with no process group, device
mesh or GPU: the config through torchtitan's ConfigManager (overrides as in a launch), the
parallel dims for N ranks, the model on the meta device, and the model converters, whose checks
and FSDP shard plan are those of the launch. Prints the parallelism, the `float8_moe` shard plan
and its totals; exits 0 when the launch would get past these steps, 2 with the launch's error
message when it would not.
"""

import argparse
import copy
import importlib
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols import BaseModelArgs
from torchtitan.protocols.model_converter import (
    ModelConvertersContainer,
    build_model_converters,
)
from torchtitan.protocols.train_spec import get_train_spec
from torchtitan.tools.utils import set_default_dtype

from . import converter as converter_module
from .converter import Float8MoEConverter
from .sharding import format_plan

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


@contextmanager
def planning_for(target: str) -> Iterator[None]:
    """Have the float8_moe converter plan the fp8 path of `target`, whatever this machine has."""
    previous = converter_module.plan_target
    converter_module.plan_target = target
    try:
        yield
    finally:
        converter_module.plan_target = previous


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


def describe_float8_moe(converters: ModelConvertersContainer, dims: ParallelDims) -> list[str]:
    float8_moe = [c for c in converters.converters if isinstance(c, Float8MoEConverter)]
    if not float8_moe:
        return ["float8_moe: not in model.converters; nothing to plan"]
    (converter,) = float8_moe
    plan = converter.shard_plan
    padding_bytes = sum(row.padding_bytes for row in plan)
    return [
        f"float8_moe: fqns {converter.fqns}, {converter.path} path ({converter.path_reason}); "
        f"FSDP shard plan for {dims.world_size} ranks:",
        format_plan(plan),
        f"totals: {len(plan)} converted weights, {padding_bytes} padding bytes "
        f"({_size(padding_bytes)}) all-gathered per step over all ranks",
    ]


def run(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """All checks in launch order. Prints each step's summary as it passes (so a failure shows
    how far the launch got) and returns the plan's report; raises PreflightError."""
    job_config = load_job_config(args.config, overrides)
    if job_config.experimental.custom_import:
        importlib.import_module(job_config.experimental.custom_import)  # as the trainer does
    dims = build_parallel_dims(job_config, args.ngpu)
    print("\n".join(describe_parallelism(dims)), flush=True)
    model, model_args = build_meta_model(job_config)
    print("\n".join(describe_model(job_config, model, model_args)), flush=True)
    converters = convert(job_config, dims, model, args.target)
    return describe_pipeline(dims) + describe_float8_moe(converters, dims)


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
