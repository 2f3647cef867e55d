"""The routed path's Triton kernels (``routed_kernels.py``) in Triton's CPU interpreter against
torch's ops on the same values (the routed path's CPU branch, torchtitan's combine): the top-k
combine and its backward, and the dispatch gather's backward; top_k 1, 2 and 8, padding rows,
experts with no token, a width that is no multiple of the kernels' block. The interpreter is
chosen when a kernel is defined, so the checks run in a fresh process."""

import pytest
import torch
from harness.interpreted import run_interpreted

# (tokens, top_k, padding rows, width)
CASES = [(37, 8, 29, 1100), (64, 1, 0, 96), (5, 2, 131, 2048)]


def _routing(tokens: int, top_k: int, padding: int, width: int, seed: int):
    """Rows of an experts' output, each (token, j)'s row, each row's owner (-1: padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = tokens * top_k + padding
    order = torch.randperm(rows, generator=gen)
    positions = order[: tokens * top_k].view(tokens, top_k)
    owner = torch.full((rows,), -1, dtype=torch.int64)
    owner[positions.reshape(-1)] = torch.arange(tokens * top_k)
    values = torch.randn(rows, width, generator=gen).bfloat16()
    scores = torch.rand(tokens, top_k, generator=gen)
    grad = torch.randn(tokens, width, generator=gen).bfloat16()
    return values, positions, scores, owner, grad


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # One rounding to bf16 of the same fp32 sums, up to their order.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-6)


def _check_kernels() -> None:
    from torchtitan_fp8_moe import routed_kernels

    for seed, (tokens, top_k, padding, width) in enumerate(CASES):
        values, positions, scores, owner, grad = _routing(tokens, top_k, padding, width, seed)
        gathered = values[positions].float()  # [T, k, D]
        want = torch.bmm(scores.unsqueeze(1), gathered).squeeze(1).bfloat16()
        _close(routed_kernels.combine(values, positions, scores), want)

        grad_rows, grad_scores = routed_kernels.combine_backward(
            grad, values, positions, scores, owner
        )
        want_rows = torch.zeros_like(values)
        per_copy = (scores.unsqueeze(-1) * grad.float().unsqueeze(1)).bfloat16()
        want_rows[positions.reshape(-1)] = per_copy.reshape(-1, width)
        _close(grad_rows, want_rows)
        assert not grad_rows[owner < 0].any(), "padding rows get no gradient"
        want_scores = torch.einsum("td,tkd->tk", grad.float(), gathered)
        torch.testing.assert_close(grad_scores, want_scores, rtol=1e-4, atol=1e-4)

        want_sum = values[positions].float().sum(1).bfloat16()
        _close(routed_kernels.token_sum(values, positions), want_sum)


@pytest.mark.slow
def test_routed_kernels_equal_torchs_ops():
    run_interpreted("test_routed_kernels_interpreted", "_check_kernels")
