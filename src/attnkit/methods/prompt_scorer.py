"""The prompt-time scorers' shared flow (:class:`PromptScorer`): compress the prompt once, and optionally
re-compress every ``decode_every`` generated tokens.

A prompt-time scorer (``snapkv``, ``knorm``, ``keydiff``) ranks the entries a layer holds with a score of its
own (:meth:`~attnkit.methods.eviction.EvictionMethod.rank`) and keeps the ``B`` best per kv head after the
prompt (the shared eviction flow of :mod:`attnkit.methods.eviction`). What happens while decoding is the
same for all of them, so it lives here, written once:

- ``decode_every=0`` (default): generated tokens are appended; the cache grows by one slot per token on
  top of the compressed prompt (SnapKV's own setting, and kvpress's prefill-only presses).
- ``decode_every=N >= 1``: every ``N`` generated tokens the layer is compressed back to ``B`` entries per kv
  head by the method's own score over everything it holds (the prompt survivors and the generated tokens),
  as kvpress's ``DecodingPress`` with ``compression_interval=N`` and ``target_size=B`` after a prefill
  compression to ``B``. A layer therefore holds at most ``B + N`` entries (the capacity and
  ``planned_slots`` say so, for the batch memory check) and exactly ``B`` after each compression; with
  ``N=1`` it holds ``B`` after every step. The compressions run after a step's attention ("attend, then
  compress", :meth:`~attnkit.methods.eviction.EvictionMethod.after_decode`, as in the buffered form of the per-step
  eviction methods, :mod:`attnkit.methods.buffered`), so the ``N``-th token's query has seen everything before the
  layer shrinks. Entries stay in ascending position order in their slots (compression keeps slot order, tokens are
  appended), which a score over the sequence (SnapKV's pooling) relies on.

``head_budgets`` says how the layer's ``kv_heads x B`` prompt entries are shared by its kv heads:

- ``uniform`` (default): ``B`` per kv head, each head's best by the method's rank.
- ``adaptive``: AdaKV (Feng, Lv, Cao, Xie, Zhou, 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
  Allocation for Efficient LLM Inference", arXiv 2407.11550, Algorithm 1): the ``kv_heads x B`` entries of
  highest rank across all kv heads of the layer, each head keeping its protected entries (SnapKV's window,
  Expected Attention's sinks) and its best ones up to at least ``int(alpha_safeguard x B)`` entries (the
  safeguard of the authors' code and kvpress's ``AdaKVPress``, default 0.2), so heads hold different counts
  (:func:`~attnkit.methods.scoring.adaptive_keep`). Nothing is padded: the compressed layer is flat
  (:meth:`attnkit.cache.LayerKV.keep_flat`), exactly ``kv_heads x (B + generated)`` entries, the bytes of
  ``uniform`` at the same ``B``; each generated token appends one entry per kv head, and a decode query attends
  over the flat layer with the slots of other kv heads masked (:func:`~attnkit.methods.scoring.flat_attention`).
  Decoding one token per step and only appending, it is refused with ``decode_every`` (and SnapKV's
  ``decode_budget``), and a speculative verification (several tokens per step) is refused.

``chunk_length=c`` (default 0: off) keeps whole chunks of ``c`` consecutive tokens instead of single entries
(ChunkKV: Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference", arXiv 2502.00299; kvpress's ``ChunkKVPress``): at every compression, the prompt's and each
``decode_every`` one, each kv head keeps its protected entries, then whole chunks (those holding a protected entry
first) by the mean of their members' scores, the chunk that does not fit whole cut to its best members, exactly ``B`` entries in all
(:mod:`attnkit.methods.chunks`). A flat layer's counts per head (``head_budgets=adaptive``) are refused with it.

``low_entropy_chunk_length=k`` (default 0: off; with ``chunk_length`` larger than it) gates the chunks by the entropy
of their members' scores: a chunk of high mean score whose scores are concentrated keeps only its ``k`` best members,
the slots saved going to further chunks (kvpress's ``EntropyGatedChunkKVPress``; :mod:`attnkit.methods.entropy_chunks`).

``merge=true`` (default false; ``similarity_threshold``, ``merge_fraction``) folds the values of the entries a
compression evicts into the kept entry of most similar key instead of dropping them, the kept positions unchanged
(kvpress's ``MergingPress``; :mod:`attnkit.methods.merging`).

kvpress's other wrapper presses are parameters too: ``criticalkv=true`` (``first_stage_ratio``, ``critical_epsilon``)
re-weights the score by each value's L1 norm through the output projection in a second stage (``CriticalKVPress``;
with ``head_budgets=adaptive``, ``CriticalAdaKVPress``; :mod:`attnkit.methods.critical`); ``segment_length=s`` gives
every ``s``-token segment of the prompt its share of ``B`` (``ChunkPress``); ``block_size=m`` attends the prompt in
blocks, compressing back to ``B`` after each, so prefill holds at most ``B + m`` entries (``BlockPress``);
``decode_fraction=f`` makes each ``decode_every`` re-compression keep ``max(1, int(f x tokens seen))`` instead of ``B``
(``CompressionRatioDecodingPress``). See :mod:`attnkit.methods.wrappers`.

``score_threshold=T`` (``threshold_window``, ``threshold_decode``) drops the entries scoring below ``T`` once they leave
a recent window instead of keeping a budget (kvpress's ``DMSPress``; :mod:`attnkit.methods.threshold`);
``positions=reindexed`` re-rotates the kept prompt keys to consecutive positions (kvpress's ``KeyRerotationPress``;
:mod:`attnkit.methods.rerotation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from attnkit import masks
from attnkit.errors import AttnkitError
from attnkit.methods import chained, rerotation, threshold, wrappers
from attnkit.methods.chunks import keep_chunks
from attnkit.methods.critical import EPSILON, FIRST_STAGE_RATIO, check_critical, critical_keep
from attnkit.methods.entropy_chunks import check_gate, keep_entropy_gated_chunks
from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.methods.merging import check_merge, similarity_merge
from attnkit.methods.scoring import adaptive_keep, flat_attention
from attnkit.session import LayerContext
from attnkit.validate import choice, fraction, whole

HEAD_BUDGETS = ("uniform", "adaptive")
ALPHA_SAFEGUARD = 0.2
# the options a scorer that sets every kv head's count once, after the prompt, cannot take (PromptScorer.refuse_options)
COUNTS_FIXED = ("decode_every", "head_budgets", "alpha_safeguard", "chunk_length", "merge", "criticalkv",
                "segment_length", "block_size", "decode_fraction")


PromptScorerState = EvictionState  # a prompt scorer's per-layer state: the eviction flow's, decode steps counted


def keep_last_queries(state, q: torch.Tensor, q_pos: torch.Tensor, size: int) -> None:
    """Keep the last `size` queries seen in ``state.window_q`` / ``state.window_pos`` (an observation window, SnapKV's
    and R-KV's): they may straddle prompt chunks and reach into the generated tokens."""
    if state.window_q is not None:
        q, q_pos = torch.cat([state.window_q, q], dim=2), torch.cat([state.window_pos, q_pos])
    state.window_q, state.window_pos = q[:, :, -size:], q_pos[-size:]


@dataclass(frozen=True)
class PromptScorer(EvictionMethod):
    """Base of the prompt-time scorers: the prompt is compressed to ``B`` by :meth:`rank`; ``decode_every``
    (``N``) re-compresses the layer to ``B`` every ``N`` generated tokens (0: generated tokens are appended);
    ``chunk_length`` (``c``) keeps whole chunks of ``c`` tokens (ChunkKV; 0: single entries)."""

    decode_every: int = 0
    head_budgets: str = "uniform"
    alpha_safeguard: float = ALPHA_SAFEGUARD
    chunk_length: int = 0
    low_entropy_chunk_length: int = 0  # members a spiky chunk keeps (attnkit.methods.entropy_chunks)
    merge: bool = False  # fold evicted values into the most key-similar kept entry (attnkit.methods.merging)
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0
    # kvpress's wrapper presses (attnkit.methods.critical, attnkit.methods.wrappers)
    criticalkv: bool = False  # CriticalKVPress / CriticalAdaKVPress: values weighted through W_o, two stages
    first_stage_ratio: float = FIRST_STAGE_RATIO
    critical_epsilon: float = EPSILON
    segment_length: int = 0  # ChunkPress: each prompt segment keeps its share of the budget
    block_size: int = 0  # BlockPress: the prompt attended in blocks, compressed after each
    decode_fraction: float | None = None  # CompressionRatioDecodingPress: re-compress to a share of all seen
    then: str | dict | None = None  # ComposedPress: a second scorer keeping a budget of what this one kept (methods.chained)
    _then: Any = field(default=None, init=False, repr=False, compare=False)
    # kvpress's DMSPress (attnkit.methods.threshold): drop entries scoring below it past a window (no budget)
    score_threshold: float | None = None
    threshold_window: int = threshold.WINDOW
    threshold_decode: bool = False
    positions: str = "original"  # KeyRerotationPress: "reindexed" re-rotates the kept prompt keys (methods.rerotation)

    layer_state_type = PromptScorerState
    size_params = ("score_threshold",)  # sizes the cache instead of a budget: a sweep's budget does not apply to it
    scores_entries_alone = False  # whether entry_score scores a generated token alone (threshold_decode)
    threshold_refusal = ""  # why score_threshold does not apply to this scorer ("": it does)
    reindex_refusal = ""  # why positions=reindexed does not apply to this scorer ("": it does)

    def check_sinks(self, ctx: LayerContext, budget: int) -> None:
        """Refuse in one line a `budget` that the method's ``n_sink`` first positions (always kept) fill whole in a
        layer that compresses: a prompt above the budget, or generated tokens growing past it with ``decode_every``."""
        s = ctx.session
        compresses = budget < s.prompt_len or (
            self.decode_every and budget + self.decode_every < s.prompt_len + s.max_new_tokens)
        if compresses and self.n_sink >= budget:
            raise AttnkitError(f"{self.name}: n_sink={self.n_sink} sinks leave no slot to choose in the {budget}-slot "
                               f"budget of layer {ctx.index}; lower n_sink or raise the budget")

    def refuse_options(self, names: tuple[str, ...], why: str) -> None:
        """Refuse in one line any of the scorer options `names` not at its default, `why` saying why (a scorer whose
        trained file or own rule fixes what those options would change: fastkvzip, lukv, restorekv)."""
        defaults = {f.name: f.default for f in fields(PromptScorer)}
        for name in names:
            value = getattr(self, name)
            if value != defaults[name]:
                raise AttnkitError(f"{self.name}: {name}={value!r} is not supported ({why})")

    def __post_init__(self):
        if not threshold.check_threshold(self):
            super().__post_init__()
        whole("decode_every", self.decode_every, 0,
              what=" (generated tokens between re-compressions of the cache; 0 = compress the prompt only)")
        choice("head_budgets", self.head_budgets, HEAD_BUDGETS)
        fraction("alpha_safeguard", self.alpha_safeguard, allow_zero=True,
                 what=" (the share of B every kv head keeps with head_budgets=adaptive)")
        if self.head_budgets == "uniform" and self.alpha_safeguard != ALPHA_SAFEGUARD:
            raise AttnkitError(f"alpha_safeguard={self.alpha_safeguard} applies to head_budgets=adaptive only")
        if self.adaptive and self.decode_every:
            raise AttnkitError(f"head_budgets=adaptive compresses the prompt only; decode_every={self.decode_every} "
                               f"is not supported with it (use head_budgets=uniform or decode_every=0)")
        whole("chunk_length", self.chunk_length, 0,
              what=" (tokens per chunk kept or dropped whole, ChunkKV; 0 = single entries)")
        if self.adaptive and self.chunk_length:
            raise AttnkitError(f"chunk_length={self.chunk_length} keeps whole chunks per kv head at one budget for "
                               f"every head; head_budgets=adaptive is not supported with it (use head_budgets=uniform)")
        whole("low_entropy_chunk_length", self.low_entropy_chunk_length, 0,
              what=" (members a spiky chunk keeps, EntropyGatedChunkKV; 0 = no gate)")
        if check_gate(self.chunk_length, self.low_entropy_chunk_length):
            raise AttnkitError(check_gate(self.chunk_length, self.low_entropy_chunk_length))
        check_merge(self)
        wrappers.check_wrappers(self)
        check_critical(self)
        rerotation.check_positions(self)
        if self.then is not None:  # the second scorer as a method; params() reports the spec as given
            stage = chained.as_stage(self.then, self, PromptScorer)
            object.__setattr__(self, "_then", stage)
            object.__setattr__(self, "then", chained.stage_spec(self.then, stage))

    @property
    def adaptive(self) -> bool:
        return self.head_budgets == "adaptive"

    @property
    def batches(self) -> bool:
        return self.score_threshold is None  # a threshold keeps a count of its own per sequence

    def entry_score(self, ctx: LayerContext, k: torch.Tensor) -> torch.Tensor:
        """``[b, kv, n]``: the score of the entries of keys `k`, each alone (``threshold_decode``; defined by a
        method whose ``scores_entries_alone`` is true)."""
        raise NotImplementedError

    def rewrites_stored_keys(self) -> bool:
        return self.positions == "reindexed"  # the kept keys are re-rotated once, when the prompt is compressed

    def decode_only_appends(self) -> bool:
        # a flat layer takes one token per step (a multi-token step, a speculative verification, is refused)
        return self.decode_every == 0 and not self.adaptive and self.score_threshold is None

    def decode_queries_kept(self) -> int | None:
        """How many recent queries a decode step between two re-compressions leaves in this method's state, when
        such a step does nothing else than append its entry and attend densely over everything held (None: it does
        more, such as gathering statistics). A host may then run those steps as plain attention, batched across
        requests, and bring the method's state up to date with :meth:`skip_appends` before the next compression
        (attnkit's vLLM host does). Scorers that observe no decode query: 0; SnapKV and R-KV: their window."""
        if self.decode_every and type(self).attend_decode is EvictionMethod.attend_decode:
            return 0
        return None

    def skip_appends(self, ctx: LayerContext, k, v, q, positions: torch.Tensor) -> None:
        """The layer's state after ``len(positions)`` decode steps that only appended (see
        :meth:`decode_queries_kept`; none of them a compression step): the entries appended in order, the last
        queries remembered, the steps counted. `q`: the queries of the last of those steps, at least as many as the
        method keeps, or all of them."""
        ctx.kv.append(k, v, positions)
        kept = self.decode_queries_kept()
        if kept:
            keep_last_queries(ctx.state, q, positions[positions.shape[0] - q.shape[2]:], kept)
        ctx.state.decoded += positions.shape[0]

    def budget_of_layer(self, layer: int, n_layers: int, prompt_len: int) -> int:
        if self._then is None:
            return super().budget_of_layer(layer, n_layers, prompt_len)
        return chained.final_budget(self, self._then, layer, n_layers, prompt_len)  # B2, what the layer keeps

    def layer_budget(self, ctx: LayerContext) -> int:
        if self._then is None or ctx.state.budget is not None:
            return super().layer_budget(ctx)
        s = ctx.session
        self.check_layer(ctx, chained.first_budget(self, ctx.index, s.n_layers, s.prompt_len))  # this scorer at B1
        budget = ctx.state.budget = self.budget_of_layer(ctx.index, s.n_layers, s.prompt_len)
        chained.check_stage(self._then, ctx, budget)
        return budget

    def decode_limit(self, ctx: LayerContext) -> int | None:
        if self.decode_fraction is not None:  # the largest share of the tokens seen, plus N
            s = ctx.session
            return wrappers.fraction_limit(s.prompt_len, self.layer_budget(ctx), self.decode_every,
                                           self.decode_fraction, s.max_new_tokens)
        return super().decode_limit(ctx) if self.decode_every else None  # B + N; 0: generated tokens are appended

    def evicts(self, ctx: LayerContext) -> bool:
        if self.score_threshold is not None:
            return threshold.threshold_evicts(ctx, self.score_threshold, self.threshold_window, self.threshold_decode)
        if self.decode_fraction is not None and ctx.state.evicts is None:
            s = ctx.session
            ctx.state.evicts = self.prefill_keep(ctx) < s.prompt_len or wrappers.fraction_evicts(
                s.prompt_len, self.layer_budget(ctx), self.decode_every, self.decode_fraction, s.max_new_tokens)
        return super().evicts(ctx)

    def after_decode(self, ctx: LayerContext) -> None:
        if self.decode_fraction is None:
            return super().after_decode(ctx)
        st = ctx.state
        if not self.evicts(ctx):
            return
        st.decoded += 1
        seen = int(ctx.q_pos[-1]) + 1
        target = wrappers.fraction_target(self.decode_fraction, seen)
        if st.decoded % self.decode_every == 0 and ctx.kv.length > target:
            self.compact(ctx, target, self.decode_every, seen)

    @property
    def needs_layer_inputs(self) -> bool:
        return self.criticalkv  # CriticalKV reads the layer's output projection from its attention module

    def critical_score(self, ctx: LayerContext) -> torch.Tensor:
        """The score CriticalKV weights by the projected values' norms (:mod:`attnkit.methods.critical`): the rank, on
        the scale of the method's score (a method whose rank sums attention over several queries averages it)."""
        return self.rank(ctx)

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        if self.score_threshold is not None and self.evicts(ctx):
            return ctx.session.prompt_len, False  # the prompt, then a flat layer of what stays
        slots, ring = super().layer_capacity(ctx)
        if self.block_size and self.evicts(ctx) and ctx.session.prompt_len > self.prefill_keep(ctx):
            slots = wrappers.block_capacity(self, ctx, slots)  # the prompt held in blocks: B + block_size at most
        return slots, ring

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if self.block_size and self.evicts(ctx):
            return wrappers.prefill_in_blocks(self, ctx, q, k, v, super().prefill_attention)
        return super().prefill_attention(ctx, q, k, v)

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        if self._then is not None:  # B1 by this scorer, then B2 (= count) of those by the second one
            s = ctx.session
            first = chained.first_budget(self, ctx.index, s.n_layers, s.prompt_len)
            if ctx.kv.length > first:
                super().compact(ctx, first, 0 if first > count else spare, next_pos)
            if ctx.kv.length > count:
                chained.second_stage(self._then, ctx, count, spare, next_pos)
                self._mark_evicting(ctx)
            return
        if self.chunk_length:
            self.keep_slots(ctx, self._chunk_slots(ctx, count, next_pos), spare)
            self._mark_evicting(ctx)
            return
        if self.criticalkv or self.segment_length:  # kvpress's CriticalKV(Ada)Press, ChunkPress
            protect = self.protect(ctx, next_pos)
            if self.criticalkv and self.adaptive:
                ctx.kv.keep_flat(*critical_keep(self, ctx, protect, count), spare=spare)
            elif self.criticalkv:
                self.keep_slots(ctx, critical_keep(self, ctx, protect, count), spare)
            else:
                self.keep_slots(ctx, wrappers.keep_segments(self.rank(ctx), protect, ctx.kv.view()[2], count,
                                                            self.segment_length), spare)
            self._mark_evicting(ctx)
            return
        if not self.adaptive:
            return super().compact(ctx, count, spare, next_pos)
        heads, slots = adaptive_keep(self.rank(ctx), self.protect(ctx, next_pos), count, self.alpha_safeguard)
        ctx.kv.keep_flat(heads, slots, spare=spare)
        self._mark_evicting(ctx)

    def _chunk_slots(self, ctx: LayerContext, count: int, next_pos) -> torch.Tensor:
        rank, protect, positions = self.rank(ctx), self.protect(ctx, next_pos), ctx.kv.view()[2]
        if self.low_entropy_chunk_length:
            return keep_entropy_gated_chunks(rank, protect, positions, count, self.chunk_length,
                                             self.low_entropy_chunk_length)
        return keep_chunks(rank, protect, positions, count, self.chunk_length)

    def merged_values(self, ctx: LayerContext, keep: torch.Tensor) -> torch.Tensor | None:
        if not self.merge:
            return None
        keys, values, _ = ctx.kv.view()
        return similarity_merge(keys, values, keep, self.similarity_threshold, self.merge_fraction)

    def planned_slots(self, ctx: LayerContext) -> int:
        if self.score_threshold is not None:
            return ctx.session.prompt_len + ctx.session.max_new_tokens  # at most: a threshold may keep everything
        return super().planned_slots(ctx)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if self.score_threshold is not None:
            if self.evicts(ctx):
                window, decode = self.threshold_window, self.threshold_decode
                threshold.keep_above(ctx, self.rank(ctx), self.score_threshold, window,
                                     threshold.decode_room(ctx, window, decode))
                self._mark_evicting(ctx)
            return
        super().after_prefill(ctx, q, k, v)
        if self.positions == "reindexed" and self.evicts(ctx) and ctx.kv.length < ctx.session.prompt_len:
            rerotation.check_rope(self, ctx)
            rerotation.reindex(ctx)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        kv = ctx.kv
        if self.score_threshold is not None and self.evicts(ctx):
            new = self.entry_score(ctx, k)[:, :, 0] if self.threshold_decode else None
            return threshold.decode_step(ctx, q, k, v, new, self.score_threshold, self.threshold_window)
        if "head" not in kv.extras:
            return super().decode_attention(ctx, q, k, v)
        if q.shape[2] != 1:
            raise AttnkitError(f"method {self.name!r} with head_budgets=adaptive decodes one token per step, "
                               f"got {q.shape[2]} at once")
        kv.append_flat(k, v, ctx.q_pos)
        keys, values, positions = kv.view()
        allowed = None
        if ctx.native_window is not None:
            allowed = masks.boolean_mask(masks.sliding_window(ctx.native_window), ctx.q_pos, positions)
        return flat_attention(q, keys, values, kv.extras["head"][:, :, :kv.length], k.shape[1], ctx.scaling, allowed)
