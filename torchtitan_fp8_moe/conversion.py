"""``convert``: give a model's MoE expert weights fp8 training (rowwise or blockwise), in one call.

Either torchtitan version's converter calls it with the job's ``Float8MoESettings``; without
torchtitan's trainer, call it on any module tree before parallelizing it::

    from torchtitan_fp8_moe import Float8MoESettings, convert
    plan = convert(model, Float8MoESettings(fqns=["experts", "shared_experts"]))

It picks the expert modules whose FQN contains one of ``fqns`` (``swap.py`` says how expert
modules are recognised), swaps their weights for ``Float8MoEWeight`` and returns one
``ShardPlanRow`` per weight: how tensor, expert and FSDP parallelism will split it
(``sharding.py``).
"""

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from . import gemm_choice, routed_dispatch
from .compile_cache import key_compile_caches
from .fp8.kernels.gemm_backends import GemmChoice
from .fp8.recipes import Recipe
from .measure import Timing, WeightCase, time_cases, timing_device
from .policy import POLICIES, fp8_gain_ms, times_weights
from .settings import DEFAULT_FQNS, Float8MoESettings, fqn_entries
from .sharding import ShardPlanRow, plan_expert_weight, plan_weight, with_all_gather
from .swap import (
    compact_fqns,
    dense_feed_forwards,
    describe_non_experts,
    expert_modules,
    expert_weight_names,
    is_grouped_experts,
    num_experts,
    same_input_weights,
    swap_expert_weights,
)
from .weight import WeightConfig, fp8_kernels_available

if TYPE_CHECKING:
    from torchtitan.distributed import ParallelDims


