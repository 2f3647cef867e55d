"""The auto policy on a GPU its cost model was not fit on: each weight timed there, at start-up.

``policy.py``'s coefficients come from one H200; on an H100 they convert GPT-OSS 20B's experts,
which then run slower than bf16 (docs/limitations.md). So where the GPU is not the one
the model was fit on, or under ``policy = "measure"``, the converter times each distinct expert
weight instead of estimating it. It multiplies random bf16 tokens by a random weight of the
weight's local shape and dtype, as torchtitan's experts do (``torch._grouped_mm(x,
w.bfloat16().transpose(-2, -1), offs)`` over even token groups; a FeedForward's 2D weight by
``F.linear``, under autocast where torchtitan runs it so), forward and backward, with a plain
weight and with a converted one. The gate and up projections (w1, w3) multiply the same
tokens, whose fp8 casts the two share (``fp8/cast_reuse.py``): they are timed together. A
timing is the wall time of a few calls between two
synchronizations (what a trainer that queues its kernels sees: host time where the host is the
slower), interleaved, median of ``ROUNDS``. Eager, also for a compiled run. fp8 is kept where
it saves at least ``MARGIN`` of bf16's time; closer calls stay bf16. The ranks average their
timings, so every rank converts the same weights, and if any rank times, all do (a job mixing
GPU models). A case that fails on any rank (out of memory) is left untimed (NaN) on every rank,
and the cost model decides it.
"""

import logging
import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .fp8.kernels.gemm_backends import GemmChoice
from .weight import Float8MoEWeight, WeightConfig

logger = logging.getLogger(__name__)

# The share of bf16's time fp8 must save to be kept: within it, timings of the same kernels
# differ from run to run, and bf16 is never slower than itself.
MARGIN = 0.02
ROUNDS = 3
ROUND_MS = 30.0  # each timing runs calls for about this long
MAX_CALLS = 50


@dataclass(frozen=True, order=True)
class WeightCase:
    """What is timed for a weight: the rows it multiplies per micro-batch, its local shape
    (``[E, N, K]`` grouped, ``[N, K]`` a linear's), the dtype its matmul reads it in, how
    many weights of that shape multiply the same rows side by side (w1 and w3: 2), whether
    the trainer runs a linear under bf16 autocast (torchtitan does without FSDP, TP and PP),
    and the backends of its fp8 GEMMs (``gemm_choice.py``)."""

    rows: int
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name: cases sort and pickle alike on every rank
    weights: int = 1
    autocast: bool = False
    gemm: GemmChoice = GemmChoice()


@dataclass(frozen=True)
class Timing:
    """Milliseconds per forward + backward of the matmuls of a case's weights."""

    bf16_ms: float
    fp8_ms: float

    @property
    def timed(self) -> bool:
        """False where timing failed (out of memory) on some rank."""
        return not (math.isnan(self.bf16_ms) or math.isnan(self.fp8_ms))

    @property
    def fp8_pays(self) -> bool:
        return self.bf16_ms - self.fp8_ms >= MARGIN * self.bf16_ms

    def describe(self, weights: int = 1) -> str:
        """The verdict's numbers; ``weights``: how many the case timed side by side."""
        saved = self.bf16_ms - self.fp8_ms
        timed = f"bf16 {self.bf16_ms:.2f} ms, fp8 {self.fp8_ms:.2f}"
        if weights > 1:
            timed += f" for {weights} weights on the same tokens"
        if self.fp8_pays:
            return f"measured {saved:.2f} ms faster: {timed}"
        if saved > 0:
            return f"measured only {saved:.2f} ms faster, under {MARGIN:.0%}: {timed}"
        return f"measured {self.fp8_ms - self.bf16_ms:.2f} ms slower: {timed}"


