"""What the `float8_moe` converter of either torchtitan version decides and checks from a run's
settings before converting: the fp8 path, the data parallelism it can train under, compile
settings, and its log line. Plain values in, no torchtitan config objects, so 0.2.2's
``converter.py`` and 0.3's ``torchtitan_v03/converter.py`` share it."""

import torch
import torch._inductor.config
from torchtitan.tools.logging import logger

from .fp8.recipes import recipe_named
from .policy import CALIBRATION
from .settings import Float8MoESettings
from .sharding import ShardPlanRow, format_plan
from .weight import fp8_kernels_available


def choose_fp8_path(emulate: bool, plan_target: str | None) -> tuple[bool, str, str]:
    """(emulate, path, why) of a run on this machine (``plan_target`` None) or planned for
    "cuda" / "cpu" elsewhere (preflight: the GPUs' fp8 support is not checked there)."""
    on_cuda = torch.cuda.is_available() if plan_target is None else plan_target == "cuda"
    if emulate or not on_cuda:
        return True, "emulated", "emulate = true" if emulate else "no CUDA device"
    if plan_target == "cuda":
        return False, "cuda", "planned for CUDA, fp8 support of the GPUs not checked"
    device = torch.device("cuda", torch.cuda.current_device())
    if fp8_kernels_available(device):
        return False, "cuda", f"fp8 tensor cores, {torch.cuda.get_device_name(device)}"
    raise ValueError(
        "float8_moe: this GPU has no fp8 tensor cores (they need sm89+); set "
        "`[float8_moe] emulate = true` to train with emulated fp8 numerics"
    )


def tokens_per_microbatch(
    local_batch_size: int, seq_len: int, microbatch_size: int, pp: int, cp: int
) -> int:
    """The tokens each rank's experts multiply per forward: a pipeline runs micro-batches of
    pipeline_parallel_microbatch_size sequences; CP splits the sequence. Raises, naming the
    option, for a size below 1, on which the launch fails (in bf16 too)."""
    sizes = {"training.local_batch_size": local_batch_size, "training.seq_len": seq_len}
    if pp > 1:  # read only by pipeline parallelism
        sizes["parallelism.pipeline_parallel_microbatch_size"] = microbatch_size
    for option, size in sizes.items():
        if size < 1:
            what, failure = _SIZES[option]
            raise ValueError(
                f"{option} = {size} must be at least 1 ({what}): torchtitan fails on it "
                f"{failure(size)}, in bf16 too; set it to a positive value"
            )
    return (microbatch_size if pp > 1 else local_batch_size) * seq_len // cp


# What each size counts, and where a launch fails on one below 1 that no check stops first
# (torchtitan 0.2.2 and torch 2.13; float8_moe's converters stop it before).
_SIZES = {
    "training.local_batch_size": (
        "sequences per rank and step",
        lambda size: (
            "building its data loader (torch's DataLoader: \"batch_size should be a positive "
            f'integer value, but got batch_size={size}")'
        ),
    ),
    "training.seq_len": (
        "tokens per sequence",
        lambda size: (
            'at step 1 ("cannot reshape tensor of 0 elements ...")'
            if size == 0
            else "building the model (its rotary table's torch.arange: \"upper bound and lower "
            'bound inconsistent with step sign")'
        ),
    ),
    "parallelism.pipeline_parallel_microbatch_size": (
        "sequences per pipeline micro-batch",
        lambda size: (
            "at start-up, dividing training.local_batch_size by it "
            + ('("integer modulo by zero")' if size == 0 else "into negative microbatches")
        ),
    ),
}


def check_fp8_all_gather_dtype(fp8_all_gather: bool, all_gather_dtype, param_dtype_name: str):
    """fp8_all_gather quantizes the shards in FSDP's param dtype; the experts need bf16."""
    if fp8_all_gather and all_gather_dtype not in (None, torch.bfloat16):
        # torchtitan's experts cast the weights to bf16, which needs the values.
        raise ValueError(
            "float8_moe: fp8_all_gather = true quantizes the shards in "
            f"training.mixed_precision_param, here {param_dtype_name}, but torchtitan's "
            "experts multiply the weights cast to bfloat16. Set "
            'training.mixed_precision_param = "bfloat16" or `[float8_moe] fp8_all_gather = '
            "false`."
        )


def check_cpu_context_parallelism(parallel_dims) -> None:
    """torch's context parallelism handles the CUDA attention kernels only (bf16 too)."""
    if parallel_dims.cp > 1:
        raise ValueError(
            f"parallelism.context_parallel_degree = {parallel_dims.cp} fails on CPU at step 1, "
            "in bf16 too: torch's context parallelism has no rule for the CPU attention kernel "
            '("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have '
            'a sharding strategy registered"). Set it to 1 on CPU'
        )


