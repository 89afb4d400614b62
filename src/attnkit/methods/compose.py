"""``compose``: the prefill outputs of one method with the KV-cache policy of another.

MInference (Jiang et al., 2024, "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic
Sparse Attention", arXiv 2407.02490) runs its sparse prefill with SnapKV compressing the cache for decoding
in its Table 5; the recipe is ``compose(prefill="minference:config=p.json", cache="snapkv:budget=0.3")``, on
the command line ``minference:config=p.json+snapkv:budget=0.3`` (two method specs joined by ``+``;
parameters after a spec belong to it), in a recipe file::

    {"method": "compose", "params": {"prefill": "minference:config=p.json", "cache": "snapkv:budget=0.3"}}

The split: everything about the cache belongs to the *cache* method (allocation, what is stored, the
statistics it observes on the prompt, the compression after prefill, decoding and eviction); only the
attention OUTPUT of the prompt's queries comes from the *prefill* method. The cache method's prefill
stores the chunk as usual and asks the session's method for the output
(:meth:`attnkit.methods.base.Method.prefill_output`), which this method hands to the prefill method, so
the dense prompt attention is never computed (a scoring cache method still computes its own statistics).
A cache method that computes its own prefill attention instead (``window``) cannot be composed: that is
reported, not silently ignored. The prefill method's per-layer state lives apart from the cache
method's (each part sees its own ``ctx.state`` and ``ctx.session_state``), and its cache hooks are never called.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.eviction import EvictionMethod
from attnkit.methods.spec import method_from_dict, parse_method_spec, register
from attnkit.session import LayerContext


@dataclass
class ComposeState:
    """A composition's state (per layer, or per generation): each part's own, and per layer whether the
    cache method asked for the prompt chunk's output (so the prefill method supplied it)."""

    cache: Any
    prefill: Any
    routed: bool = False


def _cache_part(ctx: LayerContext) -> LayerContext:
    return ctx.scoped(lambda s: s.cache, lambda r: r.cache)


def _prefill_part(ctx: LayerContext) -> LayerContext:
    return ctx.scoped(lambda s: s.prefill, lambda r: r.prefill)


def _as_method(value, role: str) -> Method:
    if isinstance(value, Method):
        method = value
    elif isinstance(value, str):
        method = parse_method_spec(value)
    elif isinstance(value, dict):
        method = method_from_dict(value, f"compose {role}")
    else:
        raise AttnkitError(f"{role} must be a method spec ('snapkv:budget=0.3'), a recipe dict or a Method, "
                         f"got {type(value).__name__}")
    if isinstance(method, Compose):
        raise AttnkitError(f"the {role} method of compose cannot itself be a composition")
    if method.run_layers is not None:
        raise AttnkitError(f"{method.name!r} runs the decoder layers itself (a model-level hook) and cannot be "
                         f"composed; use its own parameters (select takes share_config=FILE)")
    if role == "prefill" and not _supplies_prefill_output(method):
        raise AttnkitError(f"prefill method {method.name!r} computes its prefill outputs inside prefill_attention, "
                         f"not in prefill_output, so compose cannot take them from it")
    if role == "prefill" and method.name != "full" and method.dense_prefill_output():
        raise AttnkitError(f"{method.name!r} as the prefill part of PREFILL+CACHE supplies only dense prompt outputs "
                           f"and its cache policy would be dropped; put a sparse prefill method (minference, a_shape) "
                           f"first and one cache method after it")
    return method


def _supplies_prefill_output(method: Method) -> bool:
    """Whether `method`'s prefill outputs are what its ``prefill_output`` returns: it overrides that hook
    (sparse prefill), or its prefill is the base store-then-attend, or it is an eviction method (which
    stores, observes and attends densely)."""
    cls = type(method)
    return (cls.prefill_output is not Method.prefill_output or cls.prefill_attention is Method.prefill_attention
            or isinstance(method, EvictionMethod))


def _spec(value, method: Method):
    """What params() reports: the spec string as given, or a recipe dict for an instance (JSON-safe)."""
    if isinstance(value, (str, dict)):
        return value
    return {"method": method.name, "params": method.params()}


