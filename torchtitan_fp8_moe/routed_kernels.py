"""Triton kernels for the routed path's data movement (``routed_dispatch.py``), one pass each:

- ``combine(rows [P, D], positions [T, k], scores [T, k])`` -> ``[T, D]``: each token's top_k
  expert outputs, ``rows[positions[t, j]]``, weighted by its scores and summed in fp32, rounded
  once to ``rows``' dtype: torchtitan's gather, fp32 copy and batched matmul with the scores
  (``MoE.forward``), without materialising the gathered rows or their fp32 copy.
- ``combine_backward(grad [T, D], rows, positions, scores, owner [P])`` -> ``(grad_rows [P, D],
  grad_scores [T, k])``: row p of ``rows`` is (token, j) ``owner[p] = t * k + j`` (or -1: a
  padding row, gradient 0) and gets ``scores[t, j] * grad[t]``; each score gets the fp32 dot
  product of ``grad[t]`` and its row. One read of each row, no scatter.
- ``token_sum(grad_rows [P, D], positions [T, k])`` -> ``[T, D]``: each token's gradient from its
  top_k routed copies (the backward of the dispatch gather), in fp32, instead of autograd's
  sort-based accumulation into the gathered rows.
CUDA (and Triton's interpreter in the tests); the routed path runs them where its tensors are
on CUDA, torch's ops elsewhere.
"""

import torch
import triton
import triton.language as tl

from .fp8.opaque import compile_triton, launcher

BLOCK_D = 1024


@triton.jit
def _weighted_rows_kernel(
    rows_ptr,
    positions_ptr,
    scores_ptr,
    out_ptr,
    D,
    TOP_K: tl.constexpr,
    HAS_SCORES: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(positions_ptr + token * TOP_K + j).to(tl.int64)
        values = tl.load(rows_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCORES:
            values = values * tl.load(scores_ptr + token * TOP_K + j)
        acc += values
    tl.store(out_ptr + token * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(
    grad_ptr,
    rows_ptr,
    scores_ptr,
    owner_ptr,
    grad_rows_ptr,
    grad_scores_ptr,
    D,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    owner = tl.load(owner_ptr + row).to(tl.int64)
    token = tl.maximum(owner, 0) // TOP_K
    # The row's score as a one-element block: a padding row (owner -1) reads and writes none.
    owner_slot = owner + tl.arange(0, 1)
    routed_slot = owner_slot >= 0
    score = tl.sum(tl.load(scores_ptr + owner_slot, mask=routed_slot, other=0.0), axis=0)
    routed_width = tl.where(owner >= 0, D, 0)  # columns of the row that hold a gradient
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        routed = cols < routed_width
        grad = tl.load(grad_ptr + token * D + cols, mask=routed, other=0.0).to(tl.float32)
        tl.store(
            grad_rows_ptr + row * D + cols,
            (grad * score).to(grad_rows_ptr.dtype.element_ty),
            mask=mask,
        )
        values = tl.load(rows_ptr + row * D + cols, mask=routed, other=0.0)
        dot += grad * values.to(tl.float32)
    total = tl.sum(dot, axis=0) + tl.zeros([1], dtype=tl.float32)
    tl.store(grad_scores_ptr + owner_slot, total, mask=routed_slot)


def _check(rows: torch.Tensor, positions: torch.Tensor) -> None:
    if rows.dim() != 2 or positions.dim() != 2:
        raise ValueError(
            f"routed_kernels: expected rows [P, D] and positions [T, k], got "
            f"{tuple(rows.shape)} and {tuple(positions.shape)}"
        )


def _weighted_rows(rows, positions, scores) -> torch.Tensor:
    _check(rows, positions)
    rows = rows.contiguous()
    tokens, top_k = positions.shape
    width = rows.shape[1]
    out = rows.new_empty((tokens, width))
    if out.numel():
        grid = (tokens, triton.cdiv(width, BLOCK_D))
        launcher(_weighted_rows_kernel, rows)[grid](
            rows,
            positions.contiguous(),
            positions if scores is None else scores.contiguous(),
            out,
            width,
            TOP_K=top_k,
            HAS_SCORES=scores is not None,
            BLOCK_D=BLOCK_D,
        )
    return out


def _combine(rows: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    return _weighted_rows(rows, positions, scores.float())


def _token_sum(grad_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return _weighted_rows(grad_rows, positions, None)


def _combine_backward(
    grad: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scores: torch.Tensor,
    owner: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(rows, positions)
    grad, rows = grad.contiguous(), rows.contiguous()
    grad_rows = torch.empty_like(rows)
    grad_scores = torch.zeros(positions.shape, dtype=torch.float32, device=rows.device)
    if rows.numel():
        launcher(_combine_backward_kernel, rows)[(rows.shape[0],)](
            grad,
            rows,
            scores.float().contiguous(),
            owner.contiguous(),
            grad_rows,
            grad_scores,
            rows.shape[1],
            TOP_K=positions.shape[1],
            BLOCK_D=BLOCK_D,
        )
    return grad_rows, grad_scores


combine = compile_triton("routed_combine", _combine)
combine_backward = compile_triton("routed_combine_backward", _combine_backward)
token_sum = compile_triton("routed_token_sum", _token_sum)
