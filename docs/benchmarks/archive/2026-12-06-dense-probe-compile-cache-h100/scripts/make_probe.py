"""Copy of the package with the dense speed probe (wrong numerics, speed only): every grouped
forward / input-gradient fp8 GEMM runs as one dense _scaled_mm over all rows with group 0's
weight when FP8_MOE_DENSE_PROBE=1."""

import shutil
import sys

dst = sys.argv[1]
shutil.copytree(".", dst, ignore=shutil.ignore_patterns(".whl", "outputs", "gpu", ".git"))
p = f"{dst}/torchtitan_fp8_moe/fp8/recipes/rowwise.py"
s = open(p).read()
old = "    if b.shape[0] == 1:\n        # One group is a plain GEMM"
new = "    if b.shape[0] == 1 or _DENSE_PROBE:\n        # One group is a plain GEMM"
assert old in s
s = s.replace(old, new)
s = s.replace(
    "class RowwiseRecipe(Recipe):",
    "import os\n"
    '_DENSE_PROBE = os.environ.get("FP8_MOE_DENSE_PROBE") == "1"\n'
    "if _DENSE_PROBE:\n"
    '    print("DENSE_PROBE on", flush=True)\n\n\n'
    "class RowwiseRecipe(Recipe):",
    1,
)
open(p, "w").write(s)
print("probe copy at", dst)
