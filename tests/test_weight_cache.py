"""The fp8 weight cache (`[float8_moe] cache_fp8_weights`): one quantization per weight,
orientation and optimizer step, through activation checkpointing and gradient accumulation, with
results bit-identical to quantizing at every use. (Under FSDP2, where the cache keys on the
local shard, the fsdp suite's `-cache` cases train sharded with the cache against an unsharded
module without it.)"""

import pytest
import torch
from expert_modules import build_expert_module, expert_inputs
from torch.utils.checkpoint import checkpoint

from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS
from torchtitan_fp8_moe.fp8.weight_cache import clear_all
from torchtitan_fp8_moe.swap import expert_modules, swap_expert_weights
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

MICRO_BATCHES, STEPS, EXPERTS = 2, 3, 4


@pytest.fixture
def weight_quantizations(monkeypatch):
    """Counts calls of the emulated path's weight quantizers (the real functions still run)."""
    counts = {"forward": 0, "input_grad": 0}
    for orientation, name in (("forward", "weight"), ("input_grad", "weight_transposed")):
        real = getattr(TORCH_QUANTIZERS, name)

        def counted(b, *args, _real=real, _orientation=orientation, **kwargs):
            counts[_orientation] += 1
            return _real(b, *args, **kwargs)

        monkeypatch.setattr(TORCH_QUANTIZERS, name, counted)
    return counts


def _train(kind: str, cache_fp8: bool, counts: dict, clear_after_step: bool):
    module = build_expert_module(kind, EXPERTS)
    for _, expert in expert_modules(module):
        swap_expert_weights(expert, WeightConfig(emulate=True, cache_fp8=cache_fp8))
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
    for step, (expected, actual) in enumerate(zip(uncached, cached, strict=True)):
        for e, a in zip(expected, actual, strict=True):
            assert torch.equal(e, a), f"history entry {step} differs"


def test_cache_follows_in_place_changes_and_clears():
    """A weight changed in place between two uses is re-quantized; clear_all drops the copies."""
    module = build_expert_module("linear_shared", EXPERTS)
    ((_, expert),) = expert_modules(module)
    swap_expert_weights(expert, WeightConfig(emulate=True, cache_fp8=True))
    x, _, _ = expert_inputs("linear_shared", EXPERTS, 0)
    x = x.bfloat16()
    first = module(x)
    with torch.no_grad():
        expert.w1.weight.mul_(2)
    second = module(x)
    reference = build_expert_module("linear_shared", EXPERTS)
    ((_, ref_expert),) = expert_modules(reference)
    swap_expert_weights(ref_expert, WeightConfig(emulate=True))
    with torch.no_grad():
        ref_expert.w1.weight.mul_(2)
    assert not torch.equal(first, second)
    assert torch.equal(second, reference(x))
    cache = expert.w1.weight._cache
    assert len(cache) > 0
    clear_all()
    assert len(cache) == 0


def _cached_and_fresh(kind: str = "linear_shared"):
    """The same converted module twice: with the fp8 cache, and without (the reference)."""
    modules = []
    for cache_fp8 in (True, False):
        module = build_expert_module(kind, EXPERTS)
        for _, expert in expert_modules(module):
            swap_expert_weights(expert, WeightConfig(emulate=True, cache_fp8=cache_fp8))
        modules.append(module)
    x, routing, _ = expert_inputs(kind, EXPERTS, 0)
    return modules, (x.bfloat16(), *routing)


WRITES = {
    "out=": lambda w: torch.mul(w, 2, out=w),
    "copy_": lambda w: w.copy_(w.detach() * 2),
    "view mul_": lambda w: w.transpose(0, 1).mul_(2),
    "foreach": lambda w: torch._foreach_mul_([w], 2),
    "plain data (state dict)": lambda w: w._data.mul_(2),
}


@pytest.mark.parametrize("write", WRITES)
def test_cache_never_serves_a_stale_copy_after_a_write(write):
    """Forward (fills the cache), write into a weight in place, forward again: the output equals
    a module without the cache that had the same write, and differs from the first output."""
    (cached, fresh), inputs = _cached_and_fresh()
    first = cached(*inputs)
    with torch.no_grad():
        for module in (cached, fresh):
            WRITES[write](module.expert.w2.weight)
    second = cached(*inputs)
    assert not torch.equal(first, second)
    assert torch.equal(second, fresh(*inputs))


