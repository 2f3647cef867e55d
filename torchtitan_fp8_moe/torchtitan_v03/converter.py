"""`float8_moe` as a torchtitan 0.3 model-config converter.

torchtitan 0.3 converters rewrite the model config before the model is built, and see no run
settings. ``Float8MoEConverter.convert`` therefore wraps the model config once: the model class
becomes a subclass (``Float8MoE<Model>``) whose config also holds these settings and, from
``update_from_config`` (the trainer calls it with its whole config before building), the run's
parallel dims, tokens per rank and compile settings (``run.py``). Its ``__init__`` builds the
model as before, on the meta device, then converts the expert modules exactly as 0.2.2's
converter does (``conversion.convert``: selection by structure, policy, FSDP/TP/EP shard plan,
weight swap) and logs the shard plan, before torchtitan parallelizes it.
"""

from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.float8 import _float8_experts_cache
from torchtitan.components.quantization.mx import _mxfp8_experts_cache
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.tools.logging import logger

from ..conversion import DEFAULT_FQNS, convert, select_expert_modules
from ..fp8.quantize import FP8_MATRIX_ALIGNMENT
from ..fp8.recipes import recipe_named
from ..gemm_choice import check_option as check_gemm_backend
from ..policy import POLICIES
from ..run_checks import conversion_message
from ..settings import check_setting_types
from .run import Run


class Float8MoEConverter(QuantizationConverter):
    """fp8 rowwise training of the routed experts (and shared experts) of 0.3's MoE models."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        """The settings of 0.2.2's `[float8_moe]` section (``torchtitan_fp8_moe/config.py``
        says each one's meaning in full)."""

        recipe: str = "rowwise"
        """fp8 scaling recipe; with torchtitan 0.3 only "rowwise" (power-of-2 scales per row,
        float8_e4m3fn): "blockwise" runs with torchtitan 0.2.2 for now."""

        fqns: list[str] | str = field(default_factory=lambda: list(DEFAULT_FQNS))
        """Module FQN substrings of the expert modules to convert (a string: one, or a
        comma-separated list); "experts" matches 0.3's routed
        ``moe.routed_experts.inner_experts`` and shared ``moe.shared_experts``."""

        policy: str = "auto"
        """"auto": keep bf16 the weights whose fp8 GEMMs are slower at this run's per-rank
        shapes and tokens, estimated on an H200 (policy.py), timed at start-up on other GPUs
        (measure.py); "measure": time them on an H200 too; "always": convert every one."""

        gemm_backend: str = "auto"
        """The fp8 GEMMs' kernels on CUDA: "auto" (the fastest installed, timed at start-up),
        "torch" or "fbgemm" (fbgemm-gpu-genai)."""

        emulate: bool = False
        """Emulated fp8 (quantize, dequantize, fp32 matmul); always on without CUDA."""

        cache_fp8_weights: bool = False
        """Quantize each expert weight once per optimizer step and reuse it."""

        fp8_all_gather: bool = False
        """Under FSDP, quantize each expert weight on its shard and all-gather fp8."""

    def __init__(self, config: Config):
        check_setting_types(config)
        if config.recipe != "rowwise":
            raise ValueError(
                f"float8_moe: recipe {config.recipe!r} is not supported with torchtitan 0.3 "
                '(its token dispatcher is padded for rowwise); set recipe = "rowwise", or use '
                "torchtitan 0.2.2 for blockwise"
            )
        if config.policy not in POLICIES:
            raise ValueError(f"float8_moe: policy {config.policy!r} is not one of {list(POLICIES)}")
        check_gemm_backend(config.gemm_backend, recipe_named(config.recipe))
        self.config = config

    def convert(self, model_config):
        if isinstance(model_config, ConvertedModelConfig):
            raise ValueError(
                "float8_moe: Float8MoEConverter.Config is in the model's converters twice"
            )
        _check_experts_not_quantized(model_config)
        if not self.config.emulate and torch.cuda.is_available():
            # torch's fp8 grouped GEMM needs token groups of 16 rows: 0.3's token dispatcher
            # pads them when asked (as for torchao's converter).
            for _fqn, moe, _parent, _attr in model_config.traverse(MoE.Config):
                swap_token_dispatcher(moe.routed_experts, FP8_MATRIX_ALIGNMENT)
        model_cls = float8_moe_model_class(type(model_config)._owner)
        values = {f.name: getattr(model_config, f.name) for f in fields(model_config) if f.init}
        return model_cls.Config(**values, float8_moe=self.config, float8_moe_run=Run())


