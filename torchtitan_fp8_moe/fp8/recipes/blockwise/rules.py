"""The blockwise recipe's planning rules: tensor parallelism splits weights at 128-element block
boundaries, 128-row token groups on CUDA."""

from ..interface import PlanningRules
from .torch_quantizers import BLOCK


class BlockwiseRules(PlanningRules):
    def payload_scale_shapes(self, out_features: int, in_features: int):
        out_blocks, in_blocks = -(-out_features // BLOCK), -(-in_features // BLOCK)
        return (in_blocks, out_blocks), (out_blocks, in_blocks)

    def check_local_shape(self, fqn, local_shape, tp_dim, emulate):
        """Tensor parallelism must split a weight at block boundaries: each rank's blocks are
        then the unsharded weight's (and its activation tiles the unsharded activations')."""
        if tp_dim is not None and local_shape[tp_dim] % BLOCK:
            raise ValueError(
                f"float8_moe: {fqn} is split by tensor parallelism on dim {tp_dim} into local "
                f"shards of shape {list(local_shape)}; recipe blockwise needs that dim to be a "
                f"multiple of {BLOCK} on every rank (128x128 weight blocks, 1x128 activation "
                f"tiles), here {local_shape[tp_dim]}. Lower parallelism.tensor_parallel_degree "
                '(or expert_tensor_parallel_degree), or set float8_moe.recipe = "rowwise".'
            )

    def token_group_alignment(self, emulate: bool) -> int | None:
        # The CUDA weight-gradient kernel takes 128-token blocks of the whole token dim: each
        # group must start at a multiple of 128 so that no block straddles two groups. (The
        # emulation aligns its blocks to each group's start itself.)
        return None if emulate else BLOCK
