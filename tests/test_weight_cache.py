"""The fp8 weight cache (`[float8_moe] cache_fp8_weights`): one quantization per weight,
orientation and optimizer step, through activation checkpointing and gradient accumulation, with
results bit-identical to quantizing at every use. (Under FSDP2, where the cache keys on the
local shard, the fsdp suite's `-cache` cases train sharded with the cache against an unsharded
module without it.)"""

import pytest
import torch
from expert_modules import build_expert_module, expert_inputs
from torch.utils.checkpoint import checkpoint

from torchtitan_fp8_moe.fp8 import torch_quantize
from torchtitan_fp8_moe.fp8.weight_cache import clear_all
from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights

MICRO_BATCHES, STEPS, EXPERTS = 2, 3, 4


@pytest.fixture
def weight_quantizations(monkeypatch):
    """Counts calls of the emulated path's weight quantizers (the real functions still run)."""
    counts = {"forward": 0, "input_grad": 0}
    for orientation, name in (("forward", "weight"), ("input_grad", "weight_transposed")):
        real = getattr(torch_quantize, name)

        def counted(b, _real=real, _orientation=orientation):
            counts[_orientation] += 1
            return _real(b)

        monkeypatch.setattr(torch_quantize, name, counted)
    return counts


def _train(kind: str, cache_fp8: bool, counts: dict, clear_after_step: bool):
    module = build_expert_module(kind, EXPERTS)
    for _, expert in expert_modules(module):
        swap_expert_weights(expert, emulate=True, cache_fp8=cache_fp8)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    per_step, history = [], []
    for step in range(STEPS):
        before = dict(counts)
        for micro in range(MICRO_BATCHES):
            x, routing, target = expert_inputs(kind, EXPERTS, step * MICRO_BATCHES + micro)
            x = x.bfloat16().requires_grad_()
            out = checkpoint(module, x, *routing, use_reentrant=False)
            (out.float() * target).sum().backward()
        history.append([p.grad.clone() for p in module.parameters()])
        opt.step()
        opt.zero_grad()
        if clear_after_step:
            clear_all()
        per_step.append({k: counts[k] - before[k] for k in counts})
        history.append([p.detach()._data.clone() for p in module.parameters()])
    return per_step, history


@pytest.mark.parametrize("kind", ["routed", "grouped_shared", "linear_shared"])
@pytest.mark.parametrize("clear_after_step", [True, False], ids=["cleared", "version-checked"])
def test_cache_quantizes_each_weight_once_per_step(weight_quantizations, kind, clear_after_step):
    """3 weights, 2 micro-batches, full activation checkpointing: without the cache each weight
    is quantized for the forward 4 times a step (2 forwards + 2 recomputes) and for the input
    gradient twice; with it, once each. Stale copies would change the gradients from step 2 on:
    grads and weights must be bit-identical to the uncached run at every step, whether the cache
    is cleared after the optimizer step (as the converter does) or only version-checked."""
    uncached_counts, uncached = _train(kind, False, weight_quantizations, clear_after_step)
    cached_counts, cached = _train(kind, True, weight_quantizations, clear_after_step)
    assert uncached_counts == [{"forward": 12, "input_grad": 6}] * STEPS
    assert cached_counts == [{"forward": 3, "input_grad": 3}] * STEPS
    for step, (expected, actual) in enumerate(zip(uncached, cached)):
        for e, a in zip(expected, actual):
            assert torch.equal(e, a), f"history entry {step} differs"


def test_cache_follows_in_place_changes_and_clears():
    """A weight changed in place between two uses is re-quantized; clear_all drops the copies."""
    module = build_expert_module("linear_shared", EXPERTS)
    (_, expert), = expert_modules(module)
    swap_expert_weights(expert, emulate=True, cache_fp8=True)
    x, _, _ = expert_inputs("linear_shared", EXPERTS, 0)
    x = x.bfloat16()
    first = module(x)
    with torch.no_grad():
        expert.w1.weight.mul_(2)
    second = module(x)
    reference = build_expert_module("linear_shared", EXPERTS)
    (_, ref_expert), = expert_modules(reference)
    swap_expert_weights(ref_expert, emulate=True)
    with torch.no_grad():
        ref_expert.w1.weight.mul_(2)
    assert not torch.equal(first, second)
    assert torch.equal(second, reference(x))
    cache = expert.w1.weight._cache
    assert len(cache) > 0
    clear_all()
    assert len(cache) == 0
