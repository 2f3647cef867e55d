"""fp8 all-gather payloads: an expert weight quantized on its FSDP shard, gathered as fp8.

torchtitan's experts multiply ``x @ w^T`` for ``w [E, out, in]``, so the fp8 GEMM's right operand
is ``b = w^T [E, K=in, N=out]``. Both orientations of ``b`` that the GEMM quantizes
(``scaled_grouped_mm.py``) have scales that lie within one expert, whatever the recipe:
- "forward": ``b`` (rowwise: a scale per (expert, out) over ``in``; blockwise: per 128x128 block);
- "input_grad": ``b^T = w`` (rowwise: a scale per (expert, in) over ``out``; blockwise: the same
  blocks, transposed).
So a shard of whole experts (FSDP's dim-0 split) quantizes to exactly the slice of the unsharded
weight's payloads, and gathering the shards' payloads gives the unsharded weight's, bit for bit.
The recipe's rules say the per-expert shapes of the scales (``payload_scale_shapes``).

Every rank's all-gather inputs are three tensors (FSDP2 all-gathers each along dim 0):
- the forward fp8 data and the input-gradient fp8 data, each ``[rows, out, in]`` (the padded
  shard shape; stored in the quantizer's own memory order, reinterpreted to that shape);
- the fp32 scales of both orientations, flattened, ``[rows, S]`` per rank. When dim 0 splits
  unevenly, FSDP2 requires every input of every rank to have the padded shard shape, so the
  scales' bytes then travel in a ``[rows, out, in]`` tensor of the narrowest integer dtype that
  holds them (zeros after them): 3 bytes per element in all instead of bf16's 2.
Padding rows quantize as zeros with finite scales and are narrowed off after the gather.
"""

import math
from dataclasses import dataclass

import torch

from .recipes import Recipe
from .scaled_grouped_mm import quantize_weight, transposed_quantizer
from .weight_cache import WeightPayloads, WeightQuantizer

FORWARD, INPUT_GRAD = "forward", "input_grad"
_SCALE_DTYPE = torch.float32
# Carriers for the scales' bytes when every input must have the padded shard shape.
_CARRIER_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class StoredData:
    """How one orientation's fp8 data travels: its memory order as a contiguous tensor."""

    shape: tuple[int, ...]  # the contiguous tensor's shape, dim 0 the rows
    transposed: bool  # the data is that tensor's transpose over its last two dims


@dataclass(frozen=True)
class GatherLayout:
    """What the post-gather hook needs to take the gathered payloads apart."""

    logical_shape: tuple[int, ...]  # the unsharded weight, [E, out, in]
    dtype: torch.dtype  # the high-precision dtype the payloads were quantized from
    data: dict[str, StoredData]
    scale_shapes: tuple[tuple[int, ...], tuple[int, ...]]  # per expert: forward, input_grad


def quantize_shard(
    shard: torch.Tensor, recipe: Recipe, emulate: bool, cached: WeightQuantizer | None
) -> WeightPayloads:
    """Both orientations' fp8 data and scales of ``shard [rows, out, in]`` as the fp8 GEMM
    quantizes its operand ``b = shard^T``: forward ``[rows, in, out]``, input gradient
    ``[rows, out, in]``, scales as ``recipe`` lays them out. ``cached`` reuses the shard's fp8
    copies while it is unchanged (``weight_cache.py``)."""
    quantize = recipe.quantizers(emulate)
    b = shard.transpose(-2, -1)
    data, scales, state = quantize_weight(b, FORWARD, quantize.weight, cached)
    transposed = transposed_quantizer(quantize, state)
    return WeightPayloads(data, scales, *quantize_weight(b, INPUT_GRAD, transposed, cached))


def uneven(dim_size: int, world_size: int) -> bool:
    """Whether FSDP2 pads some rank's dim-0 shard (and so checks every input's shape)."""
    return dim_size % world_size != 0


def _scale_carrier(trailing: tuple[int, ...], scale_bytes: int) -> torch.dtype:
    """The narrowest integer dtype whose ``trailing``-shaped row holds ``scale_bytes`` and a
    whole number of fp32 values (so the scales come back as a view)."""
    numel = math.prod(trailing)
    for dtype in _CARRIER_DTYPES:
        row_bytes = numel * dtype.itemsize
        if row_bytes >= scale_bytes and row_bytes % _SCALE_DTYPE.itemsize == 0:
            return dtype
    raise ValueError(f"fp8 all-gather: no carrier for {scale_bytes} scale bytes in {trailing}")


