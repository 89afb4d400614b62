"""The recipes ``attnkit tune`` searches: every combination of a space's parts, each where it applies.

A space (a YAML or JSON file, ``attnkit tune --space FILE``; without one, :func:`default_space` of the target)::

    prefill: [full, minference]          # prefill methods (method specs; full = dense prefill)
    cache: [full, snapkv, streaming]     # cache methods (method specs; full = every entry kept)
    budgets: [0.25, 0.5]                 # fractions of the prompt, or token counts, for a cache that takes one
    allocation: [uniform, pyramid, adaptive]   # how a budget spreads: as the spec says, over layers as
                                         # PyramidKV (layer_budgets=pyramid), over heads as AdaKV (head_budgets=adaptive)
    quantize: [none, 4, 2]               # KIVI bits holding the cache (none: not quantized), or a quantizer spec
    decode: [none, {speculate: prompt_lookup, gamma: 4}]   # speculative decoding (a recipe's decode mapping)
    recipes: [h2o:budget=0.3]            # recipes tried as given (specs or mappings), besides the combinations

A candidate is ``PREFILL+CACHE+QUANTIZER`` at one budget (:class:`Candidate`, named as a sweep names it,
``snapkv:layer_budgets=pyramid+kivi:bits=4@0.25``, so a sweep's cells in the results directory are reused). An
allocation applies to a cache method whose class has its parameter (taken from the method registry), a budget to a
cache method that takes one and leaves it open. Speculative decoding verifies with full attention, so a ``decode``
option is a candidate of its own (full attention, no quantizer): it is lossless, so it can only win a speed target,
and the default spaces name it for ``decode`` only. Likewise a sparse prefill changes neither the KV cache nor the
decode step, only the prompt's attention (and so perhaps the accuracy): the default names prefill methods for the
``prefill`` target only. Plain full attention is the reference every candidate is measured against, never a
candidate. A combination that cannot be built (``compose`` refuses a cache method that computes its own prefill,
say) or cannot run the protocol is skipped with the reason.
"""

from __future__ import annotations

import itertools
import typing
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.eval.data.protocols import refusal
from attnkit.eval.stats.table import column_label
from attnkit.methods.spec import coerce, is_quantizer, method_class, split_method_spec
from attnkit.recipe import Recipe, as_recipe, check_budget_value
from attnkit.recipe.core import PART_ROLES
from attnkit.validate import choice, is_whole

TARGETS = ("kv", "decode", "prefill")
TARGET_TEXT = {"kv": "least peak KV bytes", "decode": "fastest decode", "prefill": "fastest prefill"}
SPACE_KEYS = ("prefill", "cache", "budgets", "allocation", "quantize", "decode", "recipes")
# allocation -> the method parameter it sets and its value (uniform: the spec as given)
ALLOCATIONS = {"uniform": None, "pyramid": ("layer_budgets", "pyramid"), "adaptive": ("head_budgets", "adaptive")}
QUANTIZER = "kivi"


def default_space(target: str, model_spec: str = "tiny") -> dict:
    """The space searched without ``--space``: small enough for a few minutes of ``tiny`` on a CPU. ``kv``: SnapKV
    (Li et al. 2024, arXiv 2404.14469) at two budgets, uniform or pyramid over layers, with and without KIVI at 4
    and 2 bits (Liu et al. 2024, arXiv 2402.02750), and KIVI alone. ``decode``: SnapKV and StreamingLLM at two
    budgets and the lossless speculative decoders (a draft model where the model has one: ``tiny``'s
    ``tiny-draft``). ``prefill``: the sparse prefill methods (MInference, Jiang et al. 2024, arXiv 2407.02490;
    its A-shape pattern), alone and with SnapKV."""
    choice("target", target, TARGETS)
    if target == "kv":
        return {"cache": ["full", "snapkv"], "budgets": [0.25, 0.5], "allocation": ["uniform", "pyramid"],
                "quantize": ["none", 4, 2]}
    if target == "decode":
        decode = ["none", {"speculate": "prompt_lookup", "gamma": 4}, {"speculate": "self", "gamma": 4}]
        if model_spec == "tiny":
            decode.append({"speculate": "draft_model", "draft": "tiny-draft", "gamma": 4})
        return {"cache": ["full", "snapkv", "streaming"], "budgets": [0.25, 0.5], "decode": decode}
    return {"prefill": ["minference", "a_shape:n_init=64,n_local=512"], "cache": ["full", "snapkv"], "budgets": [0.5]}


