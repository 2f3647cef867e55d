"""Where the ~1.5 ms per forward + backward of a small routed projection goes (M=256, TP 8
shape): torch profiler over 20 calls, host and device, bf16 and float8_moe.

    python3 docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time/host_profile.py OUT.txt
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "docs/benchmarks/archive/2026-12-01-narrow-rows-tp-host-time")
from host_overhead import projection  # noqa: E402

with open(sys.argv[1], "w") as out:
    for fp8 in (False, True):
        step = projection(256, 1024, fp8)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        for sort in ("self_cpu_time_total", "self_cuda_time_total"):
            table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
            text = f"=== {'float8_moe' if fp8 else 'bf16'} sorted by {sort} (20 calls)\n{table}\n"
            print(text)
            out.write(text)
