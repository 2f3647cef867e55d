"""`python -m torchtitan_fp8_moe.torchtitan_v03.train --module M --config C [overrides]`:
torchtitan 0.3's trainer (``torchtitan.train``), on a machine without CUDA with the CPU
adjustments of ``cpu.py``. Arguments are torchtitan's; ``--module
torchtitan_fp8_moe.torchtitan_v03.config_registry`` selects this package's config entries."""

import torch
from torchtitan.tools.logging import init_logger

from . import cpu


def run() -> None:
    init_logger()
    if not torch.cuda.is_available():
        cpu.enable_cpu_training()
    from torchtitan.train import main

    main()


if __name__ == "__main__":
    run()
