"""The math core: fp8 rowwise quantization and matmuls. Imports torch only, never torchtitan."""

from .quantize import FP8_DTYPE, FP8_MAX, dequantize, quantize_rowwise, rowwise_scales
from .scaled_grouped_mm import fp8_batched_mm, fp8_grouped_mm, fp8_matmul

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "dequantize",
    "fp8_batched_mm",
    "fp8_grouped_mm",
    "fp8_matmul",
    "quantize_rowwise",
    "rowwise_scales",
]
