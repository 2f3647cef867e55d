from .recipe import RowwiseRecipe

__all__ = ["RowwiseRecipe"]