def test_cache_after_a_checkpoint_load(tmp_path):
    """DCP load after a forward: the next forward uses the loaded weights."""
    import torch.distributed.checkpoint as dcp

    (cached, fresh), inputs = _cached_and_fresh("routed")
    dcp.save(fresh.state_dict(), checkpoint_id=str(tmp_path))
    with torch.no_grad():
        for p in cached.parameters():
            p.mul_(3)
    stale = cached(*inputs)
    state = cached.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path))
    cached.load_state_dict(state)
    loaded = cached(*inputs)
    assert not torch.equal(stale, loaded)
    assert torch.equal(loaded, fresh(*inputs))


def test_cache_keys_on_device():
    """A copy on another device is quantized there, never served the CPU copy."""
    (cached, _), inputs = _cached_and_fresh()
    cached(*inputs)
    w = cached.expert.w1.weight
    on_meta = torch.nn.functional.linear(inputs[0].to("meta"), w.to("meta"))
    assert on_meta.device.type == "meta"
    assert on_meta.shape == (inputs[0].shape[0], w.shape[0])


def test_copies_share_a_cache_until_one_is_written():
    """Two casts of the weight made in one step share their fp8 copies (one quantization);
    a write into one cast detaches it, so neither serves the other a stale copy."""
    (cached, _), inputs = _cached_and_fresh()
    w = cached.expert.w1.weight
    x = inputs[0]
    a, b = w.float(), w.float()
    torch.nn.functional.linear(x, a)
    before = w._cache.quantizations
    torch.nn.functional.linear(x, b)
    assert w._cache.quantizations == before
    with torch.no_grad():
        b.mul_(2)
    expected = torch.nn.functional.linear(
        x, Float8MoEWeight(b._data.clone(), WeightConfig(emulate=True))
    )
    assert torch.equal(torch.nn.functional.linear(x, b), expected)
    assert torch.equal(
        torch.nn.functional.linear(x, a),
        torch.nn.functional.linear(x, Float8MoEWeight(a._data.clone(), WeightConfig(emulate=True))),
    )
    c = w.float()  # a new copy after the write: a fresh cache, the weight's own values
    assert torch.equal(
        torch.nn.functional.linear(x, c),
        torch.nn.functional.linear(x, Float8MoEWeight(w._data.float(), WeightConfig(emulate=True))),
    )


def test_cache_under_fsdp_follows_writes_into_the_shard(dist_results):
    """FSDP2 over 2 ranks, cache on: after a forward, a write into the shard's plain data and a
    DCP load each reach the next forward (equal to a module without the cache)."""
    for rank, results in enumerate(dist_results("cache_writes", 2)):
        assert "error" not in results, f"rank {rank}: {results.get('traceback')}"
        full_tensor = results.pop("full_tensor")
        for write, outcome in results.items():
            assert outcome["matches_uncached"], (rank, write)
        assert results["shard plain data"]["changed"], rank
        assert full_tensor == {"type": "Float8MoEWeight", "values_equal": True}, rank


def test_compiled_experts_quantize_inline_without_the_cache():
    """Under torch.compile the cache holds nothing (a Python-side cache would be baked into the
    trace), as the converter's log says with compile on (run_checks.describe_weight_cache)."""
    module = build_expert_module("routed", EXPERTS)
    for _, expert in expert_modules(module):
        swap_expert_weights(expert, WeightConfig(emulate=True, cache_fp8=True))
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x, routing, target = expert_inputs("routed", EXPERTS, 0)
    (compiled(x.bfloat16().requires_grad_(), *routing).float() * target).sum().backward()
    weights = [p for p in module.parameters() if isinstance(p, Float8MoEWeight)]
    assert len(weights) == 3 and all(len(w._cache) == 0 for w in weights)
    module(x.bfloat16(), *routing)  # eager, the same weights: cached
    assert all(len(w._cache) == 1 for w in weights)
