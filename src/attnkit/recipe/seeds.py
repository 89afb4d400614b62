"""Seeds of a stochastic method: a recipe whose method draws random numbers (Keyformer's Gumbel noise, its
``seed`` parameter) runs once per seed of an evaluation's ``seeds``, so that its score is not one draw's.

The seed goes to the part whose method has a ``seed`` parameter; a recipe that sets its own seed runs with it
only. The copy keeps the recipe's label (its rows are one column of the report, one row per seed).
"""

from __future__ import annotations

import copy

from attnkit import validate
from attnkit.methods.spec import method_class


def seeded_role(recipe) -> str | None:
    """The part whose method takes a ``seed`` (``method``, ``prefill``, ``cache``, ...), or None."""
    if recipe.peer is not None:
        return None
    for role, (name, _) in recipe.parts.items():
        if "seed" in {f.name for f in method_class(name, recipe.source).parameters()}:
            return role
    return None


def takes_seeds(recipe) -> bool:
    """Whether an evaluation's seeds apply: the recipe's method is stochastic and leaves its seed open."""
    role = seeded_role(recipe)
    return role is not None and recipe.parts[role][1].get("seed") is None


def with_method_seed(recipe, seed: int):
    """A copy of `recipe` whose stochastic part draws with `seed` (its label unchanged)."""
    validate.whole("seed", seed, 0)
    role = seeded_role(recipe)
    out = copy.deepcopy(recipe)
    out.name = recipe.label
    out.method_seed = seed
    out.parts[role][1]["seed"] = seed
    out._method = None
    return out
