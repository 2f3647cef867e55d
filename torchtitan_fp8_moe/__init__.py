"""torchtitan-fp8-moe: FSDP-safe fp8 rowwise training for MoE experts.

Importing the package patches and registers nothing. With torchtitan 0.2.2, the job's
``job.custom_config_module = "torchtitan_fp8_moe.config"`` registers the `float8_moe` model
converter and the bundled models (``llama4_grouped_shared``, ``llama4_scout_slices``,
``qwen3_slices``; ``torchtitan_fp8_moe.models`` registers the models alone). With torchtitan
0.3, ``Float8MoEConverter`` is a model-config converter (``torchtitan_v03/``): add its
``Config`` to a model's converters. ``convert`` converts a model's expert weights without
torchtitan's trainer, with the options of ``Float8MoESettings``. Converting weights installs
the FSDP2 fix of ``fsdp_shard_buffer.py``.
"""

from ._version import __version__
from .conversion import convert
from .settings import Float8MoESettings
from .sharding import ShardPlanRow, format_plan
from .torchtitan_version import TORCHTITAN_V03
from .weight import Float8MoEWeight, WeightConfig

if TORCHTITAN_V03:
    from .torchtitan_v03 import Float8MoEConverter
else:
    from .converter import Float8MoEConverter

__all__ = [
    "__version__",
    "Float8MoEConverter",
    "Float8MoESettings",
    "Float8MoEWeight",
    "ShardPlanRow",
    "WeightConfig",
    "convert",
    "format_plan",
]
