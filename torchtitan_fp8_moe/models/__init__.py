"""Model variants this plugin registers with torchtitan."""

from torchtitan.protocols.train_spec import register_train_spec

from .llama4_grouped_shared import NAME as LLAMA4_GROUPED_SHARED
from .llama4_grouped_shared import grouped_shared_train_spec

register_train_spec(LLAMA4_GROUPED_SHARED, grouped_shared_train_spec())
