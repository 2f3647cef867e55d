"""The rowwise recipe: one power-of-2 scale per row of each GEMM operand, along its contraction.

    out    [M, N] = a [M, K] @ b[g] [K, N]        scales: a per token, b per (g, n)
    grad_a [M, K] = grad [M, N] @ b[g]^T [N, K]   scales: grad per token, b per (g, k)
    grad_b[g] [K, N] = a_g^T @ grad_g             scales: per (g, k) and (g, n) over g's tokens

Quantizers: ``torch_quantizers.py`` (emulated) and ``triton_quantizers.py`` (CUDA); planning
rules: ``rules.py``. GEMMs: on CUDA those of ``fp8/kernels/gemm_backends.py`` (torch's
``_scaled_grouped_mm`` / ``_scaled_mm``, or fbgemm-gpu-genai's, as each weight's ``GemmChoice``
says), the exact emulation of ``fp8/gemm.py`` elsewhere.
"""

import torch

from ...gemm import grouped_mm_fp32, grouped_wgrad_mm_fp32, per_token, token_groups
from ...kernels import gemm_backends
from ...quantize import dequantize
from ..interface import Quantizers, Recipe
from .rules import RowwiseRules
from .torch_quantizers import TORCH_QUANTIZERS


class RowwiseRecipe(Recipe):
    name = "rowwise"
    description = "fp8 rowwise"
    rules = RowwiseRules()
    token_cast_is_row_local = True  # [M, K] fp8 rows, [M, 1] scales
    gemm_backend_names = ("torch", "fbgemm")

    def quantizers(self, emulate: bool) -> Quantizers:
        if emulate:
            return TORCH_QUANTIZERS
        from .triton_quantizers import TRITON_QUANTIZERS  # Triton kernels: CUDA only

        return TRITON_QUANTIZERS

    def grouped_mm(self, a, a_scale, b, b_scale, offs, out_dtype, emulate, backend="torch"):
        return grouped_mm(a, a_scale, b, b_scale, offs, out_dtype, emulate, backend)

    def grouped_wgrad_mm(
        self, a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend="torch"
    ):
        return grouped_wgrad_mm(a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend)


def grouped_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    backend: str = "torch",
) -> torch.Tensor:
    """``a [M, K]`` (scales ``[M, 1]``) times ``b [G, K, N]`` (scales ``[G, 1, N]``) per group,
    on CUDA by the GEMM backend named ``backend`` (``kernels/gemm_backends.py``)."""
    if emulate:
        out = grouped_mm_fp32(dequantize(a, a_scale), dequantize(b, b_scale), offs)
        return out.to(out_dtype)
    kernels = gemm_backends.kernel(backend)
    if b.shape[0] == 1:
        # One group is a plain GEMM, faster than the grouped kernel.
        out = kernels.dense(a, a_scale.reciprocal(), b[0], b_scale[0].reciprocal())
    else:
        out = kernels.m_grouped(
            a, a_scale.reciprocal().squeeze(-1), b, b_scale.reciprocal().squeeze(-2), offs
        )
    return out.to(out_dtype)


def grouped_wgrad_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    backend: str = "torch",
) -> torch.Tensor:
    """Per group ``a_g^T @ grad_g``: ``a [M, K]`` and ``grad [M, N]`` with per-group scales
    ``[G, K]`` and ``[G, N]`` over each group's tokens; returns ``[G, K, N]``."""
    if emulate:
        groups = token_groups(offs, a.shape[0])
        # Each token's row is unscaled with its own group's scales; each group sums only its
        # own tokens.
        a_hp = a.float() * per_token(a_scale.reciprocal(), groups)
        grad_hp = grad.float() * per_token(grad_scale.reciprocal(), groups)
        return grouped_wgrad_mm_fp32(a_hp, grad_hp, offs).to(out_dtype)
    # Computed as (grad^T @ a)^T: grad^T is row-major and a column-major as the Triton
    # quantizer writes them, and the transposed result has the weight's own layout, so
    # autograd needs no copy to accumulate it.
    kernels = gemm_backends.kernel(backend)
    if offs.numel() == 1:
        out = kernels.dense(
            grad.t(),
            grad_scale.reciprocal().view(-1, 1),
            a,
            a_scale.reciprocal().view(1, -1),
        ).unsqueeze(0)
    else:
        out = kernels.k_grouped(
            grad.t(),
            grad_scale.reciprocal().reshape(-1),
            a,
            a_scale.reciprocal().reshape(-1),
            offs,
        )
    return out.transpose(-2, -1).to(out_dtype)
