"""The plugin's configuration: vLLM's ``additional_config["attnkit"]``, read and checked once (no vLLM import).

    LLM(model, additional_config={"attnkit": {"recipe": "snapkv:budget=0.3"}})
    python -m vllm.entrypoints.openai.api_server --model M --additional-config '{"attnkit": {"recipe": "r.yaml"}}'

Keys:

- ``recipe`` (required): what ``attnkit generate --method`` / ``--recipe`` take: a method spec, a recipe mapping,
  or a recipe file (YAML or JSON, such as the ``recipe.json`` that ``attnkit tune`` writes; read once, at engine
  start, by the process that starts the engine).
- ``allow``: the methods a request may choose with ``SamplingParams(extra_args={"attnkit": SPEC})`` (the OpenAI
  API's ``vllm_xargs``), by name; default: the recipe's own methods and ``full``. ``"*"`` allows every method
  the plugin supports.
- ``admission``: ``"planned"`` (default): the scheduler admits a request whose plan frees blocks only where its
  plan's peak and those of the requests already holding blocks fit in the pool (:meth:`attnkit.vllm.manager.
  AttnkitManager.reservation`), so that compressed requests are not admitted only to be preempted and recomputed
  as they grow; ``"vllm"``: vLLM's own rule (admit while the prompt fits, preempt when the cache is full).

The checked configuration travels to the scheduler and the workers as JSON (:meth:`EngineConfig.to_json`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.compose import Compose
from attnkit.recipe.core import Recipe
from attnkit.vllm.plan import SUPPORTED, check_supported, method_of, read_recipe

KEY = "attnkit"
KEYS = ("recipe", "allow", "admission")
ADMISSIONS = ("planned", "vllm")
REQUEST_SOURCE = "SamplingParams.extra_args['attnkit']"


def method_names(method: Method) -> set[str]:
    if isinstance(method, Compose):
        return {method.prefill_method.name, method.cache_method.name}
    return {method.name}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's default recipe (as a mapping) and the method names a request may choose."""

    recipe: dict
    allow: tuple[str, ...] | None  # None: every supported method
    admission: str = "planned"

    @classmethod
    def parse(cls, additional_config, recipe_source: str | None = None) -> EngineConfig | None:
        """The attnkit part of vLLM's ``additional_config`` (None when it has none), checked; `recipe_source` names
        the recipe in errors where the user gave it elsewhere (``attnkit serve --recipe``)."""
        if not isinstance(additional_config, dict) or KEY not in additional_config:
            return None
        raw = additional_config[KEY]
        source = "additional_config['attnkit']"
        if not isinstance(raw, dict):
            raise AttnkitError(f"{source} must be a mapping such as {{'recipe': 'snapkv:budget=0.3'}}, "
                               f"got {raw!r}")
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise AttnkitError(f"{source} has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                               f"{', '.join(KEYS)}")
        if "recipe" not in raw:
            raise AttnkitError(f"{source} needs a 'recipe': a method spec, a recipe mapping or a recipe file")
        recipe_source = recipe_source or f"{source}['recipe']"
        recipe = read_recipe(raw["recipe"], recipe_source)
        method = method_of(recipe, recipe_source)
        allow = raw.get("allow")
        if allow == "*":
            names = None
        elif allow is None:
            names = tuple(sorted(method_names(method) | {"full"}))
        elif isinstance(allow, list) and all(isinstance(a, str) for a in allow):
            names = tuple(sorted(set(allow) | method_names(method)))
        else:
            raise AttnkitError(f"{source}['allow'] must be a list of method names or '*', got {allow!r}")
        admission = raw.get("admission", "planned")
        if admission not in ADMISSIONS:
            raise AttnkitError(f"{source}['admission'] must be one of {', '.join(map(repr, ADMISSIONS))}, got "
                               f"{admission!r}")
        return cls(recipe.to_dict(), names, admission)

    def to_json(self) -> str:
        return json.dumps({"recipe": self.recipe, "allow": self.allow, "admission": self.admission}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        allow = data["allow"]
        return cls(data["recipe"], None if allow is None else tuple(allow), data["admission"])

    @functools.cached_property
    def method(self) -> Method:
        return Recipe.parse(self.recipe).method()

    def request_method(self, spec) -> Method:
        """The method of a request: its own spec (``extra_args['attnkit']``) when it gives one, else the engine's."""
        if spec is None:
            return self.method
        if not isinstance(spec, str):
            raise AttnkitError(f"{REQUEST_SOURCE} must be a method spec string such as 'snapkv:budget=0.3', got "
                               f"{spec!r} ({type(spec).__name__})")
        return _request_method(spec, self.allow)

    def may_run(self, name: str) -> bool:
        """Whether a request of this engine may run the method called `name` (the recipe's, or allowed)."""
        return self.allow is None or name in self.allow or name in method_names(self.method)

    def resolved(self) -> dict:
        """This configuration as ``additional_config['attnkit']`` with the recipe read: what the process that starts
        the engine hands on, so that no other process reads a recipe file again."""
        return {"recipe": self.recipe, "allow": "*" if self.allow is None else list(self.allow),
                "admission": self.admission}


@functools.lru_cache(maxsize=256)
def _request_method(spec: str, allow: tuple[str, ...] | None) -> Method:
    method = method_of(spec, REQUEST_SOURCE)
    check_supported(method, REQUEST_SOURCE)
    refused = sorted(method_names(method) - set(allow or ()))
    if allow is not None and refused:
        raise AttnkitError(f"{REQUEST_SOURCE}={spec!r}: method(s) {', '.join(refused)} not allowed by this engine; "
                           f"allowed: {', '.join(allow)} (additional_config['attnkit']['allow'] widens it; the "
                           f"plugin supports {SUPPORTED})")
    return method


def engine_of(vllm_config) -> EngineConfig | None:
    """The checked attnkit configuration of an engine (None: attnkit is off), parsed once per distinct configuration
    (after engine start its recipe is a mapping: :meth:`EngineConfig.resolved`)."""
    raw = getattr(vllm_config, "additional_config", None)
    if not isinstance(raw, dict) or KEY not in raw:
        return None
    try:
        text = json.dumps(raw[KEY], sort_keys=True)
    except TypeError:  # not JSON: parse says what is wrong with it
        return EngineConfig.parse(raw)
    return _parsed(text)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> EngineConfig:
    return EngineConfig.parse({KEY: json.loads(text)})
