"""Where the host time of one MoE layer call goes: cProfile over warm forward + backward calls.

    python scripts/profile_host.py [--preset scout_tp8] [--tokens 16384] [--impl float8_moe]
        [--calls 20] [--top 30] [--dry-run]

Builds the preset's layer as ``scripts/bench_presets.py`` does, converts it (bf16, float8_moe
with every weight in fp8, or float8_moe_auto), runs 5 warm-up calls, then profiles ``--calls``
calls, each followed by a synchronize, and prints the host time per call and the functions with
the most own time and the most cumulative time per call. Needs CUDA, except --dry-run (CPU, tiny
dims, emulated fp8).
"""

import argparse
import cProfile
import pstats
import time

import torch
from bench_presets import PRESETS, build_layer, convert, layer_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="scout_tp8", choices=[p.name for p in PRESETS])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--impl", default="float8_moe")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        from torchtitan_fp8_moe import cpu

        cpu.enable_moe_ops()  # torchtitan's router on CPU
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    set_token_group_alignment_size_m(16)  # fp8 grouped GEMMs want 16-row groups, as in the trainer
    shrink = 32 if args.dry_run else 1
    preset = next(p for p in PRESETS if p.name == args.preset)
    dim = layer_config(preset, shrink)["dim"]
    layer = convert(
        build_layer(preset, device, shrink), args.impl, args.dry_run, args.tokens, "eager"
    )
    x = torch.randn(1, args.tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call():
        layer(x).backward(grad)
        sync()

    for _ in range(5):
        call()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    per_call_ms = (time.perf_counter() - start) / args.calls * 1e3
    print(
        f"{args.preset} {args.tokens} tokens {args.impl}: {per_call_ms:.2f} ms per call (profiled)"
    )
    stats = pstats.Stats(profile)
    for key in ("tottime", "cumtime"):
        print(f"\n-- by {key} (seconds over {args.calls} calls) --")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