def convert(
    model: nn.Module,
    settings: Float8MoESettings | None = None,
    *,
    emulate: bool | None = None,
    parallel_dims: "ParallelDims | None" = None,
    all_gather_dtype: torch.dtype | None = None,
    path: str | None = None,
    tokens: int | None = None,
    compiled: bool = False,
    align_token_groups: bool = True,
    time_weights: bool = True,
    **options,
) -> list[ShardPlanRow]:
    """Convert ``model``'s expert modules in place and return the shard plan of their weights.

    ``settings``: the `float8_moe` options (``settings.Float8MoESettings`` documents each; None:
    its defaults); ``options``, keywords of the same names, override them
    (``convert(model, fqns=["experts"], policy="always")``).
    ``emulate``: the fp8 path, decided: True runs fp8 numerics emulated (quantize, dequantize,
    fp32 matmul), False the CUDA kernels; None: emulated where ``settings.emulate`` is set or no
    CUDA device with fp8 tensor cores (sm89+) is present.
    ``parallel_dims``: torchtitan's ``ParallelDims`` to plan the shards for; None plans one
    device. ``all_gather_dtype``: the dtype FSDP all-gathers (its ``param_dtype``; None: the
    weight's). ``path``: the fp8 path's name in the plan (default "emulated" or "cuda").
    ``tokens``: the tokens per rank and micro-batch a deciding policy ("auto", "measure")
    decides at, eager or ``compiled``: the cost model estimates them on an H200 or without a
    GPU (``policy.py``), this GPU times them otherwise (``measure.py``). The plan row says why.
    The emulated path has no speed to gain or lose and converts every weight under any
    policy; ``time_weights=False`` never times (preflight: the launch's GPUs are not this
    machine's). ``align_token_groups``: on
    CUDA, set torchtitan 0.2.2's token-group alignment for fp8 GEMMs (torchtitan 0.3 pads the
    groups in its token dispatcher instead: ``torchtitan_v03/converter.py`` sets it up).
    The plan row names the GEMMs' backends (``gemm_choice.py``) where another than torch's could
    run; the emulated path and ``time_weights=False`` choose none.
    """
    settings = replace(settings or Float8MoESettings(), **options)
    fqns, recipe, policy, gemm_backend = (
        settings.fqns,
        settings.recipe,
        settings.policy,
        settings.gemm_backend,
    )
    if policy not in POLICIES:
        raise ValueError(f"float8_moe: policy {policy!r} is not one of {list(POLICIES)}")
    targets = select_expert_modules(model, fqns)
    if emulate is None:
        emulate = settings.emulate or not (
            torch.cuda.is_available() and fp8_kernels_available(torch.device("cuda"))
        )
    fp8_all_gather = settings.fp8_all_gather
    config = WeightConfig(recipe, emulate, settings.cache_fp8_weights, fp8_all_gather)
    fp8_recipe = config.fp8_recipe
    gemm_choice.check_option(gemm_backend, fp8_recipe)
    alignment = fp8_recipe.rules.token_group_alignment(emulate)
    choosing_gemms = not emulate and time_weights
    gemm_device = _gemm_timing_device() if choosing_gemms else None
    # The plan names the GEMMs' backends where another than torch's could run them.
    names_gemms = choosing_gemms and gemm_choice.has_choices(gemm_backend, fp8_recipe)
    path = path or ("emulated" if emulate else "cuda")
    deciding = policy != "always" and not emulate
    if deciding and not tokens:
        raise ValueError(
            f'float8_moe: policy "{policy}" decides from the tokens each rank multiplies per '
            f"micro-batch, here {tokens}: in a trainer run training.local_batch_size "
            "(parallelism.pipeline_parallel_microbatch_size under a pipeline) x "
            "training.seq_len / parallelism.context_parallel_degree; a model converted outside "
            'the trainer has none. Set float8_moe.policy = "always" to convert every selected '
            'weight (in a call to convert: policy="always", or tokens=N)'
        )
    modules = dict(model.named_modules())
    weights = []  # (module, weight name, plan row, what the policy times or estimates)
    for module_fqn, module in targets:
        kind = kind_of(module)
        rows = None  # the rows each weight multiplies per micro-batch
        if tokens:
            rows = tokens * _top_k(modules, module_fqn) if kind == "routed" else tokens
        names = expert_weight_names(module)
        side_by_side = same_input_weights(names)
        for name in names:
            fqn = f"{module_fqn}.{name}" if module_fqn else name
            param = module.get_parameter(name)
            dtype = all_gather_dtype or param.dtype
            # Under a policy, a weight kept bf16 may be split unevenly by TP, as torchtitan does
            # for any plain weight; only an fp8 weight needs equal shares.
            row = _plan_row(
                fqn, tuple(param.shape), kind, parallel_dims, dtype.itemsize, path, not deciding
            )
            row = with_all_gather(row, all_gather_dtype, fp8_all_gather, fp8_recipe)
            gemm = config.gemm
            if choosing_gemms and _fp8_fits(row, fp8_recipe):
                gemm = gemm_choice.choose(
                    gemm_backend, fp8_recipe, row.local_shape, rows, alignment, gemm_device
                )
            case = None
            if deciding:
                # w1 and w3 share their input's fp8 casts: timed together
                together = len(side_by_side) if name in side_by_side else 1
                dtype_name = str(dtype).removeprefix("torch.")
                autocast = len(row.local_shape) == 2 and _trainer_autocasts(parallel_dims)
                case = WeightCase(rows, row.local_shape, dtype_name, together, autocast, gemm)
            weights.append((module, name, row, case, gemm))
    timings = {}
    if deciding and time_weights:
        # The cost model is rowwise's on torch's GEMMs: other recipes and backends are timed.
        estimable = fp8_recipe.rules.has_cost_model and not names_gemms
        device = timing_device(_measuring_device(policy, estimable))
        if device is not None:
            cases = {case for _, _, row, case, _ in weights if _fp8_fits(row, fp8_recipe)}
            timings = time_cases(cases, config, alignment, device)
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    plan = []
    chosen: dict[nn.Module, dict[str, GemmChoice]] = {}
    for module, name, row, case, gemm in weights:
        if deciding:
            timing = timings.get(case)
            row = _decide(row, case, compiled, fp8_recipe, policy, timing)
            if timing is not None and timing.timed:
                row = replace(row, timed_on=gpu)
        if row.fp8:
            fp8_recipe.rules.check_local_shape(row.fqn, row.local_shape, row.tp_dim, emulate)
            chosen.setdefault(module, {})[name] = gemm
            if names_gemms:
                row = replace(row, path=f"{row.path}; {gemm.describe()}")
        plan.append(row)
    for module, gemms in chosen.items():
        swap_expert_weights(module, config, set(gemms), gemms)
    if align_token_groups and alignment and torch.cuda.is_available() and any(r.fp8 for r in plan):
        # torchtitan's MoE pads each expert's token group to this many rows, as the recipe's
        # CUDA kernels need.
        from torchtitan.models.moe.utils import set_token_group_alignment_size_m

        set_token_group_alignment_size_m(alignment)
    routed_dispatch.install(model, {module for _, module in targets})
    key_compile_caches(model)
    return plan


