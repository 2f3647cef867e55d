"""What a recipe implements: its quantizers, its scaled GEMMs and its planning rules.

For the forward, input-gradient and weight-gradient GEMMs of ``b [G, K, N]``:

    out    [M, N] = a [M, K] @ b[g] [K, N]        quantizers: rows, tokens; weight
    grad_a [M, K] = grad [M, N] @ b[g]^T [N, K]   quantizers: rows; weight_transposed
    grad_b[g] [K, N] = a_g^T @ grad_g             quantizers: per_group_pair, tokens_per_group_pair

The autograd function (``scaled_grouped_mm.py``), the weight tensors (``weight/``) and the shard
plan (``sharding.py``) are the same for every recipe; they reach a recipe only through these.
"""

from abc import ABC, abstractmethod
from typing import Protocol

import torch


class Quantizers(Protocol):
    """A recipe's casts of the GEMM operands on one path (emulated or CUDA): fp8 data and fp32
    power-of-2 multiplier scales, laid out as that path's GEMMs read them. The fp8 GEMM looks
    each cast up on this object at call time, so that a wrapper set on it (tests, checks) sees
    every call; in eager code ``tokens`` and ``tokens_per_group_pair`` call ``rows`` and
    ``per_group_pair`` through it too."""

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[M, C]`` activations or output gradients, scaled along C (the contraction)."""

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` of tokens that another GEMM multiplies too (w1 and w3), which share it."""

    def weight(
        self, b: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``b [G, K, N]`` scaled along K, and what ``weight_transposed`` casts by; of
        ``b.to(round_to)``'s values (``quantize.rounded``)."""

    def weight_transposed(
        self, b: torch.Tensor, state: torch.Tensor, round_to: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``b^T [G, N, K]`` scaled along N, by ``state`` from ``weight``."""

    def per_group_pair(
        self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(a_fp8, a_scales, grad_fp8, grad_scales)`` of ``a [M, K]`` and ``grad [M, N]``,
        scaled along each group's tokens (``offs``: group end offsets); rows of no group 0."""

    def tokens_per_group_pair(
        self, a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``per_group_pair`` where another weight gradient casts the same tokens ``a``."""


class PlanningRules(ABC):
    """What the conversion plan (``conversion.py``, ``sharding.py``, the preflight) and the fp8
    all-gather ask of a recipe before its GEMMs run. Stateless; these defaults are the rules
    every recipe shares."""

    # Whether policy "auto"'s cost model (policy.py, fit to H200 runs of the rowwise recipe)
    # applies; where not, auto converts every selected weight and the plan says so.
    has_cost_model: bool = False

    @abstractmethod
    def payload_scale_shapes(
        self, out_features: int, in_features: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per expert, the shapes of the forward scales (of ``b = w^T [in, out]``) and of the
        input-gradient scales (of ``w [out, in]``) that an fp8 all-gather carries."""

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
        return None  # every shape fits, unless the recipe's rules say otherwise

    def token_group_alignment(self, emulate: bool) -> int | None:
        """The row multiple torchtitan's MoE must pad each expert's token group to, or None."""
        return None


class Recipe(ABC):
    """A recipe's GEMM side: its quantizers, its scaled GEMMs and what its GEMMs need of their
    callers; its planning rules in ``rules``. Stateless: the registry (``recipes/__init__.py``)
    holds one instance per recipe."""

    name: str  # the value of ``[float8_moe] recipe``
    description: str  # for the converter's log: "fp8 rowwise (...)"
    rules: PlanningRules
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

    @abstractmethod
    def quantizers(self, emulate: bool) -> Quantizers:
        """The casts of the emulated path (plain torch ops, any device) or of the CUDA one."""

    @abstractmethod
    def grouped_mm(
        self, a, a_scale, b, b_scale, offs, out_dtype, emulate: bool, backend: str = "torch"
    ) -> torch.Tensor:
        """``a [M, K]`` times ``b [G, K, N]`` per group (``offs``: group end offsets), operands
        from ``quantizers(emulate)``; on CUDA by the GEMM backend ``backend`` where the recipe
        has several (``gemm_backend_names``)."""

    @abstractmethod
    def grouped_wgrad_mm(
        self, a, a_scale, grad, grad_scale, offs, out_dtype, emulate: bool, backend: str = "torch"
    ) -> torch.Tensor:
        """Per group ``a_g^T @ grad_g`` -> ``[G, K, N]``, operands from ``per_group_pair``."""