@dataclass(frozen=True)
class Candidate:
    """A recipe with its budget open (`base`, as a sweep names it) at `budget` (None: the recipe as it is)."""

    base: Recipe
    budget: float | int | None = None

    @property
    def id(self) -> str:
        return column_label(self.base.label, self.budget)

    def recipe(self, length: int) -> Recipe:
        """The recipe run on prompts of `length` tokens (a fractional window budget depends on it)."""
        return self.base if self.budget is None else self.base.with_budget(self.budget, length)

    def to_file(self, length: int) -> dict:
        """:meth:`recipe` as a recipe file's mapping, named by :attr:`id`, its parameters typed as the methods
        take them (a spec's values are strings: ``bits: 2``, not ``"2"``)."""
        out = self.recipe(length).to_dict()
        out["name"] = self.id
        if "method" in out:
            out["params"] = typed_params(out["method"], out.get("params") or {})
        for role in PART_ROLES:
            if role in out:
                out[role] = {"method": out[role]["method"], "params": typed_params(out[role]["method"],
                                                                                   out[role]["params"])}
        return out


def typed_params(name: str, params: dict) -> dict:
    """`params` of method `name` converted to its fields' types (as :func:`attnkit.methods.spec.make_method` does)."""
    hints = typing.get_type_hints(method_class(name))
    return {k: coerce(k, name, hints.get(k, str), v) for k, v in params.items()}


@dataclass
class Space:
    prefill: list[str] = field(default_factory=lambda: ["full"])
    cache: list[str] = field(default_factory=lambda: ["full"])
    budgets: list = field(default_factory=list)
    allocation: list[str] = field(default_factory=lambda: ["uniform"])
    quantize: list = field(default_factory=lambda: [None])
    decode: list = field(default_factory=lambda: [None])
    recipes: list = field(default_factory=list)
    source: str = "space"

    def to_dict(self) -> dict:
        return {"prefill": self.prefill, "cache": self.cache, "budgets": self.budgets, "allocation": self.allocation,
                "quantize": [q if q is not None else "none" for q in self.quantize],
                "decode": [d if d is not None else "none" for d in self.decode], "recipes": self.recipes}


def _list(data: dict, key: str, source: str, default: list) -> list:
    value = data.get(key)
    if value is None:
        return list(default)
    if not isinstance(value, list) or not value:
        raise AttnkitError(f"{source}: {key} must be a non-empty list, got {value!r}")
    return value


def _one_method(spec, what: str) -> str:
    """A single method spec (``snapkv:window_size=16``), its method registered."""
    if not isinstance(spec, str) or not spec.strip():
        raise AttnkitError(f"{what} must be a method spec such as 'snapkv' or 'minference', got {spec!r}")
    parts = split_method_spec(spec)
    if len(parts) != 1:
        raise AttnkitError(f"{what} names one method (the space combines the parts), got {spec!r}")
    method_class(parts[0][0], what)
    return spec.strip()


