"""torchtitan-fp8-moe: FSDP-safe fp8 rowwise training for MoE experts.

Importing the package registers the `float8_moe` model converter and the
`llama4_grouped_shared` and `llama4_scout_slices` models with torchtitan. ``convert`` converts a
model's expert weights without torchtitan's trainer.
"""

from . import (
    fsdp_shard_buffer,
    models,  # noqa: F401 - registers llama4_grouped_shared, llama4_scout_slices
)
from .conversion import convert
from .converter import Float8MoEConverter
from .sharding import ShardPlanRow, format_plan
from .weight import Float8MoEWeight, WeightConfig

# Uneven FSDP2 shards of converted weights keep their storage (state dicts stay live).
fsdp_shard_buffer.install()

__all__ = [
    "Float8MoEConverter",
    "Float8MoEWeight",
    "ShardPlanRow",
    "WeightConfig",
    "convert",
    "format_plan",
]
