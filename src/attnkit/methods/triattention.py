"""``triattention``: keys ranked by a trigonometric series of the distance, from offline query statistics (Mao, Lin,
Huang, Xie, Fu, Zhuang, Han, Chen, 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
arXiv 2604.04921; the authors' code: github.com/WeianMao/triattention).

**Why.** Scorers that vote with observed queries (SnapKV's window, R-KV's importance) see only the last few queries,
which in a long chain of thought say little about what later queries will need. The paper finds that a head's
queries before RoPE concentrate around a fixed centre per frequency band, so the logit a future query will give a
key is, up to that spread, a trigonometric series in their distance, fixed by the centre and the key alone: RoPE
turns the band's product ``E[q_f] conj(k_f)`` by ``omega_f`` per position. TriAttention scores every held key with
that series averaged over future distances, plus a term for the queries' norm the centre misses, and needs no query
at all at compression time (:mod:`attnkit.methods.triattention_stats` writes the score out).

**What is kept.** Each query head ``h`` scores the held keys of its kv head with its own statistics (``S_h``), the
scores of each head are standardised over the held entries (``normalize``, the authors' default), a kv group's query
heads are reduced by their maximum (``gqa_reduce``, the authors' default; or the mean), and every kv head keeps,
besides the last ``window_size`` positions (the authors' vLLM runtime protects 128), its best entries up to the
budget ``B``: each layer and kv head its own entries (the authors' ``per_layer_per_head`` selection).

**When.** The prompt is compressed to ``B`` right after prefill by the same score when it is longer than ``B`` (the
authors' vLLM runtime counts the prompt in the budget and lets it compete, ``protect_prefill=False``); then every
``decode_every`` generated tokens (the paper's compression interval, the authors' ``divide_length``, 128) the layer
is compressed back to ``B`` (:mod:`attnkit.methods.prompt_scorer`, "attend, then compress"), so it holds at most
``B + decode_every`` entries per kv head. The round start ``t0`` is the position of the next query.

**Statistics.** ``config`` is a file written by ``attnkit calibrate triattention`` (:mod:`attnkit.calibrate.
triattention`): per layer and query head, the centre and mean norm of the pre-RoPE queries on the model's own text.
A file recorded for another geometry or other RoPE frequencies is refused in one line; without one the method
refuses to start.

**Differences from the authors' code**, by design: the selection is per layer and kv head (their
``per_layer_perhead_pruning``, whose default group reduction is this maximum); their default shares one selection per
kv head across all layers (each layer's standardised, group-maximised scores averaged over the layers), which needs
every layer's keys at once, while attnkit compresses each layer right after its own attention. The interval counts
generated tokens (theirs fires when the held length reaches ``B + divide_length``: the same spacing once the cache
is full, not before). Their evaluation path for the paper's tables pins the whole prompt and lets only generated
tokens compete (and keeps the first ``B`` prompt tokens when the prompt exceeds ``B``); attnkit follows their vLLM
runtime. Their calibration reads ``q_proj``'s output, before Qwen3's query norm; attnkit records the queries the
attention sees. There is no tie-breaking noise (theirs adds ``1e-6`` uniform noise in one path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.scoring import GQA_REDUCTIONS
from attnkit.methods.spec import register
from attnkit.methods.triattention_stats import (
    AGGREGATIONS,
    HOW_TO_MAKE,
    geometric_offsets,
    load_stats,
    standardize,
    trig_scores,
)
from attnkit.session import LayerContext
from attnkit.validate import choice, flag, whole

DEFAULT_WINDOW = 128  # recent tokens never evicted (the authors' vLLM runtime's window_size)
DEFAULT_OFFSET_MAX = 65536  # the largest future distance scored (the authors' offset_max_length)


@dataclass
class TriAttentionState(PromptScorerState):
    """Per layer: whether the statistics were checked against it, and the next query's position while compressing."""

    checked: bool = False
    next_pos: int | None = None


