"""torchtitan-fp8-moe: FSDP-safe fp8 rowwise training for MoE experts.

Importing the package registers the `float8_moe` model converter with torchtitan.
"""

from .converter import Float8MoEConverter
from .weight import Float8MoEWeight

__all__ = ["Float8MoEConverter", "Float8MoEWeight"]
