"""``compactor``: Compactor's blend of approximate leverage and non-causal attention, the prompt's first and last
tokens kept (Chari, Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
Leverage Scores", arXiv 2507.08143; kvpress's ``CompactorPress``).

**Why.** The two query-agnostic signals of the paper miss different entries: leverage
(:mod:`attnkit.methods.leverage`) finds keys that are geometric outliers, which no other entry can stand in for, and
says nothing of what the text refers to; non-causal attention (:mod:`attnkit.methods.non_causal_attention`) finds the
entries their neighbourhood points to, and misses rare keys nobody nearby attends to. Compactor standardises both and
adds them, weighting leverage more the harder the cache is compressed.

**Score.** The first ``sink_size_start`` and last ``sink_size_end`` prompt tokens are kept whatever their scores
(attention sinks, and the tokens right before the question or the first generated token); both scores are computed
over the tokens between them only (the leverage centred over them, the tiles of ``chunk_size`` starting after the
first sinks), each standardised over the sequence's kv heads and entries (``z``)::

    s_j = blending * z(l)_j + z(a)_j

``l``: the ridge leverage of the centred pre-RoPE keys through the Gaussian sketch of ``sketch_dimension`` columns
seeded by ``sketch_seed`` (see :mod:`attnkit.methods.leverage` for the draw, and how kvpress's unseeded draw is
reproduced); ``a``: the non-causal tile attention times the value norm, pooled over 3 neighbours. Each kv head keeps
its sinks and its best entries up to ``B``.

**Blending.** ``blending=None`` (default) weights leverage by the share of the prompt the layer drops, ``1 - B / n``
for a layer keeping ``B`` of ``n`` prompt entries per kv head, whether ``B`` came from ``budget`` (a fraction) or
``budget_tokens`` (per layer with ``layer_budgets``). That is kvpress's default, ``blending = compression_ratio``,
whenever ``B`` is what kvpress keeps, ``int(n (1 - compression_ratio))``, and ``n (1 - compression_ratio)`` is whole
(otherwise kvpress's weight is the ratio asked for, attnkit's the one kept, which differ by less than ``1 / n``).
A number sets the weight for every layer.

**Differences from kvpress.** The standardisation is per sequence (kvpress's spans the batch, so a batch's sequences
change each other's blend; with one sequence they agree); the sinks are protected entries (kvpress gives them the
maximum score, so with fewer than 13 entries kept it may drop one): a budget smaller than the sinks is refused. The
paper's context-calibrated compression (choosing the ratio a context supports) is not part of the method: the budget
is given.

**Decoding.** Generated tokens are appended (kvpress's press is prefill-only); ``decode_every`` is refused, as for
``non_causal_attention``: the attention term needs the queries of an entry's whole tile, later ones included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.leverage import held_leverage, z_scores
from attnkit.methods.non_causal_attention import NonCausalAttention
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import number, whole


def sink_counts(prompt_len: int, start: int, end: int) -> tuple[int, int]:
    """The first and last tokens kept of a `prompt_len`-token prompt (fewer when it is short)."""
    first = min(start, prompt_len)
    return first, min(end, max(0, prompt_len - first))


@register
@dataclass(frozen=True)
class Compactor(NonCausalAttention):
    """Per kv head, the first and last prompt tokens plus the best entries by ``blending x z(leverage) +
    z(non-causal attention)``; decode appends."""

    sink_size_start: int = 8
    sink_size_end: int = 4
    sketch_dimension: int = 48
    sketch_seed: int = 0
    blending: float | None = None

    name = "compactor"
    summary = "blend of key leverage and non-causal attention, sinks kept (Compactor, Chari & Van Durme 2025)"
    kvpress = "CompactorPress"

    def __post_init__(self):
        super().__post_init__()
        whole("sink_size_start", self.sink_size_start, 0, what=" (first prompt tokens always kept)")
        whole("sink_size_end", self.sink_size_end, 0, what=" (last prompt tokens always kept)")
        whole("sketch_dimension", self.sketch_dimension, 0,
              what=" (columns of the Gaussian sketch; 0: the keys themselves, no sketch)")
        whole("sketch_seed", self.sketch_seed, 0, what=" (the sketch's generator seed)")
        if self.blending is not None:
            number("blending", self.blending, 0.0, None,
                   what=" (the weight of the leverage scores; None: the share of the prompt dropped)")

    def span(self, prompt_len: int) -> tuple[int, int]:
        first, last = sink_counts(prompt_len, self.sink_size_start, self.sink_size_end)
        return first, prompt_len - last

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        n = ctx.session.prompt_len
        sinks = sum(sink_counts(n, self.sink_size_start, self.sink_size_end))
        if budget < n and budget < sinks:
            raise AttnkitError(f"compactor: sink_size_start + sink_size_end keep {sinks} prompt tokens, more than "
                               f"the {budget}-entry budget of layer {ctx.index}; lower them or raise the budget")

    def budget_floor(self) -> int:
        return self.sink_size_start + self.sink_size_end

    @property
    def threshold_refusal(self) -> str:
        return "" if self.blending is not None else "its default blending, 1 - B / n, needs a budget (give blending=W)"

    def blend_weight(self, ctx: LayerContext) -> float:
        """The leverage scores' weight in this layer (see the module docstring)."""
        if self.blending is not None:
            return float(self.blending)
        n = ctx.session.prompt_len
        return 1.0 - min(self.layer_budget(ctx), n) / n

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        start, end = self.span(ctx.session.prompt_len)
        positions = ctx.kv.view()[2]
        return (positions < start) | ((positions >= end) & (positions < ctx.session.prompt_len))

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        attention, start, end = self.span_scores(ctx)
        keys, _, positions = ctx.kv.view()
        middle = slice(start, end)
        leverage = held_leverage(ctx, keys[:, :, middle], positions[:, :, middle], self.sketch_dimension,
                                 self.sketch_seed, self.name)
        scores = self.blend_weight(ctx) * z_scores(leverage, ctx.session) + attention
        top = scores.flatten(1).amax(dim=1).reshape(-1, 1, 1) if scores.shape[-1] else scores.new_zeros(1, 1, 1)
        rank = top.expand(positions.shape).clone()  # the sinks: protected, ranked as the best entry (kvpress's)
        rank[:, :, middle] = scores
        return rank
