"""The SiLU backward's stores in inductor's code for torchtitan's compiled routed experts, on a
CPU: Triton's front end gets a CUDA target (no GPU needed to trace our kernels), the forward and
backward are lowered at compile time, and no kernel runs. ``python silu_stores_cpu.py on|off``
(off: without the ``as_strided`` reads of ``fp8/opaque.py``)."""

import re
import sys

import torch
import torch._functorch.config as functorch_config
import torch._inductor.async_compile as async_compile
import torch._inductor.config as inductor_config
import torch._inductor.graph as inductor_graph
import triton
from torchtitan.models.moe.moe import _run_experts_grouped_mm
from triton.backends.compiler import GPUTarget

import torchtitan_fp8_moe.fp8.opaque as opaque
import torchtitan_fp8_moe.weight.base as weight_base
from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig


class _CudaTarget:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _NotRun:
    def __getattr__(self, name):
        raise RuntimeError("not run")


codes = []
_codegen = inductor_graph.GraphLowering.codegen


def _keep_code(self):
    out = _codegen(self)
    codes.append(out[0].value)
    return out


triton.runtime.driver.set_active(_CudaTarget())
functorch_config.force_non_lazy_backward_lowering = True
inductor_config.force_disable_caches = True
inductor_graph.GraphLowering.codegen = _keep_code
async_compile.AsyncCompile.triton = lambda self, *args, **kwargs: _NotRun()
weight_base.fp8_kernels_available = lambda device: True
if sys.argv[1] == "off":
    opaque._as_strided_self = lambda value: value

E, D, H, M = 4, 512, 1024, 2048
torch.manual_seed(0)
params = [
    torch.nn.Parameter(Float8MoEWeight(torch.randn(*s) * 0.02, WeightConfig(emulate=False)))
    for s in ((E, H, D), (E, D, H), (E, H, D))
]
x = torch.randn(M, D, dtype=torch.bfloat16, requires_grad=True)
try:
    torch.compile(_run_experts_grouped_mm, fullgraph=True)(
        *params, x, torch.tensor([512, 0, 1024, 512])
    )
except RuntimeError as error:
    print("stopped before running:", str(error)[-60:])
for call in re.findall(r"\n\s+(cpp_fused\w*silu_backward\w*)\((.*?)\)\n", "".join(codes)):
    print(call[0], "buffers:", call[1])
