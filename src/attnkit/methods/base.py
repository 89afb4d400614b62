"""The method contract, the registry of methods, and the per-forward step the attention function sees.

A method is a small dataclass of its hyper-parameters (validated in ``__post_init__``) registered by
name with :func:`register`. During a forward pass the runner hands a :class:`Step` to every layer's
attention call; the step wraps the layer in a :class:`LayerContext` and calls the method's hooks:

- ``prefill_attention(ctx, q, k, v) -> out``: attention for a prompt chunk; it also stores the chunk's
  keys and values in ``ctx.kv`` (the layer's cache) as the method sees fit.
- ``prefill_output(ctx, q, keys, values, positions) -> out``: the prompt chunk's attention output over
  the stored keys; the base ``prefill_attention`` stores, then asks the session's method for this (dense
  by default; sparse-prefill methods override it; ``compose`` routes it to its prefill method while its
  cache method stores and observes).
- ``after_prefill(ctx, q, k, v)``: once, on the last prompt chunk of each layer (cache compression).
- ``decode_attention(ctx, q, k, v) -> out``: attention for a generated token, storing it.
- ``after_decode(ctx)``: keep the cache inside its budget.
- ``layer_capacity(ctx) -> (slots, ring)``: how the layer's cache is allocated (``None``: the layer keeps
  no cache at all; its hooks must then not touch ``ctx.kv``).
- ``run_layers(model, step, hidden, all_positions) -> hidden``: a model-level hook (default ``None``: the
  runner runs every decoder layer on every new token). A method that changes which tokens a layer sees
  (Select-Attention, GemFilter) runs the layers itself with :func:`attnkit.runner.run_decoder_layers`.

q is ``[b, q_heads, n, d]``, k and v ``[b, kv_heads, n, d]``, all after RoPE, at positions ``ctx.q_pos``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from attnkit.attention import attend, folded_attention, folded_bias, sdpa
from attnkit.cache import KVCache, LayerKV
from attnkit.errors import AttnkitError

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add a method dataclass to the registry under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


@dataclass
class Session:
    """State of one generation: the method, the cache, and what the method keeps per layer."""

    method: Method
    cache: KVCache
    n_layers: int
    prompt_len: int
    max_new_tokens: int
    layer_state: list[dict] = field(default_factory=list)
    # rotations by position offsets with the model's RoPE frequencies (attnkit.rope.Rope), filled in by
    # the runner / AttnkitCache; methods that re-index key positions need it
    rope: Any = None
    # state a method shares across layers (e.g. Keyformer's shared score), keyed by the method
    shared: dict = field(default_factory=dict)

    def __post_init__(self):
        self.layer_state = [{} for _ in range(self.n_layers)]


@dataclass
class Step:
    """One forward pass: which phase, which positions, and whether it ends the prompt."""

    session: Session
    phase: str  # "prefill" or "decode"
    q_pos: torch.Tensor  # [n] original positions of the new tokens
    last_chunk: bool = True
    # what the layers of this forward can share (e.g. a mask built on the first layer), by key
    shared: dict = field(default_factory=dict, repr=False)

    def shared_value(self, key, build):
        """The value the layers of this forward share under `key`, built by ``build()`` on first use."""
        value = self.shared.get(key)
        if value is None:
            value = self.shared[key] = build()
        return value

    def attention(self, layer: int, q, k, v, scaling: float, native_window: int | None) -> torch.Tensor:
        ctx = LayerContext(self, layer, scaling, native_window)
        method = self.session.method
        if ctx.kv is None:
            capacity = method.layer_capacity(ctx)
            if capacity is not None:  # None: this layer keeps no cache (Select-Attention's later layers)
                slots, ring = capacity
                self.session.cache.layers[layer] = LayerKV.allocate(k.shape[0], k.shape[1], slots, k.shape[-1],
                                                                    k.dtype, k.device, ring)
        if self.phase == "prefill":
            out = method.prefill_attention(ctx, q, k, v)
            self.session.cache.track_peak()
            if self.last_chunk:
                method.after_prefill(ctx, q, k, v)
        else:
            out = method.decode_attention(ctx, q, k, v)
            self.session.cache.track_peak()
            method.after_decode(ctx)
        self.session.cache.track_peak()
        return out


@dataclass
class LayerContext:
    step: Step
    index: int
    scaling: float
    native_window: int | None  # the model's own sliding window for this layer, if any

    @property
    def kv(self) -> LayerKV:
        return self.step.session.cache.layers[self.index]

    @property
    def q_pos(self) -> torch.Tensor:
        return self.step.q_pos

    @property
    def state(self) -> dict:
        return self.step.session.layer_state[self.index]

    @property
    def session(self) -> Session:
        return self.step.session


class Method:
    """Base class: full attention (every token kept, the model's own masking)."""

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    # model-level hook ``run_layers(model, step, hidden, all_positions) -> hidden`` (see the module
    # docstring); None = the runner runs every decoder layer on the new tokens
    run_layers: ClassVar[Any] = None

    # ---- hooks ---------------------------------------------------------------------------------
    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        return s.prompt_len + s.max_new_tokens, False

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        return self._store_and_attend(ctx, q, k, v)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        pass

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        return self._store_and_attend(ctx, q, k, v)

    def after_decode(self, ctx: LayerContext) -> None:
        pass

    def decode_only_appends(self) -> bool:
        """Whether decoding only appends to the cache (nothing evicted, no statistics gathered), so that
        a decode step may take several tokens and dropping the newest ``k`` slots (``LayerKV.length -=
        k``) undoes the last ``k`` tokens exactly (speculative decoding's rollback)."""
        return False

    # ---- shared machinery ------------------------------------------------------------------------
    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        """Output of a prompt chunk's queries over the layer's stored `keys`/`values` (at `positions`):
        dense attention. The base store-then-attend path calls it on the SESSION's method, so a wrapper
        (``compose``) can supply the outputs while another method keeps the cache."""
        return attend(q, keys, values, ctx.scaling, ctx.q_pos, positions, ctx.native_window)

    def _store_and_attend(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        ctx.kv.append(k, v, ctx.q_pos)
        if ctx.step.phase == "prefill":
            keys, values, positions = ctx.kv.view()
            return ctx.session.method.prefill_output(ctx, q, keys, values, positions)
        return self._attend_held(ctx, q)

    @staticmethod
    def _attend_held(ctx: LayerContext, q) -> torch.Tensor:
        """Attention of a decoding step's queries over the held entries (their own already stored, as the
        newest slots: they were appended, or written over one evicted slot for a single token)."""
        keys, values, positions = ctx.kv.view()
        if ctx.native_window is None and q.shape[2] == 1:
            # the newest token's query: every held key is at or before it, so no mask and none of
            # attend's checks of the key positions (reductions over the whole cache in every layer:
            # 7-9 % of a one-token step of `tiny` at 2k tokens)
            return sdpa(q, keys, values, ctx.scaling)
        if ctx.native_window is None and not ctx.kv.ring:
            # several appended tokens (a draft checking guesses): they fill the last slots, every other
            # key precedes them, so the causal mask by slot index is the mask by position, whatever each
            # head kept; built on the first layer, reused by the others holding as many entries (150 us
            # per layer otherwise)
            n, length, groups = q.shape[2], keys.shape[2], q.shape[1] // keys.shape[1]

            def slot_order_bias():
                slots = torch.arange(length, device=q.device)
                return folded_bias(slots[length - n:], slots, groups, None, q.dtype)

            bias = ctx.step.shared_value(("slot_order", n, length, groups, q.dtype), slot_order_bias)
            return folded_attention(q, keys, values, ctx.scaling, bias)
        return attend(q, keys, values, ctx.scaling, ctx.q_pos, positions, ctx.native_window)

    # ---- parameters ------------------------------------------------------------------------------
    @classmethod
    def parameters(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in self.parameters()}

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({inner})" if inner else self.name


def _coerce(name: str, method: str, hint, raw):
    """Turn a command-line string into the dataclass field's type `hint`, with a clear error."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if not isinstance(raw, str):
        return raw
    if raw.lower() in ("none", "null") and type(None) in options:
        return None
    for typ in options:
        if typ is type(None):
            continue
        try:
            if typ is bool:
                if raw.lower() in ("1", "true", "yes"):
                    return True
                if raw.lower() in ("0", "false", "no"):
                    return False
                raise ValueError
            if typ in (int, float, str):
                return typ(raw)
            if typing.get_origin(typ) is typing.Literal:
                if raw in typing.get_args(typ):
                    return raw
                raise ValueError
            if typing.get_origin(typ) is list and "/" in raw:
                # a per-layer list on the command line: values separated by "/" ("512/256/256")
                (item,) = typing.get_args(typ) or (str,)
                return [item(x) for x in raw.split("/")]
        except ValueError:
            continue
    raise AttnkitError(f"method {method!r}: parameter {name}={raw!r} is not a valid {hint}")


def make_method(name: str, **params) -> Method:
    """Build a registered method by name; string values (from the CLI) are converted to the field types."""
    from attnkit import methods as _  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise AttnkitError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    fields = {f.name: f for f in cls.parameters()}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        allowed = ", ".join(fields) or "none"
        raise AttnkitError(f"method {name!r} has no parameter {', '.join(unknown)}; its parameters: {allowed}")
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(k, name, hints.get(k, str), v) for k, v in params.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise AttnkitError(f"method {name!r}: {exc}") from None


_JOIN = re.compile(r"\+(?=\s*[A-Za-z_]\w*\s*(?::|,|\+|$))")  # "+" before a method name


def split_method_spec(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"window:window=1024"`` -> ``[("window", {"window": "1024"})]``, without building the method;
    ``"PREFILL+CACHE"`` -> two entries. Values stay strings (:func:`make_method` converts them)."""
    parts = [p.strip() for p in _JOIN.split(spec)]
    if len(parts) > 2 or not all(parts):
        raise AttnkitError(f"method spec {spec!r}: 'PREFILL+CACHE' joins exactly two method specs")
    out = []
    for part in parts:
        name, _, rest = part.partition(":")
        params = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise AttnkitError(f"method spec {spec!r}: expected key=value, got {item!r}")
            params[key.strip()] = value.strip()
        out.append((name.strip(), params))
    return out


def parse_method_spec(spec: str) -> Method:
    """``"window:window=1024"`` or ``"window:window=1024,foo=bar"`` -> a method instance.

    ``"PREFILL+CACHE"`` (two specs joined by ``+``, e.g. ``"minference:config=p.json+snapkv:budget=0.3"``)
    is the ``compose`` method: prefill outputs from the first, the KV cache policy of the second.
    """
    parts = split_method_spec(spec)
    if len(parts) > 1:
        texts = [p.strip() for p in _JOIN.split(spec)]
        return make_method("compose", prefill=texts[0], cache=texts[1])
    name, params = parts[0]
    return make_method(name, **params)
