"""Per-group cast at the trainer's shapes: tiles and paths, GB/s."""

import json
import sys

import torch
from triton.testing import do_bench

import torchtitan_fp8_moe.fp8.kernels.triton_per_group as pg

T, D, H = 32768, 5120, 8192
torch.manual_seed(0)
a = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
g = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
even = torch.arange(1, 17, device="cuda", dtype=torch.int32) * (T // 16)
one = torch.tensor([T], device="cuda", dtype=torch.int32)
bytes_rw = (a.numel() + g.numel()) * 3  # read bf16 once, write fp8
rows = []


def t(name, fn):
    ms = do_bench(fn, warmup=10, rep=60)
    rows.append({"case": name, "ms": round(ms, 4), "TBps_one_read": round(bytes_rw / ms / 1e9, 2)})
    print(f"{name:50s} {ms:7.4f} ms  {bytes_rw / ms / 1e9:5.2f} TB/s", flush=True)


t(
    "baseline a,g -> fp8 (no transpose, no scale)",
    lambda: (a.to(torch.float8_e4m3fn), g.to(torch.float8_e4m3fn)),
)
t("baseline a,g transposed bf16 copy", lambda: (a.t().contiguous(), g.t().contiguous()))
ref = {k: pg.cast_per_group_colwise_pair(a, g, offs) for k, offs in (("even", even), ("one", one))}
for tile in [
    (256, 64, 8),
    (128, 64, 4),
    (128, 64, 8),
    (64, 128, 4),
    (128, 128, 8),
    (256, 128, 8),
    (64, 64, 4),
    (32, 128, 4),
    (128, 32, 4),
    (64, 256, 8),
]:
    pg.BLOCK_ROWS, pg.BLOCK_COLS, pg.NUM_WARPS = tile
    for k, offs in (("even", even), ("one", one)):
        for chunk in (None, 0) if k == "even" else (None,):
            if chunk is None and k == "even":
                label = "whole"
            else:
                label = "chunked" if k == "one" else "whole"
            if k == "even" and chunk == 0:
                continue
            out = pg.cast_per_group_colwise_pair(a, g, offs, chunk_rows=chunk)
            ok = all(
                torch.equal(
                    x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                    y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y,
                )
                for x, y in zip(out, ref[k], strict=True)
            )
            t(
                f"{k:4s} {label:7s} tile {tile} same={ok}",
                lambda offs=offs, chunk=chunk: pg.cast_per_group_colwise_pair(
                    a, g, offs, chunk_rows=chunk
                ),
            )
    # the routed case through the chunked path too
    cr = pg.chunk_rows_for(T, 1, (D + H) // pg.BLOCK_COLS)
    t(
        f"even chunked tile {tile} rows {cr}",
        lambda cr=cr: pg.cast_per_group_colwise_pair(a, g, even, chunk_rows=cr),
    )
json.dump(rows, open(sys.argv[1], "w"), indent=1)
