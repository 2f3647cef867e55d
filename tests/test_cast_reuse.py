"""The routed tokens' fp8 cast is made once for w1 and w3 (``fp8/cast_reuse.py``), with the
results of casting them twice, and never reused for a tensor that changed or is another one.
Runs emulated on CPU, and on CUDA too where a GPU with fp8 is present."""

import copy
import threading
import weakref

import pytest
import torch
import torch.nn as nn
from torchtitan.models.moe.moe import _run_experts_grouped_mm

from torchtitan_fp8_moe.fp8 import cast_reuse, fp8_grouped_mm, recipe_named, scaled_grouped_mm
from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig, fp8_kernels_available

DIM, HIDDEN, EXPERTS = 64, 96, 4
TOKENS_PER_EXPERT = [32, 0, 48, 16]  # one empty group; multiples of 16 for the CUDA kernels
DEVICES = ["cpu"] + (
    ["cuda"] if torch.cuda.is_available() and fp8_kernels_available(torch.device("cuda")) else []
)


@pytest.fixture(autouse=True)
def empty_slot():
    """Each test starts and ends with nothing kept."""
    cast_reuse.take(None, torch.empty(0))
    yield
    cast_reuse.take(None, torch.empty(0))


def _weights(device, emulate):
    """w1, w2, w3, plain and converted: each with the default ``shares_input``, w2 too (the
    converter would not mark it), so that w2's forward leaves a cast in the slot for the
    backward to drop."""
    torch.manual_seed(0)
    shapes = ((EXPERTS, HIDDEN, DIM), (EXPERTS, DIM, HIDDEN), (EXPERTS, HIDDEN, DIM))
    plain = [torch.randn(s, device=device, dtype=torch.bfloat16) * 0.05 for s in shapes]
    converted = [
        nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(emulate=emulate))) for w in plain
    ]
    return plain, converted


def _logging(monkeypatch, module, names, log):
    """Append (name, the first argument's dim 1) to ``log`` at each call of these functions."""
    for name in names:
        original = getattr(module, name)

        def logged(*args, name=name, original=original):
            log.append((name, args[0].shape[1]))
            return original(*args)

        monkeypatch.setattr(module, name, logged)


