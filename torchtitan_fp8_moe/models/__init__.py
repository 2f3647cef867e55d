"""Model variants this plugin registers with torchtitan: `llama4_grouped_shared` (the seed's
shared-expert layout), `llama4_scout_slices` (torchtitan's Llama4 at Scout width with 2 or 4
layers) and `qwen3_slices` (torchtitan's Qwen3 at Qwen3-30B-A3B's width, flavors `30b_a3b_2layers`
and `30b_a3b_4layers`). The first two offer the `scout_2layers` and `scout_4layers` flavors;
`llama4_grouped_shared` also `debugmodel_2experts`."""

from dataclasses import replace

from torchtitan.models.llama4 import get_train_spec
from torchtitan.models.qwen3 import get_train_spec as qwen3_train_spec
from torchtitan.protocols.train_spec import register_train_spec

from .llama4_grouped_shared import NAME as LLAMA4_GROUPED_SHARED
from .llama4_grouped_shared import grouped_shared_train_spec
from .slices import QWEN3_30B_SLICES, SCOUT_SLICES

LLAMA4_SCOUT_SLICES = "llama4_scout_slices"
QWEN3_SLICES = "qwen3_slices"

grouped_shared = grouped_shared_train_spec()
_debugmodel = grouped_shared.model_args["debugmodel"]
# Two experts: expert parallelism 2 x FSDP 2 then exceeds the expert count, the case where
# torchtitan shards the experts on dim 1 (tests/test_train_parallel.py).
DEBUG_2_EXPERTS = {
    "debugmodel_2experts": replace(
        _debugmodel, moe_args=replace(_debugmodel.moe_args, num_experts=2)
    )
}
register_train_spec(
    LLAMA4_GROUPED_SHARED,
    replace(
        grouped_shared,
        model_args={**grouped_shared.model_args, **SCOUT_SLICES, **DEBUG_2_EXPERTS},
    ),
)
register_train_spec(LLAMA4_SCOUT_SLICES, replace(get_train_spec(), model_args=SCOUT_SLICES))
register_train_spec(QWEN3_SLICES, replace(qwen3_train_spec(), model_args=QWEN3_30B_SLICES))
