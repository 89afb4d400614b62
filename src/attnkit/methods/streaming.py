"""``streaming``: attention sinks + a recent window (StreamingLLM: Xiao et al., 2023, "Efficient Streaming
Language Models with Attention Sinks", ICLR 2024, arXiv 2309.17453).

The cache holds the first ``sinks`` tokens of the sequence (the attention sinks) and the most recent
``B - sinks`` tokens, the incoming one included, ``B`` being the budget: exactly StreamingLLM's rolling
KV cache of size ``start_size + recent_size`` (section 3.2, "Rolling KV Cache with Attention Sinks").
When the layer is full the oldest non-sink entry is evicted and the new token written into its slot;
the prompt is compressed to the same shape after prefill.

Positions: by default every key keeps its original position (``positions="original"``). With
``positions="reindex"`` keys are placed at their positions *inside the cache* (sinks at 0..s-1, then
the window in order, the query last), StreamingLLM's own variant (its section 3.2). Attention with
RoPE depends only on query-key distances, and the window is a contiguous run ending at the query,
whose distances are the same either way; only the sinks move: sink ``j`` is seen at
``oldest_window_position - sinks + j``. So each step re-rotates just the ``sinks`` sink keys from
copies saved when the first entry was evicted (:class:`attnkit.rope.Rope`), instead of re-rotating
the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.budget import smallest_tokens
from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, whole


@dataclass
class StreamingState(EvictionState):
    """StreamingLLM's per-layer state: the sinks' keys as stored, kept to re-rotate them (``reindex``)."""

    sink_keys: torch.Tensor | None = None
    evictions: int = 0  # decode-time evictions so far: the next victim's slot follows from it


@register
@dataclass(frozen=True)
class Streaming(EvictionMethod):
    """Attention sinks + recent window; positions original or re-indexed in the cache."""

    sinks: int = 4
    positions: str = "original"

    name = "streaming"
    layer_state_type = StreamingState
    summary = "attention sinks + recent window (StreamingLLM, Xiao et al. 2023)"
    kvpress = "StreamingLLMPress"

    def __post_init__(self):
        super().__post_init__()
        whole("sinks", self.sinks, 0, what=" (tokens)")
        choice("positions", self.positions, ("original", "reindex"))
        smallest = smallest_tokens(self.budget_tokens)
        if smallest is not None and self.sinks >= smallest:
            raise AttnkitError(f"sinks={self.sinks} leaves no room for the recent window in "
                               f"budget_tokens={self.budget_tokens!r}; sinks must be smaller than the budget")

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        if self.sinks >= budget and budget < ctx.session.prompt_len + ctx.session.max_new_tokens:
            raise AttnkitError(f"streaming: sinks={self.sinks} leaves no room for the recent window in the "
                               f"{budget}-slot budget of layer {ctx.index}")
        if self.positions == "reindex" and ctx.session.rope is None:
            raise AttnkitError("streaming positions='reindex' needs the model's rotary embedding (session.rope)")

    def budget_floor(self) -> int:
        return self.sinks

    def rewrites_stored_keys(self) -> bool:
        return self.positions == "reindex" and self.sinks > 0  # the sinks' keys are re-rotated every step

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.kv.view()[2]  # newer is kept first

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor:
        return ctx.kv.view()[2] < self.sinks

    def victim_slot(self, ctx: LayerContext) -> int:
        """The oldest non-sink entry, found without ranking: when a layer first evicts while decoding, its
        entries sit in position order (appended in order, or compacted keeping slot order), sinks first; each
        new token then takes the oldest window entry's slot, so the victims walk the window's slots in turn,
        the same slot in every row and head."""
        st = ctx.state
        sinks = min(self.sinks, ctx.kv.length - 1)
        slot = sinks + st.evictions % (ctx.kv.length - sinks)
        st.evictions += 1
        return slot

    def on_evict(self, ctx: LayerContext) -> None:
        if self.positions == "reindex" and self.sinks:
            # sinks are the lowest positions, so they sit in the first slots of every head
            ctx.state.sink_keys = ctx.kv.keys[:, :, :self.sinks].clone()

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        saved = ctx.state.sink_keys
        if saved is not None:
            # in-cache positions: the window is positions P-m+1..P (m = length - sinks), so sink j is seen at
            # P-m+1-sinks+j, i.e. shifted by P - length + 1 from where it was stored
            shift = ctx.q_pos[0] - (ctx.kv.length - 1)
            ctx.kv.keys[:, :, :self.sinks] = ctx.session.rope.rotate(saved, shift)
        return super().attend_decode(ctx, q)
