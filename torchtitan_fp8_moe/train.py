"""`python -m torchtitan_fp8_moe.train`: torchtitan's own trainer with this plugin loaded, and,
on a machine without CUDA, the CPU adjustments of `cpu.py`. Arguments are torchtitan's."""

import torch
from torchtitan.tools.logging import init_logger

from . import config, cpu  # noqa: F401 - config registers float8_moe and the models


def run() -> None:
    init_logger()
    if not torch.cuda.is_available():
        cpu.enable_cpu_training()
    from torchtitan.train import Trainer, main

    main(Trainer)


if __name__ == "__main__":
    run()
