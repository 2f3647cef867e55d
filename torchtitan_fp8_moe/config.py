"""The `[float8_moe]` config section (torchtitan 0.2.2). Point torchtitan at it with
`job.custom_config_module = "torchtitan_fp8_moe.config"` (TOML) or
`--job.custom_config_module=torchtitan_fp8_moe.config` (CLI); importing it also registers the
`float8_moe` converter and the bundled models (``models/``) with torchtitan."""

from dataclasses import dataclass, field

from torchtitan.protocols.model_converter import register_model_converter

from . import models  # noqa: F401 - registers llama4_grouped_shared, llama4_scout_slices, ...
from .converter import Float8MoEConverter
from .settings import Float8MoESettings

# The section's options, documented in settings.py; tyro and torchtitan's ConfigManager read the
# frozen dataclass as any other section.
Float8MoE = Float8MoESettings


@dataclass
class JobConfig:
    float8_moe: Float8MoESettings = field(default_factory=Float8MoESettings)


register_model_converter(Float8MoEConverter, "float8_moe")
