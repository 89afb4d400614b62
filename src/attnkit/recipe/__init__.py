"""Recipes: what to run -- a method, or a prefill method + a cache policy, head sharing, token selection,
a decoding strategy, or a peer's method -- as JSON/YAML files, mappings or method spec strings.

- :mod:`attnkit.recipe.core`: :class:`Recipe` and reading recipe files.
- :mod:`attnkit.recipe.budget`: a sweep's KV budget applied to a recipe that leaves its own open.
- :mod:`attnkit.recipe.peer`: naming kvpress presses (peers run in their own environment).
"""

from attnkit.recipe.budget import check_budget_value, format_budget
from attnkit.recipe.core import Recipe, as_recipe, load_recipe, load_recipe_file, recipe_from_dict, recipe_to_dict

__all__ = ["Recipe", "as_recipe", "load_recipe", "load_recipe_file", "recipe_from_dict", "recipe_to_dict",
           "check_budget_value", "format_budget"]