def kind_of(module: nn.Module) -> str:
    """How torchtitan parallelizes the module: "routed" grouped experts (EP splits them), a
    "grouped" [1, out, in] shared expert, or a "linear" feed-forward (both sharded like the
    dense layers)."""
    if is_grouped_experts(module):
        return "routed" if num_experts(module) > 1 else "grouped"
    return "linear"


def _plan_row(
    fqn, shape, kind: str, parallel_dims, itemsize: int, path: str, even_tp: bool = True
) -> ShardPlanRow:
    if parallel_dims is None:
        return plan_weight(fqn, shape, 1, 0, itemsize, path)
    return plan_expert_weight(fqn, shape, parallel_dims, kind, itemsize, path, even_tp)


def _top_k(modules: dict[str, nn.Module], experts_fqn: str) -> int:
    """Experts per token: the router's ``top_k`` beside the experts (torchtitan's MoE) or beside
    their parent (0.3's ``moe.routed_experts.inner_experts``), else 1."""
    fqn = experts_fqn
    for _ in range(2):
        if not fqn:
            break
        fqn = fqn.rpartition(".")[0]
        router = getattr(modules[fqn], "router", None)
        if router is not None:
            return getattr(router, "top_k", 1)
    return 1


def _decide(
    row: ShardPlanRow,
    case: WeightCase,
    compiled: bool,
    recipe: Recipe,
    policy: str,
    timing: Timing | None,
) -> ShardPlanRow:
    """``row`` with the policy's verdict for its local shape multiplied by ``case.rows``: from
    its ``timing`` on this GPU where it was timed, else (no GPU to time on, or out of its
    memory) from the cost model."""
    if row.uneven_tp:
        return replace(
            row, path=f"bf16 ({policy}: TP splits it unevenly, fp8 needs equal shares)", fp8=False
        )
    if timing is not None and timing.timed:
        if timing.fp8_pays:
            return replace(row, path=f"{row.path} ({policy}: {timing.describe(case.weights)})")
        return replace(row, path=f"bf16 ({policy}: fp8 {timing.describe(case.weights)})", fp8=False)
    if not recipe.rules.has_cost_model:
        # Not timed (no GPU): the user chose the recipe for its numerics, so it converts.
        converted = f"{row.path} ({policy}: no cost model for {recipe.name}, converted)"
        return replace(row, path=converted)
    if not _fp8_fits(row, recipe):
        unfit = f"fp8 kernels cannot multiply its local shape {list(row.local_shape)}"
        return replace(row, path=f"bf16 ({policy}: {unfit})", fp8=False)
    estimated = "est." if timing is None else "timing failed on a rank (see the log), est."
    share = 1 / row.fsdp_degree if row.all_gather == "fp8" else 1.0
    gain = fp8_gain_ms(case.rows, row.local_shape, compiled, share)
    if gain > 0:
        return replace(row, path=f"{row.path} ({policy}: {estimated} {gain:.2f} ms faster)")
    return replace(row, path=f"bf16 ({policy}: fp8 {estimated} {-gain:.2f} ms slower)", fp8=False)


def _fp8_fits(row: ShardPlanRow, recipe: Recipe) -> bool:
    """Whether the recipe's CUDA kernels take the weight's local shape (its rules'
    ``check_local_shape``) and tensor parallelism splits it evenly."""
    if row.uneven_tp:
        return False
    try:
        recipe.rules.check_local_shape(row.fqn, row.local_shape, row.tp_dim, emulate=False)
    except ValueError:
        return False
    return True


def _trainer_autocasts(parallel_dims: "ParallelDims | None") -> bool:
    """Whether torchtitan's trainer runs the model under autocast: without FSDP, TP and PP
    (``maybe_enable_amp``); a plain ``convert`` on one device is taken as that trainer's."""
    if parallel_dims is None:
        return True
    return not (parallel_dims.fsdp_enabled or parallel_dims.tp_enabled or parallel_dims.pp_enabled)


