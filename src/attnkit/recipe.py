"""Recipes: a method and its parameters written in a JSON or YAML file, as the CLI takes them.

    {"method": "window", "params": {"window": 512}}
"""

from __future__ import annotations

import json
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, make_method

RECIPE_KEYS = ("method", "params", "name", "description")


def recipe_from_dict(data, source: str = "recipe") -> Method:
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}: a recipe must be a mapping with a 'method' key, got {type(data).__name__}")
    unknown = sorted(set(data) - set(RECIPE_KEYS))
    if unknown:
        raise AttnkitError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(RECIPE_KEYS)}")
    if not isinstance(data.get("method"), str):
        raise AttnkitError(f"{source}: 'method' must be a method name (see `attnkit methods`)")
    params = data.get("params", {}) or {}
    if not isinstance(params, dict):
        raise AttnkitError(f"{source}: 'params' must be a mapping of parameter names to values")
    return make_method(data["method"], **params)


def load_recipe(path: str | Path) -> Method:
    """Read a recipe file (.json, .yaml or .yml) into a method instance, with clear errors."""
    path = Path(path)
    if not path.is_file():
        raise AttnkitError(f"recipe file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise AttnkitError(f"recipe file {str(path)!r} is malformed: {str(exc).splitlines()[0]}") from None
    return recipe_from_dict(data, f"recipe file {str(path)!r}")


def recipe_to_dict(method: Method) -> dict:
    return {"method": method.name, "params": method.params()}
