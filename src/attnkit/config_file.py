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


def write_config_file(path: str | Path, text: str) -> Path:
    """Write a config file (calibrated patterns, head clusters...) as `text`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def dumps_layered_config(config: dict, render_layer) -> str:
    """JSON text of a calibrated config, diff-friendly: its metadata one key per line, then its ``layers``,
    each written by ``render_layer(layer)`` (JSON text, indented, possibly over several lines)."""
    head = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in config.items() if k != "layers"]
    layers = ",\n".join(render_layer(layer) for layer in config["layers"])
    return "\n".join(["{", *head, '  "layers": [', layers, "  ]", "}"]) + "\n"