# Routed tokens below and above EXPERTS * HIDDEN: w1's backward takes the input gradient first,
# then the weight gradient first (scaled_grouped_mm._weight_grad_first).
@pytest.mark.parametrize(
    "tokens_per_expert",
    [TOKENS_PER_EXPERT, [160, 0, 240, 112]],
    ids=["w1-input-grad-first", "w1-weight-grad-first"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_expert_ffn_casts_the_routed_tokens_once(device, tokens_per_expert, monkeypatch):
    emulate = device == "cpu"
    quantizers = recipe_named("rowwise").quantizers(emulate)
    casts = []
    _logging(monkeypatch, quantizers, ["rows"], casts)
    counts = torch.tensor(tokens_per_expert, device=device)
    tokens = sum(tokens_per_expert)
    x = torch.randn(tokens, DIM, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, DIM, device=device, dtype=torch.bfloat16)
    plain, converted = _weights(device, emulate)

    x_fp8 = x.clone().requires_grad_()
    out = _run_experts_grouped_mm(*converted, x_fp8, counts)
    # Forward: x once for w1 and w3, then SiLU(x w1) * (x w3) for w2.
    assert casts == [("rows", DIM), ("rows", HIDDEN)]
    kept = cast_reuse._slot.kept  # w2's cast of its input (marked as shared): nothing takes it
    assert kept is not None and kept.cast == quantizers.tokens
    kept_fp8 = weakref.ref(kept.result[0])
    del kept
    if device == "cuda":
        from torchtitan_fp8_moe.fp8.recipes.rowwise import triton_quantizers

        pair_casts = ["per_group_colwise_fp8_pair", "per_group_colwise_fp8"]
        _logging(monkeypatch, triton_quantizers, pair_casts, casts)
    casts.clear()
    out.backward(grad)
    assert kept_fp8() is None, "the backward frees the last forward's kept cast"
    if device == "cuda":
        # w2, then w3: input gradient (rows of grad), weight gradient (a token pair, w3's
        # keeping x's cast); w1 reuses it, with the weight gradient first where x's kept cast
        # is larger than w1's transposed fp8 copy.
        w1_backward = [("rows", HIDDEN), ("per_group_colwise_fp8", HIDDEN)]
        if tokens > EXPERTS * HIDDEN:
            w1_backward.reverse()
        assert casts == [
            ("rows", DIM),
            ("per_group_colwise_fp8_pair", HIDDEN),
            ("rows", HIDDEN),
            ("per_group_colwise_fp8_pair", DIM),
            *w1_backward,
        ]

    # The same expert FFN with w3 given its own copy of x: two casts, same bytes.
    x_twice = x.clone().requires_grad_()
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w1, w2, w3 = converted_twice = _weights(device, emulate)[1]
    h = torch.nn.functional.silu(torch._grouped_mm(x_twice, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x_twice.clone(), w3.transpose(-2, -1), offs=offs)
    out_twice = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    out_twice.backward(grad)
    assert torch.equal(out, out_twice)
    assert torch.equal(x_fp8.grad, x_twice.grad)
    for once, twice in zip(converted, converted_twice, strict=True):
        assert torch.equal(once.grad, twice.grad)

    # And against plain bf16 math: the fp8 path ran (SQNR bounded) and within torchao's bars.
    x_ref = x.float().requires_grad_()
    ref = _run_experts_grouped_mm(*[w.float() for w in plain], x_ref, counts)
    assert 23 <= sqnr(ref, out) < 40


@pytest.mark.parametrize("device", DEVICES)
def test_a_shared_experts_linear_layers_cast_their_input_once(device, monkeypatch):
    """A FeedForward shared expert's w1 and w3 (``F.linear`` of converted 2D weights, each call
    with offsets of its own) share one forward cast of x."""
    emulate = device == "cpu"
    quantizers = recipe_named("rowwise").quantizers(emulate)
    casts = []
    _logging(monkeypatch, quantizers, ["rows"], casts)
    torch.manual_seed(0)
    w1, w3 = (
        nn.Parameter(Float8MoEWeight(torch.randn(HIDDEN, DIM, device=device) * 0.05,
                                     WeightConfig(emulate=emulate)))
        for _ in range(2)
    )  # fmt: skip
    x = torch.randn(48, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w1)
    torch.nn.functional.linear(x, w3)
    assert casts == [("rows", DIM)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_or_other_tensor_is_cast_again(device):
    emulate = device == "cpu"
    recipe = recipe_named("rowwise")
    offs = torch.cumsum(torch.tensor(TOKENS_PER_EXPERT, device=device), 0, dtype=torch.int32)
    x = torch.randn(sum(TOKENS_PER_EXPERT), DIM, device=device, dtype=torch.bfloat16)
    (w1, _, w3), _ = _weights(device, emulate)
    b1, b3 = w1.transpose(-2, -1), w3.transpose(-2, -1)

    fp8_grouped_mm(x, b1, offs, recipe, emulate)
    x.mul_(1024)  # in place: the kept cast no longer holds x's values
    assert torch.equal(
        fp8_grouped_mm(x, b3, offs, recipe, emulate),
        fp8_grouped_mm(x.clone(), b3, offs, recipe, emulate),
    )
    y = x.clone()
    fp8_grouped_mm(x, b1, offs, recipe, emulate)
    # Another tensor, equal values: cast on its own (the slot is keyed by identity).
    fp8_grouped_mm(y, b3, offs, recipe, emulate)
    assert cast_reuse.take(recipe.quantizers(emulate).tokens, y) is not None
    assert cast_reuse.take(recipe.quantizers(emulate).tokens, y) is None  # a hit empties the slot


def test_the_slot_holds_one_cast_and_only_keepable_tensors():
    def cast(t):
        return t * 2

    a, b = torch.ones(3), torch.ones(3)
    offs = torch.tensor([3])
    cast_reuse.keep(cast, a, (offs,), "a's")
    assert cast_reuse.take(cast, a, torch.tensor([3])) is None  # other offsets object
    assert cast_reuse.take(cast, a, offs) is None  # the miss emptied the slot
    cast_reuse.keep(cast, a, (offs,), "a's")
    cast_reuse.keep(cast, b, (offs,), "b's")  # replaces a's
    assert cast_reuse.take(cast, a, offs) is None
    cast_reuse.keep(cast, b, (offs,), "b's")
    assert cast_reuse.holds(cast, b, offs) and not cast_reuse.holds(cast, a, offs)
    assert cast_reuse.take(cast, b, offs) == "b's"  # holds left the slot as it was
    assert cast_reuse.take(cast, b, offs) is None  # a hit empties it too
    assert not cast_reuse.holds(cast, b, offs)
    with torch.inference_mode():
        c = torch.ones(3)
    assert cast_reuse.cast_once(cast, c) is not None
    assert cast_reuse.take(cast, c) is None  # inference tensors have no version: never kept
    d = torch.ones(3)
    cast_reuse.keep(cast, d, (), "d's")
    del d  # a freed tensor's cast is never handed to a new one at its address
    e = torch.ones(3)
    assert cast_reuse.take(cast, e) is None


def test_a_backward_in_another_thread_drops_the_forward_cast():
    """On CUDA autograd runs the backward in its device thread: it must find (and drop) the
    forward's last kept cast. Here the backward runs in a thread of its own, on CPU."""
    counts = torch.tensor(TOKENS_PER_EXPERT)
    x = torch.randn(sum(TOKENS_PER_EXPERT), DIM, dtype=torch.bfloat16, requires_grad=True)
    out = _run_experts_grouped_mm(*_weights("cpu", emulate=True)[1], x, counts)
    kept_fp8 = weakref.ref(cast_reuse._slot.kept.result[0])
    worker = threading.Thread(target=out.backward, args=(torch.ones_like(out),))
    worker.start()
    worker.join()
    assert x.grad is not None
    assert kept_fp8() is None, "the backward's thread left the forward's kept cast alive"


@pytest.mark.parametrize("device", DEVICES)
def test_either_gradient_order_gives_the_same_gradients(device, monkeypatch):
    """``_weight_grad_first`` only orders the backward's two GEMMs (for memory): both orders
    give the same bytes."""
    emulate = device == "cpu"
    counts = torch.tensor(TOKENS_PER_EXPERT, device=device)
    x = torch.randn(sum(TOKENS_PER_EXPERT), DIM, device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    grads = []
    for weight_first in (False, True):
        monkeypatch.setattr(
            scaled_grouped_mm, "_weight_grad_first", lambda *args, first=weight_first: first
        )
        x_leaf = x.clone().requires_grad_()
        converted = _weights(device, emulate)[1]
        _run_experts_grouped_mm(*converted, x_leaf, counts).backward(grad)
        grads.append([x_leaf.grad, *(w.grad for w in converted)])
    for by_input_first, by_weight_first in zip(*grads, strict=True):
        assert torch.equal(by_input_first, by_weight_first)


def test_views_of_the_same_memory_share_a_cast_and_other_memory_does_not():
    """A linear expert reshapes its input on every call: two views of one tensor with the same
    memory layout are the same values; another layout, or a write through any view, is not."""

    def cast(t):
        return t * 2

    x = torch.randn(2, 4, 6)
    cast_reuse.keep(cast, x.reshape(-1, 6), (), "x's")
    assert cast_reuse.take(cast, x.reshape(-1, 6)) == "x's"
    cast_reuse.keep(cast, x.reshape(-1, 6), (), "x's")
    assert cast_reuse.take(cast, x[:1].reshape(-1, 6)) is None  # fewer rows
    cast_reuse.keep(cast, x.reshape(-1, 6), (), "x's")
    x[1].mul_(3)  # through another view: the version counter is shared
    assert cast_reuse.take(cast, x.reshape(-1, 6)) is None
    cast_reuse.keep(cast, x, (), "x's")
    x.data = torch.randn(5, 6)  # a new tensor behind the same object: another layout
    assert cast_reuse.take(cast, x) is None


def test_a_cast_kept_in_a_backward_is_dropped_when_it_ends():
    """What a backward keeps (w3's per-group cast of the tokens, for w1) must not outlive it:
    a shared expert's w1 never takes w3's (its offsets are a new tensor per call), and the
    leftover moved the allocator's layout from step to step (fragmentation)."""
    seen = []

    class KeepsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            cast_reuse.keep(cast, grad, (), (grad.clone(),))
            seen.append(cast_reuse.holds(cast, grad))
            return grad * 2

    def cast(t):
        return (t,)

    x = torch.randn(8, requires_grad=True)
    KeepsInBackward.apply(x).sum().backward()
    assert seen == [True], "kept during the backward"
    assert cast_reuse._slot.kept is None, "the backward's kept cast outlived it"
    cast_reuse.keep(cast, x, (), (x.clone(),))  # outside a backward: kept until taken
    assert cast_reuse.holds(cast, x)


@pytest.mark.parametrize("module_kind", ["routed", "feed_forward"])
def test_only_the_gate_and_up_projections_share_their_casts(module_kind, monkeypatch):
    """The converter marks w1 and w3 as sharing their input, w2 not (``swap_expert_weights``):
    w2's forward cast is kept for no other GEMM, where a weight that may share keeps it until
    the next cast that looks (its fp8 copy lived on into the next layer). The results are the
    same bytes either way."""
    from dataclasses import replace

    from torchtitan.models.moe.moe import FeedForward, GroupedExperts

    from torchtitan_fp8_moe.swap import swap_expert_weights

    torch.manual_seed(0)
    if module_kind == "routed":
        base = GroupedExperts(DIM, HIDDEN, EXPERTS, use_grouped_mm=True)
        counts = torch.tensor(TOKENS_PER_EXPERT)
        tokens = sum(TOKENS_PER_EXPERT)
    else:
        base = FeedForward(DIM, HIDDEN)
        tokens = 48
    base = base.bfloat16()
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(tokens, DIM, dtype=torch.bfloat16)
    casts = []
    quantizers = recipe_named("rowwise").quantizers(emulate=True)
    _logging(monkeypatch, quantizers, ["rows", "per_group_pair", "tokens_per_group_pair"], casts)
    results, kept = {}, {}
    for marked in (True, False):  # by the converter, or every weight may share
        module = copy.deepcopy(base)
        swap_expert_weights(module, WeightConfig(emulate=True))
        converted = {name: p for name, p in module.named_parameters()}
        assert {n for n, p in converted.items() if p.config.shares_input} == (
            {"w1", "w3"} if module_kind == "routed" else {"w1.weight", "w3.weight"}
        )
        if not marked:
            for p in converted.values():
                p.config = replace(p.config, shares_input=True)
        casts.clear()
        xi = x.clone().requires_grad_()
        if module_kind == "routed":  # its forward without the token padding (a Triton kernel)
            out = _run_experts_grouped_mm(module.w1, module.w2, module.w3, xi, counts)
        else:
            out = module(xi)
        assert casts == [("rows", DIM), ("rows", HIDDEN)], casts  # x once, then w2's input
        kept[marked] = cast_reuse._slot.kept
        casts.clear()
        out.float().square().sum().backward()
        pairs = [name for name, _ in casts if name.endswith("per_group_pair")]
        # w2's, then w3's and w1's (``tokens_per_group_pair``, calling ``per_group_pair``)
        shared = ["tokens_per_group_pair", "per_group_pair"]
        assert pairs == (["per_group_pair"] + shared * 2 if marked else shared * 3), pairs
        results[marked] = [out, xi.grad, *(p.grad for p in module.parameters())]
    assert kept[True] is None and kept[False] is not None
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
    # w1 converted without w3 (a policy kept w3 bf16): nothing to share with
    only_w1 = copy.deepcopy(base)
    suffix = "" if module_kind == "routed" else ".weight"
    swapped = swap_expert_weights(only_w1, WeightConfig(emulate=True), {f"w1{suffix}"})
    assert [(name, p.config.shares_input) for name, p in swapped] == [(f"w1{suffix}", False)]
