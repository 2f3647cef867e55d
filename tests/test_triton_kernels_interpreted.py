"""Our Triton kernels' logic on CPU, in Triton's interpreter, against the torch rules.

The interpreter runs the kernels on CPU tensors but does not round to fp8 as a GPU does, so the
kernels write their scaled, saturated values to a float32 buffer here, and those must equal the
torch rules' values before the cast (``tests/test_cuda.py`` checks the fp8 outputs on a GPU).
The interpreter is chosen when a kernel is defined, so the checks run in a fresh process.
"""

import math
import os
import subprocess
import sys

import torch

# (tokens M, columns C, group ends): empty groups, rows past the last group, one group, a group
# shorter than a tile, columns not a multiple of the tile, M below one tile, a group over more
# than two tiles (of 256 rows).
CASES = [
    (300, 70, [0, 5, 133, 133, 290]),
    (600, 70, [1, 560, 600]),
    (256, 64, [256]),
    (40, 130, [3, 3, 3, 40]),
    (129, 1, [1, 128, 129]),
]


def _check_per_group_colwise() -> None:
    from torchtitan_fp8_moe.fp8 import gemm, torch_quantize
    from torchtitan_fp8_moe.fp8.quantize import FP8_MAX
    from torchtitan_fp8_moe.fp8.triton_per_group import cast_per_group_colwise

    torch.manual_seed(0)
    for tokens, cols, ends in CASES:
        # Columns spanning 12 orders of magnitude, so the scales differ per column and group.
        x = (torch.randn(tokens, cols) * torch.logspace(-6, 6, cols)).bfloat16()
        x[0] = 0  # an all-zero row; in CASES[2] group 0 is rows 0-2
        offs = torch.tensor(ends, dtype=torch.int32)
        values, scales = cast_per_group_colwise(x, offs, torch.float32)
        groups = gemm.token_groups(offs, tokens)
        amax = torch_quantize._amax_per_group(x, groups, offs.numel())
        want_scales = torch_quantize.scales_from_amax(amax)
        assert torch.equal(scales, want_scales), (tokens, cols, ends)
        want = (x.float() * gemm.per_token(want_scales, groups)).clamp(-FP8_MAX, FP8_MAX)
        assert torch.equal(values[: ends[-1]], want[: ends[-1]]), (tokens, cols, ends)
        assert values.stride() == (1, tokens), "column-major, as the wgrad GEMM reads it"
    # A NaN stays NaN, and only where it was.
    x = torch.ones(64, 8, dtype=torch.bfloat16)
    x[5, 3] = math.nan
    values, _ = cast_per_group_colwise(x, torch.tensor([64], dtype=torch.int32), torch.float32)
    assert values.isnan().nonzero().tolist() == [[5, 3]]


def test_per_group_colwise_kernel_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import test_triton_kernels_interpreted as t; t._check_per_group_colwise()"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
