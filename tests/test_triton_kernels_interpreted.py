"""Our Triton kernels' logic on CPU, in Triton's interpreter, against the torch rules.

The interpreter runs the kernels on CPU tensors but does not round to fp8 as a GPU does, so the
kernels write their scaled, saturated values to a float32 buffer here, and those must equal the
torch rules' values before the cast (``tests/test_cuda.py`` checks the fp8 outputs on a GPU).
The interpreter is chosen when a kernel is defined, so the checks run in a fresh process.
"""

import math

import torch
from harness.interpreted import run_interpreted

# (tokens M, columns C, group ends): empty groups, rows past the last group, one group, a group
# shorter than a tile, columns not a multiple of the tile, M below one tile, a group over more
# than two tiles (of 256 rows), groups ending exactly at a chunk's end, an empty last group, one
# group with rows past it, only empty groups.
CASES = [
    (300, 70, [0, 5, 133, 133, 290]),
    (600, 70, [1, 560, 600]),
    (256, 64, [256]),
    (40, 130, [3, 3, 3, 40]),
    (129, 1, [1, 128, 129]),
    (1100, 65, [256, 512, 513, 1024, 1024]),
    (200, 33, [150]),  # one group, rows past it (torchtitan's padding with one local expert)
    (64, 20, [0, 0]),  # no tokens in any group
]


def _check_per_group_colwise() -> None:
    from harness.cuda_path_on_cpu import poisoned

    from torchtitan_fp8_moe.fp8 import gemm
    from torchtitan_fp8_moe.fp8.kernels.triton_per_group import (
        cast_per_group_colwise_pair,
        output_rows,
    )
    from torchtitan_fp8_moe.fp8.quantize import FP8_MAX, scales_from_amax
    from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import _amax_per_group

    def want(x, groups, num_groups):
        scales = scales_from_amax(_amax_per_group(x, groups, num_groups))
        return (x.float() * gemm.per_token(scales, groups)).clamp(-FP8_MAX, FP8_MAX), scales

    torch.manual_seed(0)
    # Memory the kernels do not write shows up as NaN.
    empty, torch.empty = torch.empty, poisoned(torch.empty)
    for tokens, cols, ends in CASES:
        # Columns spanning 12 orders of magnitude, so the scales differ per column and group.
        x = (torch.randn(tokens, cols) * torch.logspace(-6, 6, cols)).bfloat16()
        x[0] = 0  # an all-zero row; in CASES[2] group 0 is rows 0-2
        grad = (torch.randn(tokens, cols + 9) * torch.logspace(4, -4, cols + 9)).bfloat16()
        offs = torch.tensor(ends, dtype=torch.int32)
        groups = gemm.token_groups(offs, tokens)
        # Whole groups, chunks of one tile (most span groups or split one), of two, the default.
        for chunk_rows in (0, 256, 512, None):
            out = cast_per_group_colwise_pair(x, grad, offs, torch.float32, chunk_rows)
            case = (tokens, cols, ends, chunk_rows)
            for values, scales, source in ((out[0], out[1], x), (out[2], out[3], grad)):
                want_values, want_scales = want(source, groups, offs.numel())
                assert torch.equal(scales, want_scales), case
                assert torch.equal(values[: ends[-1]], want_values[: ends[-1]]), case
                # Rows of no group are zeros (a one-group weight gradient is a GEMM over all).
                assert torch.equal(values[ends[-1] :], torch.zeros_like(values[ends[-1] :]))
                # Column-major, as the wgrad GEMM reads it, rows a multiple of 16 (zeros).
                assert values.stride() == (1, output_rows(tokens)), case
    torch.empty = empty
    # A NaN stays NaN, and only where it was, whichever chunk holds it.
    x = torch.ones(600, 8, dtype=torch.bfloat16)
    x[5, 3] = x[530, 6] = math.nan
    offs = torch.tensor([600], dtype=torch.int32)
    for chunk_rows in (0, 256):
        values, _, grad_values, _ = cast_per_group_colwise_pair(
            x, x[:, :2], offs, torch.float32, chunk_rows
        )
        assert values.isnan().nonzero().tolist() == [[5, 3], [530, 6]]
        assert not grad_values.isnan().any()


# Expert weights [G, K, N]: rows (N) not a multiple of a program's rows (64), K not a power of
# 2, one group, a single row, N below one transposed tile, K long enough that a program's tile
# holds fewer rows.
WEIGHT_SHAPES = [(3, 40, 150), (1, 96, 64), (2, 5, 1), (4, 70, 33), (1, 9000, 3)]


