"""Differentiable fp8 grouped matmul, and the three call forms built on it.

Forward, input gradient and weight gradient are fp8 GEMMs whose operands a recipe
(``recipes/``) quantizes and multiplies:

    out    [M, N] = a [M, K] @ b[g] [K, N]
    grad_a [M, K] = grad [M, N] @ b[g]^T [N, K]
    grad_b[g] [K, N] = a_g^T @ grad_g

A 3D x 3D batched matmul is the same thing with one group per batch entry, and a 2D matmul with a
2D weight is one group; so every expert, routed or shared, grouped or linear, has the same numerics.
"""

import torch

from . import cast_reuse, host_offsets
from .kernels.gemm_backends import TORCH_GEMMS, GemmChoice
from .recipes import Quantizers, Recipe
from .weight_cache import WeightPayloads, WeightQuantizer

# Where the GEMM gets its weight's fp8 copies: it quantizes b itself (None), a quantizer hands
# them out while b is unchanged (``weight_cache.py``), or they came with b.
WeightSource = WeightQuantizer | WeightPayloads | None


def quantize_weight(b, orientation: str, quantize, cached: WeightQuantizer | None):
    """``quantize(b)``, or b's fp8 copy of ``orientation`` from ``cached``."""
    return quantize(b) if cached is None else cached(b, orientation, quantize)


def transposed_quantizer(quantize: Quantizers, state):
    """The input-gradient orientation's quantizer for ``quantize_weight``: b^T's fp8 copy cast
    by ``state``, what the forward cast of b returned besides its own copy."""

    def transposed(b, round_to=None):
        return quantize.weight_transposed(b, state, round_to)

    return transposed


class _Fp8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, a, b, offs, recipe: Recipe, emulate: bool, shared_a, cached, gemm, *b_payloads
    ):
        """``shared_a``: another GEMM multiplies ``a`` too, and shares its casts (w1 and w3).
        ``gemm``: the ``GemmChoice`` naming each GEMM's backend.
        ``b_payloads``: the four tensors of ``WeightPayloads``, or none to quantize b (through
        ``cached`` if given); with them b carries only its shape and dtype."""
        quantize = recipe.quantizers(emulate)
        if shared_a:  # w1's cast of x serves w3
            a_fp8, a_scale = cast_reuse.cast_once(quantize.tokens, a)
        else:
            a_fp8, a_scale = quantize.rows(a)
        if b_payloads:
            b_fp8, b_scale, b_t_fp8, b_t_scale = b_payloads
            ctx.save_for_backward(a, offs, b_t_fp8, b_t_scale)
        else:
            # The forward cast also gives what the backward's cast of b^T scales by (rowwise:
            # the amax over N), so that cast need not read b for it.
            b_fp8, b_scale, b_state = quantize_weight(b, "forward", quantize.weight, cached)
            ctx.save_for_backward(a, offs, b, b_state)
        ctx.recipe, ctx.emulate, ctx.cached, ctx.b_dtype = recipe, emulate, cached, b.dtype
        ctx.shared_a, ctx.gemm = shared_a, gemm
        ctx.b_columns = b.shape[0] * b.shape[-1]  # G * N: b's fp8 copy is K * this bytes
        ctx.payload_count = len(b_payloads)
        return recipe.grouped_mm(
            a_fp8, a_scale, b_fp8, b_scale, offs, a.dtype, emulate, gemm.forward
        )

    @staticmethod
    def backward(ctx, grad_out):
        a, offs, *weight_saved = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        quantize = recipe.quantizers(emulate)
        # The last forward's cast, kept for nothing (or, under DualPipeV, the other thread's
        # forward cast: that forward casts again, see cast_reuse.py).
        cast_reuse.discard(quantize.tokens)
        grad_a = grad_b = None

        def weight_grad():
            pair = quantize.tokens_per_group_pair if ctx.shared_a else quantize.per_group_pair
            a_fp8, a_scales, grad_fp8, grad_scales = pair(a, grad_out, offs)
            backend = ctx.gemm.weight_grad
            return recipe.grouped_wgrad_mm(
                a_fp8, a_scales, grad_fp8, grad_scales, offs, ctx.b_dtype, emulate, backend
            )

        weight_first = ctx.needs_input_grad[1] and _weight_grad_first(ctx, a, offs, quantize)
        if weight_first:
            grad_b = weight_grad()
        if ctx.needs_input_grad[0]:
            grad_a = _input_grad(ctx, grad_out, a.dtype, offs, weight_saved, quantize)
        if ctx.needs_input_grad[1] and not weight_first:
            grad_b = weight_grad()
        return grad_a, grad_b, None, None, None, None, None, None, *([None] * ctx.payload_count)


