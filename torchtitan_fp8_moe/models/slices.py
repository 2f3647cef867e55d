"""Real MoE models cut down to a few layers: their width and expert shapes at a size that trains
on one or two GPUs, for end-to-end bf16-vs-fp8 runs. Llama4 Scout (dim 5120, hidden 8192, 16
routed experts, one shared expert) shows where fp8 pays; Qwen3-30B-A3B (dim 2048, 128 experts of
hidden 768, top 8) where the `auto` policy keeps narrow experts bf16. The vocabulary is the
bundled tokenizer's (2048), so the embedding and output layers do not dwarf the experts being
measured."""

import copy
from dataclasses import replace

from torchtitan.models.llama4 import llama4_args
from torchtitan.models.qwen3 import qwen3_args


def _cut(args, name: str) -> dict:
    """Flavors ``{name}_2layers`` and ``{name}_4layers`` of ``args``."""
    return {
        f"{name}_{n_layers}layers": replace(copy.deepcopy(args), n_layers=n_layers, vocab_size=2048)
        for n_layers in (2, 4)
    }


SCOUT_SLICES = _cut(llama4_args["17bx16e"], "scout")
QWEN3_30B_SLICES = _cut(qwen3_args["30B-A3B"], "30b_a3b")