def _scale_numel(recipe: Recipe, trailing: tuple[int, ...]) -> int:
    return sum(math.prod(shape) for shape in recipe.rules.payload_scale_shapes(*trailing))


def row_bytes(trailing: tuple[int, ...], pad: bool, recipe: Recipe) -> int:
    """All-gather bytes per row (expert) of a weight whose rows are ``trailing`` [out, in];
    ``pad``: dim 0 splits unevenly."""
    numel = math.prod(trailing)
    scale_bytes = _scale_numel(recipe, trailing) * _SCALE_DTYPE.itemsize
    if pad:
        scale_bytes = numel * _scale_carrier(trailing, scale_bytes).itemsize
    return 2 * numel + scale_bytes


def _scales_input(scales: torch.Tensor, padded_shape: torch.Size, pad: bool) -> torch.Tensor:
    """``scales [rows, S]`` as an all-gather input: as they are, or (``pad``) their bytes
    in a tensor of the padded shard shape."""
    if not pad:
        return scales
    rows, trailing = padded_shape[0], tuple(padded_shape[1:])
    scale_bytes = scales.view(torch.uint8)
    carrier = _scale_carrier(trailing, scale_bytes.shape[1])
    row_bytes = math.prod(trailing) * carrier.itemsize
    packed = scale_bytes.new_zeros((rows, row_bytes))
    packed[:, : scale_bytes.shape[1]] = scale_bytes
    return packed.view(carrier).view(padded_shape)


def _stored(data: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``data`` as a contiguous tensor in its own memory order, and whether that is its
    transpose over the last two dims (no copy unless it is neither)."""
    if data.is_contiguous():
        return data, False
    if data.transpose(-2, -1).is_contiguous():
        return data.transpose(-2, -1), True
    return data.contiguous(), False


def all_gather_inputs(
    payloads: WeightPayloads,
    logical_shape: tuple[int, ...],
    dtype: torch.dtype,
    world_size: int,
    recipe: Recipe,
) -> tuple[tuple[torch.Tensor, ...], GatherLayout]:
    """The all-gather inputs of a padded shard's ``quantize_shard`` payloads (module docstring),
    and the layout to unpack the gathered outputs with."""
    inputs, stored = [], {}
    padded_shape = payloads.input_grad_data.shape  # [rows, out, in]
    for orientation, data in [
        (FORWARD, payloads.forward_data),
        (INPUT_GRAD, payloads.input_grad_data),
    ]:
        contiguous, transposed = _stored(data)
        stored[orientation] = StoredData(tuple(contiguous.shape), transposed)
        inputs.append(contiguous.view(padded_shape))
    rows = padded_shape[0]
    scales = torch.cat(
        [s.reshape(rows, -1) for s in (payloads.forward_scales, payloads.input_grad_scales)], dim=1
    )
    pad = uneven(logical_shape[0], world_size)
    inputs.append(_scales_input(scales, padded_shape, pad))
    scale_shapes = recipe.rules.payload_scale_shapes(*logical_shape[1:])
    return tuple(inputs), GatherLayout(tuple(logical_shape), dtype, stored, scale_shapes)


def _gathered_data(gathered: torch.Tensor, stored: StoredData, experts: int) -> torch.Tensor:
    data = gathered.view(-1, *stored.shape[1:]).narrow(0, 0, experts)
    return data.transpose(-2, -1) if stored.transposed else data


def unpack(outputs: tuple[torch.Tensor, ...], layout: GatherLayout) -> WeightPayloads:
    """The unsharded weight's payloads (as ``quantize_shard`` gives them), as views of the
    all-gather outputs with the padding rows narrowed off."""
    forward_data, input_grad_data, scale_carrier = outputs
    experts = layout.logical_shape[0]
    world_rows = scale_carrier.shape[0]
    forward_shape, input_grad_shape = layout.scale_shapes
    forward_numel = math.prod(forward_shape)
    scale_numel = forward_numel + math.prod(input_grad_shape)
    scales = (
        scale_carrier.reshape(world_rows, -1)
        .view(torch.uint8)[:, : scale_numel * _SCALE_DTYPE.itemsize]
        .view(_SCALE_DTYPE)
        .narrow(0, 0, experts)
    )
    return WeightPayloads(
        _gathered_data(forward_data, layout.data[FORWARD], experts),
        scales[:, :forward_numel].unflatten(1, forward_shape),
        _gathered_data(input_grad_data, layout.data[INPUT_GRAD], experts),
        scales[:, forward_numel:].unflatten(1, input_grad_shape),
    )
