"""fp8 recipes: what differs between ways of scaling the expert GEMMs' operands.

A recipe owns, for the forward, input-gradient and weight-gradient GEMMs of ``b [G, K, N]``:
- the scale granularity of each operand and the quantizers that produce it, CUDA and emulated
  (``quantizers``: a namespace of ``rows``, ``weight``, ``weight_transposed``,
  ``per_group_pair``, and ``tokens`` and ``tokens_per_group_pair``, the casts of tokens that
  two GEMMs share (w1 and w3), looked up at call time so that tests and checks can wrap them);
- the scaled GEMM calls (``grouped_mm``, ``grouped_wgrad_mm``) and the GEMM backends they can
  run on (``gemm_backend_names``);
- the FSDP all-gather payload layout (``payload_scale_shapes``) and when a shard cannot
  quantize alone (``all_gather_fallback``);
- the shape rules of each rank's local weight (``check_local_shape``, which the shard plan and
  the preflight run) and the token-group alignment the CUDA kernels need.
The autograd function (``scaled_grouped_mm.py``), the weight tensors (``weight/``) and the shard
plan (``sharding.py``) are the same for every recipe.
"""

import functools
from types import ModuleType

import torch


class Recipe:
    """The recipe interface; one module per recipe implements it (``rowwise.py``,
    ``blockwise.py``). Stateless: ``recipe_named`` hands out one instance per recipe."""

    name: str
    description: str  # for the converter's log: "fp8 rowwise (...)"
    # Whether policy "auto"'s cost model (policy.py, fit to H200 runs of this recipe) applies;
    # where not, auto converts every selected weight and the plan says so.
    has_cost_model: bool = False
    # Whether its CUDA GEMMs read the token groups' bounds on the host (host_offsets.py).
    reads_offsets_on_host: bool = False
    # The GEMM backends its CUDA GEMMs can run on (kernels/gemm_backends.py; "torch": its own),
    # and the backends' forms it calls: "rowwise" (m_grouped, k_grouped, dense) or "blockwise"
    # (blockwise_m_grouped, blockwise_k_grouped, also for one group).
    gemm_backend_names: tuple[str, ...] = ("torch",)
    gemm_forms: str = "rowwise"
    # Whether ``quantizers().tokens`` casts each row alone, into an fp8 row and scales that row
    # gathers carry along (``routed_dispatch.py`` then casts each token once, not per routed copy).
    token_cast_is_row_local: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def quantizers(self, emulate: bool) -> ModuleType:
        raise NotImplementedError

    def grouped_mm(
        self, a, a_scale, b, b_scale, offs, out_dtype, emulate: bool, backend: str = "torch"
    ) -> torch.Tensor:
        """``a [M, K]`` times ``b [G, K, N]`` per group (``offs``: group end offsets); on CUDA
        by the GEMM backend ``backend`` where the recipe has several (``gemm_backends``)."""
        raise NotImplementedError

    def grouped_wgrad_mm(
        self, a, a_scale, grad, grad_scale, offs, out_dtype, emulate: bool, backend: str = "torch"
    ) -> torch.Tensor:
        """Per group ``a_g^T @ grad_g`` -> ``[G, K, N]``."""
        raise NotImplementedError

    def payload_scale_shapes(self, out_features: int, in_features: int):
        """Per expert, the shapes of the forward scales (of ``b = w^T [in, out]``) and of the
        input-gradient scales (of ``w [out, in]``) that an fp8 all-gather carries."""
        raise NotImplementedError

    def all_gather_fallback(
        self, shape: tuple[int, ...], shard_dim: int, fsdp_degree: int
    ) -> str | None:
        """Why a weight of ``shape`` sharded on ``shard_dim`` over ``fsdp_degree`` ranks cannot
        all-gather fp8 payloads that its shard quantized alone, so gathers its high-precision
        values; None when it can. Every recipe's scales lie within one expert, so a split into
        whole experts keeps them on one rank."""
        if fsdp_degree == 1:
            # FSDP2 gathers nothing then, and takes a single all-gather input as the weight.
            return "FSDP degree 1: nothing to gather"
        if len(shape) != 3:
            # nn.Linear [out, in] shards its out features: the input-gradient scales span them.
            return "2D weight: FSDP splits the out features that its input-gradient scales span"
        if shard_dim != 0:
            return f"FSDP shards dim {shard_dim}, inside the experts, which fp8 scales span"
        return None

    def check_local_shape(
        self, fqn: str, local_shape: tuple[int, ...], tp_dim: int | None, emulate: bool
    ) -> None:
        """Raise, naming the weight and the rule, where the weight each rank multiplies
        (``local_shape [.., out, in]``, after tensor/expert parallelism; ``tp_dim``: the dim
        tensor parallelism split, or None) does not fit this recipe on this path."""

    def token_group_alignment(self, emulate: bool) -> int | None:
        """The row multiple torchtitan's MoE must pad each expert's token group to, or None."""
        return None


@functools.cache  # recipes are stateless: one instance each per process
def recipe_named(name: str) -> Recipe:
    """The recipe of ``[float8_moe] recipe``; raises naming the option when unknown."""
    from .blockwise import BlockwiseRecipe
    from .rowwise import RowwiseRecipe

    recipes = {r.name: r for r in (RowwiseRecipe(), BlockwiseRecipe())}
    if name not in recipes:
        raise ValueError(
            f"float8_moe: recipe {name!r} is not supported; set float8_moe.recipe to one of "
            f"{list(recipes)}"
        )
    return recipes[name]
