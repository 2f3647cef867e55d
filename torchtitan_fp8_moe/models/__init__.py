"""Model variants this plugin registers with torchtitan: `llama4_grouped_shared` (the seed's
shared-expert layout) and `llama4_scout_slices` (torchtitan's Llama4 at Scout width with 2 or 4
layers). Both offer the `scout_2layers` and `scout_4layers` flavors."""

from dataclasses import replace

from torchtitan.models.llama4 import get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

from .llama4_grouped_shared import NAME as LLAMA4_GROUPED_SHARED
from .llama4_grouped_shared import grouped_shared_train_spec
from .scout_slices import SCOUT_SLICES

LLAMA4_SCOUT_SLICES = "llama4_scout_slices"

grouped_shared = grouped_shared_train_spec()
register_train_spec(
    LLAMA4_GROUPED_SHARED,
    replace(grouped_shared, model_args={**grouped_shared.model_args, **SCOUT_SLICES}),
)
register_train_spec(LLAMA4_SCOUT_SLICES, replace(get_train_spec(), model_args=SCOUT_SLICES))
