"""The blockwise recipe: activations in 1 x 128 tiles, weights in 128 x 128 blocks.

    out    [M, N] = a [M, K] @ b[g] [K, N]        a: 1x128 tiles along K; b: 128x128 blocks
    grad_a [M, K] = grad [M, N] @ b[g]^T [N, K]   grad: 1x128 along N; b: the same fp8 blocks
    grad_b[g] [K, N] = a_g^T @ grad_g             both: 128x1 tiles of g's tokens

An outlier spoils the scale of its 128-element tile or block, not of a whole row or expert
column, so the recipe keeps more precision on data with outlier blocks (tests/test_blockwise.py).
Quantizers: ``torch_quantizers.py`` (plain torch ops, any device; emulated) and
``triton_quantizers.py`` (CUDA: the same values, laid out with each GEMM's contraction dim
contiguous); planning rules: ``rules.py``. GEMMs: the exact emulation of ``fp8/gemm.py``; on
CUDA, by each GEMM's backend (``fp8/kernels/gemm_backends.py``): ``torch``, cuBLAS's blockwise
GEMMs where the GPU and shapes allow (``fp8/kernels/blockwise_cublas.py``), else the Triton
kernels of ``fp8/kernels/blockwise_gemm.py`` (the same results); ``deepgemm``, DeepGEMM's sm90
kernels (``fp8/kernels/blockwise_deepgemm.py``).
"""

from ...gemm import grouped_mm_fp32, grouped_wgrad_mm_fp32
from ...kernels import gemm_backends
from ...quantize import dequantize
from ..interface import Quantizers, Recipe
from .rules import BlockwiseRules
from .torch_quantizers import (
    BLOCK,
    TORCH_QUANTIZERS,
    expand_blocks,
    expand_tiles,
    per_block_token_scales,
    token_blocks,
)


class BlockwiseRecipe(Recipe):
    name = "blockwise"
    description = "fp8 blockwise (1x128 activations, 128x128 weights)"
    rules = BlockwiseRules()
    reads_offsets_on_host = True  # cuBLAS's GEMMs, one call per group
    gemm_backend_names = ("torch", "deepgemm")
    gemm_forms = "blockwise"
    token_cast_is_row_local = True  # 1 x 128 tiles within each row

    def quantizers(self, emulate: bool) -> Quantizers:
        if emulate:
            return TORCH_QUANTIZERS
        from .triton_quantizers import TRITON_QUANTIZERS  # Triton kernels: CUDA only

        return TRITON_QUANTIZERS

    def grouped_mm(self, a, a_scale, b, b_scale, offs, out_dtype, emulate, backend="torch"):
        """``a [M, K]`` (scales ``[M, ceil(K/128)]``) times ``b [G, K, N]`` (scales
        ``[G, ceil(K/128), ceil(N/128)]``) per group."""
        if not emulate:
            kernels = gemm_backends.kernel(backend)
            return kernels.blockwise_m_grouped(a, a_scale, b, b_scale, offs, out_dtype)
        a_hp = dequantize(a, expand_tiles(a_scale, a.shape[-1]))
        b_hp = dequantize(b, expand_blocks(b_scale, *b.shape[-2:]))
        return grouped_mm_fp32(a_hp, b_hp, offs).to(out_dtype)

    def grouped_wgrad_mm(
        self, a, a_scale, grad, grad_scale, offs, out_dtype, emulate, backend="torch"
    ):
        """Per group ``a_g^T @ grad_g`` of ``a [M, K]``, ``grad [M, N]`` with scales per
        128-token block of each group (``torch_quantizers.token_blocks``)."""
        if not emulate:
            # On CUDA every group starts at a multiple of 128 (the token group alignment of
            # ``rules.py``): the blocks are the global 128-row blocks, the first ceil(M / 128)
            # slots.
            blocks = -(-a.shape[0] // BLOCK)
            return gemm_backends.kernel(backend).blockwise_k_grouped(
                a, a_scale[:blocks], grad, grad_scale[:blocks], offs, out_dtype
            )
        blocks, _ = token_blocks(offs, a.shape[0])
        a_hp = a.float() * per_block_token_scales(a_scale.reciprocal(), blocks)
        grad_hp = grad.float() * per_block_token_scales(grad_scale.reciprocal(), blocks)
        return grouped_wgrad_mm_fp32(a_hp, grad_hp, offs).to(out_dtype)
