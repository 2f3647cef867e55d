"""The `float8_moe` model converter: picks the expert modules, swaps their weights for
`Float8MoEWeight`, and plans each weight's FSDP shards before torchtitan calls `fully_shard`.
Registered with torchtitan 0.2.2 as `float8_moe` by ``config.py``, the job's
`custom_config_module`."""

from dataclasses import replace

import torch
import torch._inductor.config
import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from . import run_context
from .conversion import convert, select_expert_modules
from .fp8.recipes import recipe_named
from .fp8.weight_cache import clear_all as clear_fp8_weight_caches
from .gemm_choice import check_option as check_gemm_backend
from .run_checks import (
    check_cpu_context_parallelism,
    check_data_parallelism,
    check_fp8_all_gather_dtype,
    choose_fp8_path,
    conversion_message,
    disable_compile_caches_for_tensor_parallelism,
    tokens_per_microbatch,
)
from .run_context import RunContext
from .settings import Float8MoESettings, check_setting_types, fqn_entries
from .sharding import ShardPlanRow
from .swap import is_grouped_experts

# torchtitan's converters for dense linears, and where their exclusion lists live.
_LINEAR_CONVERTERS = {
    "quantize.linear.float8": lambda job_config: job_config.quantize.linear.float8.filter_fqns,
    "quantize.linear.mx": lambda job_config: job_config.quantize.linear.mx.filter_fqns,
}


