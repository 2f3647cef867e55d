"""The `float8_moe` settings: ``Float8MoESettings``, each option documented once, and what
either torchtitan version's converter receives them as: a TOML string where a list is meant
(0.2.2 hands TOML values over unchecked; tyro only warns), or a Python config entry's values
(0.3)."""

import dataclasses
from dataclasses import dataclass, field

# The expert modules converted by default: Llama4's routed experts and its shared expert.
DEFAULT_FQNS = ("experts", "shared_expert")


@dataclass(frozen=True)
class Float8MoESettings:
    """The `float8_moe` options: torchtitan 0.2.2's `[float8_moe]` TOML section
    (``config.py``), torchtitan 0.3's ``Float8MoEConverter.Config`` (``torchtitan_v03/``) and
    ``convert(model, settings)`` take these fields."""

    recipe: str = "rowwise"
    """fp8 scaling recipe (float8_e4m3fn, power-of-2 scales; torchtitan_fp8_moe/fp8/recipes/).
    "rowwise": one scale per row of each GEMM operand along its contraction. "blockwise":
    activations and gradients in 1x128 tiles, weights in 128x128 blocks, the weight gradient's
    operands in 128x1 tiles of each expert's tokens: outliers spoil one block, not a whole row;
    under tensor parallelism each rank's split dim must be a multiple of 128."""

    fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FQNS))
    """Module FQN substrings whose expert weights are converted: grouped-experts modules
    (3D w1/w2/w3) and FeedForward modules (nn.Linear w1/w2/w3). The defaults match Llama4's
    routed `moe.experts` and its shared expert (`moe.shared_experts` or `moe.shared_expert`).
    A TOML string is one entry or a comma-separated list, as on the command line; spaces
    around an entry are dropped."""

    policy: str = "auto"
    """"auto": keep in bf16 the expert weights whose fp8 GEMMs, casts included, are slower
    than bf16's at this run's per-rank shapes and tokens per micro-batch: estimated by a cost
    model on an H200 (torchtitan_fp8_moe/policy.py), timed at start-up on any other GPU
    (torchtitan_fp8_moe/measure.py, a few seconds); the shard plan says each weight's verdict.
    "measure": time them on an H200 too. "always": convert every weight `fqns` selects. The
    emulated path (no CUDA, or emulate = true) converts every selected weight under any."""

    gemm_backend: str = "auto"
    """Which kernels run the fp8 GEMMs on CUDA (torchtitan_fp8_moe/fp8/kernels/gemm_backends.py).
    "auto": per weight and GEMM (forward, input gradient, weight gradient), the fastest of the
    installed backends, timed on the GPU at start-up at the run's per-rank shapes (each timed
    shape is logged, the shard plan names each weight's choice); torch's kernels alone where no
    other backend is installed. "torch": torch's `_scaled_grouped_mm` / `_scaled_mm`. "fbgemm":
    fbgemm-gpu-genai's CUTLASS kernels (`pip install fbgemm-gpu-genai==1.6.0` for torch 2.11,
    1.8.0 for torch 2.13), torch's for the grouped weight gradient, which fbgemm lacks; rowwise
    recipe only. "deepgemm": DeepGEMM's sm90 kernels (`deepinfer-gemm`, built against the running
    torch, docs/gemm_backends.md); blockwise recipe only. A named backend that is not installed
    is an error naming its install."""

    emulate: bool = False
    """Run fp8 numerics with an emulated matmul (quantize, dequantize, fp32 matmul) instead of
    fp8 kernels. Always on when no CUDA device is present; for GPUs without fp8 (before sm89)
    set it to true explicitly."""

    cache_fp8_weights: bool = False
    """Quantize each expert weight once per optimizer step and orientation, and reuse the fp8
    copies in every forward, activation-checkpoint recompute and gradient-accumulation
    micro-batch of the step. Saves the weight quantization time of all but the first use (the
    transposed-weight cast alone is a large share of it; timings in docs/benchmarks/README.md);
    costs the memory of the fp8 copies
    (about one bf16 copy of the unsharded expert weights) until the step ends. Compiled blocks
    quantize their weights inline, without it; with fp8_all_gather the shards are quantized in
    FSDP's (eager) all-gather hook, where it applies under torch.compile too."""

    fp8_all_gather: bool = False
    """Under FSDP, quantize each expert weight on its shard, before the all-gather, and gather the
    fp8 data and scales of both orientations (forward, input gradient) instead of the bf16
    values: each rank quantizes 1/FSDP-degree of the weight instead of all of it, for every
    forward and backward, with bit-identical results (every scale spans one expert's row or
    column, and FSDP splits whole experts). Costs about the bytes of the bf16 gather (more
    when the experts do not split evenly over the ranks, as FSDP2 then wants every all-gather
    input in the padded shard's shape). The gathered weight holds no high-precision values:
    any use of it other than the experts' `torch._grouped_mm` (x @ w^T) raises. Weights whose
    shards cannot quantize alone (2D FeedForward weights, FSDP on dim 1 under expert
    parallelism) gather bf16 as before; the converter's shard plan says which. With
    cache_fp8_weights the shard's payloads are quantized once per optimizer step. Works under
    compile.enable: compiled blocks take the gathered payloads as graph inputs."""


def check_setting_types(settings) -> None:
    """Raise, naming the option, its value and the type it takes, where a bool or str setting
    of the dataclass ``settings`` (``Float8MoESettings``, 0.3's converter ``Config``)
    holds a value of another type: neither version checks them (0.2.2's TOML values only make
    tyro warn; 0.3's config entries are Python), and ``emulate = "false"`` would be taken as
    true. ``fqns`` is read by ``fqn_entries``."""
    for f in dataclasses.fields(settings):
        if f.type not in (bool, str):
            continue
        value = getattr(settings, f.name)
        if isinstance(value, f.type):
            continue
        expected = (
            'a bool (true or false, unquoted: a string, even "false", reads as true)'
            if f.type is bool
            else "a str"
        )
        raise ValueError(
            f"float8_moe: {f.name} = {value!r} is of type {type(value).__name__}; {f.name} "
            f"takes {expected}"
        )


def fqn_entries(fqns) -> list[str]:
    """``fqns`` as its entries, each stripped of spaces: a list (or tuple) of strings, or one
    string, which is one entry or a comma-separated list of them, as torchtitan's command line
    reads list options (``--float8_moe.fqns=experts,shared_expert``)."""
    if isinstance(fqns, str):
        fqns = fqns.split(",")
    if not isinstance(fqns, list | tuple) or not all(isinstance(f, str) for f in fqns):
        raise ValueError(
            f"float8_moe: fqns = {fqns!r} is no list of module FQN substrings; set a list of "
            'strings or one comma-separated string, e.g. fqns = ["experts", "shared_expert"]'
        )
    return [f.strip() for f in fqns]
