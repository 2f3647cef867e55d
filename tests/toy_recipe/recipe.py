"""The per-tensor recipe: its GEMMs, emulated (dequantize, fp32 grouped GEMM), and its rules."""

import torch

from torchtitan_fp8_moe.fp8.gemm import grouped_mm_fp32, grouped_wgrad_mm_fp32
from torchtitan_fp8_moe.fp8.quantize import dequantize
from torchtitan_fp8_moe.fp8.recipes import PlanningRules, Quantizers, Recipe

from .quantizers import PerTensorQuantizers


class PerTensorRules(PlanningRules):
    def payload_scale_shapes(self, out_features: int, in_features: int):
        return (1, 1), (1, 1)


class PerTensorRecipe(Recipe):
    name = "per_tensor"
    description = "fp8 per-tensor (emulated only)"
    rules = PerTensorRules()

    def __init__(self):
        self._quantizers = PerTensorQuantizers()

    def quantizers(self, emulate: bool) -> Quantizers:
        if not emulate:
            raise NotImplementedError("recipe per_tensor has no CUDA kernels: emulate it")
        return self._quantizers

    def grouped_mm(self, a, a_scale, b, b_scale, offs, out_dtype, emulate, backend="torch"):
        out = grouped_mm_fp32(dequantize(a, a_scale), dequantize(b, b_scale), offs)
        return out.to(out_dtype)

    def grouped_wgrad_mm(
        self, a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend="torch"
    ) -> torch.Tensor:
        a_hp, grad_hp = dequantize(a, a_scale), dequantize(grad, grad_scale)
        return grouped_wgrad_mm_fp32(a_hp, grad_hp, offs).to(out_dtype)
