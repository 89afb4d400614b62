"""What the trailing parts of a spec (``CACHE+kivi:...``, ``CACHE+think:...``) share: each holds the cache of the
method before it in storage of its own and otherwise runs that method unchanged. :class:`CacheWrapper` hands every
step to the wrapped method (``cache``, parsed once into ``_cache``); a wrapper overrides only its storage
(``allocate_layer``) and the steps where it acts on what is stored."""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.spec import method_from_dict, parse_method_spec
from attnkit.session import LayerContext


def parse_cache(value, what: str) -> Method:
    """The method a wrapper's ``cache`` names: a spec, a recipe dict or a Method; anything else refused in one line."""
    if isinstance(value, Method):
        return value
    if isinstance(value, str):
        return parse_method_spec(value)
    if isinstance(value, dict):
        return method_from_dict(value, what)
    raise AttnkitError(f"cache must be a method spec ('snapkv:budget=0.3'), a recipe dict or a Method, "
                       f"got {type(value).__name__}")


def wrappable(value, wrapper: type, name: str, *, again: str, layers: str, storage: str, rotates: str) -> Method:
    """The method a wrapper's ``cache`` names (:func:`parse_cache`), refused in one line where wrapper `name` (of class
    `wrapper`) cannot hold its cache, each reason in the wrapper's own words: the method is already one of `wrapper`
    (`again`), it runs the decoder layers itself (`layers`), it keeps storage of its own (`storage`), it re-rotates keys
    it already stored (`rotates`)."""
    method = parse_cache(value, f"{name} cache")
    if isinstance(method, wrapper):
        raise AttnkitError(again)
    if method.run_layers is not None:
        raise AttnkitError(f"{method.name!r} runs the decoder layers itself (a model-level hook){layers}")
    inner = getattr(method, "cache_method", method)  # a composition's cache part holds the cache
    if type(inner).allocate_layer is not Method.allocate_layer:
        raise AttnkitError(f"{inner.name!r} keeps its own cache storage, {storage}; use it without {name}")
    if method.rewrites_stored_keys():
        raise AttnkitError(f"{method.describe()} re-rotates keys it already stored, {rotates}; use positions=original")
    return method


class CacheWrapper(Method):
    """The wrapped method's steps, with its own states. A subclass (a frozen dataclass with fields ``cache`` and
    ``_cache``) calls :meth:`wrap` in ``__post_init__`` with the method its checks accepted, and says what it is
    in :meth:`own_description`."""

    def wrap(self, inner: Method) -> None:
        object.__setattr__(self, "_cache", inner)  # derived once from `cache`; params() reports the spec given
        if not isinstance(self.cache, (str, dict)):
            object.__setattr__(self, "cache", {"method": inner.name, "params": inner.params()})

    def own_description(self) -> str:
        raise NotImplementedError

    @property
    def cache_method(self) -> Method:
        return self._cache

    @property
    def batches(self) -> bool:
        return self._cache.batches

    @property
    def needs_layer_inputs(self) -> bool:
        return self._cache.needs_layer_inputs

    def describe(self) -> str:
        own = self.own_description()
        return own if self._cache.name == "full" else f"{self._cache.describe()}+{own}"

    def new_layer_state(self):
        return self._cache.new_layer_state()

    def new_session_state(self):
        return self._cache.new_session_state()

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        self._cache.keep_rows(layer_states, session_state, rows)

    def run_stats(self, session) -> dict:
        return self._cache.run_stats(session)

    def layer_capacity(self, ctx: LayerContext):
        return self._cache.layer_capacity(ctx)

    def planned_slots(self, ctx: LayerContext) -> int:
        return self._cache.planned_slots(ctx)

    def dense_prefill_output(self) -> bool:
        return self._cache.dense_prefill_output()

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        return self._cache.prefill_output(ctx, q, keys, values, positions)

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        return self._cache.prefill_attention(ctx, q, k, v)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        return self._cache.decode_attention(ctx, q, k, v)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        self._cache.after_prefill(ctx, q, k, v)

    def after_decode(self, ctx: LayerContext) -> None:
        self._cache.after_decode(ctx)

    def decode_only_appends(self) -> bool:
        return self._cache.decode_only_appends()
