"""``h2o``: heavy hitters + recent window (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", NeurIPS 2023, arXiv 2306.14048).

Every cached entry carries its accumulated attention: the attention probabilities it received from
every prompt query and from every generated token's query (H2O's accumulated attention score),
reduced over the query heads of its kv group (``gqa_reduce``). The cache keeps a recent window of
``recent`` x budget tokens (or ``recent_tokens``) and fills the rest of the budget with the entries of
highest accumulated attention, per kv head: after prefill the prompt is compressed to that shape, and
at each decode step the lowest-scored entry outside the recent window leaves and the new token takes
its slot (the greedy one-out-per-step eviction of the paper's Algorithm 1). H2O's default splits the
budget half heavy hitters, half recent tokens (``recent=0.5``).

``decode_every=N >= 1`` is the buffered form (:mod:`attnkit.methods.buffered`): generated tokens are appended and
attended with everything held, every entry still accumulating its attention, and after every ``N``-th step the
layer goes back to the ``B`` entries of highest accumulated attention plus the recent window (at most ``B + N``
held; the ``N`` dropped together, by scores up to ``N`` steps newer than the one-per-step rule would have used).
The attention the ``N`` steps' queries give is added at the ``N``-th step, all of them in one pass (each over the
entries held at its own step), which is the same sum as step by step, and lets a host run the steps between as
plain attention (``decode_queries_kept``).

Prompt scores are computed in the same blocks of queries as the prompt's attention output
(:func:`attnkit.methods.scoring.attention_with_statistics`: the probabilities are computed once and no
N x N matrix is materialised); decode computes its one row of probabilities itself
(:func:`attnkit.methods.scoring.attend_with_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods import scoring_native
from attnkit.methods.buffered import BufferedEviction, BufferedState
from attnkit.methods.eviction import RecentWindowEviction
from attnkit.methods.scoring import attend_with_logits, reduce_heads
from attnkit.methods.spec import register
from attnkit.session import LayerContext


@register
@dataclass(frozen=True)
class H2O(BufferedEviction, RecentWindowEviction):
    """Accumulated-attention heavy hitters + recent window, per kv head; one out per step, or ``decode_every``."""

    name = "h2o"
    summary = "heavy hitters by accumulated attention + recent window (H2O, Zhang et al. 2023)"
    default_recent = 0.5
    layer_state_type = BufferedState
    between = "queries"

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return self.score_buffer(ctx)[:, :, :ctx.kv.length]

    def prefill_scorer(self, ctx: LayerContext):
        return self.gqa_reduce, None  # the attention probabilities

    def add_prefill_scores(self, ctx: LayerContext, stats: torch.Tensor) -> None:
        self.score_buffer(ctx)[:, :, :ctx.kv.length] += stats

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        if self.queues(ctx):  # the buffered form, or a per-step layer filling its budget: the attention taken later
            out = super().attend_decode(ctx, q)
            self.queue_queries(ctx, q, ctx.q_pos)
            if self.takes_queued(ctx):
                self.add_queued(ctx)
            return out
        keys, values, _ = ctx.kv.view()
        out, _, probs = attend_with_logits(q, keys, values, ctx.scaling, self.window_visibility(ctx), logits=False)
        self.score_buffer(ctx)[:, :, :ctx.kv.length] += reduce_heads(probs[:, :, :, 0], self.gqa_reduce)  # one query
        return out

    def add_queued(self, ctx: LayerContext) -> None:
        """The accumulated attention of the queued steps (:class:`~attnkit.methods.buffered.BufferedState`), each
        query over the entries held at its step (those at its position or before), in one pass."""
        st = ctx.state
        keys, _, positions = ctx.kv.view()
        self.score_buffer(ctx)[:, :, :ctx.kv.length] += scoring_native.attention_statistics(
            st.queued_q, keys, ctx.scaling, st.queued_pos, positions, reduce=self.gqa_reduce, window=ctx.native_window)
        st.queued_q = st.queued_pos = None
