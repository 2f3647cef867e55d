"""Check a torchtitan 0.3 config entry with `float8_moe` for N GPUs, on a machine without them.

    python -m torchtitan_fp8_moe.torchtitan_v03.preflight --module M --config C --ngpu N
        [--target cuda|cpu] [torchtitan overrides...]

Runs what torchtitan 0.3's trainer runs up to the model build, with no process group or GPU:
the entry through torchtitan's ConfigManager (overrides as in a launch), the parallel dims for N
ranks, the model config's ``update_from_config`` and the model on the meta device, whose
``Float8MoEConverter`` makes the launch's checks and shard plan. Prints the plan; exits 0 when
the launch would get this far, 2 with the launch's error message when it would not.
"""

import argparse
import sys

import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

from ..run_context import RunContext, planning
from ..sharding import format_plan
from .converter import ConvertedModelConfig

EXIT_OK = 0
EXIT_FAILED = 2
# What torchtitan raises for a config a launch would stop on (it validates with asserts, too).
_CONFIG_ERRORS = (AssertionError, KeyError, NotImplementedError, ValueError)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan_fp8_moe.torchtitan_v03.preflight",
        description="Check a torchtitan 0.3 config entry with float8_moe for N GPUs.",
        epilog="Further arguments are torchtitan overrides, e.g. --training.seq_len 4096",
        allow_abbrev=False,
    )
    parser.add_argument("--module", required=True, help="the config registry module")
    parser.add_argument("--config", required=True, help="the config entry (a function in it)")
    parser.add_argument("--ngpu", type=int, required=True, help="world size of the launch")
    parser.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    args, overrides = parser.parse_known_args(argv)
    if args.ngpu < 1:
        parser.error(f"--ngpu must be at least 1, got {args.ngpu}")
    return args, overrides


def plan(module: str, config_name: str, ngpu: int, target: str, overrides: list[str]):
    """The entry's trainer config and the ``float8_moe`` shard plan of its model."""
    config = ConfigManager().parse_args(["--module", module, "--config", config_name, *overrides])
    ParallelDims.from_config(config.parallelism, ngpu)  # the launch's own dims check
    model_config = config.model_spec.model
    if not isinstance(model_config, ConvertedModelConfig):
        raise ValueError(
            f"{module}.{config_name}: its model's converters hold no Float8MoEConverter.Config; "
            "add one (torchtitan_fp8_moe/torchtitan_v03/config_registry.py shows how)"
        )
    with planning(RunContext(plan_target=target, world_size=ngpu)):
        model_config.update_from_config(config=config)
        with torch.device("meta"):
            model = model_config.build()
    return config, model.float8_moe_shard_plan


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config, rows = plan(args.module, args.config, args.ngpu, args.target, overrides)
    except _CONFIG_ERRORS as error:
        print(f"preflight: the launch would fail: {error}", file=sys.stderr)
        return EXIT_FAILED
    p = config.parallelism
    print(
        f"{args.config} on {args.ngpu} {args.target} ranks: data_parallel_shard_degree "
        f"{p.data_parallel_shard_degree}, replicate {p.data_parallel_replicate_degree}, "
        f"tensor {p.tensor_parallel_degree}, expert {p.expert_parallel_degree}, pipeline "
        f"{p.pipeline_parallel_degree}, context {p.context_parallel_degree}"
    )
    print(format_plan(rows))
    fp8 = sum(row.fp8 for row in rows)
    policy = config.model_spec.model.float8_moe.policy
    kept = f" ({len(rows) - fp8} kept in bf16 by the {policy} policy)" if fp8 < len(rows) else ""
    print(
        f"{fp8} of {len(rows)} expert weights in fp8{kept}; padding bytes per step: "
        f"{sum(row.padding_bytes for row in rows)}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
