"""torchtitan 0.2.2's MoE routed path with one gather in and one gather out, and each token
quantized once.

torchtitan's ``MoE.forward`` moves the routed tokens three times before the experts see them
(``x[token_indices // top_k]``, a copy with a zero row appended, the padding permutation) and
three times after (the un-permutation, the slice dropping the zero row, the scatter into token
order), and the first expert GEMM casts each routed copy to fp8: a token routed to top_k experts
is cast top_k times. Row scales (rowwise: one per row; blockwise: one per 128 columns of a row)
commute with row gathers, so here:
- one index, ``padded_rows``, maps each row of the experts' padded input to its token (or to an
  appended zero row for padding); one gather builds the experts' input;
- the tokens are cast once, and the same index gathers their fp8 rows and scales, which w1's
  and w3's forward GEMMs take instead of casting the gathered rows (``cast_reuse``); the same
  rows are cast by the same rule, so the experts' outputs are bit-identical to torchtitan's;
- one index, ``combine_positions``, maps each (token, k) to its row of the experts' output; one
  gather puts the outputs in token order for the top-k combine;
- on CUDA the combine (gather, fp32 weighting by the scores, sum over top_k) is one pass, and
  so is its backward; the dispatch gather's backward sums each token's top_k rows, found by
  ``combine_positions``, instead of autograd's sort-based accumulation into the gathered rows
  (``routed_kernels.py``). Elsewhere torch's ops do the same, torchtitan's combine bit for bit.
Installed by ``convert`` on each torchtitan 0.2.2 ``MoE`` whose routed experts ``fqns`` selects
(also where the policy keeps their weights bf16: the gathers gain as much) and that scores
after the experts (DeepSeek-V3, Qwen3; Llama4 scores the routed copies before the
experts, which changes their values per copy). Where the experts are sharded by tensor or
expert parallelism (DTensor weights: torchtitan's dispatch then runs an all-to-all in the
experts' hooks), or run without grouped GEMMs, each call runs torchtitan's forward.
"""

import types

import torch
import torch.nn as nn

from .fp8 import cast_reuse
from .weight import Float8MoEWeight


def padded_rows(
    token_indices_sorted: torch.Tensor, top_k: int, permuted_indices: torch.Tensor, tokens: int
) -> torch.Tensor:
    """For each row of the experts' padded input, the index of its token in ``[x; 0]``
    (``tokens`` for a padding row): torchtitan's ``x[token_indices_sorted // top_k]`` followed
    by its padding permutation (``permuted_indices``, whose padding entries point one past the
    routed rows), as one index."""
    routed = token_indices_sorted // top_k
    return torch.cat([routed, routed.new_full((1,), tokens)])[permuted_indices]


def combine_positions(token_indices_sorted: torch.Tensor, permuted_indices: torch.Tensor):
    """For each (token, k) in token order, the row of the experts' padded output that holds it:
    the inverse of the padding permutation, then of the sort by expert."""
    routed = token_indices_sorted.numel()
    padded = permuted_indices.numel()
    # Padding entries all point at ``routed``; the row they leave there is never read.
    sorted_position = permuted_indices.new_empty(routed + 1)
    sorted_position[permuted_indices] = torch.arange(
        padded, device=permuted_indices.device, dtype=permuted_indices.dtype
    )
    positions = torch.empty_like(token_indices_sorted)
    positions[token_indices_sorted] = sorted_position[:routed].to(positions.dtype)
    return positions


def gather_cast(x_ext: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, weight) -> None:
    """Cast ``x_ext``'s rows once and keep the fp8 rows and scales of ``a = x_ext[rows]`` for the
    two GEMMs that multiply ``a`` (w1, w3: ``weight`` is w1), where its recipe's token cast is
    row-local; eager only (``cast_reuse``)."""
    recipe, emulate = weight.fp8_path()
    if not recipe.token_cast_is_row_local or torch.compiler.is_compiling():
        return
    quantize = recipe.quantizers(emulate)
    with torch.no_grad():
        x_fp8, x_scale = quantize.tokens(x_ext)
        cast = (x_fp8[rows], x_scale[rows])
    cast_reuse.keep(quantize.tokens, a, (), cast, uses=2)


class _RoutedRows(torch.autograd.Function):
    """``x_ext[rows]`` for ``x_ext = [x; 0]``, differentiable in ``x``: the gradient of token t
    is the sum of the gradients of its top_k rows, ``positions[t, :]``."""

    @staticmethod
    def forward(ctx, x, x_ext, rows, positions):
        ctx.save_for_backward(positions)
        return x_ext[rows]

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        if grad.is_cuda:
            from . import routed_kernels  # Triton: CUDA only

            return routed_kernels.token_sum(grad.contiguous(), positions), None, None, None
        per_token = grad[positions].sum(1, dtype=torch.float32).to(grad.dtype)
        return per_token, None, None, None


