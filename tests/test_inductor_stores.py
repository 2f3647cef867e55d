"""What inductor stores for our Triton kernels' inputs, from its generated code on a CPU.

Triton's front end gets a CUDA target (it traces our kernels without a GPU), the backward is
lowered when the forward compiles, and no kernel runs: the check reads the code inductor writes
for torchtitan's compiled routed experts. It runs in a fresh process (it changes Triton's active
driver and inductor's kernel loading for the whole process)."""

import re

import pytest
from harness.interpreted import run_in_fresh_process

pytestmark = pytest.mark.slow


def _silu_backward_outputs(codes: list[str]) -> int:
    """How many bf16 tensors the fused SiLU-backward kernel writes: its non-const bf16 pointer
    arguments. (Inductor may fuse other work of the same element count into the kernel, such
    as the fp32 copy of a weight gradient [4, 64, 128] beside the gradients [256, 128]: those
    outputs are fp32.)"""
    kernels = re.findall(
        r"\w*silu_backward\w* = async_compile\.cpp_pybinding\((\[.*?\])", "".join(codes)
    )
    assert len(kernels) == 1, kernels
    return sum(arg == "'at::BFloat16*'" for arg in kernels[0].strip("[]").split(", "))


def _check_silu_gradients_stored_once() -> None:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch._inductor.graph as inductor_graph
    import triton
    from torchtitan.models.moe.moe import _run_experts_grouped_mm
    from triton.backends.compiler import GPUTarget

    import torchtitan_fp8_moe.weight.base as weight_base
    from torchtitan_fp8_moe.fp8 import opaque
    from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

    class CudaTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class NotRun:
        def __getattr__(self, name):
            raise RuntimeError("not run")

    codes = []
    codegen = inductor_graph.GraphLowering.codegen

    def keep_code(self):
        out = codegen(self)
        codes.append(out[0].value)
        return out

    triton.runtime.driver.set_active(CudaTarget())
    functorch_config.force_non_lazy_backward_lowering = True
    inductor_config.force_disable_caches = True
    inductor_graph.GraphLowering.codegen = keep_code
    async_compile.AsyncCompile.triton = lambda self, *args, **kwargs: NotRun()
    weight_base.fp8_kernels_available = lambda device: True  # the CUDA path's ops, on CPU

    def compiled_code() -> list[str]:
        codes.clear()
        torch._dynamo.reset()
        torch.manual_seed(0)
        experts, dim, hidden, tokens = 4, 64, 128, 256
        params = [
            torch.nn.Parameter(Float8MoEWeight(torch.randn(*s) * 0.02, WeightConfig(emulate=False)))
            for s in ((experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))
        ]
        x = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        counts = torch.tensor([64, 0, 128, 64])
        with pytest.raises(RuntimeError, match="not run"):
            torch.compile(_run_experts_grouped_mm, fullgraph=True)(*params, x, counts)
        return list(codes)

    stored_once = _silu_backward_outputs(compiled_code())
    as_strided_self = opaque._as_strided_self
    opaque._as_strided_self = lambda value: value  # without the as_strided reads
    stored_per_reader = _silu_backward_outputs(compiled_code())
    opaque._as_strided_self = as_strided_self
    # Two gradients, each stored once; without the fix, once per kernel of ours that reads it.
    assert stored_once == 2, stored_once
    assert stored_per_reader > stored_once, stored_per_reader


def test_silu_backward_stores_each_gradient_once():
    """Compiled, each SiLU-backward gradient is stored once for all our kernels that read it
    (``fp8/opaque.py``: our ops read their inputs through ``as_strided`` views while traced);
    without that, inductor stored one copy per reading kernel."""
    run_in_fresh_process("test_inductor_stores", "_check_silu_gradients_stored_once")
