"""The method contract: the hooks a method may implement and the dense default behind them.

A method is a small frozen dataclass of its hyper-parameters (validated in ``__post_init__``) registered
by name with :func:`attnkit.methods.spec.register`. It holds no run state: what it keeps per layer and
per generation lives in the objects ``new_layer_state()`` / ``new_session_state()`` return, which the
session owns. During a forward pass the runner hands a :class:`attnkit.session.Step` to every layer's
attention call; the step wraps the layer in a :class:`attnkit.session.LayerContext` and calls the hooks:

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
- ``allocate_layer(ctx, k, slots, ring) -> LayerKV``: the storage of that cache (default: full precision,
  :class:`attnkit.cache.LayerKV`; ``kivi`` gives quantized storage with the same slots).
- ``run_layers(model, step, hidden, all_positions) -> hidden``: a model-level hook (default ``None``: the
  runner runs every decoder layer on every new token). A method that changes which tokens a layer sees
  (Select-Attention, GemFilter) runs the layers itself with :func:`attnkit.forward.run_decoder_layers`.

- ``planned_slots(ctx) -> int``: slots the layer will hold once the prompt is processed, asked of every
  layer before any work (a batch's memory check; a parameter that does not fit the prompt raises here).
- ``keep_rows(layer_states, session_state, rows)``: keep the rows of any per-row tensors in the states
  when finished sequences leave a batch.
- ``dense_prefill_output()``: whether the prompt's outputs are plain dense attention (a scoring method may then
  compute them together with its statistic); ``rewrites_stored_keys()``: whether the method overwrites keys it
  already stored (a quantized cache cannot hold those).

q is ``[b, q_heads, n, d]``, k and v ``[b, kv_heads, n, d]``, all after RoPE, at positions ``ctx.q_pos``.
The ``b`` rows of a session are sequences of the same prompt length (same positions, same budgets), so a
hook that works row by row serves a batch; a method whose choices cannot be shared by rows sets
``batches = False`` and the runner gives each sequence a session of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from attnkit.attention import attend, folded_attention, folded_bias, sdpa
from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError
from attnkit.methods.spec import make_method, parse_method_spec
from attnkit.session import LayerContext, stack_states, unstack_states


class Method:
    """Base class: full attention (every token kept, the model's own masking)."""

    name: ClassVar[str] = "base"
    summary: ClassVar[str] = ""
    # the kvpress press with this method's kept positions (checked side by side, docs/methods.md), or "" for none
    kvpress: ClassVar[str] = ""
    # model-level hook ``run_layers(model, step, hidden, all_positions) -> hidden`` (see the module
    # docstring); None = the runner runs every decoder layer on the new tokens
    run_layers: ClassVar[Any] = None
    # whether one session may hold several sequences (of the same prompt length) in its batch dimension;
    # a method whose prefill or token choice is per sequence (sparse prefill indexes, Select's chosen
    # tokens) says False and the runner gives each sequence its own session
    batches: ClassVar[bool] = True
    # whether the hooks read each layer's attention input hidden states (``ctx.layer_input()``, kvzap's predictor):
    # the hosts then hand them over (:func:`attnkit.attention.watch_layer_inputs`)
    needs_layer_inputs: ClassVar[bool] = False

    # ---- state ---------------------------------------------------------------------------------
    def new_layer_state(self):
        """This method's state for one layer of one generation (``ctx.state``): a small dataclass of
        its own, or None for a method that keeps none."""
        return None

    def new_session_state(self):
        """This method's state for one generation, shared by its layers (``ctx.session_state``)."""
        return None

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` of any per-row tensors in this method's states (the session drops
        sequences that finished; the cache's own rows are already kept). Default: the states hold none."""

    @property
    def stacks_decode(self) -> bool:
        """Whether a decode step of several generations of this method may run as one step whose rows are theirs
        (:attr:`attnkit.session.Step.per_row`: each row at its own position, the states stacked by
        :meth:`stack_states`); the vLLM host then steps its requests together instead of one by one."""
        return False

    def stack_states(self, layer_states: list, session_states: list) -> tuple | None:
        """``(layer state, session state)`` standing for several generations' states of one layer in a stacked
        decode step (:func:`attnkit.session.stack_states`), or None where they cannot step together."""
        if not self.stacks_decode:
            return None
        layer, run = stack_states(layer_states), stack_states(session_states)
        return (layer[1], run[1]) if layer[0] and run[0] else None

    def unstack_states(self, stacked: tuple, layer_states: list, session_states: list) -> None:
        """After a stacked decode step: each generation's states from the stacked ones (:meth:`stack_states`)."""
        unstack_states(stacked[0], layer_states)
        unstack_states(stacked[1], session_states)

    def run_stats(self, session) -> dict:
        """What this method measured during the generation `session` ran (numbers by name), for the
        run's statistics (:attr:`attnkit.runner.GenerationStats.method_stats`)."""
        return {}

    # ---- hooks ---------------------------------------------------------------------------------
    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        return s.prompt_len + s.max_new_tokens, False

    def allocate_layer(self, ctx: LayerContext, k: torch.Tensor, slots: int, ring: bool) -> LayerKV:
        """The storage of this layer's cache, `slots` per kv head (:meth:`layer_capacity`), shaped after the
        layer's first keys `k` ``[b, kv, n, d]``: full precision by default."""
        return LayerKV.allocate(k.shape[0], k.shape[1], slots, k.shape[-1], k.dtype, k.device, ring)

    def dense_prefill_output(self) -> bool:
        """Whether this method's prompt outputs are plain dense attention (its ``prefill_output`` is the base's)."""
        return type(self).prefill_output is Method.prefill_output

    def merged_values(self, ctx: LayerContext, keep: torch.Tensor) -> torch.Tensor | None:
        """A merging method's instruction to the host at a compression keeping the slots `keep` ``[b, kv, n]``
        (ascending): those entries' new values ``[b, kv, n, d]``, the evicted entries' values folded in, keys and
        positions unchanged (:meth:`attnkit.cache.LayerKV.keep_merged` applies it). None (the default): the
        evicted entries are dropped."""
        return None

    def rewrites_stored_keys(self) -> bool:
        """Whether this method overwrites keys it already stored (re-rotating them in place, say)."""
        return False

    def planned_slots(self, ctx: LayerContext) -> int:
        """Slots per kv head this layer will hold once the prompt is processed, asked of every layer before
        any work (a batch's memory check); raises AttnkitError when the method's parameters do not fit
        this session's prompt. Default: the layer's capacity."""
        capacity = self.layer_capacity(ctx)
        return 0 if capacity is None else capacity[0]

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
            # attend's checks of the key positions (reductions over the whole cache in every layer)
            return sdpa(q, keys, values, ctx.scaling)
        if ctx.native_window is None and not ctx.kv.ring:
            # several appended tokens (a draft checking guesses): they fill the last slots, every other
            # key precedes them, so the causal mask by slot index is the mask by position, whatever each
            # head kept; built on the first layer, reused by the others holding as many entries
            n, length, groups = q.shape[2], keys.shape[2], q.shape[1] // keys.shape[1]

            def slot_order_bias():
                slots = torch.arange(length, device=q.device)
                return folded_bias(slots[length - n:], slots, groups, None, q.dtype)

            bias = ctx.step.shared_value(("slot_order", n, length, groups, q.dtype, q.device), slot_order_bias)
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


def resolve_method(method, params: dict | None = None) -> Method:
    """A method instance from a name (+ params), a one-line spec (``"h2o:budget=0.3"``, ``"PREFILL+CACHE"``),
    an instance, or None (= full)."""
    if method is None:
        method = "full"
    if isinstance(method, Method):
        if params:
            raise AttnkitError("params are given with a method instance; set them on the instance instead")
        return method
    if isinstance(method, str):
        if params is not None and not isinstance(params, dict):
            raise AttnkitError(f"params must be a mapping of parameter names to values, got {params!r}")
        if ":" in method or "+" in method:
            if params:
                raise AttnkitError(f"params are given with the spec {method!r}, which sets its own; use one of them")
            return parse_method_spec(method)
        return make_method(method, **(params or {}))
    raise AttnkitError(f"method must be a name or a Method, got {type(method).__name__}")
