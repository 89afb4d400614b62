"""``tova``: Token Omission Via Attention (Oren, Hassid, Yarden, Adi, Schwartz, 2024, "Transformers are
Multi-State RNNs", arXiv 2401.06104).

The paper views a decoder with a bounded cache as a multi-state RNN whose states are the cached entries, and
TOVA is its compression policy: when the cache is over its size, drop the entry that the CURRENT query
attends to least, the attention averaged over all the layer's heads,

    evict argmin_i (1/H) sum_h softmax(q_t^h K^T / sqrt(d))_i,

so every kv head of a layer keeps the same positions. Applied to the prompt, the last prompt query's averaged
attention keeps the ``B`` best entries. While decoding the layer holds at most ``B`` entries, the incoming one
included: when it is full the entry with the lowest averaged attention from the previous step's query leaves
and the new token takes its slot (no recent window). Dropping at the start of a step with the previous step's
statistics is the paper's "attend, then drop the lowest" one step later, so TOVA's cache size ``k`` is
``B - 1``. The entry of the query that produced the scores (the last prompt token, then the newest generated
one) is never the one dropped, as kvpress's ``TOVAPress`` forces it kept (the paper lets it compete; its own
attention is usually high), so the kept positions match kvpress's at every step. The latest probabilities
live in a per-slot score buffer that moves with its entries; the newest entry's score is stored as +inf, so
the entry to evict is a plain argmin of the buffer (no mask over the cache per step). The mean over the heads is
summed in float64 (:func:`attnkit.heads.mean_over_heads`): the same whichever heads are added first, so
tensor-parallel shards, each adding its heads' sum to the others', keep what one process keeps.

``decode_every=N >= 1`` is the buffered form (:mod:`attnkit.methods.buffered`): generated tokens are appended and
attended with everything held, and after every ``N``-th step the layer keeps the ``B`` entries that step's query
attended to most, averaged over the heads, its own entry among them (at most ``B + N`` held; the paper drops one
entry per step by the current query, here ``N`` go together by the ``N``-th query's attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnkit.methods.buffered import BufferedEviction, BufferedState
from attnkit.methods.scoring import attend_with_logits, attention_statistics
from attnkit.methods.spec import register
from attnkit.session import LayerContext


@dataclass
class TOVAState(BufferedState):
    newest: int | torch.Tensor | None = None  # the slot (or ``[b, kv, 1]`` slots) of this step's token


@register
@dataclass(frozen=True)
class TOVA(BufferedEviction):
    """Per layer, the entries the current query attends to most, averaged over all heads (one set for every kv
    head); one entry out per decode step once full, or ``N`` every ``N`` steps (``decode_every``)."""

    name = "tova"
    summary = "drop the entry the current query attends to least, averaged over heads (TOVA, Oren et al. 2024)"
    kvpress = "TOVAPress"
    layer_state_type: ClassVar[type] = TOVAState
    between = "nothing"  # the compression step's own attention replaces the scores of the steps before it

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if self.evicts(ctx):
            # the last prompt query's attention over the whole prompt, averaged over the kv group's query heads
            # and then over the kv heads (equal groups: the mean over every query head), shared by all kv heads
            keys, _, positions = ctx.kv.view()
            last = attention_statistics(q[:, :, -1:], keys, ctx.scaling, ctx.q_pos[-1:], positions[0, 0],
                                        window=ctx.native_window)
            self.score_buffer(ctx)[:, :, :ctx.kv.length] = ctx.session.mean_over_heads(last, (1,)).unsqueeze(1)
        super().after_prefill(ctx, q, k, v)
        if self.evicts(ctx):
            # the last prompt token (the highest position, so the last slot after compaction too) gave the scores
            self.score_buffer(ctx)[:, :, ctx.kv.length - 1] = float("inf")

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return self.score_buffer(ctx)[:, :, :ctx.kv.length]

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        # the newest entry, whose query gave the scores: the last prompt token, then the last generated one
        return ctx.kv.view()[2] == next_pos - 1

    def victim_slots(self, ctx: LayerContext) -> torch.Tensor:
        # the newest entry (the protected one) holds +inf in the buffer: the plain argmin is the masked one
        return self.score_buffer(ctx)[:, :, :ctx.kv.length].argmin(dim=-1, keepdim=True)

    def after_write(self, ctx: LayerContext, slot: int | torch.Tensor) -> None:
        ctx.state.newest = slot

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        keys, values, _ = ctx.kv.view()
        out, _, probs = attend_with_logits(q, keys, values, ctx.scaling, self.window_visibility(ctx), logits=False)
        # probs [b, kv, g, 1, L]: the mean over every query head of the layer (of the whole model: a tensor-parallel
        # shard's heads and the others'), for every kv head's slots
        score = self.score_buffer(ctx)
        score[:, :, :ctx.kv.length] = ctx.session.mean_over_heads(probs, (1, 2, 3)).unsqueeze(1)
        newest = ctx.state.newest  # this step's token, whose query gave the scores: kept at the next eviction
        if isinstance(newest, int):
            score[:, :, newest] = float("inf")
        else:
            score.scatter_(2, newest, float("inf"))
        return out
