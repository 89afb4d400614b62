"""Naming a peer's method in a recipe: NVIDIA kvpress presses (github.com/NVIDIA/kvpress).

A press is named ``kvpress:PRESS[:key=value,...]`` (``kvpress:SnapKVPress:compression_ratio=0.5``) or,
in a recipe file, ``{"kvpress": "SnapKVPress", "params": {...}}``. kvpress pins another transformers
than attnkit, so presses run in an interpreter of their own (:mod:`attnkit.eval.run.peers` starts it):
``$ATTNKIT_KVPRESS_PYTHON``, else ``.venv-kvpress/bin/python`` of the source checkout or of the current
directory, else this interpreter when it can import kvpress. A recipe naming a press is refused at once
when there is no such interpreter, so a sweep never starts what it cannot finish.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from attnkit.errors import AttnkitError

PREFIX = "kvpress:"
ENV_VAR = "ATTNKIT_KVPRESS_PYTHON"
# the source checkout holding src/attnkit/recipe/peer.py (an installed package has no .venv-kvpress there)
CHECKOUT = Path(__file__).resolve().parents[3]


def check_press_name(name, source: str = "kvpress") -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*Press", name):
        raise AttnkitError(f"{source}: a kvpress press is named by its class, e.g. 'SnapKVPress' or "
                           f"'StreamingLLMPress', got {name!r}")
    return name


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_peer_spec(spec: str) -> tuple[str, dict]:
    """``"kvpress:SnapKVPress:compression_ratio=0.5,window_size=64"`` -> ``("SnapKVPress", {...})``."""
    if not isinstance(spec, str) or not spec.startswith(PREFIX):
        raise AttnkitError(f"a peer spec starts with {PREFIX!r}, e.g. 'kvpress:SnapKVPress:compression_ratio=0.5', "
                           f"got {spec!r}")
    name, _, rest = spec[len(PREFIX):].partition(":")
    press = check_press_name(name.strip(), f"peer spec {spec!r}")
    params = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise AttnkitError(f"peer spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = _value(value.strip())
    return press, params


def kvpress_python() -> str | None:
    """The interpreter that runs kvpress, or None when kvpress is not installed (see the module docstring)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return env if Path(env).is_file() else None
    for base in (CHECKOUT, Path.cwd()):
        candidate = base / ".venv-kvpress" / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    if importlib.util.find_spec("kvpress") is not None:
        return sys.executable
    return None


def require_kvpress() -> str:
    """The kvpress interpreter, or a one-line error saying how to install one."""
    python = kvpress_python()
    if python is None:
        raise AttnkitError("kvpress is not installed, so kvpress:... recipes cannot run: create .venv-kvpress "
                           "(python -m venv .venv-kvpress; .venv-kvpress/bin/pip install torch==2.13.0 kvpress) or "
                           f"set {ENV_VAR} to a Python that imports kvpress")
    return python
