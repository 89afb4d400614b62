"""Reading the JSON / YAML files users hand to attnkit (recipes, sweeps, calibrated configs), with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from attnkit.errors import AttnkitError


def read_config_file(path: str | Path, what: str, hint: str = ""):
    """The parsed contents of a .json / .yaml / .yml file; `what` names it in errors ("recipe file"),
    `hint` is added to the "does not exist" error (how to make one)."""
    path = Path(path)
    if not path.is_file():
        raise AttnkitError(f"{what} {str(path)!r} does not exist{hint}")
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        return json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError
        raise AttnkitError(f"{what} {str(path)!r} is malformed: {str(exc).splitlines()[0]}") from None