def _weight(groups, k, n, fp32=False):
    """Stored as the expert modules hold it ([G, N, K]) and used as [G, K, N]; magnitudes over 12
    decades along both K and N, an all-zero column and row; bf16, or fp32 with values that
    bf16 cannot hold (ROUNDING_CASES in the first row)."""
    stored = (
        torch.randn(groups, n, k) * torch.logspace(-6, 6, k) * torch.logspace(3, -3, n)[:, None]
    )
    stored[:, 0] = 0
    stored[:, :, -1] = 0
    if fp32:
        cases = torch.tensor(ROUNDING_CASES[: k - 1])
        stored[:, min(1, n - 1), : cases.numel()] = cases
        assert not torch.equal(stored, stored.bfloat16().float())
    else:
        stored = stored.bfloat16()
    return stored, stored.transpose(-2, -1)


# fp32 values where rounding to bf16 (8 significant bits) is decided by ties to even, and ones
# that round up to the next power of two (an amax, so a scale, changes).
ROUNDING_CASES = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 - 2**-9, 448 - 2**-7, 3 * 2**-20]


def _check_weight_casts(round_to_bf16: bool = False) -> None:
    """With ``round_to_bf16`` the kernels read fp32 weights and must give what the rules give
    for the weights cast to bf16 (a lazy bf16 cast's quantization, ``weight/lazy_cast.py``)."""
    from torchtitan_fp8_moe.fp8.kernels.triton_rowwise import cast_rows
    from torchtitan_fp8_moe.fp8.kernels.triton_transposed import cast_transposed
    from torchtitan_fp8_moe.fp8.quantize import FP8_MAX, scales_from_amax
    from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS

    torch.manual_seed(0)
    for shape in WEIGHT_SHAPES:
        stored, operand = _weight(*shape, fp32=round_to_bf16)
        b = operand.bfloat16()  # the values the results are of
        # Forward orientation (scales over K) and the amax over N, in one pass.
        values, scales, amax_over_n = cast_rows(
            stored, column_amax=True, out_dtype=torch.float32, round_to_bf16=round_to_bf16
        )
        _, want_scales, want_amax = TORCH_QUANTIZERS.weight(b)
        assert torch.equal(scales.transpose(-2, -1), want_scales), shape
        assert torch.equal(amax_over_n, want_amax), shape
        want = (b.float() * want_scales).clamp(-FP8_MAX, FP8_MAX)
        assert torch.equal(values.transpose(-2, -1), want), shape
        # The rowwise kernel without the column amax (activations, weight rows up to 4096).
        values, scales, _ = cast_rows(
            stored, column_amax=False, out_dtype=torch.float32, round_to_bf16=round_to_bf16
        )
        assert torch.equal(scales.transpose(-2, -1), want_scales), shape
        assert torch.equal(values.transpose(-2, -1), want), shape
        # Input-gradient orientation (scales over N) from that amax, b read through its strides.
        for source in (operand, operand.contiguous()):
            values_t, scales_t = cast_transposed(
                source, amax_over_n, torch.float32, round_to_bf16=round_to_bf16
            )
            want_t_scales = scales_from_amax(want_amax).unsqueeze(-2)
            assert torch.equal(scales_t.unsqueeze(-2), want_t_scales), shape
            want_t = (b.transpose(-2, -1).float() * want_t_scales).clamp(-FP8_MAX, FP8_MAX)
            assert torch.equal(values_t, want_t), shape
            assert values_t.stride() == (shape[1] * shape[2], 1, shape[2]), "column-major"
    if round_to_bf16:
        # A NaN whose payload lies in the bits rounding drops stays NaN (not infinity); the
        # largest float32 rounds to infinity, as torch's cast does (its row's scale is 0).
        stored = torch.ones(1, 2, 8)
        stored.view(torch.int32)[0, 0, 3] = 0x7F800001
        stored[0, 1, 5] = torch.finfo(torch.float32).max
        values, scales, amax = cast_rows(stored, True, torch.float32, round_to_bf16=True)
        assert values[0, 0].isnan().nonzero().flatten().tolist() == [3]
        assert scales[0, 1] == 0
        assert amax[0, 5] == torch.inf and amax[0, 3].isnan()
        return
    # Activations: rows of [M, C], no column amax.
    x = torch.randn(5, 33).bfloat16() * torch.logspace(-4, 4, 5)[:, None].bfloat16()
    values, scales, none = cast_rows(x[None], column_amax=False, out_dtype=torch.float32)
    want_values, want_scales = TORCH_QUANTIZERS.rows(x)
    assert none is None and torch.equal(scales[0], want_scales)
    assert torch.equal(values[0], (x.float() * want_scales).clamp(-FP8_MAX, FP8_MAX))
    # A NaN stays NaN, only where it was, in both orientations; its column's amax is NaN.
    stored = torch.ones(2, 70, 8, dtype=torch.bfloat16)
    stored[1, 5, 3] = math.nan
    values, _, amax_over_n = cast_rows(stored, column_amax=True, out_dtype=torch.float32)
    assert values.isnan().nonzero().tolist() == [[1, 5, 3]]
    assert amax_over_n.isnan().nonzero().tolist() == [[1, 3]]
    values_t, _ = cast_transposed(stored.transpose(-2, -1), amax_over_n, torch.float32)
    assert values_t.isnan().nonzero().tolist() == [[1, 5, 3]]


