"""The run settings a torchtitan 0.3 model converts its experts for, read from the trainer's
config (``Run.capture``, from the model config's ``update_from_config``), with the checks
0.2.2's converter makes on them (``run_checks.py``)."""

import functools

import torch
import torch._inductor.config
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims

from .. import run_context
from ..fp8.weight_cache import clear_all as clear_fp8_weight_caches
from ..run_checks import (
    check_cpu_context_parallelism,
    check_data_parallelism,
    check_fp8_all_gather_dtype,
    choose_fp8_path,
    disable_compile_caches_for_tensor_parallelism,
    tokens_per_microbatch,
)
from ..settings import check_setting_types

# torchtitan 0.3's parallelization backend float8_moe is tested with: DTensor parameters over the
# TP/EP meshes and FSDP2, as in 0.2.2. (0.3's default, "spmd_types", fails on CPU in bf16 too.)
TESTED_SPMD_BACKEND = "partial_dtensor"


class ExpertPlanDims:
    """0.3's ``ParallelDims`` as the shard planner (``sharding.py``) reads it: 0.3 has no
    expert tensor parallelism (etp 1), and shards routed experts on dim 1 beyond the expert
    count also without EP."""

    etp = 1
    routed_dim1_without_ep = True

    def __init__(self, dims: ParallelDims):
        self._dims = dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


class Run:
    """What the converter plans for: nothing captured (a model built outside the trainer) plans
    one device, like ``convert`` without ``parallel_dims``."""

    def __init__(self):
        self.context = run_context.current()
        self.plan_dims: ExpertPlanDims | None = None
        self.tokens: int | None = None
        self.compiled = False
        self.all_gather_dtype: torch.dtype | None = None

    def capture(self, trainer_config, settings) -> None:
        """Read the trainer config (a ``Trainer.Config``) and check it, as 0.2.2's converter
        does at construction; the settings again, as a config entry may set them after
        building the model config (``tests_v03/entries.py`` does)."""
        check_setting_types(settings)
        # Where it runs: the trainer's machine, or preflight's target (run_context.planning).
        self.context = run_context.current()
        training, parallelism = trainer_config.training, trainer_config.parallelism
        if parallelism.spmd_backend != TESTED_SPMD_BACKEND:
            raise ValueError(
                f"float8_moe: parallelism.spmd_backend = {parallelism.spmd_backend!r} is not "
                f"tested with converted expert weights; set it to {TESTED_SPMD_BACKEND!r} "
                f"(--parallelism.spmd_backend {TESTED_SPMD_BACKEND}, or in the config entry; "
                "torchtitan_fp8_moe/torchtitan_v03/config_registry.py's entries do)"
            )
        dims = ParallelDims.from_config(parallelism, self.context.ranks())
        self.tokens = tokens_per_microbatch(
            training.local_batch_size,
            training.seq_len,
            parallelism.pipeline_parallel_microbatch_size,
            dims.pp,
            dims.cp,
        )
        compile_config = trainer_config.compile
        self.compiled = compile_config.enable and "model" in compile_config.components
        param_dtype = training.mixed_precision_param
        self.all_gather_dtype = TORCH_DTYPE_MAP[param_dtype] if dims.fsdp_enabled else None
        check_fp8_all_gather_dtype(settings.fp8_all_gather, self.all_gather_dtype, param_dtype)
        check_data_parallelism(dims)
        self.plan_dims = ExpertPlanDims(dims)
        self.fp8_path(settings)  # a GPU without fp8 fails here, before anything is built
        if not self.context.on_cuda():
            check_cpu_context_parallelism(dims)
        if compile_config.enable:
            # Inductor otherwise fuses the bf16 -> fp32 -> fp8 casts of the quantization into
            # one rounding, which changes the fp8 values (pytorch/pytorch#150859).
            torch._inductor.config.emulate_precision_casts = True
            if dims.tp > 1:
                disable_compile_caches_for_tensor_parallelism()
        if settings.cache_fp8_weights:
            _clear_caches_after_optimizer_steps()

    def fp8_path(self, settings) -> tuple[bool, str, str]:
        return choose_fp8_path(settings.emulate, self.context.plan_target)

    def to_dict(self) -> dict:
        """What the trainer's config dump shows of it."""
        return {
            "tokens": self.tokens,
            "compiled": self.compiled,
            "all_gather_dtype": str(self.all_gather_dtype),
        }


@functools.cache
def _clear_caches_after_optimizer_steps():
    """0.3 converters have no post-optimizer hook: a global one frees the fp8 weight copies,
    stale once the weights changed (0.2.2's converter does it in its post_optimizer_hook); one
    per process. Imported from ``torch.optim.optimizer``: ``torch.optim`` deletes its
    ``optimizer`` name."""
    return register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: clear_fp8_weight_caches()
    )
