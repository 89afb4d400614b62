"""The common prefill/decode flow of the KV-cache eviction methods (:class:`EvictionMethod`).

The four eviction methods -- ``streaming`` (StreamingLLM: Xiao et al., 2023, "Efficient Streaming Language
Models with Attention Sinks", arXiv 2309.17453), ``h2o`` (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", arXiv 2306.14048), ``keyformer`` (Adnan et al.,
MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative
Inference", arXiv 2403.09054) and ``snapkv`` (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation", arXiv 2404.14469) -- differ only in which entries they rank high and which they never
evict; the flow is the same:

**Budget.** ``B`` slots per layer and kv head, the incoming token included (:mod:`attnkit.methods.budget`).

**Prefill.** The prompt (in chunks if the runner chunks it) is attended in full and stored; a scoring
method accumulates its statistics chunk by chunk. A method that scores every prompt query
(:meth:`EvictionMethod.prefill_scorer`) gets the output and the statistic from the same blocks
(:func:`attnkit.methods.scoring.attention_with_statistics`); when another method supplies the prompt's
output (``compose``), or the prompt is long enough that SDPA plus a separate statistic is cheaper
(:func:`~attnkit.methods.scoring.one_pass_pays`), the statistic is computed on its own
(:func:`~attnkit.methods.scoring.attention_statistics`). On a GPU H2O's whole prompt takes two fused kernels
instead (:func:`~attnkit.methods.scoring.fused_attention_with_statistics`), where the blocks would write every
logit to memory, and the other statistics a kernel can tile (a maximum over the kv group, Keyformer's noise) take
Triton kernels that tile queries and keys (:mod:`attnkit.methods.scoring_triton`). On a CPU in float32 H2O's and
Keyformer's prompt chunks take a C++ kernel that computes each tile of logits once for the output and the statistic
(:mod:`attnkit.methods.scoring_native`), where the cache holds the whole prompt before the chunk. Either way no N x N
matrix exists. After the last chunk the layer keeps its ``B`` best entries per kv head
(:func:`~attnkit.methods.scoring.keep_top`) and the larger tensors are released (:meth:`LayerKV.keep`).

**Decode.** When the layer is full, the lowest-ranked entry per kv head that is not protected (the
recent window, attention sinks) is evicted (:func:`~attnkit.methods.scoring.lowest`) and the incoming
token is written into its slot in place (:meth:`LayerKV.write_slots`): the kept entries stay where they
are, contiguous in the first ``length`` slots, and nothing is gathered or copied per step. Evicting at the
start of a step with the statistics of the steps before it is the same rule as the papers' "attend, then
drop one" (H2O's Algorithm 1): the candidates and statistics are identical, the victim just leaves one
step later.

**Buffered form** (``decode_every=N``, :mod:`attnkit.methods.buffered`): tokens are appended instead, and the layer
is compressed back to ``B`` after every ``N``-th step (:meth:`EvictionMethod.after_decode`, as the prompt scorers do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from attnkit.errors import AttnkitError
from attnkit.methods import scoring_native
from attnkit.methods.base import Method
from attnkit.methods.budget import check_budget, check_recent, pyramid_share, recent_window, resolve_budget
from attnkit.methods.keyformer_noise import GumbelFactorWeights
from attnkit.methods.scoring import (
    GQA_REDUCTIONS,
    attention_statistics,
    attention_with_statistics,
    fused_attention_with_statistics,
    fused_pays,
    keep_top,
    lowest,
    one_pass_pays,
    visible,
)
from attnkit.methods.scoring_triton import kernels_pay, prompt_attention_with_statistics
from attnkit.session import LayerContext
from attnkit.validate import choice


@dataclass
class EvictionState:
    """What an eviction method keeps per layer for one generation."""

    budget: int | None = None  # B, the layer's slots per kv head (resolved on first use)
    evicts: bool | None = None  # whether this layer can ever drop an entry in this generation
    evicting: bool = False  # whether it has dropped entries yet
    recent: int | None = None  # the recent window in tokens (RecentWindowEviction)
    decoded: int = 0  # decode steps taken while evicting, counted with ``decode_every`` (the buffered form)


@dataclass(frozen=True)
class EvictionMethod(Method):
    """Base of the eviction methods (see the module docstring). Subclasses say how entries rank
    (:meth:`rank`), which are never evicted (:meth:`protect`) and what statistics they gather."""

    budget: float | list[float] | None = None
    budget_tokens: int | list[int] | None = None
    layer_budgets: str = "uniform"

    name = "eviction-base"
    layer_state_type: ClassVar[type] = EvictionState
    decode_every = 0  # N, tokens between compressions back to B: a field of BufferedEviction and PromptScorer

    def __post_init__(self):
        check_budget(self.name, self.budget, self.budget_tokens, self.layer_budgets)

    def new_layer_state(self) -> EvictionState:
        return self.layer_state_type()

    # ---- sizes -------------------------------------------------------------------------------------
    def budget_of_layer(self, layer: int, n_layers: int, prompt_len: int) -> int:
        """``B`` of `layer`: the uniform share (:func:`resolve_budget`), or PyramidKV's (``layer_budgets``)."""
        budget = resolve_budget(self.budget, self.budget_tokens, layer, n_layers, prompt_len)
        if self.layer_budgets == "pyramid":
            budget = pyramid_share(budget, min(budget, self.budget_floor()), layer, n_layers)
        return budget

    def budget_floor(self) -> int:
        """Slots the method always keeps whatever the budget (PyramidKV spreads only the rest over the layers)."""
        return 0

    def layer_budget(self, ctx: LayerContext) -> int:
        """``B``: slots per kv head of this layer while decoding (resolved once per generation)."""
        st = ctx.state
        if st.budget is None:
            s = ctx.session
            st.budget = self.budget_of_layer(ctx.index, s.n_layers, s.prompt_len)
            self.check_layer(ctx, st.budget)
        return st.budget

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        """Raise AttnkitError when this layer's resolved budget does not fit the method's other parameters."""

    def prefill_keep(self, ctx: LayerContext) -> int:
        """Entries per kv head kept when the prompt is compressed."""
        return self.layer_budget(ctx)

    def decode_limit(self, ctx: LayerContext) -> int | None:
        """Most entries per kv head while decoding, the incoming one included (``B``; ``B + N`` with
        ``decode_every``); None: no limit."""
        return self.layer_budget(ctx) + self.decode_every

    def evicts(self, ctx: LayerContext) -> bool:
        """Whether this layer can ever drop an entry in this generation (otherwise it behaves as `full`)."""
        if ctx.state.evicts is None:
            s = ctx.session
            n, total = s.prompt_len, s.prompt_len + s.max_new_tokens
            limit = self.decode_limit(ctx)
            ctx.state.evicts = self.prefill_keep(ctx) < n or (limit is not None and limit < total)
        return ctx.state.evicts

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        n, total = s.prompt_len, s.prompt_len + s.max_new_tokens
        if not self.evicts(ctx):
            return total, False
        if n > self.prefill_keep(ctx):
            return n, False  # the whole prompt until after_prefill compresses it
        limit = self.decode_limit(ctx)
        return (total if limit is None else min(limit, total)), False

    def planned_slots(self, ctx: LayerContext) -> int:
        s = ctx.session
        total = s.prompt_len + s.max_new_tokens
        if not self.evicts(ctx):
            return total
        limit = self.decode_limit(ctx)
        return min(total, self.prefill_keep(ctx) if limit is None else limit)

    def spare_after_prefill(self, ctx: LayerContext, kept: int) -> int:
        limit = self.decode_limit(ctx)
        return ctx.session.max_new_tokens if limit is None else max(0, limit - kept)

    # ---- what subclasses define --------------------------------------------------------------------
    def rank(self, ctx: LayerContext) -> torch.Tensor:
        """``[b, kv, length]``: how much each held entry deserves to stay (higher = kept)."""
        raise NotImplementedError

    def protect(self, ctx: LayerContext, next_pos: torch.Tensor | int) -> torch.Tensor | None:
        """``[b, kv, length]`` boolean: entries never evicted when the token at `next_pos` comes in."""
        return None

    def prefill_scorer(self, ctx: LayerContext) -> tuple[str, Callable | None] | None:
        """For a method whose statistic sums a function of every prompt query's logits over the queries
        (H2O, Keyformer): the GQA reduction and the weights function of
        :func:`~attnkit.methods.scoring.attention_with_statistics` (None: the attention probabilities),
        so the prompt's attention and statistic are computed in one pass. None: no such statistic."""
        return None

    def add_prefill_scores(self, ctx: LayerContext, stats: torch.Tensor) -> None:
        """Accumulate the ``[b, kv, length]`` statistic of a prompt chunk (see :meth:`prefill_scorer`)."""

    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        """Gather statistics of a prompt chunk's queries (the chunk is already stored) when the output was
        not computed by the one-pass path: by default :meth:`prefill_scorer`'s statistic on its own."""
        scorer = self.prefill_scorer(ctx)
        if scorer is None:
            return
        reduce, weights = scorer
        keys, _, positions = ctx.kv.view()
        if self._native_prompt(ctx, q, keys, None, scorer, stored=True):
            self.add_prefill_scores(ctx, scoring_native.prompt_statistics(q, keys, ctx.scaling, reduce=reduce,
                                                                          weights=weights))
            return

        def with_probs(logits, q_pos, k_pos):
            return weights(logits, torch.softmax(logits, dim=-1), q_pos, k_pos)

        self.add_prefill_scores(ctx, attention_statistics(
            q, keys, ctx.scaling, ctx.q_pos, positions[0, 0], reduce=reduce,
            weights=None if weights is None else with_probs, window=ctx.native_window))

    def defer_prefill_eviction(self, ctx: LayerContext) -> bool:
        """True when the prompt must be compressed at the first decode step instead of after prefill."""
        return False

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        """Attention of the incoming token over the held entries (it is already stored)."""
        return self._attend_held(ctx, q)

    def victim_slot(self, ctx: LayerContext) -> int | None:
        """The one slot every row and kv head evicts this step, for a method that knows it without ranking
        (StreamingLLM's oldest non-sink entry), or None: the lowest-ranked unprotected entry per kv head."""
        return None

    def victim_slots(self, ctx: LayerContext) -> torch.Tensor:
        """Slots ``[b, kv, 1]`` evicted this step when :meth:`victim_slot` names none: the lowest-ranked entry per
        kv head that is not protected from the incoming token (:func:`~attnkit.methods.scoring.lowest`). A method
        whose rank already puts its protected entries out of reach overrides it to skip the mask (TOVA)."""
        return lowest(self.rank(ctx), self.protect(ctx, ctx.q_pos))

    def before_write(self, ctx: LayerContext) -> None:
        """Hook at the start of every decode step, before the incoming token is stored."""

    def after_write(self, ctx: LayerContext, slot: int | torch.Tensor) -> None:
        """Hook after the step's token is stored at `slot` (an index, or ``[b, kv, 1]`` slots), before attending."""

    def on_evict(self, ctx: LayerContext) -> None:
        """Hook called when this layer first drops entries."""

    # ---- the flow ----------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        scorer = self.prefill_scorer(ctx) if self.evicts(ctx) else None
        dense = scorer is not None and ctx.session.method.dense_prefill_output()
        whole_prompt = dense and ctx.native_window is None and ctx.kv.length == 0
        fused = None
        if whole_prompt and scorer == ("mean", None) and fused_pays(q):
            # a whole prompt's attention probabilities, summed per key: two fused kernels (H2O on a GPU)
            fused = fused_attention_with_statistics(q, k, v, ctx.scaling)
        elif whole_prompt and self._tileable(scorer) and kernels_pay(q):
            # the other statistics a kernel can tile (a maximum over the group, Keyformer's noise): Triton on a GPU
            fused = prompt_attention_with_statistics(q, k, v, ctx.scaling, ctx.q_pos, reduce=scorer[0],
                                                     weights=scorer[1])
        if fused is not None:
            ctx.kv.append(k, v, ctx.q_pos)
            self.add_prefill_scores(ctx, fused[1])
            return fused[0]
        if dense and self._native_prompt(ctx, q, k, v, scorer):
            # a prompt chunk over the whole prompt before it, on a CPU: the C++ kernel's one sweep
            ctx.kv.append(k, v, ctx.q_pos)
            keys, values, _ = ctx.kv.view()
            out, stats = scoring_native.prompt_attention_with_statistics(q, keys, values, ctx.scaling,
                                                                         reduce=scorer[0], weights=scorer[1])
            self.add_prefill_scores(ctx, stats)
            return out
        if dense and one_pass_pays(q.device, ctx.kv.length + q.shape[2]):
            # the prompt's output is plain dense attention: computed with the statistic, in one pass
            ctx.kv.append(k, v, ctx.q_pos)
            keys, values, positions = ctx.kv.view()
            out, stats = attention_with_statistics(q, keys, values, ctx.scaling, ctx.q_pos, positions[0, 0],
                                                   reduce=scorer[0], weights=scorer[1], window=ctx.native_window)
            self.add_prefill_scores(ctx, stats)
            return out
        out = self._store_and_attend(ctx, q, k, v)
        if self.evicts(ctx):
            self.observe_prefill(ctx, q)
        return out

    @staticmethod
    def _tileable(scorer) -> bool:
        """Whether a kernel computes this prompt statistic itself (the Triton kernels on a GPU, the C++ kernel on a
        CPU): the attention probabilities (H2O) or Keyformer's Gumbel weights at temperature 1."""
        return scorer[1] is None or isinstance(scorer[1], GumbelFactorWeights)

    def _native_prompt(self, ctx: LayerContext, q, k, v, scorer, stored: bool = False) -> bool:
        """Whether :mod:`~attnkit.methods.scoring_native`'s kernel computes this prompt chunk's statistic (and output,
        given values `v`): a statistic it can tile, no window, and a cache holding exactly positions ``0..`` before
        the chunk's own (`stored`: the chunk is in the cache already)."""
        if ctx.native_window is not None or not self._tileable(scorer):
            return False
        if not scoring_native.kernel_pays(q, k, v):
            return False
        held = ctx.kv.view()[2]
        if not torch.equal(held, torch.arange(held.shape[-1], device=held.device).expand_as(held)):
            return False
        length = held.shape[-1] + (0 if stored else q.shape[2])
        return scoring_native.is_prompt_tail(ctx.q_pos, torch.arange(length, device=ctx.q_pos.device))

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if not self.evicts(ctx) or self.defer_prefill_eviction(ctx):
            return
        keep = self.prefill_keep(ctx)
        if ctx.kv.length > keep:
            self.compact(ctx, keep, self.spare_after_prefill(ctx, keep), ctx.session.prompt_len)

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        """Keep `count` entries per kv head (protected first, then by rank) in fresh tensors."""
        self.keep_slots(ctx, keep_top(self.rank(ctx), self.protect(ctx, next_pos), count), spare)
        self._mark_evicting(ctx)

    def keep_slots(self, ctx: LayerContext, keep: torch.Tensor, spare: int) -> None:
        """Keep the slots `keep` ``[b, kv, n]``, values merged first when the method merges (:meth:`merged_values`)."""
        ctx.kv.keep_merged(keep, spare, self.merged_values(ctx, keep))

    def _mark_evicting(self, ctx: LayerContext) -> None:
        if not ctx.state.evicting:
            ctx.state.evicting = True
            self.on_evict(ctx)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if q.shape[2] != 1 and not self.decode_only_appends():
            raise AttnkitError(f"method {self.name!r} decodes one token per step, got {q.shape[2]} at once")
        kv = ctx.kv
        if self.evicts(ctx):
            self.before_write(ctx)
            limit = self.decode_limit(ctx)
            if self.defer_prefill_eviction(ctx) and not ctx.state.decoded and kv.length > self.layer_budget(ctx):
                # the deferred prompt compression: to B - 1 beside the incoming token, or to B (the buffered form)
                keep = self.layer_budget(ctx) - (0 if self.decode_every else 1)
                self.compact(ctx, keep, limit - keep, ctx.q_pos)
            if limit is not None and kv.length >= limit:
                slot = self.victim_slot(ctx)
                if slot is None:
                    slot = self.victim_slots(ctx)
                    kv.write_slots(slot, k, v, ctx.q_pos)
                else:
                    kv.write_slot(slot, k, v, ctx.q_pos)
                self._mark_evicting(ctx)
            else:
                kv.append(k, v, ctx.q_pos)
                slot = kv.length - 1
            self.after_write(ctx, slot)
        else:  # this layer never drops anything in this generation: exactly `full`
            return self._store_and_attend(ctx, q, k, v)
        return self.attend_decode(ctx, q)

    def after_decode(self, ctx: LayerContext) -> None:
        """With ``decode_every=N``: after every ``N``-th decode step the layer is compressed back to ``B`` entries per
        kv head whenever it holds more (:mod:`attnkit.methods.buffered`)."""
        every, st = self.decode_every, ctx.state
        if not every or not self.evicts(ctx):
            return
        st.decoded += 1
        if st.decoded % every == 0 and ctx.kv.length > self.layer_budget(ctx):
            self.compact(ctx, self.layer_budget(ctx), every, ctx.q_pos[-1] + 1)

    # ---- helpers for subclasses --------------------------------------------------------------------
    @staticmethod
    def score_buffer(ctx: LayerContext, name: str = "score") -> torch.Tensor:
        """A float32 per-slot statistic ``[b, kv, capacity]`` that moves with its entry (created on first use)."""
        kv = ctx.kv
        buf = kv.extras.get(name)
        if buf is None:
            buf = kv.extras[name] = torch.zeros(kv.positions.shape, dtype=torch.float32, device=kv.positions.device)
        return buf

    @staticmethod
    def recent_mask(ctx: LayerContext, recent: int, next_pos) -> torch.Tensor | None:
        """Entries among the `recent` tokens right before `next_pos` (the recent window)."""
        if recent <= 0:
            return None
        return ctx.kv.positions[:, :, :ctx.kv.length] >= (next_pos - recent)

    @staticmethod
    def window_visibility(ctx: LayerContext) -> torch.Tensor | None:
        """For a model with its own sliding window: which held keys the decode query may see."""
        if ctx.native_window is None:
            return None
        return visible(ctx.q_pos, ctx.kv.view()[2], ctx.native_window)


@dataclass(frozen=True)
class RecentWindowEviction(EvictionMethod):
    """Base of the methods that always keep a recent window (H2O, Keyformer): ``recent`` is the window
    as a fraction of the budget (default ``default_recent``), ``recent_tokens`` as a count; the query
    heads of a kv group are reduced with ``gqa_reduce``."""

    recent: float | None = None
    recent_tokens: int | None = None
    gqa_reduce: str = "mean"

    default_recent = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_recent(self.recent, self.recent_tokens, self.budget_tokens)
        choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        recent_window(self.recent, self.recent_tokens, self.default_recent, budget, ctx.index)

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return self.recent_mask(ctx, self.recent_tokens_for(ctx), next_pos)  # the recent window is never evicted

    def recent_tokens_for(self, ctx: LayerContext) -> int:
        """This layer's recent window in tokens, from the subclass's ``recent`` (a fraction of the budget,
        default ``default_recent``) or ``recent_tokens`` (resolved once per generation)."""
        if ctx.state.recent is None:
            ctx.state.recent = recent_window(self.recent, self.recent_tokens, self.default_recent,
                                             self.layer_budget(ctx), ctx.index)
        return ctx.state.recent
