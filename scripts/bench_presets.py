"""torchtitan's MoE layer, forward + backward, at the per-GPU shapes of real runs: bf16, torchao
0.18's fp8 rowwise path and float8_moe (rowwise; ``float8_moe_auto``: the default policy;
``float8_moe_measure``: the policy that times each weight; ``float8_moe_blockwise``: the
blockwise recipe), eager and compiled.

    python scripts/bench_presets.py [--presets P,..] [--tokens 16384,..] [--modes eager,compiled]
        [--impls bf16,torchao,float8_moe,float8_moe_auto,float8_moe_measure,float8_moe_blockwise]
        (a float8_moe impl may name its gemm_backend: float8_moe_auto:torch, float8_moe:fbgemm,
        and run on torchtitan's own MoE forward: float8_moe_auto@stock)
        [--rounds 3]
        [--iters 10] [--label cold]
        [--budget-s S] [--profile] [--out outputs/benchmarks/presets.json] [--append]
    python scripts/bench_presets.py --list        # the presets and their per-rank shapes
    python scripts/bench_presets.py --dry-run     # CPU, tiny dims, float8_moe emulated
    python scripts/bench_presets.py --table --out FILE   # FILE's tables again, with the bounds

The layer is torchtitan's own module (``torchtitan.models.moe.MoE``: router, routed grouped
experts, FeedForward shared experts where the model has them; GPT-OSS: its ``GptOssMoE``, with
biases and the clamped SwiGLU) built from the model's registry entry (routing settings, shared
experts), at one rank's shape:
- tensor (and expert-tensor) parallelism of degree N: the experts' and the shared expert's hidden
  dim split N ways; every token on every rank;
- expert parallelism: the rank's ``num_local_experts`` experts, its tokens routed top-k among
  them (tokens * top_k rows, as the all-to-all brings on balanced routing), no collective;
  DeepSeek-V3's node-limited routing is left out (it picks among all experts).
Per preset, token count and mode the three implementations are built from one set of bf16
weights and timed in ``--rounds`` interleaved rounds (bf16, torchao, float8_moe, bf16, ...);
each number is the median over rounds:
- ``wall_ms``: host wall time of one call with the GPU idle before it and synchronized after it
  (median of ``--iters`` calls per round);
- ``pipelined_ms``: ``--iters`` calls back to back, CUDA events around them, per call (the host
  runs ahead of the GPU, as in training);
- ``host_ms``: host time until the call returns, before the synchronize (launch overhead);
- ``gpu_busy_ms``: the profiler's sum of kernel times per call, and its kernel families (fp8
  GEMMs, bf16 GEMMs, casts, ...; ``scripts/profile_summary.py``'s names);
- ``step_peak_gib``: peak memory the call allocates above what was resident before it
  (activations, gradients, fp8 copies);
- ``first_call_s``: the first call of each implementation, compilation and autotuning included
  (cold on a fresh machine; ``--label`` names the run).
torchao converts the routed experts only (its path leaves the shared expert in bf16, and wrapping
the shared expert's ``nn.Linear`` weights only adds overhead: ``bench_moe.py``'s shared_linear);
float8_moe converts routed and shared experts (the converter's default ``fqns``). fp8 needs
token groups aligned to 16, so every implementation pads to ``--align`` (16; float8_moe to
``--fp8-align`` where given). Writes JSON rows (after every case) and a PNG next to them, and
prints a table. Needs CUDA with fp8 (sm89+), except --dry-run.
"""

import argparse
import copy
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from bench_moe import _to_torchao, kernel_times, sqnr, write_json
from profile_summary import family

from torchtitan_fp8_moe.fp8 import recipe_named
from torchtitan_fp8_moe.fp8.kernels.gemm_backends import GEMM_BACKEND_OPTIONS

BLOCKWISE = recipe_named("blockwise")