def _check_experts_not_quantized(model_config) -> None:
    """torchtitan's own grouped-experts converters (torchao's fp8 or MXFP8) swap the experts'
    configs for subclasses of their own; converting those again would quantize twice."""
    quantized = tuple(
        cls.Config for cls in (*_float8_experts_cache.values(), *_mxfp8_experts_cache.values())
    )
    for fqn, experts, _parent, _attr in model_config.traverse(GroupedExperts.Config):
        if isinstance(experts, quantized):
            raise ValueError(
                f"float8_moe: {fqn} is a {type(experts).__qualname__}, converted by torchtitan's "
                "Float8GroupedExpertsConverter or MXFP8GroupedExpertsConverter before "
                "Float8MoEConverter; keep one of them in the model's converters"
            )


class ConvertedModelConfig:
    """Marks the config of a model class made by ``float8_moe_model_class``."""


_model_classes: dict[type, type] = {}


def float8_moe_model_class(model_cls: type) -> type:
    """``model_cls`` converting its experts after it is built: one subclass per model class."""
    if model_cls in _model_classes:
        return _model_classes[model_cls]
    parent_config = model_cls.Config

    class Float8MoEModel(model_cls):
        @dataclass(kw_only=True, slots=True)
        class Config(parent_config, ConvertedModelConfig):
            float8_moe: Float8MoEConverter.Config
            float8_moe_run: Run

            def update_from_config(self, *, config, **kwargs) -> None:
                # slots=True dataclasses take no zero-argument super().
                parent_config.update_from_config(self, config=config, **kwargs)
                self.float8_moe_run.capture(config, self.float8_moe)

        def __init__(self, config):
            super().__init__(config)
            convert_experts(self, config.float8_moe, config.float8_moe_run)

    Float8MoEModel.__name__ = Float8MoEModel.__qualname__ = f"Float8MoE{model_cls.__name__}"
    _model_classes[model_cls] = Float8MoEModel
    return Float8MoEModel


def convert_experts(model: nn.Module, settings: Float8MoEConverter.Config, run: Run) -> None:
    """Convert the built ``model``'s expert modules for ``run`` and log their shard plan."""
    emulate, path, path_reason = run.fp8_path(settings)
    targets = select_expert_modules(model, settings.fqns)
    plan = convert(
        model,
        fqns=settings.fqns,
        emulate=emulate,
        cache_fp8_weights=settings.cache_fp8_weights,
        fp8_all_gather=settings.fp8_all_gather,
        parallel_dims=run.plan_dims,
        all_gather_dtype=run.all_gather_dtype,
        path=path,
        policy=settings.policy,
        tokens=run.tokens,
        compiled=run.compiled,
        align_token_groups=False,  # the token dispatcher pads them (Float8MoEConverter.convert)
        time_weights=run.launching,
        gemm_backend=settings.gemm_backend,
    )
    model.float8_moe_shard_plan = plan
    if not run.launching:
        return  # preflight prints the plan itself, once
    warn, message = conversion_message(
        plan,
        len(targets),
        path,
        path_reason,
        settings.policy,
        run.tokens,
        settings.cache_fp8_weights,
        settings.fp8_all_gather,
        compiled=run.compiled,
        gemm_backend=settings.gemm_backend,
    )
    (logger.warning if warn else logger.info)(message)