@register
@dataclass(frozen=True)
class TriAttention(PromptScorer):
    """Keys ranked by the trigonometric series of their distance to future queries, from offline pre-RoPE query
    statistics; the prompt compressed after prefill, then the layer every ``decode_every`` tokens (the authors'
    ``divide_length``), a recent window kept."""

    config: str | None = None
    decode_every: int = 128
    window_size: int = DEFAULT_WINDOW
    offset_max_length: int = DEFAULT_OFFSET_MAX
    aggregation: str = "mean"
    normalize: bool = True
    gqa_reduce: str = "max"

    name = "triattention"
    layer_state_type = TriAttentionState
    summary = "keys by a trigonometric series of the distance, offline query statistics (TriAttention, Mao et al. 2026)"

    def __post_init__(self):
        if not isinstance(self.config, str) or not self.config:
            raise AttnkitError(f"triattention needs config=FILE, the model's pre-RoPE query statistics; "
                               f"{HOW_TO_MAKE} (got config={self.config!r})")
        super().__post_init__()
        whole("window_size", self.window_size, 0, what=" (recent tokens never evicted)")
        whole("offset_max_length", self.offset_max_length, 1, what=" (the largest future distance scored)")
        choice("aggregation", self.aggregation, AGGREGATIONS)
        flag("normalize", self.normalize)
        choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)
        object.__setattr__(self, "_stats", load_stats(self.config))
        object.__setattr__(self, "_offsets", geometric_offsets(self.offset_max_length))

    # ---- sizes -------------------------------------------------------------------------------------------
    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        if s.rope is not None:  # the layers and frequencies now; the heads when the first q, k arrive
            self._stats.check(s.n_layers, None, None, None, s.rope.inv_freq)
        evicts = budget < s.prompt_len or (self.decode_every and budget + self.decode_every < s.prompt_len
                                           + s.max_new_tokens)
        if evicts and self.window_size >= budget:
            raise AttnkitError(f"triattention: window_size={self.window_size} recent tokens fill the {budget}-slot "
                               f"budget of layer {ctx.index}; lower window_size or raise the budget")

    def budget_floor(self) -> int:
        return self.window_size  # the recent window is always kept

    # ---- the statistics against the model ----------------------------------------------------------------
    def _check(self, ctx: LayerContext, n_heads: int | None, kv_heads: int, head_dim: int) -> None:
        """Refuse statistics of another geometry, or a model without RoPE over the whole head, once per layer."""
        if ctx.state.checked:
            return
        rope = ctx.session.rope
        if rope is None:
            raise AttnkitError("triattention scores keys by their RoPE phases; this model has no rotary embedding")
        if 2 * rope.inv_freq.numel() != head_dim:
            raise AttnkitError(f"triattention needs RoPE over the whole head (head_dim {head_dim}, rotary dimension "
                               f"{2 * rope.inv_freq.numel()}); partial rotary embeddings are not supported")
        n_heads, kv_heads = ctx.session.model_heads(n_heads, kv_heads)  # a tensor-parallel shard's: the whole model's
        self._stats.check(ctx.session.n_layers, n_heads, kv_heads, head_dim, rope.inv_freq)
        ctx.state.checked = True

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        self._check(ctx, q.shape[1], k.shape[1], k.shape[-1])
        return super().prefill_attention(ctx, q, k, v)

    # ---- the score -----------------------------------------------------------------------------------------
    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        ctx.state.next_pos = int(next_pos)
        super().compact(ctx, count, spare, next_pos)
        ctx.state.next_pos = None

    def head_scores(self, ctx: LayerContext, round_start: int) -> torch.Tensor:
        """``S_h`` ``[b, kv, g, L]`` of every held entry for each query head, standardised with ``normalize``."""
        keys = ctx.kv.view()[0]
        self._check(ctx, None, keys.shape[1], keys.shape[-1])
        center, abs_mean = self._stats.layer(ctx.index, keys.device, ctx.session.held_heads(keys.shape[1], kv=True))
        scores = trig_scores(keys, center, abs_mean, ctx.session.rope.inv_freq, round_start, self._offsets,
                             self.aggregation)
        return standardize(scores) if self.normalize else scores

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        """The group's reduced scores ``[b, kv, L]``, the next query at the compression's position (or after the
        latest held entry)."""
        start = ctx.state.next_pos
        if start is None:
            start = int(ctx.kv.view()[2].max()) + 1
        scores = self.head_scores(ctx, start)
        return scores.amax(dim=2) if self.gqa_reduce == "max" else scores.mean(dim=2)

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return self.recent_mask(ctx, self.window_size, next_pos)