class _Combine(torch.autograd.Function):
    """torchtitan's top-k combine of the experts' output rows: ``bmm(scores [T, 1, k],
    rows[positions].float())`` in ``rows``' dtype; ``owner``: each row's ``t * k + j``, or -1
    for a padding row."""

    @staticmethod
    def forward(ctx, rows, positions, scores, owner):
        ctx.save_for_backward(rows, positions, scores, owner)
        if rows.is_cuda:
            from . import routed_kernels

            return routed_kernels.combine(rows, positions, scores)
        weighted = torch.bmm(scores.unsqueeze(1), rows[positions].float())
        return weighted.squeeze(1).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, positions, scores, owner = ctx.saved_tensors
        if rows.is_cuda:
            from . import routed_kernels

            grad_rows, grad_scores = routed_kernels.combine_backward(
                grad, rows, positions, scores, owner
            )
        else:
            grad_fp32 = grad.float()
            grad_scores = torch.einsum("td,tkd->tk", grad_fp32, rows[positions].float())
            per_copy = scores.unsqueeze(-1) * grad_fp32.unsqueeze(1)
            grad_rows = torch.zeros_like(rows)
            grad_rows[positions.reshape(-1)] = per_copy.to(rows.dtype).reshape(-1, rows.shape[1])
        return grad_rows, None, grad_scores.to(scores.dtype), None


def _shares_input(w1, w3) -> bool:
    return (
        isinstance(w1, Float8MoEWeight)
        and isinstance(w3, Float8MoEWeight)
        and w1.config.shares_input
        and w3.config.shares_input
    )


def routed_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``MoE.forward`` (torchtitan 0.2.2) with the routed path above."""
    from torchtitan.models.moe import moe
    from torchtitan.models.moe import utils as moe_utils

    experts = self.experts
    if isinstance(experts.w1, torch.distributed.tensor.DTensor) or not experts.use_grouped_mm:
        return type(self).forward(self, x)
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    tokens, top_k = x.shape[0], self.router.top_k
    top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
    with torch.no_grad():
        self.tokens_per_expert.add_(num_tokens_per_expert)
    _, token_indices_sorted, num_tokens_per_expert = self.reorderer(
        top_scores, selected_experts_indices
    )
    # torchtitan's padding (``moe.utils._permute``) of the routed rows to the token group
    # alignment the grouped GEMMs need.
    num_local_experts = experts.w1.shape[0]
    align = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    padded_max_len = -(-(token_indices_sorted.numel() + num_local_experts * align) // align) * align
    with torch.no_grad():
        permuted_indices, padded_counts, _ = moe_utils.generate_permute_indices(
            num_tokens_per_expert, num_local_experts, 1, padded_max_len, align
        )
        rows = padded_rows(token_indices_sorted, top_k, permuted_indices, tokens)
        positions = combine_positions(token_indices_sorted, permuted_indices)
        owner = torch.full_like(rows, -1)
        owner[positions] = torch.arange(positions.numel(), device=rows.device)
        positions = positions.view(tokens, top_k)
        x_ext = torch.cat([x, x.new_zeros(1, dim)])
    routed_input = _RoutedRows.apply(x, x_ext, rows, positions)
    w1, w2, w3 = experts.w1, experts.w2, experts.w3
    run_experts = moe._run_experts_grouped_mm
    # Under torchtitan's compile.enable this function is compiled (``apply_compile``), and
    # compiled casts do not read the eager cast kept for them.
    if _shares_input(w1, w3) and not hasattr(run_experts, "__wrapped__"):
        gather_cast(x_ext, rows, routed_input, w1)
    routed_output = run_experts(w1, w2, w3, routed_input, padded_counts)
    out = self.shared_experts(x) if self.shared_experts is not None else None
    out_experts = _Combine.apply(routed_output, positions, top_scores.view(tokens, top_k), owner)
    if out is None:
        return out_experts.reshape(bs, slen, dim)
    return (out + out_experts).reshape(bs, slen, dim)


def install(model: nn.Module, selected: set[nn.Module]) -> int:
    """Give each torchtitan 0.2.2 ``MoE`` of ``model`` whose routed experts are among the
    ``selected`` expert modules (``float8_moe.fqns``: converted, or kept bf16 by the policy) and
    that scores after the experts the routed path above; returns how many."""
    try:
        from torchtitan.models.moe.moe import MoE
        from torchtitan.tools.logging import logger
    except ImportError:  # torchtitan 0.3: its MoE dispatches through token dispatchers
        return 0
    installed = 0
    for module in model.modules():
        if type(module) is not MoE or module.score_before_experts:
            continue
        if module.experts not in selected:
            continue
        module.forward = types.MethodType(routed_forward, module)
        installed += 1
    if installed:
        logger.info(
            f"float8_moe: {installed} MoE modules gather their routed tokens once each way and "
            "cast each token once for w1 and w3 (eager; torchtitan's forward where expert or "
            "tensor parallelism shards the experts)"
        )
    return installed


def uninstall(model: nn.Module) -> None:
    """torchtitan's own ``MoE.forward`` again (benchmarks compare the two)."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), types.MethodType):
            if module.__dict__["forward"].__func__ is routed_forward:
                del module.forward
