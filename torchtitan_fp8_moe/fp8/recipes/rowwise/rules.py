"""The rowwise recipe's planning rules: both matrix dims of each rank's weight aligned for torch's
fp8 GEMMs on CUDA, 16-row token groups."""

from ...quantize import FP8_MATRIX_ALIGNMENT
from ..interface import PlanningRules


class RowwiseRules(PlanningRules):
    has_cost_model = True

    def payload_scale_shapes(self, out_features: int, in_features: int):
        return (1, out_features), (1, in_features)

    def check_local_shape(self, fqn, local_shape, tp_dim, emulate):
        if emulate:
            return
        matrix_dims = (len(local_shape) - 2, len(local_shape) - 1)
        unaligned = [d for d in matrix_dims if local_shape[d] % FP8_MATRIX_ALIGNMENT]
        if not unaligned:
            return
        which = ", ".join(f"dim {d} ({local_shape[d]})" for d in unaligned)
        if tp_dim in unaligned:
            cause = (
                f"dim {tp_dim} is split by parallelism.tensor_parallel_degree "
                "(expert_tensor_parallel_degree for routed experts under expert parallelism); "
                "lower it, "
            )
        else:
            cause = "the model's own size (no tensor parallelism splits it); "
        raise ValueError(
            f"float8_moe: {fqn} has shape {list(local_shape)} per rank; fp8 kernels need both "
            f"matrix dims to be multiples of {FP8_MATRIX_ALIGNMENT}, not {which}: "
            f"{cause}leave the module out of float8_moe.fqns, or set float8_moe.policy = "
            '"auto", which keeps in bf16 the weights fp8 kernels cannot multiply.'
        )

    def token_group_alignment(self, emulate: bool) -> int | None:
        # torch's fp8 grouped GEMM needs 16-row token groups (with torchtitan's default, a
        # device-side assert poisons the process at the first backward).
        return None if emulate else FP8_MATRIX_ALIGNMENT