# float8_moe_auto: the converter's default policy (torchtitan_fp8_moe/policy.py), which keeps in
# bf16 the weights whose fp8 GEMMs it estimates slower at the case's tokens and mode (on an H200;
# on other GPUs it times them, as float8_moe_measure does everywhere: measure.py).
# float8_moe_blockwise: every expert weight in the blockwise recipe (token groups aligned to its
# 128-token blocks).
STOCK = "@stock"  # an impl on torchtitan's own MoE forward (``split_impl``)
IMPLS = (
    "bf16",
    "torchao",
    "float8_moe",
    "float8_moe_auto",
    "float8_moe_measure",
    "float8_moe_blockwise",
)
MODES = ("eager", "compiled")
# Llama4's MoE hidden dim: 4 * 5120 * 2/3 * 1.2 split over top_k + shared = 2 experts, rounded up
# to multiple_of 2048 (torchtitan llama4 model.py, auto_scale_hidden_dim).
LLAMA4_HIDDEN = 8192


@dataclass(frozen=True)
class Preset:
    name: str
    model: str  # llama4 | deepseek_v3 | qwen3 | gpt_oss
    flavor: str  # the model registry's key
    parallel: str
    local_experts: int
    tp: int = 1  # tensor (and expert-tensor) parallel degree: hidden dims split tp ways


PRESETS = [
    Preset("scout", "llama4", "17bx16e", "FSDP only", 16),
    Preset("scout_tp8", "llama4", "17bx16e", "TP 8 x ETP 8", 16, tp=8),
    Preset("maverick_ep8", "llama4", "17bx128e", "EP 8 (16 of 128 experts)", 16),
    Preset("dsv3_671b_ep32", "deepseek_v3", "671B", "EP 32 (8 of 256)", 8),
    Preset("dsv3_671b_ep16", "deepseek_v3", "671B", "EP 16 (16 of 256)", 16),
    Preset("dsv3_671b_ep8", "deepseek_v3", "671B", "EP 8 (32 of 256)", 32),
    Preset("dsv3_16b", "deepseek_v3", "16B", "FSDP only (64 experts)", 64),
    Preset("qwen3_30b", "qwen3", "30B-A3B", "FSDP only (128 experts)", 128),
    Preset("qwen3_30b_ep8", "qwen3", "30B-A3B", "EP 8 (16 of 128)", 16),
    Preset("qwen3_235b", "qwen3", "235B-A22B", "FSDP only (128 experts)", 128),
    Preset("qwen3_235b_ep8", "qwen3", "235B-A22B", "EP 8 (16 of 128)", 16),
    Preset("gpt_oss_20b", "gpt_oss", "20b", "FSDP only (32 experts)", 32),
    Preset("gpt_oss_120b", "gpt_oss", "120b", "FSDP only (128 experts)", 128),
]
PRESET_BY_NAME = {p.name: p for p in PRESETS}


def registry_args(preset: Preset):
    """The model's args from torchtitan's registry."""
    if preset.model == "llama4":
        from torchtitan.models.llama4 import llama4_args as registry
    elif preset.model == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_args as registry
    elif preset.model == "qwen3":
        from torchtitan.models.qwen3 import qwen3_args as registry
    elif preset.model == "gpt_oss":
        from torchtitan.models.gpt_oss import gptoss_configs as registry
    else:
        raise ValueError(preset.model)
    return registry[preset.flavor]


