"""Registers and spills of our cast kernels at the tiles they launch with, for a GPU target,
without a GPU: Triton compiles each kernel to a cubin for ``--arch`` (ptxas ships with Triton) and
``cuobjdump`` reads its resource usage.

    python scripts/kernel_resources.py [--arch 90] [--width 8192] [--out FILE.json]

A kernel that spills (STACK > 0: registers stored to local memory) may run well below the
memory's speed; a tile sweep on a GPU (``scripts/bench_quantize.py``) decides, this shows which
tiles to try. Prints one row per kernel and tile: registers per thread, stack bytes per thread.
"""

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from torchtitan_fp8_moe.fp8.kernels import triton_per_group as per_group
from torchtitan_fp8_moe.fp8.kernels import triton_rowwise as rowwise
from torchtitan_fp8_moe.fp8.quantize import AMAX_FLOOR, FP8_MAX

LIMITS = {"FP8_LIMIT": FP8_MAX, "AMAX_FLOOR": AMAX_FLOOR}
ROWS_SIGNATURE = {
    "x_ptr": "*bf16",
    "out_ptr": "*fp8e4nv",
    "scale_ptr": "*fp32",
    "column_amax_ptr": "*i32",
    "n_rows": "i32",
    "n_cols": "i32",
}
PER_GROUP_SIGNATURE = {
    "a_ptr": "*bf16",
    "grad_ptr": "*bf16",
    "a_out_ptr": "*fp8e4nv",
    "grad_out_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "grad_scale_ptr": "*fp32",
    "offs_ptr": "*i32",
    "out_rows": "i32",
    "a_cols": "i32",
    "grad_cols": "i32",
    "a_col_blocks": "i32",
    "groups": "i32",
}


def resources(kernel, signature: dict, constants: dict, warps: int, arch: int) -> dict:
    """``{"registers": .., "stack": ..}`` of ``kernel`` compiled for sm_``arch``, specialized as
    a launch specializes it: pointers (torch's allocations) 16-byte aligned."""
    aligned = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind.startswith("*")
    }
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found[1]), "stack": int(found[2])}


def rows(width: int, arch: int) -> list[dict]:
    block = triton.next_power_of_2(width)
    out = []

    def add(name, kernel, signature, constants, warps):
        usage = resources(kernel, signature, {**LIMITS, **constants}, warps, arch)
        out.append({"kernel": name, "width": width, "warps": warps, **usage})

    # Activation row casts: the shipped tile.
    warps = rowwise._rows_warps(width, block, rowwise.ROWS_TILE_ROWS)
    tile = dict(TILE_ROWS=rowwise.ROWS_TILE_ROWS, ROW_TILES=rowwise.ROWS_ROW_TILES)
    flags = dict(COLUMN_AMAX=False, ROUND_TO_BF16=False)
    add("rows, shipped", rowwise._rowwise_fp8_kernel, ROWS_SIGNATURE,
        dict(BLOCK=block, **tile, **flags), warps)  # fmt: skip
    # Weight casts (rows of the stored weight, with the other orientation's amax): the shipped
    # bf16 and fp32 tiles and one-row tiles.
    for dtype, element_size, round_to_bf16 in (("bf16", 2, False), ("fp32", 4, True)):
        shipped = rowwise.weight_tile(block, element_size)
        for tile_rows, tiles in (shipped, (1, 32), (1, 64)):
            name = f"weight {dtype}, {tile_rows} x {tiles}"
            if (tile_rows, tiles) == shipped:
                name += ", shipped"
            add(name, rowwise._rowwise_fp8_kernel, {**ROWS_SIGNATURE, "x_ptr": f"*{dtype}"},
                dict(BLOCK=block, TILE_ROWS=tile_rows, ROW_TILES=tiles, COLUMN_AMAX=True,
                     ROUND_TO_BF16=round_to_bf16),
                rowwise._warps_per_tile(block, tile_rows))  # fmt: skip
    # The weight gradient's per-group casts (whole groups), the shipped tile.
    add("per-group pair, whole groups, shipped", per_group._per_group_whole_kernel,
        PER_GROUP_SIGNATURE,
        dict(BLOCK_ROWS=per_group.BLOCK_ROWS, BLOCK_COLS=per_group.BLOCK_COLS,
             DESCENDING=per_group.WHOLE_GROUP_DESCENDING),
        per_group.NUM_WARPS)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="sm_XX (90: H100 / H200)")
    parser.add_argument("--width", type=int, default=8192, help="row length (Scout: hidden)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    table = rows(args.width, args.arch)
    print(f"{'kernel':<40}{'width':>7}{'warps':>7}{'registers':>11}{'stack B':>9}")
    for r in table:
        print(f"{r['kernel']:<40}{r['width']:>7}{r['warps']:>7}{r['registers']:>11}{r['stack']:>9}")
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": args.arch, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
