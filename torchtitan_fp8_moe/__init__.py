"""torchtitan-fp8-moe: FSDP-safe fp8 rowwise training for MoE experts.

With torchtitan 0.2.2, importing the package registers the `float8_moe` model converter and the
`llama4_grouped_shared` and `llama4_scout_slices` models with torchtitan. With torchtitan 0.3,
``Float8MoEConverter`` is a model-config converter (``torchtitan_v03/``): add its ``Config``
to a model's converters. ``convert`` converts a model's expert weights without torchtitan's
trainer.
"""

from . import fsdp_shard_buffer
from ._version import __version__
from .conversion import convert
from .sharding import ShardPlanRow, format_plan
from .torchtitan_version import TORCHTITAN_V03
from .weight import Float8MoEWeight, WeightConfig

if TORCHTITAN_V03:
    from .torchtitan_v03 import Float8MoEConverter
else:
    from . import models  # noqa: F401 - registers llama4_grouped_shared, llama4_scout_slices
    from .converter import Float8MoEConverter

# Uneven FSDP2 shards of converted weights keep their storage (state dicts stay live).
fsdp_shard_buffer.install()

__all__ = [
    "__version__",
    "Float8MoEConverter",
    "Float8MoEWeight",
    "ShardPlanRow",
    "WeightConfig",
    "convert",
    "format_plan",
]
