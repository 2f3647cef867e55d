"""The CUDA code path on CPU (``harness/cuda_path_on_cpu.py``: our Triton kernels in Triton's
interpreter writing the GPU's fp8 bytes, torch's fp8 GEMMs as their CUDA kernels define them,
``torch.empty`` poisoned): outputs and gradients equal the emulated path's, whose quantization
is the torch rules and whose GEMMs are fp32 sums of the same values, up to summation order.

What the GPU tests check only where a GPU is lent, CI checks here on every change: the kernels'
layouts against the GEMMs' requirements, the weight gradient's group ends, rows of no group
(torchtitan's padding, one local expert), the fp8 all-gather's CUDA quantizers, torchtitan's
MoE layer end to end."""

import pytest
import torch
import torch.nn.functional as F
from harness.interpreted import run_interpreted

pytestmark = pytest.mark.slow

D, H, E, M = 64, 96, 4, 256
ENDS = [48, 48, 160, 224]  # an empty group, rows past the last group


def _assert_equal_up_to_summation_order(cuda_path, emulated, what) -> None:
    assert cuda_path.dtype == emulated.dtype and cuda_path.shape == emulated.shape, what
    torch.testing.assert_close(cuda_path.float(), emulated.float(), rtol=1e-2, atol=1e-6, msg=what)


def _check_call_forms() -> None:
    from expert_modules import emulated_and_cuda_path
    from harness import cuda_path_on_cpu

    from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

    cuda_path_on_cpu.install()
    offs = torch.tensor(ENDS, dtype=torch.int32)
    one_group = torch.tensor([M - 32], dtype=torch.int32)

    def routed(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def routed_lazy_cast(x, w):  # torchtitan's w.bfloat16() of an fp32 parameter
        return torch._grouped_mm(x, w.bfloat16().transpose(-2, -1), offs=offs)

    def one_local_expert(x, w):  # its padding rows past the group (torchtitan's _permute)
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=one_group)

    def grouped_shared(x, w):
        return torch._grouped_mm(x.unsqueeze(0), w.transpose(-2, -1)).squeeze(0)

    def batched(x, w):  # two batch entries of M / 2 tokens
        return torch._grouped_mm(x.view(2, M // 2, D), w.transpose(-2, -1)).view(M, H)

    # (name, forward, weight shape, weight dtype, tokens): a shared expert's tokens per
    # micro-batch need not be a multiple of 16, which its weight gradient contracts over.
    cases = [
        ("routed", routed, (E, H, D), torch.bfloat16, M),
        ("routed_lazy_cast", routed_lazy_cast, (E, H, D), torch.float32, M),
        ("one_local_expert", one_local_expert, (1, H, D), torch.bfloat16, M),
        ("grouped_shared", grouped_shared, (1, H, D), torch.bfloat16, M),
        ("grouped_shared_odd_tokens", grouped_shared, (1, H, D), torch.bfloat16, M - 7),
        ("batched", batched, (2, H, D), torch.bfloat16, M),
        ("linear", F.linear, (H, D), torch.bfloat16, M),
        ("linear_odd_tokens", F.linear, (H, D), torch.bfloat16, M - 7),
        ("linear_fp32", F.linear, (H, D), torch.float32, M),
    ]
    for name, forward, shape, dtype, tokens in cases:
        torch.manual_seed(0)
        w = torch.randn(shape, dtype=dtype) * 0.02
        x_dtype = torch.bfloat16 if name == "routed_lazy_cast" else dtype
        x = torch.randn(tokens, D, dtype=x_dtype)
        grad = torch.randn(tokens, H, dtype=x_dtype)
        if name == "one_local_expert":
            x[M - 32 :] = 0
        emulated, cuda_path = emulated_and_cuda_path(forward, w, x, grad)
        rows = {"routed": ENDS[-1], "routed_lazy_cast": ENDS[-1], "one_local_expert": M - 32}
        kept = rows.get(name, tokens)  # rows of no group: the GEMM's unwritten memory in both
        for what, got, want in zip(("out", "x.grad", "w.grad"), cuda_path, emulated, strict=True):
            if what != "w.grad":
                got, want = got[:kept], want[:kept]
            _assert_equal_up_to_summation_order(got, want, f"{name} {what}")
    # Batch entries of other than a multiple of 16 rows: a clear error where the weight gets a
    # gradient (not a device assert); without one the forward runs.
    w = torch.randn(2, H, D, dtype=torch.bfloat16) * 0.02
    weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), WeightConfig()))
    x = torch.randn(2, 40, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="each batch entry's 40 rows to be a multiple of 16"):
        torch._grouped_mm(x, weight.transpose(-2, -1))
    with torch.no_grad():
        out = torch._grouped_mm(x, weight.transpose(-2, -1))
        emulated = Float8MoEWeight(w.clone(), WeightConfig(emulate=True))
        want = torch._grouped_mm(x, emulated.transpose(-2, -1))
    _assert_equal_up_to_summation_order(out, want, "batched, no gradient")


