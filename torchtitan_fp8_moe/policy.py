"""When fp8 pays: the fwd+bwd time of one expert weight in fp8 against bf16, before the run.

An fp8 expert GEMM is faster than bf16's, but each call also casts its operands to fp8 (the
activation and the output gradient per token, both again per expert group for the weight
gradient, the weight in both orientations) and runs more kernels. For a weight ``[E, N, K]``
multiplied by ``M`` rows (tokens x top_k for routed experts, tokens for shared ones), the time
fp8 saves over bf16 per micro-batch, forward and backward, is modelled as

    gain = gemm_saving * M*N*K - activation_cast * M*(N + K) - weight_cast * E*N*K - call_overhead

The saving grows with the GEMM, the activation casts with its narrow dim (fp8 pays for wide
experts, not for Scout's TP 8 shards or Qwen3-30B's 768-wide ones), the weight casts with
1 / tokens per expert. The coefficients are a least-squares fit to torchtitan's MoE layer,
forward + backward, on one H200 at the per-GPU shapes of real runs, eager and compiled apart
(``scripts/fit_policy.py`` over ``docs/benchmarks/presets/h200.json``). Over the 40 measured
cases the layer's estimate has the measured sign but for two: Scout at 8K tokens (measured
faster, estimated slower: the policy keeps its routed experts bf16) and GPT-OSS 120B at 32K (about
even; docs/benchmarks/presets/README.md).
Calibrated on an H200 with torch 2.11, at 8K-32K tokens per rank (beyond, the terms are
extrapolated linearly). On any other GPU the auto policy times each weight there instead
(``measure.py``), and so it does on an H200 for the blockwise recipe and for GEMMs on another
backend than torch's (``gemm_backend``), which the fit does not cover; ``policy = "measure"``
times every weight, ``"always"`` forces fp8.
"""

from dataclasses import dataclass

POLICIES = ("auto", "always", "measure")


@dataclass(frozen=True)
class CostModel:
    """Milliseconds per 1e12 multiply-adds saved, per 1e9 elements cast, per call."""

    gemm_saving: float
    activation_cast: float
    weight_cast: float
    call_overhead: float


# The GPU the coefficients below were fit on, as torch.cuda.get_device_name names it.
CALIBRATED_GPU = "H200"
# What the converter's log says of the fit under policy "auto" where it estimates.
CALIBRATION = (
    f"its cost model is fit on an {CALIBRATED_GPU} with torch 2.11; on other GPUs it times "
    "each weight at start-up instead"
)


def times_weights(policy: str, gpu_name: str, estimable: bool = True) -> bool:
    """Whether ``policy`` times the weights on the GPU named ``gpu_name`` rather than
    estimate them (``measure.py``). ``estimable``: the cost model covers the weights' recipe
    and GEMM backends (the rowwise recipe on torch's GEMMs, which it was fit on)."""
    if policy == "measure":
        return True
    return policy == "auto" and (not estimable or CALIBRATED_GPU not in gpu_name)


# scripts/fit_policy.py on docs/benchmarks/presets/h200.json (torch 2.11, H200, 2026-12-03).
H200 = {
    "eager": CostModel(
        gemm_saving=4.826, activation_cast=2.887, weight_cast=2.582, call_overhead=0.522
    ),
    "compiled": CostModel(
        gemm_saving=5.734, activation_cast=4.098, weight_cast=3.791, call_overhead=0.303
    ),
}


def fp8_gain_ms(
    rows: int, weight_shape: tuple[int, ...], compiled: bool, weight_cast_share: float = 1.0
) -> float:
    """Estimated ms that fp8 saves over bf16 (negative: fp8 is slower) for one micro-batch's
    forward and backward of a weight of ``weight_shape`` (``[E, N, K]`` or a linear's
    ``[N, K]``) multiplied by ``rows`` rows. ``weight_cast_share``: the part of the weight each
    rank casts (1 / FSDP degree when it all-gathers fp8 payloads cast on the shard)."""
    experts, n, k = (1, *weight_shape) if len(weight_shape) == 2 else weight_shape
    model = H200["compiled" if compiled else "eager"]
    return (
        model.gemm_saving * rows * n * k / 1e12
        - model.activation_cast * rows * (n + k) / 1e9
        - model.weight_cast * experts * n * k * weight_cast_share / 1e9
        - model.call_overhead
    )
