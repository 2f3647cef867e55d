"""Llama4 Scout cut down to a few layers: the real model's width and expert shapes (dim 5120,
hidden 8192, 16 routed experts, one shared expert) at a size that trains on one or two GPUs, for
end-to-end bf16-vs-fp8 runs. The vocabulary is the bundled tokenizer's (2048), so the embedding
and output layers do not dwarf the experts being measured."""

import copy
from dataclasses import replace

from torchtitan.models.llama4 import llama4_args

SCOUT_SLICES = {
    f"scout_{n_layers}layers": replace(
        copy.deepcopy(llama4_args["17bx16e"]), n_layers=n_layers, vocab_size=2048
    )
    for n_layers in (2, 4)
}
