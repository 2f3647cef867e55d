"""Several torchtitan trainer runs in one launch (CPU, gloo): `tests/conftest.py`'s
``trainer_run`` fixture starts it. Each run is what `scripts/run_train.sh` would run in a launch
of its own (`torchtitan_fp8_moe.train`: the plugin, the CPU mode, torchtitan's ConfigManager and
Trainer) without the process start-up, one process group for all of them; each rank writes each
run's log to a file of its own.

    python tests/harness/fork_launch.py --nproc=N tests/harness/trainer_batch.py SPEC.json

SPEC: ``{"runs": [{"name", "args", "log_dir", "env", "copy"}, ...]}``; ``args`` are the
trainer's command-line arguments (config file included), ``env`` variables set for that run,
``copy`` an optional ``[source, destination]`` folder copied by rank 0 before it (a checkpoint
written by an earlier run). A run that raises ends the launch: the launcher stops every rank.
"""

import dataclasses
import gc
import json
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger, logger

import torchtitan_fp8_moe.config  # noqa: F401 - registers float8_moe and the models
from torchtitan_fp8_moe import cpu


def _skip_final_sleep() -> None:
    """Rank 0 of torchtitan's ``Trainer.train`` sleeps 2 s at the end "for other ranks to
    complete"; the barrier after each run here does that job."""
    import time
    import types

    import torchtitan.train

    names = {n: getattr(time, n) for n in dir(time) if not n.startswith("_")}
    torchtitan.train.time = types.SimpleNamespace(**dict(names, sleep=lambda seconds: None))


# Smaller variants of the debug flavors, for runs whose cost is the model's size. qwen3
# debugmodel_moe is 8 layers of 64 experts (302M expert parameters): an emulated fp8 step of it
# is slow on a CPU machine (docs/cpu.md). Llama4's
# debugmodel alternates dense and MoE layers over 6; 2 layers keep one of each (a 4-rank TP
# run: 4-5 s instead of 11-16 s). Each keeps its experts, routing and modules.
TWO_LAYER_CHANGES = {"n_layers": 2}
TEST_FLAVORS = {
    ("qwen3", "debugmodel_moe_2layers"): ("debugmodel_moe", TWO_LAYER_CHANGES),
    ("llama4", "debugmodel_2layers"): ("debugmodel", TWO_LAYER_CHANGES),
    ("llama4_grouped_shared", "debugmodel_2layers"): ("debugmodel", TWO_LAYER_CHANGES),
    ("llama4_grouped_shared", "debugmodel_2experts_2layers"): (
        "debugmodel_2experts",
        TWO_LAYER_CHANGES,
    ),
}


def _register_test_flavors() -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    for (model, flavor), (base, changes) in TEST_FLAVORS.items():
        flavors = get_train_spec(model).model_args
        flavors[flavor] = dataclasses.replace(flavors[base], **changes)


def _train(args: list[str]) -> None:
    from torchtitan.train import Trainer

    config = ConfigManager().parse_args(args)
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()


def _compile_configs() -> list:
    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config

    return [torch._dynamo.config, torch._inductor.config, torch._functorch.config]


class _ProcessState:
    """What a run changes for the whole process that a run of its own would not pass on: the
    compile configs (the converter turns compile caches off, torchtitan turns
    ``capture_scalar_outputs`` on), torchtitan's MoE experts function, which its
    ``apply_compile`` replaces by a compiled one module-wide, and its token-group alignment,
    which the converter sets for fp8."""

    def __init__(self):
        from torchtitan.models.moe import moe, utils

        self.moe, self.moe_utils = moe, utils
        self.configs = [module.save_config() for module in _compile_configs()]
        self.run_experts_grouped_mm = moe._run_experts_grouped_mm
        self.alignment = utils.TOKEN_GROUP_ALIGN_SIZE_M

    def restore(self) -> None:
        for module, saved in zip(_compile_configs(), self.configs, strict=True):
            module.load_config(saved)
        self.moe._run_experts_grouped_mm = self.run_experts_grouped_mm
        self.moe_utils.set_token_group_alignment_size_m(self.alignment)


def _run(run: dict, rank: int, preamble: list[logging.LogRecord]) -> None:
    log_dir = Path(run["log_dir"])
    handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("[titan] %(asctime)s - %(levelname)s - %(message)s"))
    for record in preamble:
        handler.handle(record)
    logger.addHandler(handler)
    env = run.get("env", {})
    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    state = _ProcessState()
    try:
        if run.get("copy") and rank == 0:
            shutil.copytree(*run["copy"])
        if dist.is_initialized():  # the first run initializes the process group
            dist.barrier()
        _train(run["args"])
        logger.info("trainer_batch: run %s finished", run["name"])
    except BaseException:
        logger.error("trainer_batch: run %s failed:\n%s", run["name"], traceback.format_exc())
        raise
    finally:
        logger.removeHandler(handler)
        handler.close()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    # What one run compiled, switched, cached or left for the collector must not reach the next.
    state.restore()
    torch._dynamo.reset()
    gc.collect()


class _Recorder(logging.Handler):
    """Keeps the records logged before the first run (the CPU mode's lines), which a launch of
    its own would show in every run's log."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_logger()
    start = _Recorder()
    logger.addHandler(start)
    if not torch.cuda.is_available():
        cpu.enable_cpu_training()
    logger.removeHandler(start)
    _skip_final_sleep()
    _register_test_flavors()
    rank = int(os.environ["RANK"])
    for run in spec["runs"]:
        try:
            _run(run, rank, start.records)
        except BaseException:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(1)
        dist.barrier()
    logging.shutdown()
    # As the CPU mode's end of training: no gloo teardown (it aborted a rank about once in ten
    # CI runs).
    os._exit(0)


if __name__ == "__main__":
    main()
