"""A third recipe for the tests, as a new recipe is added: one folder (this one) and one call of
``register_recipe`` (``tests/test_recipe_registry.py``). Per-tensor scales: one power-of-2 scale
for each activation, output gradient and weight-gradient operand, one per expert for the
weights. Emulated GEMMs only."""

from .recipe import PerTensorRecipe

__all__ = ["PerTensorRecipe"]
