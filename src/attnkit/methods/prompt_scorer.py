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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit import masks
from attnkit.errors import AttnkitError
from attnkit.methods.chunks import keep_chunks
from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.methods.scoring import adaptive_keep, flat_attention
from attnkit.session import LayerContext
from attnkit.validate import choice, fraction, whole

HEAD_BUDGETS = ("uniform", "adaptive")
ALPHA_SAFEGUARD = 0.2


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

    layer_state_type = PromptScorerState

    def __post_init__(self):
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

    @property
    def adaptive(self) -> bool:
        return self.head_budgets == "adaptive"

    def decode_only_appends(self) -> bool:
        # a flat layer takes one token per step (a multi-token step, a speculative verification, is refused)
        return self.decode_every == 0 and not self.adaptive

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
        queries remembered, the steps counted."""
        ctx.kv.append(k, v, positions)
        kept = self.decode_queries_kept()
        if kept:
            keep_last_queries(ctx.state, q, positions, kept)
        ctx.state.decoded += positions.shape[0]

    def decode_limit(self, ctx: LayerContext) -> int | None:
        return super().decode_limit(ctx) if self.decode_every else None  # B + N; 0: generated tokens are appended

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        if self.chunk_length:
            ctx.kv.keep(keep_chunks(self.rank(ctx), self.protect(ctx, next_pos), ctx.kv.view()[2], count,
                                    self.chunk_length), spare=spare)
            self._mark_evicting(ctx)
            return
        if not self.adaptive:
            return super().compact(ctx, count, spare, next_pos)
        heads, slots = adaptive_keep(self.rank(ctx), self.protect(ctx, next_pos), count, self.alpha_safeguard)
        ctx.kv.keep_flat(heads, slots, spare=spare)
        self._mark_evicting(ctx)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        kv = ctx.kv
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