def _run_interpreted(check: str) -> None:
    run_interpreted("test_triton_kernels_interpreted", check)


def test_per_group_colwise_kernel_in_triton_interpreter():
    _run_interpreted("_check_per_group_colwise")


def test_weight_cast_kernels_in_triton_interpreter():
    """The forward weight cast with the amax over N, and the single-read transposed cast."""
    _run_interpreted("_check_weight_casts")


def _check_weight_casts_rounding_to_bf16() -> None:
    _check_weight_casts(round_to_bf16=True)


def test_weight_casts_of_fp32_rounded_to_bf16_in_triton_interpreter():
    """A lazy bf16 cast's weight: the kernels read fp32 and quantize its bf16 values, ties to
    even and round-ups to the next power of two included."""
    _run_interpreted("_check_weight_casts_rounding_to_bf16")


def test_kernels_are_custom_ops_only_where_needed():
    """Meta and fake tensors (pipeline shape inference, torch.compile's tracing) reach our
    kernels' custom ops and get their shape rules without a launch; plain eager tensors skip the
    op's dispatch (host time) and run the implementation directly."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchtitan_fp8_moe.fp8 import gemm
    from torchtitan_fp8_moe.fp8.kernels import triton_per_group, triton_rowwise, triton_transposed
    from torchtitan_fp8_moe.fp8.quantize import FP8_DTYPE

    x = torch.empty(6, 40, device="meta", dtype=torch.bfloat16)
    data, scales = triton_rowwise.rowwise_fp8(x)
    assert (data.device.type, data.shape, data.dtype) == ("meta", (6, 40), FP8_DTYPE)
    assert scales.shape == (6, 1)
    b = torch.empty(3, 40, 24, device="meta", dtype=torch.bfloat16)
    _, _, amax = triton_rowwise.rowwise_fp8_with_column_amax(b)
    assert (amax.device.type, amax.shape) == ("meta", (3, 24))
    data_t, scales_t = triton_transposed.transposed_fp8(b, amax)
    assert (data_t.shape, scales_t.shape) == ((3, 24, 40), (3, 40))
    offs = torch.tensor([2, 6], dtype=torch.int32)
    with FakeTensorMode() as mode:
        fake_a = mode.from_tensor(torch.randn(6, 40))
        fake_grad = mode.from_tensor(torch.randn(6, 24))
        fake_offs = mode.from_tensor(offs)
        pair = triton_per_group.per_group_colwise_fp8_pair(fake_a, fake_grad, fake_offs)
    # Rows: the 6 tokens and zeros to a multiple of 16.
    assert [tuple(t.shape) for t in pair] == [(16, 40), (2, 40), (16, 24), (2, 24)]

    a, b_plain = torch.randn(6, 40), torch.randn(2, 40, 24)
    with torch.profiler.profile() as profile:
        out = gemm.grouped_mm_fp32(a, b_plain, offs)
    names = {event.key for event in profile.key_averages()}
    assert "aten::_grouped_mm" in names
    assert not any(name.startswith("torchtitan_fp8_moe::") for name in names), names
    assert torch.allclose(out[:2], a[:2] @ b_plain[0], atol=1e-5)
    assert torch.allclose(out[2:], a[2:] @ b_plain[1], atol=1e-5)