def time_cases(
    cases: set[WeightCase], config: WeightConfig, alignment: int | None, device: torch.device
) -> dict[WeightCase, Timing]:
    """Each case's bf16 and fp8 timing on ``device``, averaged over the ranks of the default
    process group. ``config``: the converted weights' (its fp8 weight cache left out: it would
    reuse one cast over the repeated calls); ``alignment``: the row multiple of the token
    groups."""
    ordered = sorted(cases)
    if _across_ranks():
        _check_same_cases_on_every_rank(ordered)
    config = replace(config, cache_fp8=False)
    # A generator of its own: the model's initialization draws from the global one next, and
    # must draw the same values as without the timing (a bf16 run's, a resumed run's).
    generator = torch.Generator(device).manual_seed(0)
    with torch.enable_grad():
        measured = [_timed_or_nan(c, config, alignment or 1, device, generator) for c in ordered]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the allocator's blocks back before the model's arrive
    if _across_ranks():
        sums = torch.tensor(measured, dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        measured = (sums / dist.get_world_size()).tolist()
    return {case: Timing(*ms) for case, ms in zip(ordered, measured, strict=True)}


def timing_device(wanted: torch.device | None) -> torch.device | None:
    """This rank's choice (its GPU, or None to estimate) made every rank's: where any rank
    times, all do, each on its current GPU. A job mixing GPU models (an H200 estimates, another
    GPU times) would otherwise leave ranks waiting in ``time_cases``'s collectives. Without
    CUDA no rank can time (a plan for CUDA made on CPUs), so none asks the others."""
    if not (_across_ranks() and torch.cuda.is_available()):
        return wanted
    gpu = torch.device("cuda", torch.cuda.current_device())
    anyone = torch.tensor([wanted is not None], dtype=torch.int32, device=gpu)
    dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
    return (wanted or gpu) if anyone.item() else None


def _across_ranks() -> bool:
    """Whether the ranks agree through collectives: not alone, and not torchtitan's dry run
    on the "fake" backend, whose collectives return nothing."""
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and dist.get_backend() != "fake"
    )


def _check_same_cases_on_every_rank(cases: list[WeightCase]) -> None:
    """Averaging needs the same cases in the same order everywhere (each rank converts the
    whole model); a rank that differs would leave the others waiting in the all-reduce. Their
    GEMM backends may differ (each rank chooses alone, ``gemm_choice.py``)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [replace(case, gemm=GemmChoice()) for case in cases])
    differing = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if differing:
        raise ValueError(
            f"float8_moe: the policy times the expert weights on every rank, but ranks "
            f"{differing} have other weight shapes than rank 0 ({every[differing[0]]} against "
            f'{every[0]}); set float8_moe.policy = "always" for this layout'
        )


def _timed_or_nan(case: WeightCase, *args) -> list[float]:
    try:
        return _time_case(case, *args)
    except Exception as e:  # noqa: BLE001 - out of memory comes as several types; no rank may stop here
        logger.warning(f"float8_moe: timing {case} failed ({e!r}); the cost model decides it")
        return [math.nan, math.nan]  # NaN survives the ranks' average: all fall back alike


def _time_case(
    case: WeightCase, config: WeightConfig, alignment: int, device, generator
) -> list[float]:
    dtype = getattr(torch, case.dtype)
    n, k = case.shape[-2:]
    # as the converter marks them
    config = replace(config, shares_input=case.weights > 1, gemm=case.gemm)

    def random(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)

    data = [random(*case.shape, dtype=dtype) / math.sqrt(k) for _ in range(case.weights)]
    weights = {
        "bf16": [nn.Parameter(d) for d in data],
        "fp8": [nn.Parameter(Float8MoEWeight(d, config)) for d in data],
    }
    if len(case.shape) == 3:
        experts = case.shape[0]
        per_group = max(alignment, case.rows // experts // alignment * alignment)
        rows = per_group * experts
        offs = torch.arange(1, experts + 1, dtype=torch.int32, device=device) * per_group

        def matmul(x, w):
            return torch._grouped_mm(x, w.bfloat16().transpose(-2, -1), offs=offs)

    else:
        rows, matmul = case.rows, F.linear
    # torchtitan's grouped experts cast the tokens to bf16; a linear gets the model's
    # activations: bf16 under autocast or FSDP's bf16, else the weight's dtype
    plain_linear = len(case.shape) == 2 and not case.autocast
    x = random(rows, k, dtype=dtype if plain_linear else torch.bfloat16).requires_grad_()
    grad = random(rows, n, dtype=x.dtype)

    def call(ws: list[nn.Parameter]) -> None:
        with torch.autocast(device.type, torch.bfloat16) if case.autocast else nullcontext():
            outs = [matmul(x, w) for w in ws]
        torch.autograd.backward(outs, [grad] * len(outs))
        x.grad = None
        for w in ws:
            w.grad = None

    def ms_per_call(ws: list[nn.Parameter], calls: int) -> float:
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call(ws)
        _synchronize(device)
        return (time.perf_counter() - start) * 1e3 / calls

    for w in weights.values():
        call(w)  # compiles the kernels
    slowest = max(ms_per_call(w, 1) for w in weights.values())
    calls = max(1, min(MAX_CALLS, math.ceil(ROUND_MS / max(slowest, 1e-3))))
    times = {name: [] for name in weights}
    for round_ in range(ROUNDS):
        order = list(weights) if round_ % 2 == 0 else list(reversed(weights))
        for name in order:
            times[name].append(ms_per_call(weights[name], calls))
    return [statistics.median(times["bf16"]), statistics.median(times["fp8"])]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
