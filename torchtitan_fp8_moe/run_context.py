"""Where the run a `float8_moe` converter plans for runs: on this machine (the trainer), or on
another one, planned here (preflight). Either torchtitan version builds its converter itself,
so preflight hands the context over with ``planning(context)``, a scope the converter reads
once, when it captures the run (0.2.2: at construction; 0.3: in ``update_from_config``)."""

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RunContext:
    plan_target: str | None = None
    """The device to plan the fp8 path for. None (the trainer): this machine's. "cuda" or "cpu"
    (the preflight): a launch on that device, planned where it may be absent, with that path's
    checks; the GPUs' fp8 support is not checked, as the model never runs."""

    world_size: int | None = None
    """The world size to plan for where no process group runs (torchtitan 0.3's preflight);
    None: the process group's, 1 without one."""

    @property
    def launching(self) -> bool:
        """False while preflight plans the run for another machine: nothing is timed on this
        one, and preflight prints the plan itself."""
        return self.plan_target is None

    def on_cuda(self) -> bool:
        """Whether the run has CUDA devices."""
        return torch.cuda.is_available() if self.plan_target is None else self.plan_target == "cuda"

    def ranks(self) -> int:
        """The world size the run plans for."""
        if self.world_size is not None:
            return self.world_size
        return dist.get_world_size() if dist.is_initialized() else 1


# The trainer's: this machine, its process group (a frozen default, shared safely).
_current: ContextVar[RunContext] = ContextVar(
    "float8_moe_run_context",
    default=RunContext(),  # noqa: B039
)


def current() -> RunContext:
    """The context of the converters built now: ``planning``'s inside it, else the trainer's."""
    return _current.get()


@contextmanager
def planning(context: RunContext) -> Iterator[RunContext]:
    """Converters built (0.2.2) or captured (0.3) inside plan for ``context``."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)
