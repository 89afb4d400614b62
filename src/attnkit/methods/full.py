"""``full``: ordinary attention over every cached token, the reference every method is measured against.

It honours the model's own masking: a layer that the model defines with a sliding window (Mistral's
``sliding_window``, Qwen2's sliding layers) sees only that window, exactly as transformers computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.attention import sdpa
from attnkit.methods.base import Method, register


@register
@dataclass
class FullAttention(Method):
    """Dense causal attention; the KV cache holds prompt + generated tokens."""

    name = "full"
    summary = "dense attention, every token kept (the reference)"

    def decode_attention(self, ctx, q, k, v):
        """The new token's query over the cache. The cache is append-only and in position order (slot
        ``i`` holds position ``i``), so the query, the newest position, sees every stored key, or within
        the model's window the last ``window`` slots: no mask, and none of the general path's checks of
        the key positions (reductions over the whole cache in every layer, about 7 % of a one-token step
        of ``tiny`` at 2k tokens)."""
        if q.shape[2] != 1:
            return super().decode_attention(ctx, q, k, v)
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, _ = ctx.kv.view()
        if ctx.native_window is not None and keys.shape[2] > ctx.native_window:
            keys, values = keys[:, :, -ctx.native_window:], values[:, :, -ctx.native_window:]
        return sdpa(q, keys, values, ctx.scaling)
