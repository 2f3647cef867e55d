"""`llama4_grouped_shared`: Llama4 with its shared expert stored the way torchtitan's original
Llama4 (0.1.0) stored it, the layout of the seed bug: `layers.N.moe.shared_expert` holds
`[1, hidden, dim]` / `[1, dim, hidden]` grouped weights run as a 3D x 3D `torch._grouped_mm`.
Same flavors, parallelization and training components as torchtitan's `llama4`."""

from dataclasses import replace

from torchtitan.models.llama4 import Transformer, TransformerModelArgs, get_train_spec
from torchtitan.models.llama4.infra.parallelize import parallelize_llama
from torchtitan.protocols.train_spec import TrainSpec

from .grouped_shared import GroupedSharedMoE, tensor_parallelize_shared_expert

NAME = "llama4_grouped_shared"


class GroupedSharedTransformer(Transformer):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(model_args)
        for block in self.layers.values():
            if block.moe_enabled:
                hidden_dim = block.moe.experts.w1.shape[1]
                block.moe = GroupedSharedMoE(model_args.moe_args, model_args.dim, hidden_dim)


def parallelize_grouped_shared(model, parallel_dims, job_config):
    """torchtitan's Llama4 parallelization, plus the grouped shared expert's tensor-parallel
    split, which torchtitan's plan (written for a FeedForward at ``shared_experts``) lacks."""
    if parallel_dims.tp_enabled:
        for block in model.layers.values():
            if block.moe_enabled and block.moe.shared_expert is not None:
                tensor_parallelize_shared_expert(
                    block.moe.shared_expert, parallel_dims.get_mesh("tp")
                )
    return parallelize_llama(model, parallel_dims, job_config)


def grouped_shared_train_spec() -> TrainSpec:
    # No HF state-dict adapter: HF Llama4 checkpoints store the shared expert as linears.
    return replace(
        get_train_spec(),
        model_cls=GroupedSharedTransformer,
        state_dict_adapter=None,
        parallelize_fn=parallelize_grouped_shared,
    )