def check_data_parallelism(parallel_dims) -> None:
    """Replicas without FSDP are torch's DDP, which broadcasts the weights at its first forward
    with ``aten.cat``, an op a converted weight refuses rather than leave fp8."""
    dims = parallel_dims
    if dims.dp_replicate_enabled and not dims.fsdp_enabled and not dims.ep_enabled:
        raise ValueError(
            f"float8_moe: parallelism.data_parallel_replicate_degree = {dims.dp_replicate} "
            "without FSDP (data_parallel_shard_degree 1) is DDP, which fails at step 1 with "
            'converted weights: it broadcasts them with aten.cat ("float8_moe: aten.cat.default '
            'on converted weights ... does not know this op"). Shard with FSDP instead: '
            "data_parallel_shard_degree > 1 (HSDP with data_parallel_replicate_degree)."
        )


def describe_policy(policy: str, path: str, plan: list[ShardPlanRow]) -> str:
    """The policy as the logs name it, with how it decided the ``plan``'s weights on CUDA: timed
    on this GPU (``measure.py``), or estimated by a cost model fit on one GPU (``policy.py``)."""
    if path != "cuda" or policy == "always":
        return f"policy {policy}"
    timed_on = next((row.timed_on for row in plan if row.timed_on), None)
    if timed_on:
        return f"policy {policy} (each weight timed on this {timed_on} at start-up)"
    if policy == "auto":
        return f"policy auto ({CALIBRATION})"
    return (
        f"policy {policy} (each weight timed on the GPU at launch; the verdicts below are the "
        "cost model's estimates)"
    )


def describe_weight_cache(plan: list[ShardPlanRow], cache_fp8_weights: bool, compiled: bool) -> str:
    """What ``cache_fp8_weights`` does in this run. Compiled blocks (``compiled``: the model
    under torch.compile) quantize their weights inline, bypassing the cache (``weight/tensor.py``,
    ``_cached_quantizer``); only the shards an fp8 all-gather quantizes, in FSDP's eager hook
    (plan rows gathering "fp8"), still reuse their fp8 copies."""
    if not cache_fp8_weights:
        return "fp8 weight cache off"
    if not compiled:
        return "fp8 weight cache on"
    fp8_rows = [row for row in plan if row.fp8]
    gathered = sum(row.all_gather == "fp8" for row in fp8_rows)
    if gathered == 0:
        return (
            "fp8 weight cache off (torch.compile: compiled blocks quantize their weights "
            "inline, without it; it applies to shards gathered with fp8_all_gather only)"
        )
    if gathered == len(fp8_rows):
        return (
            "fp8 weight cache on (torch.compile: for the shards fp8_all_gather quantizes in "
            "FSDP's eager all-gather hook, every fp8 weight here)"
        )
    return (
        f"fp8 weight cache on for {gathered} of {len(fp8_rows)} fp8 weights (torch.compile: "
        "only the shards fp8_all_gather quantizes in FSDP's eager all-gather hook use it; "
        "compiled blocks quantize the others inline)"
    )


def conversion_message(
    plan: list[ShardPlanRow],
    modules: int,
    settings: Float8MoESettings,
    path: str,
    path_reason: str,
    tokens: int | None,
    compiled: bool = False,
) -> tuple[bool, str]:
    """(warn, text) of the converter's log line: how many weights went fp8, and the plan;
    ``compiled``: the model runs under torch.compile (``describe_weight_cache``)."""
    fp8_rows = [row for row in plan if row.fp8]
    kept = len(plan) - len(fp8_rows)
    policy = settings.policy
    text = (
        f"float8_moe: converted {len(fp8_rows)} expert weights of {modules} modules to "
        f"{recipe_named(settings.recipe).description}, {path} path ({path_reason}), "
        f"{describe_policy(policy, path, plan)}"
        + (
            f" (kept {kept} in bf16 at {tokens} tokens per rank and micro-batch, the plan says "
            'why; policy = "always" forces fp8)'
            if kept
            else ""
        )
        # The emulated path runs no kernels.
        + (f", GEMM backend {settings.gemm_backend}" if path == "cuda" else "")
        + f", {describe_weight_cache(plan, settings.cache_fp8_weights, compiled)}, "
        f"fp8 all-gather {'on' if settings.fp8_all_gather else 'off'}; FSDP shard plan:\n"
        + format_plan(plan)
    )
    return not fp8_rows, text


def disable_compile_caches_for_tensor_parallelism() -> None:
    """A compiled graph loaded from torch's on-disk caches names tensor-parallel process groups
    of the run that wrote it (pytorch/pytorch#176532; seen on CPU with torch 2.13, in bf16 too):
    the second launch of the same command fails with "Could not resolve the process group
    registered under the name N", or trains on wrong losses without a word (the loss compiled
    alone: 3.9 instead of 8.1, tests/test_train_parallel.py). Compile from scratch instead."""
    import torch._functorch.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    logger.warning(
        "float8_moe: tensor parallelism with compile.enable: torch's on-disk compile caches "
        "(FX graph, AOTAutograd) are off for this run; a cached graph names the process groups "
        "of the run that wrote it, and the next run fails or trains wrong (pytorch/pytorch#176532)"
    )
