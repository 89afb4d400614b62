"""Recipes: what to run, written in a JSON or YAML file (or a method spec string), as the CLI takes them.

One method (the original form)::

    {"method": "window", "params": {"window": 512}}

A prefill method, a cache policy and a decoding strategy (the parts map onto the ``compose`` method;
each part is a method spec string or ``{"method": NAME, "params": {...}}``)::

    {"name": "sparse+snap",
     "prefill": "minference:pattern=vertical_slash",
     "cache": {"method": "snapkv", "params": {"budget": 0.3}},
     "decode": {"speculate": "prompt_lookup", "gamma": 4}}

``heads`` (head sharing) and ``select`` (token selection) name a method the same way; today the
``compose`` mechanism joins a prefill method and a cache method only, so either stands alone.
``quantize`` names a quantizer (``kivi``) that holds the cache of whatever the other parts build (the spec's
trailing ``+kivi:...`` part)::

    {"cache": "snapkv:budget=0.3", "quantize": {"method": "kivi", "params": {"bits": 4, "residual": 128, "group": 32}}}
``decode`` is speculative decoding (:func:`attnkit.speculative_generate`): ``speculate`` is
``draft_model``, ``prompt_lookup`` or ``self``, with ``gamma``, ``adaptive_gamma``, ``max_gamma``,
``draft`` (the draft's spec, as ``--draft``), ``draft_lookup`` (as ``--draft-lookup``),
``draft_confidence`` (as ``--draft-confidence``) and ``draft_weights`` (as ``--draft-weights``); it verifies
with full attention, so it is not combined with another attention method.

A peer's method (NVIDIA's kvpress, named as :mod:`attnkit.recipe.peer` says)::

    {"kvpress": "SnapKVPress", "params": {"compression_ratio": 0.5}}      # or "kvpress:SnapKVPress:compression_ratio=0.5"

A sweep's budget goes to the part that takes one (:mod:`attnkit.recipe.budget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.spec import is_quantizer, make_method, method_from_dict, split_method_spec
from attnkit.recipe import budget as budgets
from attnkit.recipe import seeds
from attnkit.recipe.peer import PREFIX as PEER_PREFIX
from attnkit.recipe.peer import check_press_name, parse_peer_spec, require_kvpress
from attnkit.runner import generate
from attnkit.speculative import SpeculativeConfig, speculative_generate

RECIPE_KEYS = ("method", "params", "name", "description")
PART_ROLES = ("prefill", "cache", "heads", "select", "quantize")
ATTENTION_ROLES = PART_ROLES[:-1]  # the parts a quantizer may hold the cache of
ALL_RECIPE_KEYS = RECIPE_KEYS + PART_ROLES + ("decode", "kvpress")


# --------------------------------------------------------------------------------------------------
# the original single-method form (kept: compose and `load_recipe` use it)


def recipe_from_dict(data, source: str = "recipe") -> Method:
    """A ``{"method": NAME, "params": {...}}`` mapping -> a method instance."""
    return method_from_dict(data, source)


def load_recipe(path: str | Path) -> Method:
    """Read a recipe file (.json, .yaml or .yml) into its attention method (see :func:`load_recipe_file`
    for the whole recipe, decoding strategy included)."""
    recipe = load_recipe_file(path)
    if recipe.decode is not None:
        raise AttnkitError(f"recipe file {str(path)!r} has a decoding strategy; load it with load_recipe_file")
    return recipe.method()


def recipe_to_dict(method: Method) -> dict:
    return {"method": method.name, "params": method.params()}


# --------------------------------------------------------------------------------------------------
# the full recipe


def _spec_text(name: str, params: dict) -> str:
    inner = ",".join(f"{k}={v}" for k, v in params.items())
    return f"{name}:{inner}" if inner else name


@dataclass
class Recipe:
    """A prefill method, a cache policy, optional head sharing / token selection, a decoding strategy
    (or a peer's method). ``parts`` maps a role (``method`` for a single method, or ``prefill``,
    ``cache``, ``heads``, ``select``) to ``(method name, params)``."""

    parts: dict[str, tuple[str, dict]] = field(default_factory=dict)
    decode: SpeculativeConfig | None = None
    peer: tuple[str, dict] | None = None  # (kvpress press class, params)
    name: str | None = None
    description: str | None = None
    budget: float | int | None = None  # the sweep budget applied by with_budget, if any
    method_seed: int | None = None  # the seed applied by with_method_seed, if any
    source: str = "recipe"
    _method: Method | None = field(default=None, init=False, repr=False, compare=False)  # built on first use

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def parse(cls, value, source: str = "recipe") -> Recipe:
        """A recipe from a spec string, a mapping, a :class:`Method` or a Recipe."""
        if isinstance(value, Recipe):
            return value
        if isinstance(value, Method):
            return cls({"method": (value.name, value.params())}, source=source)
        if isinstance(value, str):
            return cls.from_spec(value, source)
        if isinstance(value, dict):
            return cls.from_dict(value, source)
        raise AttnkitError(f"{source}: a recipe must be a mapping (or a method spec string such as "
                           f"'snapkv:budget=0.3'), got {type(value).__name__}")

    @classmethod
    def from_spec(cls, spec: str, source: str = "recipe") -> Recipe:
        if not isinstance(spec, str) or not spec.strip():
            raise AttnkitError(f"{source}: method specs must be non-empty strings like 'window:window=512', "
                               f"got {spec!r}")
        spec = spec.strip()
        if spec.startswith(PEER_PREFIX):
            press, params = parse_peer_spec(spec)
            require_kvpress()
            return cls(peer=(press, params), name=spec, source=source)
        parts = split_method_spec(spec)
        quantize = len(parts) > 1 and is_quantizer(parts[-1][0])
        roles = ("method",) if len(parts) - quantize == 1 else ("prefill", "cache")
        recipe = cls(dict(zip(roles + ("quantize",) * quantize, parts)), name=spec, source=source)
        recipe.check()
        return recipe

    @classmethod
    def from_dict(cls, data: dict, source: str = "recipe") -> Recipe:
        if not isinstance(data, dict):
            raise AttnkitError(f"{source}: a recipe must be a mapping with a 'method' key, got {type(data).__name__}")
        unknown = sorted(set(data) - set(ALL_RECIPE_KEYS))
        if unknown:
            raise AttnkitError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(ALL_RECIPE_KEYS)}")
        name, description = data.get("name"), data.get("description")
        for key, value in (("name", name), ("description", description)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise AttnkitError(f"{source}: {key!r} must be a non-empty string, got {value!r}")
        params = data.get("params", {}) or {}
        if not isinstance(params, dict):
            raise AttnkitError(f"{source}: 'params' must be a mapping of parameter names to values")
        if data.get("kvpress") is not None:
            others = sorted(k for k in data if k not in ("kvpress", "params", "name", "description"))
            if others:
                raise AttnkitError(f"{source}: a kvpress recipe names the press and its params only; drop "
                                   f"{', '.join(others)}")
            press = check_press_name(data["kvpress"], source)
            require_kvpress()
            return cls(peer=(press, dict(params)), name=name or _spec_text(PEER_PREFIX + press, params),
                       description=description, source=source)
        given = [r for r in ATTENTION_ROLES if data.get(r) is not None]
        parts: dict[str, tuple[str, dict]] = {}
        if data.get("quantize") is not None:
            parts["quantize"] = _parse_part(data["quantize"], f"{source}: quantize")
        if data.get("method") is not None or not given:
            if given:
                raise AttnkitError(f"{source}: give either 'method' (one method) or the parts "
                                   f"{', '.join(ATTENTION_ROLES)}, not both")
            if not isinstance(data.get("method"), str) and data.get("decode") is None and not parts:
                raise AttnkitError(f"{source}: 'method' must be a method name (see `attnkit methods`), or give "
                                   f"the parts {', '.join(PART_ROLES)} / 'decode' / 'kvpress'")
            if data.get("method") is not None:
                if not isinstance(data["method"], str):
                    raise AttnkitError(f"{source}: 'method' must be a method name (see `attnkit methods`)")
                parts["method"] = (data["method"], dict(params))
        else:
            if params:
                raise AttnkitError(f"{source}: 'params' belongs to 'method'; give each part's params inside it")
            for role in given:
                parts[role] = _parse_part(data[role], f"{source}: {role}")
        decode = None if data.get("decode") is None else SpeculativeConfig.from_mapping(data["decode"], source)
        recipe = cls(parts, decode, name=name, description=description, source=source)
        recipe.check()
        return recipe

    # ---- what it is ---------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """The name shown in tables (the spec as given, the recipe's name, or one derived from it)."""
        if self.name:
            return self.name
        if self.peer is not None:
            return _spec_text(PEER_PREFIX + self.peer[0], self.peer[1])
        roles = ("method",) + PART_ROLES
        attn = "+".join(_spec_text(*self.parts[r]) for r in roles if r in self.parts) or "full"
        if self.decode is None:
            return attn
        mapping = self.decode.to_mapping()
        dec = _spec_text(f"speculate:{mapping.pop('speculate')}", mapping)
        return dec if attn == "full" else f"{attn} {dec}"

    @property
    def is_peer(self) -> bool:
        return self.peer is not None

    @property
    def is_full(self) -> bool:
        """Plain full attention with plain decoding: the reference every other row is compared with."""
        if self.peer is not None or self.decode is not None:
            return False
        return list(self.parts.values()) in ([], [("full", {})])

    def budget_role(self) -> str | None:
        """The part a sweep budget goes to (see :func:`attnkit.recipe.budget.budget_role`)."""
        return budgets.budget_role(self)

    def has_own_budget(self) -> bool:
        return budgets.has_own_budget(self)

    def takes_budget(self) -> bool:
        """Whether a sweep's budgets apply (something takes a budget and the recipe leaves it open)."""
        return self.budget_role() is not None and not self.has_own_budget()

    def with_budget(self, budget, length: int | None = None) -> Recipe:
        """This recipe at `budget` (a fraction of the prompt or a token count); `length` (the prompt's
        tokens) turns a fraction into a window size."""
        out = budgets.with_budget(self, budget, length)
        out._method = None
        out.check()
        return out

    def takes_seeds(self) -> bool:
        """Whether an evaluation's seeds apply (a stochastic method whose seed is left open)."""
        return seeds.takes_seeds(self)

    def with_method_seed(self, seed: int) -> Recipe:
        """This recipe with its stochastic method drawing from `seed` (:mod:`attnkit.recipe.seeds`)."""
        out = seeds.with_method_seed(self, seed)
        out.check()
        return out

    # ---- using it -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Build everything once so that a bad recipe fails now (an open budget is filled in for the check)."""
        if self.peer is not None:
            return
        if self.decode is not None:
            attn = [p for p in self.parts.values() if p != ("full", {})]
            if attn:
                raise AttnkitError(f"{self.source}: speculative decoding verifies with full attention; drop the "
                                   f"attention part(s) {', '.join(_spec_text(*p) for p in attn)} (for "
                                   f"self-speculation give the draft's cache method as decode.draft)")
        roles = set(self.parts) - {"quantize"}
        if len(roles & set(PART_ROLES)) > 1 and roles != {"prefill", "cache"}:
            raise AttnkitError(f"{self.source}: parts {', '.join(sorted(roles))} cannot be combined: compose joins "
                               f"one 'prefill' method and one 'cache' method; 'heads' and 'select' stand alone")
        if "quantize" in self.parts and not is_quantizer(self.parts["quantize"][0]):
            raise AttnkitError(f"{self.source}: 'quantize' names a quantizer (kivi), got {self.parts['quantize'][0]!r}")
        probe = self.with_budget(0.5, 1024) if self.takes_budget() else self
        probe._build()

    def _build(self) -> Method:
        if self.peer is not None:
            raise AttnkitError(f"recipe {self.label!r} is a kvpress press; it runs in kvpress's environment "
                               f"(attnkit.eval.run.peers), not as an attnkit method")
        parts = {role: part for role, part in self.parts.items() if role != "quantize"}
        if not parts:
            inner = {"method": "full", "params": {}}
        elif set(parts) == {"prefill", "cache"}:
            (pn, pp), (cn, cp) = parts["prefill"], parts["cache"]
            inner = {"method": "compose", "params": {"prefill": {"method": pn, "params": pp},
                                                     "cache": {"method": cn, "params": cp}}}
        else:
            ((name, params),) = parts.values()
            inner = {"method": name, "params": params}
        if "quantize" in self.parts:
            name, params = self.parts["quantize"]
            if "cache" in params:
                raise AttnkitError(f"{self.source}: the quantizer {name} holds the cache of the other parts; drop its "
                                   f"'cache' parameter")
            return make_method(name, **params, cache=inner)
        return make_method(inner["method"], **inner["params"])

    def method(self) -> Method:
        """The attention method (``full`` for a recipe that only sets the decoding strategy), built once."""
        if self._method is None:
            self._method = self._build()
        return self._method

    def generate(self, model, prompt, **options):
        """:func:`attnkit.generate` with this recipe's method, or :func:`attnkit.speculative_generate`
        with its decoding strategy; `options` are theirs (max_new_tokens, stop, ...)."""
        if self.decode is None:
            return generate(model, prompt, self.method(), **options)
        return speculative_generate(model, prompt, self.decode, **options)

    def to_dict(self) -> dict:
        """The recipe as a mapping :meth:`from_dict` reads back (JSON-safe)."""
        out: dict = {"name": self.label}
        if self.description:
            out["description"] = self.description
        if self.peer is not None:
            out.update(kvpress=self.peer[0], params=dict(self.peer[1]))
            return out
        if "method" in self.parts:
            out.update(method=self.parts["method"][0], params=dict(self.parts["method"][1]))
        for role in PART_ROLES:
            if role in self.parts:
                out[role] = {"method": self.parts[role][0], "params": dict(self.parts[role][1])}
        if self.decode is not None:
            out["decode"] = self.decode.to_mapping()
        return out


def _parse_part(value, source: str) -> tuple[str, dict]:
    if isinstance(value, str):
        parts = split_method_spec(value)
        if len(parts) != 1:
            raise AttnkitError(f"{source}: one method spec per part, got the composition {value!r}")
        return parts[0]
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"method", "params"})
        if unknown or not isinstance(value.get("method"), str):
            raise AttnkitError(f"{source}: a part is a method spec string or {{'method': NAME, 'params': {{...}}}}, "
                               f"got {value!r}")
        params = value.get("params", {}) or {}
        if not isinstance(params, dict):
            raise AttnkitError(f"{source}: 'params' must be a mapping of parameter names to values")
        return value["method"], dict(params)
    raise AttnkitError(f"{source}: a part is a method spec string or a mapping, got {type(value).__name__}")


def load_recipe_file(path: str | Path) -> Recipe:
    """Read a recipe file (.json, .yaml or .yml) into a :class:`Recipe`."""
    data = read_config_file(path, "recipe file")
    return Recipe.parse(data, f"recipe file {str(path)!r}")


def as_recipe(value, source: str = "recipe") -> Recipe:
    """A spec string, mapping, method or recipe -> :class:`Recipe`."""
    return Recipe.parse(value, source)
