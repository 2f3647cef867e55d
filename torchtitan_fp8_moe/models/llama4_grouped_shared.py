"""`llama4_grouped_shared`: Llama4 with its shared expert stored the way torchtitan's original
Llama4 (0.1.0) stored it, the layout of the seed bug: `layers.N.moe.shared_expert` holds
`[1, hidden, dim]` / `[1, dim, hidden]` grouped weights run as a 3D x 3D `torch._grouped_mm`.
Same flavors, parallelization and training components as torchtitan's `llama4`."""

from dataclasses import replace

from torchtitan.models.llama4 import Transformer, TransformerModelArgs, get_train_spec
from torchtitan.protocols.train_spec import TrainSpec

from .grouped_shared import GroupedSharedMoE

NAME = "llama4_grouped_shared"


class GroupedSharedTransformer(Transformer):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(model_args)
        for block in self.layers.values():
            if block.moe_enabled:
                hidden_dim = block.moe.experts.w1.shape[1]
                block.moe = GroupedSharedMoE(model_args.moe_args, model_args.dim, hidden_dim)


def grouped_shared_train_spec() -> TrainSpec:
    # No HF state-dict adapter: HF Llama4 checkpoints store the shared expert as linears.
    return replace(get_train_spec(), model_cls=GroupedSharedTransformer, state_dict_adapter=None)
