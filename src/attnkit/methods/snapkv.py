"""``snapkv``: prompt compression voted by an observation window (Li et al., 2024, "SnapKV: LLM Knows What
You are Looking for Before Generation", arXiv 2404.14469).

After prefill, the last ``window_size`` prompt queries (the observation window) vote for the prompt
keys before them: their attention probabilities are summed over the window's queries, reduced over
the query heads of each kv group (``gqa_reduce``), and smoothed along the sequence with a pooling
kernel (``kernel_size``, ``pooling`` avg or max; SnapKV's clustering, so that a selected token brings
its neighbours). Each kv head keeps its ``budget - window_size`` best-voted prefix entries plus the
observation window itself, so the prompt occupies ``budget`` slots per kv head. Only the window's
queries are scored (a ``window_size`` x prompt product, in blocks), beside SDPA's prefill. A prompt no longer
than the window is all window: every query votes, nothing is pooled or protected, and the ``budget``
best-voted entries stay (kvpress refuses such a prompt; a window larger than the budget inside a longer prompt
is refused here too, since the window is always kept).

Decoding then appends every generated token (SnapKV does not evict during generation). With
``decode_budget=m`` the generated tokens are capped to a rolling window of the last ``m`` (the incoming
one included) so the cache stays at ``budget + m`` slots. With ``decode_every=N`` instead
(:mod:`attnkit.methods.prompt_scorer`) the layer is re-compressed to ``budget`` every ``N`` generated tokens
by the same vote, the observation window then being the last ``window_size`` queries seen (generated
ones included), whose own entries are kept; the pooling runs along the held entries in position order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods import scoring_native
from attnkit.methods.budget import smallest_tokens
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState, keep_last_queries
from attnkit.methods.scoring import GQA_REDUCTIONS, avg_or_max_pool
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, whole


@dataclass
class SnapKVState(PromptScorerState):
    """SnapKV's per-layer state: the observation window's queries while the prompt streams in (and while
    decoding, with ``decode_every``), then its votes while the layer is compressed."""

    window_q: torch.Tensor | None = None
    window_pos: torch.Tensor | None = None
    votes: torch.Tensor | None = None


@register
@dataclass(frozen=True)
class SnapKV(PromptScorer):
    """Observation-window votes, pooled, top entries per kv head after prefill; decode appends (or
    re-compresses every ``decode_every`` tokens)."""

    window_size: int = 32
    kernel_size: int = 7
    pooling: str = "avg"
    gqa_reduce: str = "mean"
    decode_budget: int | None = None

    name = "snapkv"
    layer_state_type = SnapKVState
    summary = "prompt compression by observation-window votes + pooling (SnapKV, Li et al. 2024)"
    kvpress = "SnapKVPress"

    def __post_init__(self):
        super().__post_init__()
        whole("window_size", self.window_size, 1)
        whole("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise AttnkitError(f"kernel_size must be odd so the pooling is centred, got {self.kernel_size}")
        choice("pooling", self.pooling, ("avg", "max"))
        choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)
        if self.decode_budget is not None:
            whole("decode_budget", self.decode_budget, 1, what=" (generated tokens kept)")
            if self.decode_every:
                raise AttnkitError(f"give decode_budget or decode_every, not both (decode_budget={self.decode_budget}, "
                                   f"decode_every={self.decode_every}): both bound the generated tokens, one by a "
                                   f"rolling window, the other by re-compressing the whole cache")
            if self.adaptive:
                raise AttnkitError(f"decode_budget={self.decode_budget} evicts per kv head while decoding, which "
                                   f"head_budgets=adaptive does not support (use head_budgets=uniform)")
        smallest = smallest_tokens(self.budget_tokens)
        if smallest is not None and self.window_size > smallest:
            raise AttnkitError(f"window_size={self.window_size} is larger than budget_tokens={self.budget_tokens!r}; "
                               f"the observation window is always kept, so it must fit in the budget")

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        n = ctx.session.prompt_len
        # the window is kept whenever the layer is compressed: after the prompt (a window of at most n queries)
        # and, with decode_every, while decoding (a full window: a compression means more than `budget` seen)
        recompresses = self.decode_every and budget + self.decode_every < n + ctx.session.max_new_tokens
        # a prompt no longer than the window: the window is the whole prompt, every query votes and nothing is
        # protected (compress() keeps the best-voted `budget`); kvpress refuses such a prompt
        if (budget < n and n > self.window_size > budget) or (recompresses and self.window_size > budget):
            raise AttnkitError(f"snapkv: the observation window ({self.window_size} tokens) does not fit in the "
                               f"{budget}-slot budget of layer {ctx.index}; lower window_size or raise the budget")

    def budget_floor(self) -> int:
        return self.window_size  # the observation window is always kept

    def decode_only_appends(self) -> bool:
        # the prompt is compressed once; generated tokens are appended
        return self.decode_budget is None and super().decode_only_appends()

    def decode_limit(self, ctx: LayerContext) -> int | None:
        if self.decode_budget is None:
            return super().decode_limit(ctx)
        return min(ctx.session.prompt_len, self.layer_budget(ctx)) + self.decode_budget

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:  # the window's queries are kept per row while decoding with decode_every
            if st.window_q is not None:
                st.window_q = st.window_q[rows.to(st.window_q.device)]

    # ---- votes of the observation window ----------------------------------------------------------
    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        self._observe(ctx, q)

    def _observe(self, ctx: LayerContext, q: torch.Tensor) -> None:
        # the window may straddle prompt chunks (and, with decode_every, reach into the generated tokens)
        keep_last_queries(ctx.state, q, ctx.q_pos, self.window_size)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        super().after_prefill(ctx, q, k, v)
        if not self.decode_every or not self.evicts(ctx):  # no later compression needs the window's queries
            ctx.state.window_q = ctx.state.window_pos = None

    def decode_queries_kept(self) -> int | None:
        return self.window_size if self.decode_every else None  # the observation window reaches into decoding

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        if self.decode_every:
            self._observe(ctx, q)
        return super().attend_decode(ctx, q)

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        st = ctx.state
        st.votes = self.votes(ctx)
        super().compact(ctx, count, spare, next_pos)
        st.votes = None

    def votes(self, ctx: LayerContext) -> torch.Tensor:
        """``[b, kv, L]``: the window queries' attention to every held entry, reduced over each kv group's query
        heads, pooled along the entries before the window (held in position order)."""
        st = ctx.state
        keys, _, positions = ctx.kv.view()
        # the prompt: every head holds positions 0..n-1 (one shared, ascending axis); later (or past a prompt block,
        # block_size), each its own
        k_pos = positions[0, 0] if ctx.step.phase == "prefill" and not st.evicting else positions
        votes = scoring_native.attention_statistics(st.window_q, keys, ctx.scaling, st.window_pos, k_pos,
                                                    reduce=self.gqa_reduce, window=ctx.native_window)
        prefix = keys.shape[2] - st.window_q.shape[2]
        if prefix > 0:
            votes[:, :, :prefix] = avg_or_max_pool(votes[:, :, :prefix], self.kernel_size, self.pooling)
        return votes

    def critical_score(self, ctx: LayerContext) -> torch.Tensor:
        # the votes averaged over the window's queries: the attention share CriticalKV weights (kvpress's scale)
        return self.rank(ctx) / ctx.state.window_q.shape[2]

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        votes = ctx.state.votes
        if votes is not None:  # compressing
            return votes
        return ctx.kv.view()[2]  # decoding with a decode_budget: the oldest generated token leaves

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor:
        positions = ctx.kv.view()[2]
        if ctx.state.votes is not None:  # the observation window, unless it is the whole prompt (check_layer)
            return positions >= (next_pos - self.window_size if next_pos > self.window_size else next_pos)
        return positions < ctx.session.prompt_len  # decoding with a decode_budget: the compressed prompt stays
