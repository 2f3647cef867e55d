"""The CUDA fp8 kernels against the emulated path: same quantization, so the results agree up
to fp32 accumulation order. Runs only on CUDA devices with fp8 (sm89+); skipped elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_fp8_moe.weight import Float8MoEWeight, fp8_kernels_available

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


def _sqnr(ref, actual):
    return (20 * torch.log10(ref.float().norm() / (ref.float() - actual.float()).norm())).item()


@pytest.mark.parametrize(
    "forward,shape,dtype",
    [
        (_routed, (E, H, D), torch.bfloat16),
        (_grouped_shared, (1, H, D), torch.bfloat16),
        (_linear, (H, D), torch.bfloat16),
        (_linear, (H, D), torch.float32),  # a FeedForward without FSDP mixed precision
    ],
    ids=["routed", "grouped_shared", "linear", "linear_fp32"],
)
def test_cuda_kernels_match_emulation(forward, shape, dtype):
    torch.manual_seed(0)
    w = torch.randn(shape, device="cuda", dtype=dtype) * 0.02
    x = torch.randn(M, D, device="cuda", dtype=dtype)
    grad = torch.randn(M, H, device="cuda", dtype=dtype)
    results = []
    for emulate in (True, False):
        weight = torch.nn.Parameter(Float8MoEWeight(w.clone(), emulate=emulate))
        xi = x.clone().requires_grad_()
        out = forward(xi, weight)
        out.backward(grad)
        results.append((out, xi.grad, weight.grad))
    for emulated, cuda in zip(*results):
        assert cuda.dtype == emulated.dtype == dtype
        assert _sqnr(emulated, cuda) > 35
