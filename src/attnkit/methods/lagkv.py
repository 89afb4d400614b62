"""``lagkv``: score each token against the next stretch of the sequence, with no attention (Liang, Wang, Xu, Mao,
Chen, 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important", arXiv 2504.04704;
kvpress's ``LagKVPress``).

The held entries after ``n_sink`` sinks are cut into partitions of ``lag_size`` tokens. Each partition is scored by
the one after it (its *lag* reference), per kv head and separately for keys and values: with the reference's
element-wise minimum ``m`` and maximum ``M`` over its tokens, a token ``x`` of the partition is normalised
channel-wise, ``(x - m) / (M - m)``, and scores the standard deviation of the normalised channels, softmaxed over
the partition's tokens: a token that stands out against what follows it carries
information the later tokens do not repeat. The token's score is the mean of its key and value scores, and within a
partition the tokens rank by it: each gets its rank divided by ``lag_size`` (``cross_scoring=false``, the paper's
per-partition selection), or the raw score (``cross_scoring=true``, to compare partitions). The sinks, the last whole
partition (it has no reference) and the leftover tokens after it score 1, above every rank: kept first. A layer
holding fewer than ``n_sink + 2 * lag_size`` entries has no partition to score: its entries after the sinks rank
by recency.

Decoding appends generated tokens (``decode_every=0``), or re-compresses the layer to ``B`` every ``decode_every``
tokens by the same scores over everything it holds (the paper compresses each new partition as it fills; the
re-compression here scores the whole layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, whole


def lag_scores(states: torch.Tensor, lag: int) -> torch.Tensor:
    """``[b, kv, parts - 1, lag]``: each token of partitions ``0 .. parts - 2`` of `states` ``[b, kv, parts, lag,
    d]``, normalised by the next partition's per-channel range, scored by the spread of its channels, softmaxed over
    its partition."""
    reference = states[:, :, 1:]
    low, high = reference.amin(dim=3, keepdim=True), reference.amax(dim=3, keepdim=True)
    spread = ((states[:, :, :-1] - low) / (high - low)).std(dim=-1)
    return spread.softmax(dim=-1)


def lagkv_rank(keys: torch.Tensor, values: torch.Tensor, sinks: int, lag: int, cross: bool) -> torch.Tensor:
    """LagKV's score of every held entry ``[b, kv, L]`` (float32; see the module docstring)."""
    b, kv, length, d = keys.shape
    if length < sinks + 2 * lag:  # nothing to score against: the sinks, then the most recent first
        rank = torch.ones(b, kv, length, device=keys.device)
        if length > sinks:
            rank[:, :, sinks:] = torch.arange(length - sinks, device=keys.device) / (length - sinks)
        return rank
    parts = (length - sinks) // lag
    end = sinks + parts * lag
    scored = [lag_scores(t[:, :, sinks:end].float().reshape(b, kv, parts, lag, t.shape[-1]), lag)
              for t in (keys, values)]
    score = (scored[0] + scored[1]) / 2
    if not cross:
        score = score.argsort(dim=-1).argsort(dim=-1) / lag
    first = torch.ones(b, kv, sinks, device=keys.device)
    last = torch.ones(b, kv, length - (end - lag), device=keys.device)  # the last whole partition and the rest
    return torch.cat([first, score.reshape(b, kv, -1).float(), last], dim=-1)


@register
@dataclass(frozen=True)
class LagKV(PromptScorer):
    """Per kv head, the tokens that stand out against the partition after theirs (LagKV); decode appends."""

    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    name = "lagkv"
    summary = "keep the tokens that stand out against the next lag partition (LagKV, Liang et al. 2025)"
    kvpress = "LagKVPress"

    def __post_init__(self):
        super().__post_init__()
        whole("n_sink", self.n_sink, 0, what=" (first tokens always kept)")
        whole("lag_size", self.lag_size, 2, what=" (tokens per partition)")
        flag("cross_scoring", self.cross_scoring)

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        keys, values, _ = ctx.kv.view()
        return lagkv_rank(keys, values, self.n_sink, self.lag_size, self.cross_scoring)
