"""``window``: sliding-window attention with a rolling KV cache (Jiang et al., 2023, "Mistral 7B",
arXiv 2310.06825, section 2).

Each token attends to itself and the ``window - 1`` tokens before it (section 2, "Sliding Window
Attention"; as a boolean mask, ``triu(1) | tril(-window)`` marks the hidden keys). Prefill applies that
mask (computed band by band, so its cost grows with ``window``, not with the square of the prompt);
decoding reads only the last ``window`` entries; the "Rolling Buffer Cache" stores position ``i`` in slot
``i mod window``, overwriting the oldest entry, so the cache never grows past ``window`` slots per layer.
Keys keep their original RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.attention import attend
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import is_whole


@register
@dataclass(frozen=True)
class Window(Method):
    """Sliding-window attention over the last `window` tokens (self included), rolling cache."""

    window: int = 1024

    name = "window"
    summary = "sliding window + rolling cache (Mistral 7B, Jiang et al. 2023)"

    def __post_init__(self):
        if not is_whole(self.window) or self.window <= 0:
            raise AttnkitError(f"window must be a positive integer number of tokens, got {self.window!r}")

    def _window(self, ctx: LayerContext) -> int:
        return self.window if ctx.native_window is None else min(self.window, ctx.native_window)

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        return min(self._window(ctx), s.prompt_len + s.max_new_tokens), True

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        # keys: what the ring holds from earlier chunks (sorted by position), then this chunk
        old_k, old_v, old_pos = ctx.kv.view()
        if old_pos.shape[-1]:
            order = old_pos[0, 0].argsort()
            keys = torch.cat([old_k[:, :, order], k], dim=2)
            values = torch.cat([old_v[:, :, order], v], dim=2)
            k_pos = torch.cat([old_pos[0, 0, order], ctx.q_pos])
        else:
            keys, values, k_pos = k, v, ctx.q_pos
        out = attend(q, keys, values, ctx.scaling, ctx.q_pos, k_pos, self._window(ctx))
        ctx.kv.append(k, v, ctx.q_pos)  # ring write: slot = position mod capacity
        return out

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        ctx.kv.append(k, v, ctx.q_pos)  # overwrites the entry that just left the window
        keys, values, positions = ctx.kv.view()
        return attend(q, keys, values, ctx.scaling, ctx.q_pos, positions, self._window(ctx))