def layer_config(preset: Preset, shrink: int = 1) -> dict:
    """One rank's layer: dims, experts, routing. ``shrink`` divides dim and hidden (dry runs)."""
    args = registry_args(preset)
    full_hidden = LLAMA4_HIDDEN if preset.model == "llama4" else args.moe_inter_dim
    if full_hidden % preset.tp:
        raise ValueError(f"{preset.name}: hidden {full_hidden} does not split {preset.tp} ways")
    moe = args.moe_args
    if preset.local_experts > moe.num_experts or preset.local_experts < moe.top_k:
        raise ValueError(f"{preset.name}: {preset.local_experts} local experts, top {moe.top_k}")
    hidden = _shrink(full_hidden // preset.tp, shrink)
    return dict(
        dim=_shrink(args.dim, shrink),
        hidden=hidden,
        experts=preset.local_experts,
        top_k=moe.top_k,
        shared_hidden=hidden * moe.num_shared_experts,
        score_func=moe.score_func,
        route_norm=moe.route_norm,
        score_before_experts=moe.score_before_experts,
        module="GptOssMoE" if preset.model == "gpt_oss" else "MoE",
    )


def _shrink(size: int, shrink: int) -> int:
    """``size / shrink`` rounded up to 16 (fp8 GEMMs want 16-byte rows)."""
    return size if shrink == 1 else -(-size // shrink // 16) * 16


def build_layer(preset: Preset, device: torch.device, shrink: int = 1) -> nn.Module:
    """torchtitan's MoE module of the preset, bf16, initialised as torchtitan does (seed 0)."""
    from torchtitan.models.moe.moe import MoE

    args = registry_args(preset)
    cfg = layer_config(preset, shrink)
    moe_args = dataclasses.replace(
        args.moe_args,
        num_experts=preset.local_experts,
        num_expert_groups=None,  # node-limited routing picks among all experts, not a rank's
        num_limited_groups=None,
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if preset.model == "gpt_oss":
                from torchtitan.models.gpt_oss.model.moe import GptOssMoE

                model_args = dataclasses.replace(args, moe_args=moe_args)
                layer = GptOssMoE(model_args, dim=cfg["dim"], hidden_dim=cfg["hidden"])
            else:
                layer = MoE(moe_args, dim=cfg["dim"], hidden_dim=cfg["hidden"])
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        layer.init_weights(0.02, device)
    return layer


def split_impl(impl: str) -> tuple[str, str | None]:
    """``(implementation, gemm_backend)`` of an ``--impls`` entry: ``float8_moe_auto:fbgemm`` is
    ``float8_moe_auto`` with ``gemm_backend = "fbgemm"``; without a suffix the package's
    default. ``@stock`` after the name (``float8_moe_auto@stock:torch``): on torchtitan's own
    MoE forward, without float8_moe's routed path (``routed_dispatch.py``)."""
    base, _, gemm_backend = impl.partition(":")
    return base.removesuffix(STOCK), gemm_backend or None


def impl_order(impl: str) -> tuple[int, bool, str]:
    base, gemm_backend = split_impl(impl)
    return IMPLS.index(base), STOCK in impl, gemm_backend or ""


def ordered_impls(rows) -> list[str]:
    return sorted({r["impl"] for r in rows}, key=impl_order)


def convert(layer: nn.Module, impl: str, emulate: bool, tokens: int, mode: str) -> nn.Module:
    stock = STOCK in impl
    impl, gemm_backend = split_impl(impl)
    gemm = {"gemm_backend": gemm_backend} if gemm_backend else {}
    if impl == "torchao":
        _to_torchao(layer.experts)  # in place
    elif impl == "float8_moe":
        import torchtitan_fp8_moe

        torchtitan_fp8_moe.convert(
            layer,
            emulate=emulate,
            policy="always",
            tokens=tokens,
            compiled=mode == "compiled",
            **gemm,
        )
    elif impl in ("float8_moe_auto", "float8_moe_measure"):
        import torchtitan_fp8_moe

        policy = impl.removeprefix("float8_moe_")
        start = time.perf_counter()
        plan = torchtitan_fp8_moe.convert(
            layer,
            emulate=emulate,
            policy=policy,
            tokens=tokens,
            compiled=mode == "compiled",
            **gemm,
        )
        seconds = time.perf_counter() - start  # where the policy times the weights: that time
        print(
            f"  {policy} policy, {tokens} tokens, {mode} ({seconds:.1f} s):",
            *{r.path for r in plan},
            flush=True,
        )
    elif impl == "float8_moe_blockwise":
        import torchtitan_fp8_moe

        torchtitan_fp8_moe.convert(
            layer,
            recipe="blockwise",
            policy="always",
            emulate=emulate,
            compiled=mode == "compiled",
            **gemm,
        )
    if stock:
        from torchtitan_fp8_moe import routed_dispatch

        routed_dispatch.uninstall(layer)
    return layer


def expert_weight(layer: nn.Module) -> nn.Parameter:
    """The routed experts' first (up) projection weight, for the weight-gradient SQNR."""
    experts = layer.experts
    return experts.mlp1_weight if hasattr(experts, "mlp1_weight") else experts.w1


def layer_flops(cfg: dict, tokens: int) -> float:
    """Matmul FLOPs of fwd + bwd: routed (tokens * top_k rows) and shared experts, router."""
    # up: w1 + w3 (GPT-OSS: mlp1, 2 * hidden wide), down: w2 (mlp2)
    routed = 2 * tokens * cfg["top_k"] * cfg["dim"] * cfg["hidden"] * 3
    shared = 2 * tokens * cfg["dim"] * cfg["shared_hidden"] * 3
    router = 2 * tokens * cfg["dim"] * cfg["experts"]
    return 3 * (routed + shared + router)


class Clock:
    """CUDA events and synchronize on GPU; the host clock alone on CPU (dry runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def events(self):
        if self.cuda:
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return None


class Case:
    """One implementation of one (preset, tokens, mode): its layer, input and step."""

    def __init__(self, base, impl, mode, x, grad, emulate, align):
        self.impl = impl
        self.align = align
        self.layer = convert(copy.deepcopy(base), impl, emulate, x.shape[0] * x.shape[1], mode)
        self.fn = self.layer
        if mode == "compiled":
            # The float8_moe converter's setting under compile.enable (pytorch/pytorch#150859).
            options = {"emulate_precision_casts": True} if impl.startswith("float8_moe") else None
            self.fn = torch.compile(self.layer, dynamic=False, options=options)
        self.x = x.detach().clone().requires_grad_()
        self.grad = grad
        self.walls, self.hosts, self.pipelined = [], [], []
        self.first_call_s = self.step_peak_gib = self.warm_ms = None
        self.outputs = self.kernels = None

    def drop_grads(self):
        self.x.grad = None
        for p in self.layer.parameters():
            p.grad = None

    def step(self):
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m

        set_token_group_alignment_size_m(self.align)  # read by the routing of each call
        out = self.fn(self.x)
        out.backward(self.grad)
        return out

    def first_call(self, clock):
        self.drop_grads()
        clock.sync()
        t0 = time.perf_counter()
        out = self.step()
        clock.sync()
        self.first_call_s = time.perf_counter() - t0
        self.outputs = (
            out.detach().float(),
            self.x.grad.detach().float(),
            _plain(expert_weight(self.layer).grad).float(),
        )
        for _ in range(2):  # warm-up
            self.drop_grads()
            self.step()
        clock.sync()
        t0 = time.perf_counter()
        self.drop_grads()
        self.step()
        clock.sync()
        self.warm_ms = (time.perf_counter() - t0) * 1e3

    def time_round(self, clock, iters):
        """One round: ``iters`` synchronized calls, then ``iters`` back to back."""
        cuda = clock.cuda
        walls, hosts = [], []
        if cuda and self.step_peak_gib is None:
            self.drop_grads()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(iters):
            self.drop_grads()
            clock.sync()
            t0 = time.perf_counter()
            self.step()
            t1 = time.perf_counter()
            clock.sync()
            t2 = time.perf_counter()
            hosts.append((t1 - t0) * 1e3)
            walls.append((t2 - t0) * 1e3)
        if cuda and self.step_peak_gib is None:
            self.step_peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
        self.walls.append(statistics.median(walls))
        self.hosts.append(statistics.median(hosts))
        events = clock.events()
        clock.sync()
        t0 = time.perf_counter()
        if events:
            events[0].record()
        for _ in range(iters):
            self.drop_grads()
            self.step()
        if events:
            events[1].record()
        clock.sync()
        elapsed = events[0].elapsed_time(events[1]) if events else (time.perf_counter() - t0) * 1e3
        self.pipelined.append(elapsed / iters)

    def profile(self, clock, iters=3):
        if not clock.cuda:
            return
        times = kernel_times(self.step, [self.x, *self.layer.parameters()], iters)
        self.kernels = {k: v for k, v in times.items() if v[0] > 0}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A gradient as a plain tensor (subclass gradients unwrapped)."""
    t = t.detach()
    if type(t) is not torch.Tensor:
        for attr in ("_data", "_tensor", "data"):
            inner = getattr(t, attr, None)
            if type(inner) is torch.Tensor:
                return inner
    return t


def kernel_family(name: str) -> str:
    """``profile_summary.family``, except that torchao's Triton casts (``_triton_fp8_*``) are
    torchao's: its per-group kernel also matches the float8_moe pattern ``_per_group_colwise``."""
    return "torchao cast" if name.startswith("_triton_fp8") else family(name)


def families(kernels: dict) -> dict:
    """GPU ms and launches per call by kernel family."""
    out: dict[str, list[float]] = {}
    for name, (ms, calls) in kernels.items():
        acc = out.setdefault(kernel_family(name), [0.0, 0.0])
        acc[0] += ms
        acc[1] += calls
    return {k: {"ms": round(v[0], 3), "launches": round(v[1], 1)} for k, v in out.items()}


def run_case(preset, tokens, mode, impls, args, device, clock) -> list[dict]:
    """The rows of one (preset, tokens, mode): one per implementation."""
    shrink = args.shrink
    cfg = layer_config(preset, shrink)
    base = build_layer(preset, device, shrink)
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (1, tokens, cfg["dim"])
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():  # how evenly the router spreads the tokens over the local experts
        _, _, counts = base.router(x.view(-1, cfg["dim"]), base.expert_bias)
    imbalance = (counts.max() / counts.float().mean()).item()
    cases, errors = {}, {}
    for impl in impls:
        try:
            fp8 = impl.startswith("float8_moe") and args.fp8_align
            align = args.fp8_align if fp8 else args.align
            if split_impl(impl)[0] == "float8_moe_blockwise":  # its GEMMs need 128-token groups
                align = max(align, BLOCKWISE.rules.token_group_alignment(emulate=False))
            case = Case(base, impl, mode, x, grad, args.dry_run, align)
            case.first_call(clock)
            cases[impl] = case
        except Exception as e:  # noqa: BLE001 - reported in the table
            errors[impl] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {preset.name} {tokens} {mode} {impl}: {errors[impl]}", flush=True)
    del base
    # calls per round and kind: about --round-ms of the slowest implementation, the same for all
    slowest = max((c.warm_ms for c in cases.values()), default=1.0)
    iters = max(args.min_iters, min(args.iters, int(args.round_ms / slowest)))
    for _ in range(args.rounds):  # bf16, torchao, float8_moe, bf16, ...: drift hits all
        for impl, case in list(cases.items()):
            try:
                case.time_round(clock, iters)
            except Exception as e:  # noqa: BLE001
                errors[impl] = f"{type(e).__name__}: {str(e)[:300]}"
                del cases[impl]
    for case in cases.values():
        case.profile(clock)
    rows = []
    flops = layer_flops(cfg, tokens)
    for impl in impls:
        row = {
            "preset": preset.name,
            "model": f"{preset.model} {preset.flavor}",
            "parallel": preset.parallel,
            "tokens": tokens,
            "mode": mode,
            "impl": impl,
            "label": args.label,
            "align": cases[impl].align if impl in cases else None,
            **cfg,
            "routed_rows": tokens * cfg["top_k"],
            "expert_load_max_over_mean": round(imbalance, 3),
            "calls_per_round": iters,
        }
        if impl in errors or impl not in cases:
            row["error"] = errors.get(impl, "not run")
            rows.append(row)
            continue
        case = cases[impl]
        wall = statistics.median(case.walls)
        row.update(
            wall_ms=round(wall, 3),
            wall_ms_rounds=[round(t, 3) for t in case.walls],
            pipelined_ms=round(statistics.median(case.pipelined), 3),
            pipelined_ms_rounds=[round(t, 3) for t in case.pipelined],
            host_ms=round(statistics.median(case.hosts), 3),
            tflops_wall=round(flops / wall / 1e9, 1),
            first_call_s=round(case.first_call_s, 2),
        )
        if case.step_peak_gib is not None:
            row["step_peak_gib"] = round(case.step_peak_gib, 2)
        if case.kernels is not None:
            busy = sum(ms for ms, _ in case.kernels.values())
            row["gpu_busy_ms"] = round(busy, 3)
            row["gpu_busy_over_wall"] = round(busy / wall, 3)
            row["kernel_launches"] = round(sum(c for _, c in case.kernels.values()), 1)
            row["families"] = families(case.kernels)
            ranked = sorted(case.kernels.items(), key=lambda kv: -kv[1][0])
            row["top_kernels_ms"] = {k[:110]: round(v[0], 3) for k, v in ranked[: args.top]}
        if "bf16" in cases and impl != "bf16":
            ref = cases["bf16"].outputs
            row["sqnr_out_dx_dw_db"] = [sqnr(r, a) for r, a in zip(ref, case.outputs, strict=True)]
        rows.append(row)
    bf16 = next((r for r in rows if r["impl"] == "bf16" and "wall_ms" in r), None)
    for row in rows:
        if bf16 and "wall_ms" in row:
            row["speedup_wall"] = round(bf16["wall_ms"] / row["wall_ms"], 3)
            row["speedup_pipelined"] = round(bf16["pipelined_ms"] / row["pipelined_ms"], 3)
            row["host_ms_over_bf16"] = round(row["host_ms"] - bf16["host_ms"], 3)
    del cases
    if clock.cuda:
        torch.cuda.empty_cache()
    if mode == "compiled":
        torch._dynamo.reset()
    return rows


def signature(preset: Preset) -> tuple:
    """Presets of equal signature build the same layer (Scout FSDP-only = Maverick EP 8)."""
    cfg = layer_config(preset)
    args = registry_args(preset)
    moe_args = dataclasses.replace(
        args.moe_args, num_experts=0, num_expert_groups=None, num_limited_groups=None
    )
    return tuple(sorted(cfg.items())), repr(moe_args), preset.model


def print_table(rows) -> None:
    impls = ordered_impls(rows)
    keys = []
    for r in rows:
        key = (r["preset"], r["tokens"], r["mode"], r["label"])
        if key not in keys:
            keys.append(key)
    print(
        f"\n{'preset':15} {'tokens':>6} {'mode':8} {'run':5} {'bf16 ms':>8}  "
        + "  ".join(f"{i + ' x':>13}" for i in impls if i != "bf16")
        + "   busy/wall "
        + "/".join(impls)
        + "   host ms "
        + "/".join(impls)
        + "   peak GiB   first s"
    )
    print("  (x: speedup of wall time per synchronized call; in brackets, back to back)")
    for key in keys:
        group = {
            r["impl"]: r for r in rows if (r["preset"], r["tokens"], r["mode"], r["label"]) == key
        }
        bf16 = group.get("bf16", {})
        cells = []
        for impl in impls:
            if impl == "bf16":
                continue
            r = group.get(impl, {})
            cells.append(
                f"{r['speedup_wall']:5.2f} ({r['speedup_pipelined']:4.2f})"
                if "speedup_wall" in r
                else f"{'fails':>13}"
            )
        busy = "/".join(_fmt(group.get(i, {}).get("gpu_busy_over_wall"), ".2f") for i in impls)
        host = "/".join(_fmt(group.get(i, {}).get("host_ms"), ".2f") for i in impls)
        peak = "/".join(_fmt(group.get(i, {}).get("step_peak_gib"), ".1f") for i in impls)
        first = "/".join(_fmt(group.get(i, {}).get("first_call_s"), ".1f") for i in impls)
        print(
            f"{key[0]:15} {key[1]:>6} {key[2]:8} {key[3]:5} {_fmt(bf16.get('wall_ms'), '8.2f')}  "
            + "  ".join(cells)
            + f"   {busy:>14}   {host:>14}   {peak:>14}   {first}"
        )
    for r in rows:
        if "error" in r:
            print(f"  {r['preset']} {r['tokens']} {r['mode']} {r['impl']}: {r['error'][:200]}")


def family_ms(row: dict, family: str) -> float:
    """GPU ms per call of one kernel family in a profiled row (0 where it ran none)."""
    return row["families"].get(family, {}).get("ms", 0.0)


def print_families(rows) -> None:
    """GPU ms per call by kernel family, for every row that was profiled."""
    names = ["fp8 GEMM", "bf16 GEMM", "float8_moe cast", "torchao cast", "copy / memset", "other"]
    print(
        f"\n{'preset':15} {'tokens':>6} {'mode':8} {'impl':10} {'busy ms':>8} {'launches':>8} "
        + " ".join(f"{n:>15}" for n in names)
    )
    for r in rows:
        if "families" not in r:
            continue
        print(
            f"{r['preset']:15} {r['tokens']:>6} {r['mode']:8} {r['impl']:10} "
            f"{r['gpu_busy_ms']:>8.2f} {r['kernel_launches']:>8.0f} "
            + " ".join(f"{family_ms(r, n):>15.3f}" for n in names)
        )


def print_bounds(rows) -> None:
    """What fp8 expert GEMMs could give each profiled layer, from its bf16 and float8_moe rows:
    the expert GEMMs' share of bf16's wall time (bf16's GEMM time less what float8_moe leaves in
    bf16, the router), the speedup if those GEMMs ran at twice bf16's speed (the H200's dense fp8
    peak) with free casts and no added host time, the speedup with float8_moe's measured fp8
    GEMMs and free casts, and the speedup measured. A target above the 2x bound is out of reach of
    any fp8 expert GEMM on this layer."""
    by_key = {(r["preset"], r["tokens"], r["mode"], r["label"], r["impl"]): r for r in rows}
    print(
        f"\n{'preset':15} {'tokens':>6} {'mode':8} {'expert GEMMs of bf16':>21} "
        f"{'bound at 2x':>11} {'measured fp8 GEMMs, free casts':>31} {'casts ms':>8} "
        f"{'measured':>8}"
    )
    for r in rows:
        if r["impl"] != "bf16" or "families" not in r:
            continue
        fp8 = by_key.get((r["preset"], r["tokens"], r["mode"], r["label"], "float8_moe"))
        if fp8 is None or "families" not in fp8:
            continue
        experts = family_ms(r, "bf16 GEMM") - family_ms(fp8, "bf16 GEMM")
        wall = r["wall_ms"]
        at_2x = wall / (wall - experts / 2)
        measured_gemms = wall / (wall - experts + family_ms(fp8, "fp8 GEMM"))
        print(
            f"{r['preset']:15} {r['tokens']:>6} {r['mode']:8} "
            f"{f'{experts:.2f} ms ({experts / wall:.0%})':>21} {at_2x:>10.2f}x "
            f"{measured_gemms:>30.2f}x {family_ms(fp8, 'float8_moe cast'):>8.2f} "
            f"{fp8['speedup_wall']:>7.2f}x"
        )


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot(rows, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "speedup_wall" in r and r["impl"] != "bf16"]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    if not modes:
        return
    labels = {m: [] for m in modes}
    for r in rows:
        key = (r["preset"], r["tokens"])
        if key not in labels[r["mode"]]:
            labels[r["mode"]].append(key)
    order = {p.name: i for i, p in enumerate(PRESETS)}
    for keys in labels.values():
        keys.sort(key=lambda k: (order.get(k[0], len(order)), k[1]))
    fig, axes = plt.subplots(
        len(modes),
        1,
        figsize=(max(8, 0.55 * max(len(v) for v in labels.values())), 4 * len(modes)),
        squeeze=False,
    )
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        keys = labels[mode]
        compared = [i for i in ordered_impls(rows) if i != "bf16"]
        for i, impl in enumerate(compared):
            values = []
            for key in keys:
                # the last run's row (warm, when both are there)
                match = [
                    r
                    for r in rows
                    if (r["preset"], r["tokens"]) == key and r["impl"] == impl and r["mode"] == mode
                ]
                values.append(match[-1]["speedup_wall"] if match else 0)
            width = 0.8 / len(compared)
            offset = (i - (len(compared) - 1) / 2) * width
            ax.bar([j + offset for j in range(len(keys))], values, width, label=impl)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(
            range(len(keys)), [f"{p}\n{t / 1024:g}K" for p, t in keys], fontsize=7, rotation=60
        )
        ax.set_ylabel("speedup vs bf16 (fwd+bwd)")
        ax.set_title(f"torchtitan MoE layer, per-GPU shapes, {mode} (0 = fails)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(p.name for p in PRESETS))
    parser.add_argument("--tokens", default="16384", help="comma-separated tokens per GPU")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--iters", type=int, default=10, help="most calls per round and kind")
    parser.add_argument("--min-iters", type=int, default=3, help="fewest calls per round, kind")
    parser.add_argument(
        "--round-ms", type=float, default=300.0, help="aim of each round's calls of one kind"
    )
    parser.add_argument(
        "--align", type=int, default=16, help="token-group row multiple (fp8 GEMMs need 16)"
    )
    parser.add_argument("--fp8-align", type=int, help="float8_moe's own (default: --align)")
    parser.add_argument("--label", default="run", help="names the run in the rows: cold, warm")
    parser.add_argument("--budget-s", type=float, default=None, help="start no case after this")
    parser.add_argument("--top", type=int, default=8, help="kernels per row in top_kernels_ms")
    parser.add_argument("--profile", action="store_true", help="print the kernel families too")
    parser.add_argument("--out", default="outputs/benchmarks/presets.json")
    parser.add_argument("--append", action="store_true", help="add to the rows already in --out")
    parser.add_argument("--list", action="store_true", help="print the presets and exit")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, dims / --shrink, float8_moe emulated"
    )
    parser.add_argument("--shrink", type=int, default=None, help="divide dim and hidden by this")
    parser.add_argument(
        "--table", action="store_true", help="print --out's tables, draw its PNG again, and exit"
    )
    args = parser.parse_args()
    if args.table:
        rows = json.loads(Path(args.out).read_text())
        print_table(rows)
        print_families(rows)
        print_bounds(rows)
        plot(rows, Path(args.out).with_suffix(".png"))
        return
    if args.list:
        for p in PRESETS:
            print(f"{p.name:15} {p.model} {p.flavor:10} {p.parallel:28} {layer_config(p)}")
        return
    presets = [PRESET_BY_NAME[n] for n in args.presets.split(",")]
    impls = args.impls.split(",")
    modes = args.modes.split(",")
    known = all(
        split_impl(i)[0] in IMPLS
        and (split_impl(i)[1] is None or i.startswith("float8_moe"))
        and split_impl(i)[1] in (None, *GEMM_BACKEND_OPTIONS)
        for i in impls
    )
    if "bf16" not in impls or not known:
        raise SystemExit(
            f"--impls: a subset of {','.join(IMPLS)} with bf16, the baseline; a float8_moe one "
            f"may name its gemm_backend after a colon, one of {','.join(GEMM_BACKEND_OPTIONS)}"
        )
    if not set(modes) <= set(MODES) or args.rounds < 1 or args.iters < 1:
        raise SystemExit("--modes: eager,compiled; --rounds, --iters: at least 1")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    if args.dry_run:
        device = torch.device("cpu")
        args.shrink = args.shrink or 64
        from torchtitan_fp8_moe import cpu

        cpu.enable_moe_ops()
        cpu.use_fp32_gemms_for_bf16()
    else:
        args.shrink = args.shrink or 1
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --dry-run)")
        device = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False
    clock = Clock(device)
    import torchao
    import triton

    import torchtitan_fp8_moe

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, torchao {torchao.__version__}, "
        f"{gpu}; torchtitan_fp8_moe from {Path(torchtitan_fp8_moe.__file__).parent}",
        flush=True,
    )
    out = Path(args.out)
    rows = json.loads(out.read_text()) if args.append and out.exists() else []
    start = time.perf_counter()
    done: dict[tuple, str] = {}
    for mode in modes:
        for tokens in tokens_list:
            for preset in presets:
                sig = (signature(preset), tokens, mode)
                if sig in done:  # the same layer as a preset already run: copy its rows
                    same = [
                        dict(
                            r,
                            preset=preset.name,
                            model=f"{preset.model} {preset.flavor}",
                            parallel=preset.parallel,
                            same_layer_as=done[sig],
                        )
                        for r in rows
                        if (r["preset"], r["tokens"], r["mode"], r["label"])
                        == (done[sig], tokens, mode, args.label)
                    ]
                    rows.extend(same)
                    write_json(rows, str(out))
                    continue
                elapsed = time.perf_counter() - start
                if args.budget_s is not None and elapsed > args.budget_s:
                    print(f"budget: {preset.name} {tokens} {mode} not run ({elapsed:.0f} s)")
                    continue
                t0 = time.perf_counter()
                new = run_case(preset, tokens, mode, impls, args, device, clock)
                done[sig] = preset.name
                rows.extend(new)
                for r in new:
                    brief = {
                        k: r.get(k)
                        for k in (
                            "preset",
                            "tokens",
                            "mode",
                            "impl",
                            "wall_ms",
                            "pipelined_ms",
                            "host_ms",
                            "gpu_busy_ms",
                            "speedup_wall",
                            "speedup_pipelined",
                            "step_peak_gib",
                            "first_call_s",
                            "sqnr_out_dx_dw_db",
                            "error",
                        )
                    }
                    print(json.dumps({k: v for k, v in brief.items() if v is not None}), flush=True)
                print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
                write_json(rows, str(out))  # after every case: a cut-off run keeps its rows
    print_table(rows)
    if args.profile:
        print_families(rows)
        print_bounds(rows)
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
