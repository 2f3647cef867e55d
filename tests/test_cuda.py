"""The CUDA fp8 kernels against the emulated path: same quantization, so the results agree up
to fp32 accumulation order. Runs only on CUDA devices with fp8 (sm89+); skipped elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from expert_modules import emulated_and_cuda_path, gathered_by_hand, shared_token_cast_calls

from torchtitan_fp8_moe.fp8.sqnr import sqnr
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig, fp8_kernels_available

if not (torch.cuda.is_available() and fp8_kernels_available(torch.device("cuda"))):
    pytest.skip("needs a CUDA device with fp8 (sm89+)", allow_module_level=True)

D, H, E, M = 512, 1024, 4, 2048
OFFS = torch.tensor([512, 512, 1536, 2048], dtype=torch.int32)  # one empty group


def _routed(x, w):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=OFFS.cuda())


def _grouped_shared(x, w):
    return torch._grouped_mm(x.unsqueeze(0), w.transpose(-2, -1)).squeeze(0)


def _linear(x, w):
    return F.linear(x, w)


# A shared expert's tokens per micro-batch need not be a multiple of 16; its weight gradient
# contracts over them, and torch's fp8 GEMMs need 16 (the casts add zero rows).
@pytest.mark.parametrize(
    "forward,shape,dtype,tokens",
    [
        (_routed, (E, H, D), torch.bfloat16, M),
        (_grouped_shared, (1, H, D), torch.bfloat16, M),
        (_grouped_shared, (1, H, D), torch.bfloat16, M - 7),
        (_linear, (H, D), torch.bfloat16, M),
        (_linear, (H, D), torch.bfloat16, M - 7),
        (_linear, (H, D), torch.float32, M),  # a FeedForward without FSDP mixed precision
    ],
    ids=[
        "routed",
        "grouped_shared",
        "grouped_shared_odd_tokens",
        "linear",
        "linear_odd_tokens",
        "linear_fp32",
    ],
)
def test_cuda_kernels_match_emulation(forward, shape, dtype, tokens):
    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
    x = torch.randn(tokens, D, device="cuda", dtype=dtype)
    grad = torch.randn(tokens, H, device="cuda", dtype=dtype)
    results = emulated_and_cuda_path(forward, w, x, grad)
    for emulated, cuda in zip(*results, strict=True):
        assert cuda.dtype == emulated.dtype == dtype
        assert sqnr(emulated, cuda) > 35


def test_one_local_expert_with_padding_rows_matches_emulation():
    """One local expert (expert parallelism over as many ranks as experts): torchtitan pads the
    routed tokens past the group's end (``_permute``), and the one-group weight gradient is a
    plain GEMM over all rows. Its operands' rows past the group were never written (whatever
    memory they got; here freed fp8 NaNs of their sizes); now they are zeros, and the CUDA
    gradients match the emulated ones."""
    torch.manual_seed(0)
    w = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.tensor([M - 96], device="cuda", dtype=torch.int32)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    x[M - 96 :] = 0  # torchtitan's padding rows
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

    def expert(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    results = []
    for emulate in (True, False):
        poison = [torch.full((n * M,), 0x7F, device="cuda", dtype=torch.uint8) for n in (D, H) * 8]
        del poison  # back to the allocator's free blocks, contents kept
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(emulate=emulate)))
        xi = x.clone().requires_grad_()
        out = expert(xi, weight)
        out.backward(grad)
        results.append((out[: M - 96], xi.grad[: M - 96], weight.grad))
    for emulated, cuda in zip(*results, strict=True):
        assert cuda.isfinite().all()
        assert sqnr(emulated.float(), cuda.float()) > 35


@pytest.mark.parametrize(
    "forward,shape",
    [(_routed, (E, H, D)), (_grouped_shared, (1, H, D)), (_linear, (H, D))],
    ids=["routed", "grouped_shared", "linear"],
)
def test_cuda_autocast_gives_the_plain_weights_dtype(forward, shape):
    """Under CUDA autocast (torchtitan's single-GPU and DDP runs) an fp32 activation times a
    converted fp32 weight comes out in the dtype the plain weight gives, within the SQNR bar
    of that product."""
    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda") * 0.02
    x = torch.randn(M, D, device="cuda")
    weight = Float8MoEWeight(w.clone(), WeightConfig(emulate=False))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = forward(x, w)
        out = forward(x, weight)
    assert out.dtype == expected.dtype
    assert sqnr(expected.float(), out.float()) > 23


@pytest.mark.parametrize(
    "forward,shape",
    [(_routed, (E, H, D)), (_grouped_shared, (1, H, D)), (_linear, (H, D))],
    ids=["routed", "grouped_shared", "linear"],
)
def test_blockwise_cuda_kernels_match_emulation(forward, shape):
    """The blockwise recipe's CUDA GEMMs (fp8/kernels/blockwise_gemm.py) against its emulation:
    same fp8 operands and scales (OFFS' groups start at multiples of 128, as the CUDA kernels'
    weight-gradient blocks need)."""
    pytest.importorskip("torchtitan_fp8_moe.fp8.kernels.blockwise_gemm")
    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    results = []
    for emulate in (True, False):
        config = WeightConfig("blockwise", emulate=emulate)
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), config))
        xi = x.clone().requires_grad_()
        out = forward(xi, weight)
        out.backward(grad)
        results.append((out, xi.grad, weight.grad))
    for emulated, cuda in zip(*results, strict=True):
        assert sqnr(emulated, cuda) > 35


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((4096, 5120), torch.bfloat16),
        ((999, 8192), torch.bfloat16),
        ((64, 300), torch.float32),
        ((3, 16, 40), torch.bfloat16),
    ],
)
def test_rowwise_kernel_matches_the_torch_rules(shape, dtype):
    """Our one-pass Triton kernel gives the bytes and scales of quantize.py's torch rules, on
    rows spanning 10 decades of magnitude, an all-zero row and a row at the fp8 limit."""
    from torchtitan_fp8_moe.fp8 import quantize_rowwise
    from torchtitan_fp8_moe.fp8.kernels.triton_rowwise import rowwise_fp8

    torch.manual_seed(0)
    rows = torch.logspace(-6, 4, shape[-2], device="cuda").unsqueeze(-1)
    x = (torch.randn(shape, device="cuda") * rows).to(dtype)
    x[..., 0, :] = 0
    x[..., 1, :] = 448.0
    data, scales = rowwise_fp8(x)
    ref_data, ref_scales = quantize_rowwise(x, dim=-1)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


def test_rowwise_kernel_keeps_non_finite_values_in_their_rows():
    """A NaN or Inf makes its own row non-finite (never silently finite); other rows exact."""
    from torchtitan_fp8_moe.fp8 import quantize_rowwise
    from torchtitan_fp8_moe.fp8.kernels.triton_rowwise import rowwise_fp8

    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    x[2, 5], x[5, 7] = float("nan"), float("inf")
    data, scales = rowwise_fp8(x)
    ref_data, ref_scales = quantize_rowwise(x, dim=-1)
    finite_rows = [r for r in range(8) if r not in (2, 5)]
    assert torch.equal(data[finite_rows].view(torch.uint8), ref_data[finite_rows].view(torch.uint8))
    assert torch.equal(scales[finite_rows], ref_scales[finite_rows])
    assert data[2, 5].float().isnan() and data[5, 7].float().isnan()


@pytest.mark.parametrize("stored_shape", [(E, H, D), (3, 1000, 77), (1, 8192, 5120)])
def test_weight_quantizers_match_the_torch_rules(stored_shape):
    """Both weight orientations on CUDA (our kernels: the forward cast with the amax over N, and
    the transposed cast from it) give the torch rules' bytes and scales, for weights whose rows
    are not a multiple of a program's, and the seed's [1, 8192, 5120] shared expert; NaN stays
    in its own rows."""
    from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS
    from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS

    torch.manual_seed(0)
    stored = torch.randn(stored_shape, device="cuda") * torch.logspace(
        -4, 4, stored_shape[-1], device="cuda"
    )
    b = stored.bfloat16().transpose(-2, -1)
    data, scales, amax = TRITON_QUANTIZERS.weight(b)
    ref_data, ref_scales, ref_amax = TORCH_QUANTIZERS.weight(b)
    assert torch.equal(amax, ref_amax)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    data_t, scales_t = TRITON_QUANTIZERS.weight_transposed(b, amax)
    ref_data_t, ref_scales_t = TORCH_QUANTIZERS.weight_transposed(b, ref_amax)
    assert torch.equal(scales_t, ref_scales_t)
    assert torch.equal(data_t.view(torch.uint8), ref_data_t.view(torch.uint8))
    assert data_t.stride() == (b.shape[1] * b.shape[2], 1, b.shape[2])
    b_nan = b.clone()
    b_nan[0, 3, 5] = float("nan")
    data, _, amax = TRITON_QUANTIZERS.weight(b_nan)
    data_t, _ = TRITON_QUANTIZERS.weight_transposed(b_nan, amax)
    assert data.float().isnan().nonzero().tolist() == [[0, 3, 5]]
    assert data_t.float().isnan().nonzero().tolist() == [[0, 5, 3]]


def test_per_group_kernel_matches_the_torch_rules_for_every_token_count():
    """Our per-group column-wise cast (the weight gradient's operands) equals the torch rules
    for token counts that change from call to call, as they do under expert parallelism, and
    with empty groups and rows past the last group (zeros in the outputs)."""
    from torchtitan_fp8_moe.fp8.recipes.rowwise.torch_quantizers import TORCH_QUANTIZERS
    from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS

    torch.manual_seed(0)
    for tokens in (16, 200, 1000, 4111):
        a = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16) * 1e-3
        ends = sorted(torch.randint(0, tokens + 1, (E - 1,)).tolist()) + [tokens - tokens % 16]
        offs = torch.tensor(sorted(ends), device="cuda", dtype=torch.int32)
        rows = int(offs[-1])
        # The second call casts only the new gradient and reuses a's cast (fp8/cast_reuse.py).
        for grad_i in (grad, grad * 7):
            got = TRITON_QUANTIZERS.tokens_per_group_pair(a, grad_i, offs)
            want = TORCH_QUANTIZERS.per_group_pair(a, grad_i, offs)
            for data, ref in ((got[0], want[0]), (got[2], want[2])):
                assert data.stride() == (1, -(-tokens // 16) * 16), "rows to a multiple of 16"
                assert torch.equal(data[:rows].float(), ref[:rows].float()), tokens
                assert not data[rows:].float().any(), "rows of no group are zeros"
            assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3]), tokens


def test_weight_cache_on_cuda_matches_uncached():
    """The fp8 weight cache on the CUDA path: two micro-batches, bit-identical gradients, and
    one quantization of the weight (forward orientation only: x needs no gradient)."""
    torch.manual_seed(0)
    w = torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) * 0.02
    grads = []
    for cache in (False, True):
        weight = torch.nn.Parameter(
            Float8MoEWeight(w.clone(), WeightConfig(emulate=False, cache_fp8=cache))
        )
        for micro in range(2):
            torch.manual_seed(micro)
            x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
            _routed(x, weight).float().square().sum().backward()
        grads.append(weight.grad)
    assert torch.equal(grads[0], grads[1])
    assert weight._cache.quantizations == 1


def test_compiled_projection_equals_eager_on_cuda():
    """torch.compile(fullgraph=True) of a routed projection's forward and backward on CUDA: our
    kernels run as custom ops there and as plain calls in eager mode, with the same bytes."""
    torch.manual_seed(0)
    w = torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    results = []
    for forward in (_routed, torch.compile(_routed, fullgraph=True)):
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(emulate=False)))
        x_in = x.clone().requires_grad_()
        out = forward(x_in, weight)
        out.float().square().sum().backward()
        results.append((out, x_in.grad, weight.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("experts,world", [(4, 2), (3, 2), (1, 2)], ids=["even", "uneven", "seed"])
def test_fp8_all_gather_on_cuda_equals_the_unsharded_weight(experts, world):
    """`fp8_all_gather`'s hooks with the Triton quantizers, FSDP2's all-gather done by hand for
    `world` shards on one GPU: outputs and both gradients equal the unsharded weight's bit for
    bit, ranks of padding only included, eager and compiled by inductor (the gathered weight as a
    graph input)."""
    torch.manual_seed(0)
    w = (torch.randn(experts, H, D, device="cuda") * 0.02).bfloat16()
    unsharded = gathered_by_hand(w, world, emulate=False)
    # Token groups aligned to 16, as the fp8 grouped GEMM needs (torchtitan pads them so).
    group = M // experts // 16 * 16
    offs = torch.tensor([group * (e + 1) for e in range(experts - 1)] + [M], dtype=torch.int32)
    offs = offs.cuda()
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

    def experts_fn(x, weight):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    compiled_fn = torch.compile(experts_fn, fullgraph=True)
    results = []
    for weight, fn in [
        (Float8MoEWeight(w.clone(), WeightConfig(emulate=False)), experts_fn),
        (unsharded, experts_fn),
        (unsharded, compiled_fn),
    ]:
        param = torch.nn.Parameter(weight)
        xi = x.clone().requires_grad_()
        out = fn(xi, param)
        out.backward(grad)
        results.append((out, xi.grad, param.grad))
    reference = results[0]
    for result in results[1:]:
        for value, expected in zip(result, reference, strict=True):
            assert torch.equal(value, expected)


# K = D, and K long enough for the weight cast that takes the amax over N in its own read.
@pytest.mark.parametrize("dim", [D, 5120])
def test_lazy_cast_on_cuda_keeps_no_bf16_copy(dim):
    """torchtitan's ``w.bfloat16()`` of an fp32 parameter (one GPU, DDP): what the forward
    keeps for the backward holds no bf16 copy of the weight, the results equal a copied cast's
    bit for bit (our kernels round the fp32 values as they read them) and match the emulated
    path."""
    torch.manual_seed(0)
    w = torch.randn(E, H, dim, device="cuda") * 0.02
    x = torch.randn(M, dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    results, kept = [], {}
    for name, emulate, cast in [
        ("lazy_emulated", True, lambda p: p.bfloat16()),
        ("lazy", False, lambda p: p.bfloat16()),
        ("copied", False, lambda p: p.bfloat16().clone()),
    ]:
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig(emulate=emulate)))
        xi = x.clone().requires_grad_()
        out = _routed(xi, cast(weight))
        torch.cuda.synchronize()
        with_graph = torch.cuda.memory_allocated()
        del out  # frees what the forward kept for the backward
        kept[name] = with_graph - torch.cuda.memory_allocated()
        out = _routed(xi, cast(weight))
        out.backward(grad)
        results.append((out, xi.grad, weight.grad))
    # the bf16 copy, less the lazy operand's one-element tensor (a 512-byte block)
    assert kept["copied"] - kept["lazy"] >= w.numel() * 2 - 512
    for emulated, cuda, copied in zip(*results, strict=True):
        assert cuda.dtype == emulated.dtype
        assert sqnr(emulated.float(), cuda.float()) > 35
        assert torch.equal(cuda, copied)
    assert results[1][2].dtype == torch.float32


def test_compiled_lazy_cast_keeps_no_weight_copy():
    """torchtitan's compiled routed experts (``w.bfloat16()`` inside the compiled function): the
    lazy cast leaves no weight-sized tensor for the backward, where copied casts kept one (the
    bf16 copy, or inductor's fp8 copy of its transpose, at least one byte per element), and the
    results equal eager's copied cast bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(E, H, D, device="cuda") * 0.02
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

    def experts(x, weight):
        return _routed(x, weight.bfloat16())

    results, kept = {}, {}
    for name, lazy_cast, compiled in [
        ("eager_copied", False, False),
        ("compiled_copied", False, True),
        ("compiled_lazy", True, True),
    ]:
        torch._dynamo.reset()
        fn = torch.compile(experts, fullgraph=True) if compiled else experts
        config = WeightConfig(emulate=False, lazy_cast=lazy_cast)
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), config))
        xi = x.clone().requires_grad_()
        fn(xi, weight).backward(grad)  # compiles
        weight.grad = xi.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn(xi, weight)
        torch.cuda.synchronize()
        kept[name] = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        out.backward(grad)
        results[name] = (out, xi.grad, weight.grad)
    assert kept["compiled_copied"] - kept["compiled_lazy"] >= w.numel() - 512, kept
    for name in ("compiled_copied", "compiled_lazy"):
        for value, expected in zip(results[name], results["eager_copied"], strict=True):
            assert torch.equal(value, expected), name