@register
@dataclass(frozen=True)
class Compose(Method):
    """Prefill outputs from `prefill`, everything about the KV cache from `cache`."""

    prefill: str | dict | Method = "full"
    cache: str | dict | Method = "full"
    _prefill: Method = field(default=None, init=False, repr=False, compare=False)
    _cache: Method = field(default=None, init=False, repr=False, compare=False)

    name = "compose"
    summary = "prefill outputs of one method + the KV cache policy of another (PREFILL+CACHE)"

    def __post_init__(self):
        prefill, cache = _as_method(self.prefill, "prefill"), _as_method(self.cache, "cache")
        # derived once from the parameters (the parts as methods; what params() reports)
        object.__setattr__(self, "_prefill", prefill)
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "prefill", _spec(self.prefill, prefill))
        object.__setattr__(self, "cache", _spec(self.cache, cache))

    @property
    def prefill_method(self) -> Method:
        return self._prefill

    @property
    def cache_method(self) -> Method:
        return self._cache

    def describe(self) -> str:
        return f"{self._prefill.describe()}+{self._cache.describe()}"

    # ---- state: each part keeps its own --------------------------------------------------------------
    def new_layer_state(self) -> ComposeState:
        return ComposeState(self._cache.new_layer_state(), self._prefill.new_layer_state())

    def new_session_state(self) -> ComposeState:
        return ComposeState(self._cache.new_session_state(), self._prefill.new_session_state())

    # ---- the cache: all from the cache method -------------------------------------------------------
    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        return self._cache.layer_capacity(_cache_part(ctx))

    def planned_slots(self, ctx: LayerContext) -> int:
        return self._cache.planned_slots(_cache_part(ctx))

    def allocate_layer(self, ctx: LayerContext, k, slots: int, ring: bool):
        return self._cache.allocate_layer(_cache_part(ctx), k, slots, ring)

    def rewrites_stored_keys(self) -> bool:
        return self._cache.rewrites_stored_keys()

    def run_stats(self, session) -> dict:
        """Each part's statistics, each part seeing its own states (the session's otherwise as they are)."""
        stats = {}
        for method, part in ((self._prefill, "prefill"), (self._cache, "cache")):
            view = copy.copy(session)
            view.layer_state = [getattr(s, part) for s in session.layer_state]
            view.state = getattr(session.state, part)
            stats.update(method.run_stats(view))
        return stats

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        self._cache.keep_rows([s.cache for s in layer_states], session_state.cache, rows)
        self._prefill.keep_rows([s.prefill for s in layer_states], session_state.prefill, rows)

    @property
    def stacks_decode(self) -> bool:
        return self._cache.stacks_decode  # decoding is the cache method's alone

    def stack_states(self, layer_states: list, session_states: list) -> tuple | None:
        # decoding reads the cache part's states only: the prefill part's stay where they are
        got = self._cache.stack_states([s.cache for s in layer_states], [s.cache for s in session_states])
        return None if got is None else (ComposeState(got[0], None), ComposeState(got[1], None))

    def unstack_states(self, stacked: tuple, layer_states: list, session_states: list) -> None:
        self._cache.unstack_states((stacked[0].cache, stacked[1].cache), [s.cache for s in layer_states],
                                   [s.cache for s in session_states])

    @property
    def batches(self) -> bool:
        return self._cache.batches and self._prefill.batches

    @property
    def needs_layer_inputs(self) -> bool:
        return self._cache.needs_layer_inputs or self._prefill.needs_layer_inputs

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        own = ctx.session.layer_state[ctx.index]
        own.routed = False
        out = self._cache.prefill_attention(_cache_part(ctx), q, k, v)
        if not own.routed:
            raise AttnkitError(f"compose: cache method {self._cache.name!r} computes its own prefill attention "
                               f"instead of asking for prefill_output, so {self._prefill.name!r} cannot supply the "
                               f"prefill outputs; compose it with a cache method that stores then attends "
                               f"(full, snapkv, h2o, keyformer, streaming)")
        return out

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        self._cache.after_prefill(_cache_part(ctx), q, k, v)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        return self._cache.decode_attention(_cache_part(ctx), q, k, v)

    def after_decode(self, ctx: LayerContext) -> None:
        self._cache.after_decode(_cache_part(ctx))

    def decode_queries_kept(self) -> int | None:
        return getattr(self._cache, "decode_queries_kept", lambda: None)()

    def skip_appends(self, ctx: LayerContext, k, v, q, positions) -> None:
        self._cache.skip_appends(_cache_part(ctx), k, v, q, positions)

    # ---- the prompt's attention outputs: from the prefill method ------------------------------------
    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        ctx.session.layer_state[ctx.index].routed = True
        return self._prefill.prefill_output(_prefill_part(ctx), q, keys, values, positions)
