"""The blockwise recipe: ``recipe.py`` (the recipe, its GEMMs and their emulation), ``rules.py``
(its planning rules), ``torch_quantizers.py`` (emulated) and ``triton_quantizers.py`` (CUDA; its
kernels in ``fp8/kernels/``)."""

from .recipe import BlockwiseRecipe

__all__ = ["BlockwiseRecipe"]
