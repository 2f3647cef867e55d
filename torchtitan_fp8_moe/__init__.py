"""torchtitan-fp8-moe: FSDP-safe fp8 rowwise training for MoE experts.

Importing the package registers the `float8_moe` model converter and the
`llama4_grouped_shared` and `llama4_scout_slices` models with torchtitan.
"""

from . import models  # noqa: F401 - registers llama4_grouped_shared, llama4_scout_slices
from .converter import Float8MoEConverter
from .weight import Float8MoEWeight

__all__ = ["Float8MoEConverter", "Float8MoEWeight"]
