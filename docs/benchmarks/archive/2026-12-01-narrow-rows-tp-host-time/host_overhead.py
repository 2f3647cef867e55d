"""Host (CPU) time of one routed projection's forward + backward on the H200: bf16 against
float8_moe at a token count small enough that the GPU waits for the host (M=256), and at the TP 8
shape of M=16384 (16 experts, 5120 -> 1024). Prints wall ms per call (median of 5 timings of 20
calls each, synchronized) and a cProfile of 20 float8_moe calls (top functions by own time).

    python3 docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time/host_overhead.py OUT.json
"""

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from torchtitan_fp8_moe import Float8MoEWeight

EXPERTS, DIM = 16, 5120


def projection(tokens, hidden, fp8):
    torch.manual_seed(0)
    w = torch.randn(EXPERTS, hidden, DIM, device="cuda", dtype=torch.bfloat16) * 0.02
    w = torch.nn.Parameter(Float8MoEWeight(w, emulate=False) if fp8 else w)
    x = torch.randn(tokens, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, EXPERTS + 1, dtype=torch.int32, device="cuda") * (tokens // EXPERTS)
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None
        w.grad = None
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).backward(grad)

    return step


def wall_ms(step, calls=20):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return round(statistics.median(times), 4), round(min(times), 4), round(max(times), 4)


def main():
    rows = []
    for tokens, hidden in ((256, 1024), (16384, 1024), (16384, 8192)):
        for fp8 in (False, True):
            ms = wall_ms(projection(tokens, hidden, fp8))
            rows.append(
                {
                    "tokens": tokens,
                    "hidden": hidden,
                    "impl": "float8_moe" if fp8 else "bf16",
                    "ms": ms[0],
                    "min": ms[1],
                    "max": ms[2],
                }
            )
            print(rows[-1], flush=True)
    step = projection(256, 1024, True)
    wall_ms(step)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(35)
    print(text.getvalue())
    json.dump(
        {"rows": rows, "cprofile_top_tottime": text.getvalue()}, open(sys.argv[1], "w"), indent=1
    )


if __name__ == "__main__":
    main()
