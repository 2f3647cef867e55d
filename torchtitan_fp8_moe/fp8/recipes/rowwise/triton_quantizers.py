"""The rowwise recipe's quantizers on CUDA: the rules of ``quantize.py`` as fused Triton kernels.

Same outputs as ``torch_quantizers.py`` (fp8 data, fp32 power-of-2 multipliers), laid out the way
the fp8 GEMMs want them: activations row-major, weights column-major per expert. Our kernels
throughout (faster than torchao's, docs/benchmarks/): one-pass rowwise casts
(``kernels/triton_rowwise.py``; for rows longer than 4096 the weight's forward cast also takes
the amax of the other orientation), the single-read transposed weight cast
(``kernels/triton_transposed.py``) and the per-group casts of the weight gradient without
token-count autotuning (``kernels/triton_per_group.py``). Only rows longer than our rowwise
kernel holds in registers use torchao's kernels.
"""

import torch
from torchao.prototype.moe_training.kernels import (
    triton_fp8_colwise_3d_scale_and_cast,
    triton_fp8_rowwise_2d_scale_and_cast,
)

from ... import cast_reuse
from ...gemm import column_major
from ...kernels.triton_per_group import (
    per_group_colwise_fp8,
    per_group_colwise_fp8_pair,
    per_group_colwise_fp8_shared,
)
from ...kernels.triton_rowwise import MAX_ROW, rowwise_fp8, rowwise_fp8_with_column_amax
from ...kernels.triton_transposed import transposed_fp8
from ...opaque import compile_opaque, traced
from ...quantize import FP8_DTYPE, amax_along, rounded


def _cast_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
    if x.shape[-1] <= MAX_ROW:
        return rowwise_fp8(x)
    return triton_fp8_rowwise_2d_scale_and_cast(
        x.contiguous(), output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
    )


# The casts that w1 and w3 share (the same tokens, the same rule). Eager code keeps the first
# for the second (``cast_reuse.py``). A compiled graph cannot read that table, and a triton op's
# launches are never equal graph nodes (each has its own output buffers and constant-args
# entry), so compiled code cast the tokens once per projection. As pure custom ops, the two
# calls on the same tokens are equal nodes, which AOTAutograd's CSE merges into one. Each call
# pays the op's dispatch and Triton's Python launcher, host time a triton op does not
# (``opaque.compile_triton``), so only weights that share their input take this path
# (``WeightConfig.shares_input``). Eager calls run the kernels directly.
_shared_tokens = compile_opaque("tokens_rowwise_fp8", _cast_rows, _cast_rows)


# The forward weight cast takes the amax over N in the same read only for rows (K) longer than
# this: on an H200 it was the fastest way for rows of 5120 and 8192 (ahead of the cast and
# torch's amax), but several times slower than those two for rows of 1024-4096, the TP 2-8
# shards of w2 (timings in docs/benchmarks/README.md).
FUSED_AMAX_MIN_ROW = 4097


class RowwiseTritonQuantizers:
    """``interface.Quantizers`` on CUDA: ``RowwiseTorchQuantizers``' values, in our kernels."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, K]`` -> fp8 ``[M, K]``, scales ``[M, 1]`` (per row, over K)."""
        return _cast_rows(x)

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of tokens that another GEMM multiplies too: in eager code ``self.rows`` (so
        that wrappers of it see the call), traced the pure custom op above."""
        return _shared_tokens(x) if traced(x) else self.rows(x)

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` (column-major) -> fp8 ``[G, K, N]``, scales ``[G, 1, N]`` (over K), and
        the amax over N ``[G, K]`` that ``weight_transposed`` scales by; of ``b.to(round_to)``'s
        values (``quantize.rounded``)."""
        b = column_major(b)  # K contiguous: each [K] column of b is one row of the storage
        if b.shape[-2] > MAX_ROW:
            b = rounded(b, round_to)
            data, scales = triton_fp8_colwise_3d_scale_and_cast(
                b, output_dtype=FP8_DTYPE, round_scales_to_power_of_2=True
            )
            return data, scales, amax_along(b, dim=-1)
        b, round_to_bf16 = _in_kernel_rounding(b, round_to)
        stored = b.transpose(-2, -1)
        if b.shape[-2] >= FUSED_AMAX_MIN_ROW:
            data, scales, amax_over_n = rowwise_fp8_with_column_amax(stored, round_to_bf16)
        else:
            data, scales = rowwise_fp8(stored, round_to_bf16)
            # Rounding to nearest is monotonic and symmetric: the amax of the rounded values is
            # the rounded amax.
            amax_over_n = amax_along(b, dim=-1)
            if round_to_bf16:
                amax_over_n = amax_over_n.bfloat16().float()
        return data.transpose(-2, -1), scales.transpose(-2, -1), amax_over_n

    def weight_transposed(
        self, b: torch.Tensor, amax_over_n: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[G, K, N]`` and its amax over N -> fp8 of ``b^T [G, N, K]``, scales ``[G, 1, K]``;
        of ``b.to(round_to)``'s values."""
        b, round_to_bf16 = _in_kernel_rounding(b, round_to)
        data, scales = transposed_fp8(b, amax_over_n, round_to_bf16)
        return data, scales.unsqueeze(-2)

    def per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """Per-group scales over tokens for the weight-gradient GEMM: ``(a_fp8, a_scales [G, K],
        grad_fp8, grad_scales [G, N])``, data column-major."""
        return per_group_colwise_fp8_pair(a, grad, offs)

    def tokens_per_group_pair(self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor):
        """``per_group_pair`` where another weight gradient casts the same tokens ``a`` (w3's
        and w1's): eager keeps a's cast for it (``cast_reuse.py``), compiled code makes it one
        node (see ``tokens``)."""
        if traced(a, grad, offs):
            return (*per_group_colwise_fp8_shared(a, offs), *per_group_colwise_fp8(grad, offs))
        kept = cast_reuse.take(self.tokens_per_group_pair, a, offs)
        if kept is not None:
            return (*kept, *per_group_colwise_fp8(grad, offs))
        a_fp8, a_scales, grad_fp8, grad_scales = self.per_group_pair(a, grad, offs)
        cast_reuse.keep(self.tokens_per_group_pair, a, (offs,), (a_fp8, a_scales))
        return a_fp8, a_scales, grad_fp8, grad_scales


TRITON_QUANTIZERS = RowwiseTritonQuantizers()


def _in_kernel_rounding(b: torch.Tensor, round_to: torch.dtype | None):
    """``(b, True)`` where our kernels round b's values to ``round_to`` as they read them (fp32
    to bf16: a lazy cast's weight then needs no bf16 copy), else ``(rounded(b), False)``."""
    if round_to == torch.bfloat16 and b.dtype == torch.float32:
        return b, True
    return rounded(b, round_to), False
