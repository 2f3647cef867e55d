"""``[float8_moe] gemm_backend``: the backend (``fp8/kernels/gemm_backends.py``) of each fp8 GEMM
of a converted weight, chosen when the converter runs.

"torch", "fbgemm" and "deepgemm" name one backend for every GEMM; a form the named backend
lacks (fbgemm's weight gradient of grouped experts) runs on torch's. "auto" times, on this GPU at
start-up, each backend that loads on each of the weight's GEMMs (forward, input gradient, weight
gradient) at the rows it multiplies per micro-batch (even token groups, fp8 operands in the
layouts the recipe's quantizers write), and keeps the fastest; a backend other than torch's only
where it saves at least ``MARGIN`` of torch's time. Timings are kept per GEMM shape, so the
weights of one shape (w1 and w3, every layer) are timed once, and each timed shape is logged.
Without a GPU to time on, or without the token count, "auto" keeps torch's. Each rank chooses
alone: the backends compute the same products, rounded alike up to accumulation order.
"""

import logging
import statistics

import torch

from .fp8.kernels import gemm_backends
from .fp8.kernels.gemm_backends import GEMM_BACKEND_OPTIONS, TORCH_GEMMS, GemmChoice
from .fp8.quantize import FP8_DTYPE
from .fp8.recipes import Recipe

logger = logging.getLogger(__name__)

# The share of torch's time another backend must save to be chosen: within it, timings of the
# same kernel differ from run to run.
MARGIN = 0.02
ROUNDS = 3
CALLS = 10  # per round and backend

# (form, dims) -> {backend: ms per call}, for every GEMM shape timed in this process.
_timings: dict[tuple, dict[str, float]] = {}


def check_option(gemm_backend: str, recipe: Recipe) -> None:
    """Raise, naming the option, where ``gemm_backend`` is unknown or the recipe cannot run its
    GEMMs on it."""
    if gemm_backend not in GEMM_BACKEND_OPTIONS:
        raise ValueError(
            f"float8_moe: gemm_backend {gemm_backend!r} is not one of {list(GEMM_BACKEND_OPTIONS)}"
        )
    if gemm_backend != "auto" and gemm_backend not in recipe.gemm_backend_names:
        raise ValueError(
            f"float8_moe: recipe {recipe.name!r} runs its GEMMs on "
            f"{list(recipe.gemm_backend_names)} only, not gemm_backend = {gemm_backend!r}; set "
            'float8_moe.gemm_backend = "auto", or recipe = "rowwise"'
        )


def candidates(recipe: Recipe) -> list[str]:
    """The backends "auto" chooses among for ``recipe``: those that load here."""
    return [name for name in gemm_backends.available() if name in recipe.gemm_backend_names]


def has_choices(gemm_backend: str, recipe: Recipe) -> bool:
    """Whether ``gemm_backend`` may run a GEMM of ``recipe`` on another backend than torch's."""
    if gemm_backend == "auto":
        return len(candidates(recipe)) > 1
    return gemm_backend != "torch"


def gemms_of(weight_shape: tuple[int, ...], rows: int, recipe: Recipe) -> dict[str, tuple]:
    """The (form, dims) of each GEMM of a weight of local shape ``[E, N, K]`` (or a linear's
    ``[N, K]``) multiplied by ``rows`` rows: dense ``(M, K, N)``, m-grouped ``(M, K, N, G)``,
    k-grouped ``(P, M, Q, G)`` (``gemm_backends``' argument names); blockwise m-grouped
    ``(M, K, N, G)``, k-grouped ``(M, K, N, G)`` (``a [M, K]``, ``grad [M, N]``)."""
    groups, n, k = (1, *weight_shape) if len(weight_shape) == 2 else weight_shape
    if recipe.gemm_forms == "blockwise":
        return {
            "forward": ("blockwise_m_grouped", (rows, k, n, groups)),
            "input_grad": ("blockwise_m_grouped", (rows, n, k, groups)),
            "weight_grad": ("blockwise_k_grouped", (rows, k, n, groups)),
        }
    if groups == 1:
        return {
            "forward": ("dense", (rows, k, n)),
            "input_grad": ("dense", (rows, n, k)),
            "weight_grad": ("dense", (n, rows, k)),
        }
    return {
        "forward": ("m_grouped", (rows, k, n, groups)),
        "input_grad": ("m_grouped", (rows, n, k, groups)),
        "weight_grad": ("k_grouped", (n, rows, k, groups)),
    }


