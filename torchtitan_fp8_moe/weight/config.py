"""The settings a converted weight carries: one frozen object, the tensor subclasses' flatten
metadata (so compiled graphs guard on it), handed on to every weight derived from it."""

from dataclasses import dataclass

from ..fp8.kernels.gemm_backends import GemmChoice
from ..fp8.recipes import Recipe, recipe_named


@dataclass(frozen=True)
class WeightConfig:
    recipe: str = "rowwise"  # ``[float8_moe] recipe``: how the fp8 GEMMs scale (fp8/recipes/)
    # Emulated fp8 GEMMs (quantize, dequantize, fp32 matmul) instead of fp8 kernels.
    emulate: bool = False
    # Keep the weight's fp8 copies while it is unchanged (fp8/weight_cache.py).
    cache_fp8: bool = False
    # Under FSDP2: all-gather fp8 payloads quantized on the shard where it can (config.py).
    fp8_all_gather: bool = False
    # A forward's cast of an fp32 parameter to bf16 holds no copy, eager or compiled
    # (weight/lazy_cast.py); off for compiled code whose graph breaks between such a cast and its
    # matmul, where the cast would cross a graph boundary.
    lazy_cast: bool = True
    # Another weight multiplies the same tokens (w1 and w3): their fp8 casts of the tokens are
    # made once for both, kept for the other in eager code and merged in compiled graphs, where
    # they are custom ops that cost host time per call (fp8/recipes/rowwise/triton_quantizers.py).
    # The converter turns it off for weights without such a partner by name (w2;
    # swap.same_input_weights).
    shares_input: bool = True
    # The backend of each of its fp8 GEMMs (fp8/kernels/gemm_backends.py), chosen by the
    # converter from ``[float8_moe] gemm_backend`` (gemm_choice.py).
    gemm: GemmChoice = GemmChoice()

    def __post_init__(self):
        recipe_named(self.recipe)  # an unknown recipe fails here, naming the option

    @property
    def fp8_recipe(self) -> Recipe:
        return recipe_named(self.recipe)
