"""The math core: fp8 quantization rules, recipes and matmuls. Imports torch only, never
torchtitan.

- ``quantize.py``: the scale and cast rules every recipe shares;
- ``recipes/``: what differs between recipes (scale granularity, quantizers, scaled GEMMs,
  all-gather payload layout, shape rules), one subpackage per recipe and their registry;
- ``scaled_grouped_mm.py``: the differentiable fp8 grouped matmul and its call forms;
- ``gemm.py``: the emulated GEMMs' building blocks; ``kernels/``: the Triton casts and GEMMs;
- ``gathered.py``, ``weight_cache.py``: fp8 payloads of FSDP all-gathers, cached fp8 weights.
"""

from .quantize import FP8_DTYPE, FP8_MAX, dequantize, quantize_rowwise, rowwise_scales
from .recipes import Recipe, recipe_named
from .scaled_grouped_mm import fp8_batched_mm, fp8_grouped_mm, fp8_matmul

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Recipe",
    "dequantize",
    "fp8_batched_mm",
    "fp8_grouped_mm",
    "fp8_matmul",
    "quantize_rowwise",
    "recipe_named",
    "rowwise_scales",
]
