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

from dataclasses import dataclass, field, fields, make_dataclass

import torch
import torch.nn as nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.float8 import _float8_experts_cache
from torchtitan.components.quantization.mx import _mxfp8_experts_cache
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.tools.logging import logger

from ..conversion import convert, select_expert_modules
from ..fp8.quantize import FP8_MATRIX_ALIGNMENT
from ..fp8.recipes import recipe_named
from ..gemm_choice import check_option as check_gemm_backend
from ..policy import POLICIES
from ..run_checks import conversion_message
from ..settings import Float8MoESettings, check_setting_types
from .run import Run


def _settings_config(base: type) -> type:
    """``base`` (0.3's converter config) with the fields of ``Float8MoESettings``, mutable as
    0.3's configs are (config entries set them after building the model config), and
    ``settings()`` to read them as ``Float8MoESettings``."""

    def settings(self) -> Float8MoESettings:
        """This config's options."""
        options = {f.name: getattr(self, f.name) for f in fields(Float8MoESettings)}
        return Float8MoESettings(**options)

    config = make_dataclass(
        "Config",
        [
            (f.name, f.type, field(default=f.default, default_factory=f.default_factory))
            for f in fields(Float8MoESettings)
        ],
        bases=(base,),
        namespace={"settings": settings},
        kw_only=True,
        slots=True,
    )
    config.__module__ = __name__
    config.__qualname__ = "Float8MoEConverter.Config"
    config.__doc__ = (
        "The `float8_moe` options (``torchtitan_fp8_moe/settings.py``'s ``Float8MoESettings`` "
        "documents each one), and 0.3's ``model_compile_enabled``. With torchtitan 0.3 recipe "
        '"rowwise" only; "experts" of ``fqns`` matches 0.3\'s routed '
        "``moe.routed_experts.inner_experts`` and shared ``moe.shared_experts``."
    )
    return config


class Float8MoEConverter(QuantizationConverter):
    """fp8 rowwise training of the routed experts (and shared experts) of 0.3's MoE models."""

    Config = _settings_config(QuantizationConverter.Config)

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


def convert_experts(model: nn.Module, config: Float8MoEConverter.Config, run: Run) -> None:
    """Convert the built ``model``'s expert modules for ``run`` and log their shard plan."""
    settings = config.settings()
    emulate, path, path_reason = run.fp8_path(settings)
    targets = select_expert_modules(model, settings.fqns)
    plan = convert(
        model,
        settings,
        emulate=emulate,
        parallel_dims=run.plan_dims,
        all_gather_dtype=run.all_gather_dtype,
        path=path,
        tokens=run.tokens,
        compiled=run.compiled,
        align_token_groups=False,  # the token dispatcher pads them (Float8MoEConverter.convert)
        time_weights=run.context.launching,
    )
    model.float8_moe_shard_plan = plan
    if not run.context.launching:
        return  # preflight prints the plan itself, once
    warn, message = conversion_message(
        plan, len(targets), settings, path, path_reason, run.tokens, compiled=run.compiled
    )
    (logger.warning if warn else logger.info)(message)
