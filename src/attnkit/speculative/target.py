"""The target's side of speculative decoding: its verification attention (:class:`VerifyingFull`) and
one prompt pass that fills the target's cache and a self-draft's compressed cache together
(:func:`prefill_sessions`)."""

from __future__ import annotations

import torch

from attnkit.attention import folded_attention, folded_bias
from attnkit.forward import prefill_steps
from attnkit.methods.base import Method
from attnkit.methods.full import Full
from attnkit.model import LoadedModel
from attnkit.session import Session, Step

# Verification steps of at most this many tokens use the folded attention (attnkit.attention); longer
# multi-token steps (the prompt) take the ordinary path.
VERIFY_FOLD_MAX_TOKENS = 64


class VerifyingFull(Full):
    """``full`` attention as the speculative target: identical semantics (every key kept, causal by
    position, the model's own window), with one faster kernel call for the verification step.

    A verification step is a handful of queries over the whole cache. Handing SDPA the query heads
    with grouped kv heads and a boolean mask sends it to a path that expands the kv heads; instead the
    query heads of each kv group are folded into the query axis (``[b, kv, groups * n, d]``,
    :func:`attnkit.attention.folded_attention`, as the decode step does for one token) with an additive
    mask tiled over the groups (:func:`attnkit.attention.folded_bias`), so the cache is read once per kv
    head. Every layer of a full cache holds the same positions, so the tiled mask is built once per
    forward (on its first layer) and reused by the others.
    Not registered: it is ``full`` to everyone else.
    """

    def prefill_attention(self, ctx, q, k, v):
        n = q.shape[2]
        if ctx.kv.length == 0 or n > VERIFY_FOLD_MAX_TOKENS:  # the prompt (or a prompt chunk)
            return super().prefill_attention(ctx, q, k, v)
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, positions = ctx.kv.view()
        groups = q.shape[1] // keys.shape[1]
        bias = ctx.step.shared_value(
            ("verify", ctx.native_window, keys.shape[2], groups, q.dtype),
            lambda: folded_bias(ctx.q_pos, positions[0, 0], groups, ctx.native_window, q.dtype))
        return folded_attention(q, keys, values, ctx.scaling, bias)


class _Tee:
    """A step that hands every layer's attention call to several sessions (the first one's output is
    the forward's): the target's prompt pass also fills the self-draft's compressed cache."""

    def __init__(self, steps: list[Step]):
        self.steps = steps

    def attention(self, layer, q, k, v, scaling, native_window):
        out = self.steps[0].attention(layer, q, k, v, scaling, native_window)
        for step in self.steps[1:]:
            step.attention(layer, q, k, v, scaling, native_window)
        return out


class _OutputDiscarded(Method):
    """A session's method during a prompt pass whose attention output nobody reads (the extra sessions
    of :func:`prefill_sessions`): every cache hook goes to the wrapped method (it stores, observes and
    compresses as always), but the dense prompt attention a store-then-attend method asks the session
    for (:meth:`attnkit.methods.base.Method.prefill_output`) is not computed."""

    def __init__(self, inner: Method):
        self.inner = inner
        self.name = inner.name

    def layer_capacity(self, ctx):
        return self.inner.layer_capacity(ctx)

    def allocate_layer(self, ctx, k, slots, ring):
        return self.inner.allocate_layer(ctx, k, slots, ring)

    def prefill_attention(self, ctx, q, k, v):
        return self.inner.prefill_attention(ctx, q, k, v)

    def after_prefill(self, ctx, q, k, v):
        self.inner.after_prefill(ctx, q, k, v)

    def prefill_output(self, ctx, q, keys, values, positions):
        return torch.empty_like(q)

    def describe(self) -> str:
        return self.inner.describe()


def prefill_sessions(model: LoadedModel, sessions: list[Session], ids: torch.Tensor,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Prompt pass feeding every session's method from the same forward (q, k, v of the first
    session's forward); final hidden state of the last position ``[1, hidden]``. The other sessions'
    methods store and observe the prompt but compute no attention output of their own (their output
    would be discarded); a method that computes its prompt attention itself (``window``) still does."""
    extra = sessions[1:]
    methods = [s.method for s in extra]
    for s in extra:
        s.method = _OutputDiscarded(s.method)

    def step(pos, last):
        steps = [Step(s, "prefill", pos, last) for s in sessions]
        return steps[0] if len(steps) == 1 else _Tee(steps)

    try:
        return prefill_steps(model, ids, step, chunk_size)
    finally:
        for s, m in zip(extra, methods):
            s.method = m