def test_call_forms_on_the_cuda_path_equal_the_emulated_path():
    """Routed experts with an empty group and rows past the last one, the lazy bf16 cast of an
    fp32 weight, one local expert with padding rows, the grouped shared expert, 3D x 3D batches,
    linear layers in bf16 and fp32, shared experts of token counts not a multiple of 16:
    forward, input and weight gradients; batch entries of such counts are refused clearly."""
    run_interpreted("test_cuda_path_interpreted", "_check_call_forms")


def _check_fp8_all_gather() -> None:
    from expert_modules import gathered_by_hand
    from harness import cuda_path_on_cpu

    from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

    cuda_path_on_cpu.install()
    # Even, uneven, the seed's one expert, ranks holding only padding (1 expert over 3 ranks, 3
    # over 4, 5 over 8).
    for experts, world in ((4, 2), (3, 2), (1, 2), (1, 3), (3, 4), (5, 8)):
        torch.manual_seed(0)
        w = (torch.randn(experts, H, D) * 0.02).bfloat16()
        group = M // experts // 16 * 16
        offs = torch.tensor([group * (e + 1) for e in range(experts - 1)] + [M], dtype=torch.int32)
        x = torch.randn(M, D, dtype=torch.bfloat16)
        grad = torch.randn(M, H, dtype=torch.bfloat16)
        results = []
        for weight in (
            Float8MoEWeight(w.clone(), WeightConfig(emulate=False)),
            gathered_by_hand(w, world, emulate=False),
        ):
            param = torch.nn.Parameter(weight)
            xi = x.clone().requires_grad_()
            out = torch._grouped_mm(xi, param.transpose(-2, -1), offs=offs)
            out.backward(grad)
            results.append((out, xi.grad, param.grad))
        for what, gathered, plain in zip(("out", "x.grad", "w.grad"), *results[::-1], strict=True):
            assert torch.equal(gathered, plain), (experts, world, what)


def test_fp8_all_gather_on_the_cuda_path_equals_the_unsharded_weight():
    """``fp8_all_gather``'s hooks with the CUDA quantizers, FSDP2's all-gather done by hand: even
    and uneven shards, the seed's one-expert weight and ranks that hold only padding give the
    plain weight's bits."""
    run_interpreted("test_cuda_path_interpreted", "_check_fp8_all_gather")


def _check_moe_layers() -> None:
    import copy

    from harness import cuda_path_on_cpu
    from torchtitan.models.moe.moe import MoE, MoEArgs
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    import torchtitan_fp8_moe
    from torchtitan_fp8_moe import cpu
    from torchtitan_fp8_moe.models.grouped_shared import GroupedSharedMoE

    cuda_path_on_cpu.install()
    cpu.enable_moe_ops()
    # What convert() sets where CUDA is present: token groups padded to 16 rows.
    set_token_group_alignment_size_m(16)
    # (routed experts, top k, shared experts, fp8 weight cache, module): top 2 with a shared
    # expert, one local expert (torchtitan pads its tokens past the group), 8 experts top 1
    # (some get no token), the weight cache over two micro-batches (gradient accumulation), the
    # seed's layout (the shared expert a grouped [1, hidden, dim] module).
    for experts, top_k, shared, cache, module in (
        (4, 2, 1, False, MoE),
        (1, 1, 0, False, MoE),
        (8, 1, 1, False, MoE),
        (4, 2, 1, True, MoE),
        (4, 1, 1, False, GroupedSharedMoE),
    ):
        args = MoEArgs(num_experts=experts, num_shared_experts=shared, top_k=top_k)
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        base = module(args, dim=D, hidden_dim=H)
        torch.set_default_dtype(default_dtype)
        with torch.no_grad():
            base.init_weights(0.02, torch.device("cpu"))
        micro_batches = [torch.randn(2, 60, D, dtype=torch.bfloat16) for _ in range(1 + cache)]
        results = []
        for emulate in (True, False):
            layer = copy.deepcopy(base)
            torchtitan_fp8_moe.convert(
                layer, emulate=emulate, policy="always", cache_fp8_weights=cache
            )
            for x in micro_batches:
                xi = x.clone().requires_grad_()
                out = layer(xi)
                out.float().square().sum().backward()
            grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
            results.append({"out": out, "x.grad": xi.grad, **grads})
        emulated, cuda_path = results
        assert emulated.keys() == cuda_path.keys()
        for what, want in emulated.items():
            case = f"{module.__name__}, {experts} experts, top {top_k}, {shared} shared, "
            case += f"cache {cache}: {what}"
            _assert_equal_up_to_summation_order(cuda_path[what], want, case)


def test_torchtitan_moe_layers_on_the_cuda_path_equal_the_emulated_path():
    """torchtitan's MoE layer converted with the CUDA path and emulated: output, input gradient
    and every parameter's gradient, with a shared expert, with one local expert, with experts
    that get no token, with the fp8 weight cache over two micro-batches, and in the seed's
    layout (a grouped [1, hidden, dim] shared expert)."""
    run_interpreted("test_cuda_path_interpreted", "_check_moe_layers")