def choose(
    gemm_backend: str,
    recipe: Recipe,
    weight_shape: tuple[int, ...],
    rows: int | None,
    alignment: int | None,
    device: torch.device | None,
) -> GemmChoice:
    """The backends of a weight's GEMMs under ``gemm_backend`` (``check_option`` passed): a
    named one where it has the form (raises naming the install command where it does not
    load), else each GEMM's fastest on ``device`` at ``rows`` rows, token groups a multiple of
    ``alignment`` rows."""
    gemms = gemms_of(weight_shape, rows or 1, recipe)
    if gemm_backend != "auto":
        named = gemm_backends.backend(gemm_backend)
        return GemmChoice(
            **{
                use: named.name if form in named.forms else "torch"
                for use, (form, _) in gemms.items()
            }
        )
    names = candidates(recipe)
    if len(names) == 1 or rows is None or device is None:
        return TORCH_GEMMS
    return GemmChoice(
        **{
            use: _fastest(form, dims, names, alignment or 1, device)
            for use, (form, dims) in gemms.items()
        }
    )


def _fastest(form: str, dims: tuple, names: list[str], alignment: int, device) -> str:
    candidates = [n for n in names if form in gemm_backends.backend(n).forms]
    if len(candidates) == 1:
        return candidates[0]
    key = (form, dims, alignment)
    if key not in _timings:
        _timings[key] = _time(form, dims, candidates, alignment, device)
        timed = ", ".join(f"{name} {ms:.3f} ms" for name, ms in _timings[key].items())
        logger.info(
            f"float8_moe: gemm_backend auto, {form} GEMM {list(dims)}: {timed} per call -> "
            f"{_pick(_timings[key])}"
        )
    return _pick(_timings[key])


def _pick(times: dict[str, float]) -> str:
    """torch's, unless another backend saves ``MARGIN`` of its time (then the fastest); a
    backend that failed (no time) is never picked."""
    best = min(times, key=times.get)
    torch_ms = times["torch"]
    return best if times[best] <= (1 - MARGIN) * torch_ms else "torch"


def _operands(form: str, dims: tuple, alignment: int, device, generator) -> tuple:
    """Random fp8 operands and positive scales of one GEMM, in the layouts the recipe hands the
    backends (rowwise: ``a`` row-major, ``b`` column-major; blockwise: its CUDA quantizers'
    outputs); even token groups."""

    def fp8(*shape):
        return torch.randn(shape, device=device, generator=generator).to(FP8_DTYPE)

    def scales(*shape):
        return torch.rand(shape, device=device, generator=generator) + 0.5

    def offsets(rows: int, groups: int) -> torch.Tensor:
        per_group = max(alignment, rows // groups // alignment * alignment)
        return torch.arange(1, groups + 1, dtype=torch.int32, device=device) * per_group

    if form.startswith("blockwise_"):
        return _blockwise_operands(form, dims, offsets, device, generator)
    if form == "dense":
        m, k, n = dims
        return fp8(m, k), scales(m, 1), fp8(n, k).t(), scales(1, n)
    if form == "m_grouped":
        m, k, n, groups = dims
        b = fp8(groups, n, k).transpose(-2, -1)
        return fp8(m, k), scales(m), b, scales(groups, n), offsets(m, groups)
    p, m, q, groups = dims
    return fp8(p, m), scales(groups * p), fp8(q, m).t(), scales(groups * q), offsets(m, groups)


def _blockwise_operands(form: str, dims: tuple, offsets, device, generator) -> tuple:
    """The blockwise recipe's CUDA quantizers' outputs for random bf16 values."""
    # Triton: CUDA only
    from .fp8.recipes.blockwise.triton_quantizers import TRITON_QUANTIZERS as quantize

    def values(*shape):
        return torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16)

    m, k, n, groups = dims
    offs = offsets(m, groups)
    if form == "blockwise_m_grouped":
        a, a_scale = quantize.rows(values(m, k))
        b, b_scale, _ = quantize.weight(values(groups, n, k).transpose(-2, -1))
        return a, a_scale, b, b_scale, offs, torch.bfloat16
    a, a_scale, grad, grad_scale = quantize.per_group_pair(values(m, k), values(m, n), offs)
    tiles = -(-m // 128)
    return a, a_scale[:tiles], grad, grad_scale[:tiles], offs, torch.bfloat16


def _time(form: str, dims: tuple, names: list[str], alignment: int, device) -> dict[str, float]:
    """ms per call of each backend in ``names`` (torch's among them) on one set of operands,
    interleaved rounds, median; a backend that fails is logged and left out."""
    generator = torch.Generator(device).manual_seed(0)
    args = _operands(form, dims, alignment, device, generator)
    calls = {}
    for name in names:
        call = getattr(gemm_backends.backend(name), form)
        try:
            call(*args)  # the first call loads the kernel
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape
            if name == "torch":
                raise
            logger.info(
                f"float8_moe: gemm_backend auto, {form} GEMM {list(dims)}: {name} fails "
                f"({type(e).__name__}: {str(e)[:200]}); not used for it"
            )
            continue
        calls[name] = call
    times = {name: [] for name in calls}
    for round_ in range(ROUNDS):
        order = list(calls) if round_ % 2 == 0 else list(reversed(calls))
        for name in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                calls[name](*args)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / CALLS)
    del args
    torch.cuda.empty_cache()
    return {name: statistics.median(ms) for name, ms in times.items()}
