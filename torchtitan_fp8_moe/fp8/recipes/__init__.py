"""fp8 recipes: what differs between ways of scaling the expert GEMMs' operands.

Each recipe is one subpackage (``rowwise/``, ``blockwise/``) implementing ``interface.py``: its
``Recipe`` (the scaled GEMMs, CUDA and emulated, and the GEMM backends they run on), its
``Quantizers`` (emulated and CUDA: the scale granularity of each operand), and its
``PlanningRules`` (the FSDP all-gather payload layout and when a shard cannot quantize alone,
the shape rules of each rank's local weight, the token-group alignment of its CUDA kernels).
Its kernels live beside it or in ``fp8/kernels/``. This module is the registry: one line per
recipe below, or ``register_recipe`` from outside the package.
"""

from .blockwise import BlockwiseRecipe
from .interface import PlanningRules, Quantizers, Recipe
from .rowwise import RowwiseRecipe

__all__ = [
    "BlockwiseRecipe",
    "PlanningRules",
    "Quantizers",
    "Recipe",
    "RowwiseRecipe",
    "recipe_named",
    "register_recipe",
    "unregister_recipe",
]

_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> None:
    """Make ``recipe`` the one of ``[float8_moe] recipe = recipe.name``."""
    if recipe.name in _RECIPES:
        raise ValueError(f"float8_moe: a recipe named {recipe.name!r} is registered already")
    _RECIPES[recipe.name] = recipe


def unregister_recipe(name: str) -> Recipe:
    """Take the recipe ``name`` out of the registry (a test's recipe, after the test)."""
    return _RECIPES.pop(name)


def recipe_named(name: str) -> Recipe:
    """The recipe of ``[float8_moe] recipe``; raises naming the option when unknown."""
    if name not in _RECIPES:
        raise ValueError(
            f"float8_moe: recipe {name!r} is not supported; set float8_moe.recipe to one of "
            f"{list(_RECIPES)}"
        )
    return _RECIPES[name]


register_recipe(RowwiseRecipe())
register_recipe(BlockwiseRecipe())
