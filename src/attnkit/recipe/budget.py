"""A sweep's KV budget applied to a recipe that leaves its own open.

A budget is a fraction ``0 < f <= 1`` of the prompt (a float) or a whole number of tokens (an int). It
goes to the part of the recipe that takes one: ``budget`` / ``budget_tokens`` of an eviction method (the
cache part, or a method alone), ``window`` of ``window`` (a fraction is of the task's length), and
``compression_ratio = 1 - f`` of a kvpress press. A recipe that sets its own budget runs at that budget only.
"""

from __future__ import annotations

import copy

from attnkit import validate
from attnkit.errors import AttnkitError
from attnkit.methods.spec import method_class

BUDGET_ROLES = ("cache", "method", "select", "heads")


def format_budget(budget) -> str:
    return "" if budget is None else f"{budget:g}"


def is_fraction(budget) -> bool:
    return isinstance(budget, float) and 0.0 < budget <= 1.0


def check_budget_value(budget, source: str = "budget"):
    """A sweep budget: a fraction 0 < f <= 1 (float) or a whole number of tokens >= 1 (int); a float that
    is a whole number above 1 is a token count."""
    if not validate.is_number(budget):
        raise AttnkitError(f"{source}: budgets are fractions of the prompt (0 < f <= 1) or whole token counts, "
                           f"got {budget!r}")
    if isinstance(budget, float) and not is_fraction(budget):
        if budget.is_integer() and budget > 1:
            return int(budget)
        raise AttnkitError(f"{source}: a fractional budget must satisfy 0 < f <= 1, got {budget!r} "
                           f"(write a whole number for a token count)")
    if isinstance(budget, int) and budget < 1:
        raise AttnkitError(f"{source}: a token budget must be >= 1, got {budget!r}")
    return budget


def budget_params(name: str, source: str) -> tuple[str, str]:
    """A method's (fraction, token count) budget parameters: ``budget`` and ``budget_tokens`` unless its class names
    others (``quest``: the tokens a step reads, ``token_budget``)."""
    return getattr(method_class(name, source), "budget_params", ("budget", "budget_tokens"))


def budget_style(name: str, source: str) -> str | None:
    """How a method takes a budget: "eviction" (a fraction or a token count, :func:`budget_params`), "window", or
    None."""
    fields = {f.name for f in method_class(name, source).parameters()}
    if set(budget_params(name, source)) <= fields:
        return "eviction"
    if name == "window":
        return "window"
    return None


def budget_role(recipe) -> str | None:
    """The part a sweep budget goes to (``cache``, or ``method``/``heads``/``select`` alone), or
    ``kvpress``; None when nothing in the recipe takes a budget."""
    if recipe.peer is not None:
        return "kvpress"
    for role in BUDGET_ROLES:
        if role in recipe.parts and budget_style(recipe.parts[role][0], recipe.source):
            return role
    return None


def has_own_budget(recipe) -> bool:
    role = budget_role(recipe)
    if role is None:
        return False
    if role == "kvpress":
        return "compression_ratio" in recipe.peer[1]
    name, params = recipe.parts[role]
    keys = budget_params(name, recipe.source) if budget_style(name, recipe.source) == "eviction" else ("window",)
    keys += tuple(getattr(method_class(name, recipe.source), "size_params", ()))  # kvzap's threshold sizes it too
    return any(params.get(k) is not None for k in keys)


def with_budget(recipe, budget, length: int | None = None):
    """A copy of `recipe` at `budget`; `length` (the prompt's tokens) turns a fraction into a window size."""
    budget = check_budget_value(budget, f"{recipe.source} ({recipe.label})")
    role = budget_role(recipe)
    if role is None:
        raise AttnkitError(f"recipe {recipe.label!r} has no part that takes a KV budget")
    out = copy.deepcopy(recipe)
    out.budget = budget
    if role == "kvpress":
        if not is_fraction(budget):
            raise AttnkitError(f"recipe {recipe.label!r}: kvpress presses take fractional budgets "
                               f"(compression_ratio = 1 - budget), got {budget!r} tokens")
        out.peer[1]["compression_ratio"] = round(1.0 - budget, 10)
        return out
    name, params = out.parts[role]
    if budget_style(name, recipe.source) == "eviction":
        fraction, tokens = budget_params(name, recipe.source)
        params.pop(fraction, None)
        params.pop(tokens, None)
        params[fraction if is_fraction(budget) else tokens] = budget
    else:
        if is_fraction(budget):
            if length is None:
                raise AttnkitError(f"recipe {recipe.label!r}: a fractional window budget needs the prompt length")
            params["window"] = max(1, round(budget * length))
        else:
            params["window"] = budget
    return out
