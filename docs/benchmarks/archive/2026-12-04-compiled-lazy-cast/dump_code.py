"""Inductor's code for torchtitan's compiled routed experts over converted fp32 weights."""

import torch
import torch._dynamo.config
from torchtitan.models.moe.moe import _run_experts_grouped_mm

from torchtitan_fp8_moe.weight import Float8MoEWeight, WeightConfig

torch._dynamo.config.capture_scalar_outputs = True
E, D, H, M = 4, 512, 1024, 2048
torch.manual_seed(0)
ws = [
    torch.nn.Parameter(Float8MoEWeight(torch.randn(*s, device="cuda") * 0.02, WeightConfig()))
    for s in ((E, H, D), (E, D, H), (E, H, D))
]
x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
tokens = torch.tensor([512, 512, 512, 512], device="cuda")
fn = torch.compile(_run_experts_grouped_mm, fullgraph=True)
out = fn(ws[0], ws[1], ws[2], x, tokens)
out.float().sum().backward()
torch.cuda.synchronize()
print("done")