def test_compiled_silu_gradients_are_stored_fewer_times():
    """torchtitan's compiled routed experts: with our kernels reading their inputs through an
    ``as_strided`` view (``fp8/opaque.py``), inductor stores the SiLU backward's two gradients
    fewer times than without it, where it copied each for every kernel that reads it (one store
    per reading kernel in the Scout trainer's kernel).
    The results are the same bits either way, and near eager's: inductor fuses SiLU and the
    product into one rounding to bf16 where eager rounds twice, so the fp8 casts of the product
    may differ in a few elements."""
    import re

    from torch._inductor.utils import fresh_cache, run_and_get_code
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    from torchtitan_fp8_moe.fp8 import opaque

    torch.manual_seed(0)
    shapes = ((E, H, D), (E, D, H), (E, H, D))
    weights = [torch.randn(*shape, device="cuda") * 0.02 for shape in shapes]
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    tokens = torch.tensor([512, 0, 1024, 512], device="cuda")

    def step(fn):
        params = [torch.nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig())) for w in weights]
        xi = x.clone().requires_grad_()
        out = fn(*params, xi, tokens)
        out.backward(grad)
        return [out, xi.grad, *(p.grad for p in params)]

    def silu_backward_stores():
        torch._dynamo.reset()
        compiled = torch.compile(_run_experts_grouped_mm, fullgraph=True)
        with fresh_cache():  # inductor generates the code, not its cache
            results, codes = run_and_get_code(step, compiled)
        kernels = "".join(codes).split("async_compile.triton(")
        silu = [k.split("device_str=")[0] for k in kernels if re.match(r"'triton_\w*silu_backw", k)]
        assert silu
        return results, sum(kernel.count("tl.store(") for kernel in silu)

    expected = step(_run_experts_grouped_mm)
    results, stores = silu_backward_stores()
    as_strided_self = opaque._as_strided_self
    try:
        opaque._as_strided_self = lambda value: value
        results_without, stores_without = silu_backward_stores()
    finally:
        opaque._as_strided_self = as_strided_self
        torch._dynamo.reset()
    assert stores < stores_without, (stores, stores_without)
    for value, without, want in zip(results, results_without, expected, strict=True):
        assert torch.equal(value, without)
        assert sqnr(want, value) >= 30


