from .recipe import BlockwiseRecipe

__all__ = ["BlockwiseRecipe"]