def _weight_grad_first(ctx, a, offs, quantize: Quantizers) -> bool:
    """Whether the weight gradient should go first for the lower peak memory. Where the other
    projection's backward kept a's cast (w1 after w3), taking it first frees that fp8 copy of
    a [M, K] before the input gradient allocates; but then the weight gradient [G, K, N] is
    alive beside the input gradient's fp8 copy of b^T [G, N, K], where that copy is made here.
    So: first where b^T's fp8 copy exists anyway (fp8 all-gather payloads, the weight cache)
    or is smaller than a's (M > G * N: many tokens, small experts). (``holds`` first: it is
    False in compiled code, which then compares no symbolic sizes.)"""
    keeps_copies = ctx.cached is not None and ctx.cached.keeps_copies
    return (
        ctx.shared_a
        and cast_reuse.holds(quantize.tokens_per_group_pair, a, offs)
        and (ctx.payload_count > 0 or keeps_copies or a.shape[0] > ctx.b_columns)
    )


def _input_grad(ctx, grad_out, dtype, offs, weight_saved, quantize: Quantizers) -> torch.Tensor:
    """``grad_out @ b^T`` in fp8. A function of its own so that its fp8 copies (the gradient's and
    the transposed weight's, the size of the weight) are freed before the other gradient's
    casts allocate theirs: they raised the backward's peak memory above bf16's."""
    grad_fp8, grad_scale = quantize.rows(grad_out)
    if ctx.payload_count:
        b_t_fp8, b_t_scale = weight_saved
    else:
        b, b_state = weight_saved
        transposed = transposed_quantizer(quantize, b_state)
        b_t_fp8, b_t_scale = quantize_weight(b, "input_grad", transposed, ctx.cached)
    return ctx.recipe.grouped_mm(
        grad_fp8, grad_scale, b_t_fp8, b_t_scale, offs, dtype, ctx.emulate, ctx.gemm.input_grad
    )


def fp8_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    recipe: Recipe,
    emulate: bool,
    cached: WeightSource = None,
    shared_a: bool = True,
    gemm: GemmChoice = TORCH_GEMMS,
) -> torch.Tensor:
    """``torch._grouped_mm(a [M, K], b [G, K, N], offs=offs)`` in fp8 by ``recipe``, each GEMM on
    the backend ``gemm`` names (``kernels/gemm_backends.py``). ``cached``
    gives b's fp8 copies instead of quantizing b: from a cache while b is unchanged
    (``weight_cache.py``), or the payloads an fp8 all-gather brought (``gathered.py``).
    ``shared_a``: another GEMM may multiply the same ``a`` (w1 and w3), which then shares its
    fp8 casts (``WeightConfig.shares_input``)."""
    if isinstance(cached, WeightPayloads):
        return _Fp8GroupedMM.apply(a, b, offs, recipe, emulate, shared_a, None, gemm, *cached)
    return _Fp8GroupedMM.apply(a, b, offs, recipe, emulate, shared_a, cached, gemm)


def _made_on_host(offs: torch.Tensor, values, recipe: Recipe, emulate: bool) -> None:
    """Tell ``host_offsets`` the ``values`` of ``offs``, where the recipe's GEMMs would read
    them back from the device (a sync); no work for the others."""
    if recipe.reads_offsets_on_host and not emulate:
        host_offsets.remember(offs, list(values))


def fp8_batched_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    recipe: Recipe,
    emulate: bool,
    cached: WeightSource = None,
    shared_a: bool = True,
    gemm: GemmChoice = TORCH_GEMMS,
) -> torch.Tensor:
    """``torch._grouped_mm(a [G, M, K], b [G, K, N])`` (no offsets) in fp8."""
    groups, tokens, _ = a.shape
    alignment = recipe.rules.token_group_alignment(emulate)
    weight_gradient = torch.is_grad_enabled() and b.requires_grad
    if weight_gradient and groups > 1 and alignment and tokens % alignment:
        # The weight gradient contracts over each batch entry's rows: else a device-side assert
        # in its GEMM (rowwise), or 128-row blocks that span two entries (blockwise).
        raise ValueError(
            f"float8_moe: torch._grouped_mm of {list(a.shape)} x {list(b.shape)} (3D x 3D): on "
            f"CUDA the {recipe.name} fp8 weight gradient needs each batch entry's {tokens} rows "
            f"to be a multiple of {alignment}; pad them, or leave this weight out of "
            "float8_moe.fqns"
        )
    offs = torch.arange(1, groups + 1, device=a.device, dtype=torch.int32) * tokens
    _made_on_host(offs, range(tokens, (groups + 1) * tokens, tokens), recipe, emulate)
    a_2d = a.reshape(groups * tokens, -1)
    out = fp8_grouped_mm(a_2d, b, offs, recipe, emulate, cached, shared_a, gemm)
    return out.view(groups, tokens, -1)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    recipe: Recipe,
    emulate: bool,
    cached: WeightSource = None,
    shared_a: bool = True,
    gemm: GemmChoice = TORCH_GEMMS,
) -> torch.Tensor:
    """``a [..., K] @ b [K, N]`` in fp8 (a linear layer's ``x @ W^T`` has b = W^T)."""
    a_2d = a.reshape(-1, a.shape[-1])
    offs = torch.full((1,), a_2d.shape[0], device=a.device, dtype=torch.int32)
    _made_on_host(offs, [a_2d.shape[0]], recipe, emulate)
    out = fp8_grouped_mm(a_2d, b.unsqueeze(0), offs, recipe, emulate, cached, shared_a, gemm)
    return out.view(*a.shape[:-1], b.shape[-1])