def _quantizer(value, what: str) -> str | None:
    """None (not quantized), KIVI's bits, or a quantizer's spec -> its spec."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    if is_whole(value):
        return f"{QUANTIZER}:bits={value}"
    spec = _one_method(value, what)
    if not is_quantizer(split_method_spec(spec)[0][0]):
        raise AttnkitError(f"{what} must be none, a number of bits (4, 2) or a quantizer spec such as "
                           f"'kivi:bits=4,residual=64', got {value!r}")
    return spec


def space_from_dict(data, source: str = "space") -> Space:
    """Validate a space mapping (module docstring); missing parts are not searched (full prefill, full cache,
    uniform allocation, no quantizer, no speculation)."""
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}: a space must be a mapping with some of {', '.join(SPACE_KEYS)}")
    unknown = sorted(set(data) - set(SPACE_KEYS))
    if unknown:
        raise AttnkitError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SPACE_KEYS)}")
    prefill = [_one_method(s, f"{source}: prefill") for s in _list(data, "prefill", source, ["full"])]
    cache = [_one_method(s, f"{source}: cache") for s in _list(data, "cache", source, ["full"])]
    budgets = [check_budget_value(b, f"{source}: budgets") for b in _list(data, "budgets", source, [None])
               if b is not None]
    if len(set(budgets)) != len(budgets):
        raise AttnkitError(f"{source}: budgets has duplicates: {budgets}")
    allocation = [choice(f"{source}: allocation", a, tuple(ALLOCATIONS))
                  for a in _list(data, "allocation", source, ["uniform"])]
    quantize = [_quantizer(q, f"{source}: quantize") for q in _list(data, "quantize", source, [None])]
    decode = []
    for d in _list(data, "decode", source, [None]):
        if d is None or (isinstance(d, str) and d.strip().lower() == "none"):
            decode.append(None)
        elif isinstance(d, dict):
            as_recipe({"decode": d}, f"{source}: decode")  # validated now
            decode.append(dict(d))
        else:
            raise AttnkitError(f"{source}: decode options are none or a mapping such as "
                               f"{{speculate: prompt_lookup, gamma: 4}}, got {d!r}")
    recipes = data.get("recipes") or []
    if not isinstance(recipes, list):
        raise AttnkitError(f"{source}: recipes must be a list of method specs or recipe mappings")
    for i, r in enumerate(recipes):
        as_recipe(r, f"{source}: recipes[{i}]")
    return Space(prefill, cache, budgets, allocation, quantize, decode, list(recipes), source)


def load_space(path: str | Path) -> Space:
    path = Path(path)
    return space_from_dict(read_config_file(path, "space file"), f"space file {str(path)!r}")


def _spec_text(name: str, params: dict) -> str:
    inner = ",".join(f"{k}={v}" for k, v in params.items())
    return f"{name}:{inner}" if inner else name


def _allocated(cache: str, allocation: str) -> str | None:
    """`cache` with `allocation` applied; None where its method has no such parameter."""
    if ALLOCATIONS[allocation] is None:
        return cache
    key, value = ALLOCATIONS[allocation]
    ((name, params),) = split_method_spec(cache)
    if key not in {f.name for f in method_class(name).parameters()}:
        return None
    return _spec_text(name, {**params, key: value})


def combinations(space: Space) -> list[str | dict]:
    """Every recipe the space names (method specs, or decode mappings), before budgets: prefill x cache x
    allocation x quantizer, the decoding options, the recipes given."""
    out: list[str | dict] = []
    for prefill, cache, allocation, quant in itertools.product(space.prefill, space.cache, space.allocation,
                                                                space.quantize):
        if cache == "full" and allocation != "uniform":
            continue
        cache_spec = _allocated(cache, allocation) if cache != "full" else None
        if cache != "full" and cache_spec is None:
            continue
        parts = [p for p in (None if prefill == "full" else prefill, cache_spec) if p is not None]
        if quant is not None:
            parts = (parts or ["full"]) + [quant]
        if parts:
            out.append("+".join(parts))
    out += [{"decode": d} for d in space.decode if d is not None]
    return out + list(space.recipes)


def candidates(space: Space, lengths: list[int], protocol: str) -> tuple[list[Candidate], list[dict]]:
    """The space's candidates, in order and each once, and those skipped (``{"recipe", "why"}``): a combination
    that cannot be built, cannot run `protocol`, or is plain full attention (the reference)."""
    out: dict[str, Candidate] = {}
    skipped: list[dict] = []
    for item in combinations(space):
        try:
            base = as_recipe(item, f"{space.source}: recipe {item!r}")
        except AttnkitError as exc:
            skipped.append({"recipe": str(item), "why": str(exc)})
            continue
        if base.is_full:
            continue
        why = refusal(base, protocol)
        if why:
            skipped.append({"recipe": base.label, "why": why})
            continue
        budgets = space.budgets if base.takes_budget() else [None]
        if not budgets:
            skipped.append({"recipe": base.label, "why": "it takes a KV budget and the space gives no budgets"})
        for budget in budgets:
            cand = Candidate(base, budget)
            try:
                for length in lengths:
                    cand.recipe(length).check()
            except AttnkitError as exc:
                skipped.append({"recipe": cand.id, "why": str(exc)})
                continue
            out.setdefault(cand.id, cand)
    return list(out.values()), skipped