def _check_cpu_composition(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Compositions that torchtitan 0.2.2 itself cannot run on CPU (bf16 included)."""
    ac = job_config.activation_checkpoint
    selective_op_ac = ac.mode == "selective" and ac.selective_ac_option == "op"
    compiled_model = job_config.compile.enable and "model" in job_config.compile.components
    # Measured in bf16 on 2-4 CPU ranks: TP 2 x FSDP 2 with AC none or selective per layer
    # trains; TP alone (any AC), AC full and selective op AC fail.
    layer_or_no_ac = ac.mode == "none" or (ac.mode == "selective" and not selective_op_ac)
    tensor_parallel_compile_trains = layer_or_no_ac and parallel_dims.fsdp_enabled
    if parallel_dims.tp > 1 and compiled_model and not tensor_parallel_compile_trains:
        without_fsdp = "" if parallel_dims.fsdp_enabled else " without FSDP"
        op_ac = ', selective_ac_option = "op"' if selective_op_ac else ""
        raise ValueError(
            f"float8_moe: parallelism.tensor_parallel_degree = {parallel_dims.tp}{without_fsdp} "
            'with compile.enable (compile.components with "model") and '
            f'activation_checkpoint.mode = "{ac.mode}"{op_ac} fails on CPU with torch 2.13, in '
            'bf16 too (AOTAutograd: "expected all tensors_saved_with_vc_check to be Tensors", '
            "or DTensor's backward handed a plain tensor); not tried on GPUs. On CPU it trains "
            "with FSDP as well (data_parallel_shard_degree > 1) and activation_checkpoint.mode "
            '= "none" or "selective" with a layer count as selective_ac_option, with only the '
            "loss compiled, or without compile."
        )
    check_cpu_context_parallelism(parallel_dims)
    if parallel_dims.ep > 1 and selective_op_ac:
        raise ValueError(
            f"float8_moe: parallelism.expert_parallel_degree = {parallel_dims.ep} with "
            'activation_checkpoint.mode = "selective" and selective_ac_option = "op" fails on '
            "CPU in torchtitan 0.2.2 itself, in bf16 too (an op of the expert-parallel token "
            "dispatch is recomputed differently); it trains on GPUs. On CPU set "
            'activation_checkpoint.mode = "full" or "none", or selective_ac_option to a layer '
            "count."
        )


def _check_blockwise_compile_backend(backend: str) -> None:
    """The emulated blockwise GEMMs trace whole (dynamo and AOTAutograd give eager's results
    bit for bit), but inductor on CPU (torch 2.13) miscompiles their forward and backward
    together: outputs far from eager's (tests/test_blockwise.py)."""
    if backend == "inductor":
        raise ValueError(
            'float8_moe: recipe "blockwise" emulated (no CUDA, or emulate = true) with '
            'compile.enable and compile.components with "model" under compile.backend = '
            '"inductor": inductor (torch 2.13, CPU) miscompiles the emulated blockwise GEMMs '
            "when both gradients are taken (outputs far from eager's). Set compile.backend = "
            '"aot_eager", leave "model" out of compile.components, or use recipe = "rowwise".'
        )


class Float8MoEConverter:
    def __init__(
        self,
        job_config: JobConfig,
        parallel_dims: ParallelDims,
        context: RunContext | None = None,
    ):
        """``context``: where the run runs; None: ``run_context.current()`` (the trainer's,
        or preflight's inside its ``planning`` scope), read once, here."""
        self.context = run_context.current() if context is None else context
        config: Float8MoESettings | None = getattr(job_config, "float8_moe", None)
        if config is None:
            raise ValueError(
                "float8_moe: the job config has no [float8_moe] section; set "
                'job.custom_config_module = "torchtitan_fp8_moe.config"'
            )
        check_setting_types(config)
        self.recipe = recipe_named(config.recipe)  # raises naming the option when unknown
        self.policy = config.policy  # checked by conversion.convert
        check_gemm_backend(config.gemm_backend, self.recipe)
        training = job_config.training
        self.tokens = tokens_per_microbatch(
            training.local_batch_size,
            training.seq_len,
            job_config.parallelism.pipeline_parallel_microbatch_size,
            parallel_dims.pp,
            parallel_dims.cp,
        )
        self.compiled = job_config.compile.enable and "model" in job_config.compile.components
        # The options, fqns as their entries (a TOML string may list them).
        self.settings = replace(config, fqns=fqn_entries(config.fqns))
        self.fqns = self.settings.fqns
        self.parallel_dims = parallel_dims
        self.linear_converter_filters = {
            name: filter_fqns(job_config)
            for name, filter_fqns in _LINEAR_CONVERTERS.items()
            if name in job_config.model.converters
        }
        self.all_gather_dtype = (
            TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
            if parallel_dims.fsdp_enabled
            else None
        )
        check_fp8_all_gather_dtype(
            config.fp8_all_gather, self.all_gather_dtype, job_config.training.mixed_precision_param
        )
        check_data_parallelism(parallel_dims)
        if not self.context.on_cuda():
            _check_cpu_composition(job_config, parallel_dims)
        self.emulate, self.path, self.path_reason = choose_fp8_path(
            config.emulate, self.context.plan_target
        )
        if self.compiled and self.emulate and self.recipe.name == "blockwise":
            _check_blockwise_compile_backend(job_config.compile.backend)
        if job_config.compile.enable:
            # Inductor otherwise fuses the bf16 -> fp32 -> fp8 casts of the quantization into
            # one rounding, which changes the fp8 values (pytorch/pytorch#150859).
            torch._inductor.config.emulate_precision_casts = True
            if parallel_dims.tp > 1:
                disable_compile_caches_for_tensor_parallelism()
        self.shard_plan: list[ShardPlanRow] = []

    def convert(self, model: nn.Module) -> None:
        """Convert the expert modules (recognised by structure, ``swap.py``) whose FQN contains
        one of ``fqns`` (``conversion.convert``) and log their shard plan."""
        targets = select_expert_modules(model, self.fqns)
        for module_fqn, module in targets:
            self._check_not_claimed_by_linear_converters(module_fqn, module)
        launching = self.context.launching  # preflight plans another machine's GPUs
        self.shard_plan = convert(
            model,
            self.settings,
            emulate=self.emulate,
            parallel_dims=self.parallel_dims,
            all_gather_dtype=self.all_gather_dtype,
            path=self.path,
            tokens=self.tokens,
            compiled=self.compiled,
            time_weights=launching,
        )
        if not launching:
            return  # preflight prints the plan itself, once
        warn, message = conversion_message(
            self.shard_plan,
            len(targets),
            self.settings,
            self.path,
            self.path_reason,
            self.tokens,
            compiled=self.compiled,
        )
        (logger.warning if warn else logger.info)(message)

    def _check_not_claimed_by_linear_converters(self, module_fqn: str, module: nn.Module):
        if is_grouped_experts(module):
            return
        for name, filter_fqns in self.linear_converter_filters.items():
            if not any(f in f"{module_fqn}.w1" for f in filter_fqns):
                raise ValueError(
                    f"float8_moe: {module_fqn} is a FeedForward that {name} converts too; give "
                    f"it to one converter: add '{module_fqn.split('.')[-1]}' to "
                    f"{name}.filter_fqns, or leave it out of float8_moe.fqns"
                )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        # The weights just changed: their fp8 copies are stale (and their memory is freed).
        clear_fp8_weight_caches()