def test_a_shared_experts_backward_keeps_no_cast_after_it():
    """A FeedForward's w1 and w3 cast the same tokens per group in backward; whatever the last
    one keeps is dropped when the backward ends (it lived into the next step before)."""
    from torchtitan.models.moe.moe import FeedForward

    from torchtitan_fp8_moe.fp8 import cast_reuse
    from torchtitan_fp8_moe.swap import swap_expert_weights

    torch.manual_seed(0)
    ffn = FeedForward(D, H).cuda().bfloat16()
    swap_expert_weights(ffn, WeightConfig(emulate=False))
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ffn(x).sum().backward()
    assert cast_reuse._slot.kept is None


def test_compiled_shared_expert_casts_its_tokens_once():
    """A FeedForward shared expert compiled (w1 and w3: ``F.linear`` of the same tokens): one
    fp8 cast of the tokens forward and one for both weight gradients, where the compiled code
    without AOTAutograd's CSE casts them for each (``RowwiseTritonQuantizers.tokens``; w2's
    casts are triton ops), with the same bits, and near eager's (inductor rounds SiLU and the
    product once, eager twice)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.utils import fresh_cache, run_and_get_code
    from torchtitan.models.moe.moe import FeedForward

    from torchtitan_fp8_moe.swap import swap_expert_weights

    torch.manual_seed(0)
    ffn = FeedForward(D, H).cuda().bfloat16()
    swap_expert_weights(ffn, WeightConfig(emulate=False))
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)

    def step(fn):
        ffn.zero_grad()
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.backward(grad)
        return [out, xi.grad, *(p.grad.clone() for p in ffn.parameters())]

    def compiled(cse: bool):
        torch._dynamo.reset()
        with fresh_cache(), functorch_config.patch(cse=cse):
            results, codes = run_and_get_code(step, torch.compile(ffn, fullgraph=True))
        return results, shared_token_cast_calls("\n".join(codes))

    expected = step(ffn)
    try:
        (results, casts), (separate, separate_casts) = compiled(True), compiled(False)
    finally:
        torch._dynamo.reset()
    assert casts == (1, 1) and separate_casts == (2, 2), (casts, separate_casts)
    for value, apart, want in zip(results, separate, expected, strict=True):
        assert torch.equal(value, apart)
        assert sqnr(want, value) >= 30


@pytest.mark.parametrize("quantizer", ["pair_op", "tokens_per_group_pair"])
def test_compiled_chunked_per_group_cast_equals_eager(quantizer):
    """The weight gradient's per-group cast of a shared expert (one group: the chunked kernels,
    which take each operand's amax by atomic max into a zeroed buffer) compiled by inductor
    equals eager, with the allocator's free blocks holding large values first. With both amax
    buffers slices of one, inductor cloned the second from outside its slice and the compiled
    trainer's shared-expert weight gradients came out wrong (docs/limitations.md). The pair op
    (eager's cast) and the quantizer (compiled: the tokens' cast, shared, and the gradient's)."""
    from torchtitan_fp8_moe.fp8.kernels.triton_per_group import per_group_colwise_fp8_pair
    from torchtitan_fp8_moe.fp8.recipes.rowwise.triton_quantizers import TRITON_QUANTIZERS

    cast = {
        "pair_op": per_group_colwise_fp8_pair,
        "tokens_per_group_pair": TRITON_QUANTIZERS.tokens_per_group_pair,
    }[quantizer]
    torch.manual_seed(0)
    tokens, k, n = 8192, 5120, 8192  # Scout's shared expert, w1 / w3
    a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    offs = torch.tensor([tokens], device="cuda", dtype=torch.int32)

    def both(a, grad, offs):  # two casts of the same shapes in one graph, as w3's then w1's
        return cast(a, grad, offs), cast(a, grad * 2, offs)

    expected = both(a, grad, offs)
    compiled = torch.compile(both, fullgraph=True)
    for _ in range(2):
        poison = [torch.full((8192,), 1e4, device="cuda") for _ in range(512)]
        del poison  # back to the allocator's free blocks, contents kept
        for want, got in zip(expected, compiled(a, grad, offs), strict=True):
            for x, y in zip(want, got, strict=True):
                if x.dtype.itemsize == 1:
                    x, y = x.view(torch.uint8), y.view(torch.uint8)
                assert torch.equal(x, y)


def test_timing_policy_keeps_fp8_where_it_pays_on_this_gpu():
    """measure.py on the GPU: Scout's routed w1 and w3 at 64K tokens (fp8 well ahead of bf16 there,
    docs/benchmarks/README.md) are kept fp8; a tiny weight, where fp8's extra kernel launches cost
    more than its GEMM saves, stays bf16. convert with policy "measure" times, says so, frees what
    it timed with and leaves the CUDA generator as it was."""
    from expert_modules import scout_meta_model

    from torchtitan_fp8_moe import convert
    from torchtitan_fp8_moe.measure import WeightCase, time_cases

    scout = WeightCase(65536, (16, 8192, 5120), "bfloat16", 2)
    tiny = WeightCase(256, (4, 256, 128), "bfloat16")
    timings = time_cases({scout, tiny}, WeightConfig("rowwise", False), 16, torch.device("cuda"))
    assert timings[scout].fp8_pays, timings[scout]
    assert not timings[tiny].fp8_pays, timings[tiny]
    allocated, rng_state = torch.cuda.memory_allocated(), torch.cuda.get_rng_state()
    plan = convert(scout_meta_model(), emulate=False, tokens=65536, policy="measure")
    routed = [row for row in plan if ".experts." in row.fqn]
    assert all(row.fp8 and "(measure: measured" in row.path for row in routed), plan
    assert torch.cuda.memory_allocated() == allocated
    assert torch.equal(torch.cuda.get_rng_state(), rng_state)