def _gemm_timing_device() -> torch.device | None:
    """The GPU gemm_backend "auto" times the GEMMs on, or None without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _measuring_device(policy: str, estimable: bool = True) -> torch.device | None:
    """The GPU a deciding ``policy`` times the weights on (``measure.py``), or None where it
    estimates them (``policy.py``; ``estimable``: the cost model covers their recipe and GEMM
    backends)."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(device)
    return device if times_weights(policy, gpu, estimable) else None


def select_expert_modules(
    model: nn.Module, fqns: Sequence[str] | str
) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of the expert modules ``convert`` converts; raises, naming what it looked
    at, when ``fqns`` is empty, an entry matches no expert module (with the defaults, one of
    them may: a model without shared experts), or an entry matches a dense feed-forward."""
    fqns = fqn_entries(fqns)
    if not fqns or any(not f for f in fqns):
        raise ValueError(
            f"float8_moe: fqns {fqns} is empty or holds an empty string, which would match "
            f"every module; name the expert modules to convert, e.g. {list(DEFAULT_FQNS)}"
        )
    dense_fqns = dense_feed_forwards(model)
    candidates = [(fqn, m) for fqn, m in expert_modules(model) if fqn not in dense_fqns]
    dense = [fqn for fqn in dense_fqns if any(f in fqn for f in fqns)]
    if dense:
        raise ValueError(
            f"float8_moe: fqns {fqns} match the dense feed-forwards {compact_fqns(dense)}, which "
            "are no MoE experts (no grouped experts beside them); float8_moe converts expert "
            "weights only. Use torchtitan's quantize.linear.float8 converter for dense layers, "
            f"and narrow fqns to the expert modules {compact_fqns([f for f, _ in candidates])}"
        )
    unmatched = [f for f in fqns if not any(f in fqn for fqn, _ in candidates)]
    if fqns == list(DEFAULT_FQNS) and len(unmatched) < len(fqns):
        # The defaults name routed and shared experts; Qwen3's and GPT-OSS's have no shared.
        unmatched = []
    if unmatched:
        raise ValueError(_no_match_message(model, fqns, unmatched, candidates))
    return [(fqn, m) for fqn, m in candidates if any(f in fqn for f in fqns)]


def _no_match_message(
    model: nn.Module, fqns: list[str], unmatched: list[str], candidates: list[tuple[str, nn.Module]]
) -> str:
    """What was looked at and which ``fqns`` entries matched nothing (``unmatched``): the expert
    modules and the entries that match each, then every other module holding parameters,
    grouped by class."""
    names = [fqn for fqn, _ in candidates]
    if len(unmatched) == len(fqns):
        fix = (
            "set float8_moe.fqns to substrings of those FQNs"
            if candidates
            else "the model has none; leave float8_moe out of model.converters for it"
        )
        header = f"float8_moe: fqns {fqns} match none of the model's expert modules {names}"
    else:
        # The other entries convert their modules: the ones meant here would stay bf16.
        fix = "every entry must match one; correct or remove it"
        header = (
            f"float8_moe: fqns entries {unmatched} of {fqns} match none of the model's expert "
            f"modules {names}"
        )
    lines = [f"{header}; {fix}. Modules looked at, by class:"]
    by_class: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for fqn, module in candidates:
        matched = tuple(f for f in fqns if f in fqn)
        by_class.setdefault((type(module).__name__, matched), []).append(fqn)
    for (cls, matched), class_fqns in by_class.items():
        match = f"matched by {list(matched)}" if matched else "FQN matches none of float8_moe.fqns"
        lines.append(
            f"  {cls} x{len(class_fqns)} ({compact_fqns(class_fqns)}): expert module, {match}"
        )
    lines += [f"  {line}" for line in describe_non_experts(model)]
    lines.append(
        "  (expert modules are: >= 2 floating 3D [E, out, in] parameters with one E and no "
        "parameter above 3D (grouped experts), or nn.Linear children w1/w2/w3 beside grouped "
        "experts (shared experts))"
    )
    return "\n".join(lines)
