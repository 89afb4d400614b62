"""``non_causal_attention``: keep the prompt entries that receive the most attention from the queries of their own
chunk of the prompt, earlier and later ones alike (Chari, Van Durme, 2025, "Compactor: Calibrated Query-Agnostic
KV Cache Compression with Approximate Leverage Scores", arXiv 2507.08143, its attention term; kvpress's
``NonCausalAttnPress``).

**Why.** A causal prompt's attention sums favour the first tokens (every later query sees them, H2O's bias);
Compactor asks instead which entries the text around them points to, with no mask: the prompt is cut into tiles of
``chunk_size`` consecutive tokens, and every query of a tile attends to every key of the same tile, before and after
it. An entry that its neighbourhood refers to is one a later question about that neighbourhood will look for.

**Score.** For an entry ``j`` in tile ``T`` (positions ``[t, t + chunk_size)``), query head ``h`` of its kv group
``G``, queries and keys after RoPE (the prompt's own, as the model computed them)::

    a_j = mean_{h in G} sum_{i in T} softmax_{j' in T}(q^h_i . k_{j'})_j      (logits unscaled, as kvpress's)
    s_j = avgpool_3(a * ||v||)_j                                             (window 3, zeros beyond the ends)

and the scores are standardised over the sequence's kv heads and entries (a z-score, kvpress's over the whole
batch; the order within a kv head is the same). The last tile, when ``chunk_size`` does not divide the prompt, is
padded to a whole tile with zero queries and zero keys, as kvpress does: its entries share their softmax with the
padding keys (logit 0) and receive ``1 / chunk_size`` from each padding query. Each kv head keeps its ``B``
entries of highest ``s_j``.

**Prompt chunks.** The tiles are scored as their queries arrive, chunk by chunk of the prompt: only the queries of
an unfinished tile wait in the layer's state (at most ``chunk_size - 1``), with the per-position sums ``a``, so no
prompt-length matrix is kept and a host that gathers the layer anew for each prompt chunk (vLLM's) carries them.
Every prompt query must come, in order (a prompt whose start was not computed here, a cached prefix, is refused in
one line).

**Decoding.** Generated tokens are appended (kvpress's press is prefill-only). ``decode_every`` is refused: the
score of an entry needs the queries of its whole tile, later ones included, which a generated token never has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError
from attnkit.methods.eviction import EvictionState
from attnkit.methods.leverage import z_scores
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import whole

TILE_ELEMENTS = 1 << 24  # most logits computed at once (tiles are batched up to this many)


@dataclass
class NonCausalState(EvictionState):
    """Per layer while the prompt arrives: each scored position's attention sum ``a`` ``[b, kv, prompt_len]``
    (float32), the queries ``[b, heads, m, d]`` of the unfinished tile and the next prompt position expected."""

    column: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    next_query: int = 0


def tile_sums(q: torch.Tensor, k: torch.Tensor, chunk: int) -> torch.Tensor:
    """``a`` ``[b, kv, m]`` of `m` consecutive positions starting a tile: queries `q` ``[b, heads, m, d]`` and keys
    `k` ``[b, kv, m, d]`` after RoPE, cut into tiles of `chunk` (the last padded with zeros to a whole tile), each
    query attending with a softmax over its own tile's keys, the probabilities summed over the tile's queries and
    averaged over each kv group's query heads."""
    b, heads, m, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    tiles = -(-m // chunk)
    pad = tiles * chunk - m
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        k = F.pad(k, (0, 0, 0, pad))
    q = q.reshape(b, kv, group, tiles, chunk, d)
    k = k.reshape(b, kv, 1, tiles, chunk, d)
    step = max(1, TILE_ELEMENTS // max(1, b * heads * chunk * chunk))
    sums = []
    for t in range(0, tiles, step):
        logits = (q[:, :, :, t:t + step] @ k[:, :, :, t:t + step].transpose(-2, -1)).float()
        sums.append(torch.softmax(logits, dim=-1).sum(dim=-2))  # [b, kv, group, tiles, chunk]
    return torch.cat(sums, dim=3).mean(dim=2).reshape(b, kv, tiles * chunk)[:, :, :m]


def pooled_scores(column: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``avgpool_3(a * ||v||)`` over consecutive entries ``[b, kv, L]``, the zero padding counted at the ends."""
    scores = column * values.norm(dim=-1)
    shape = scores.shape
    pooled = F.avg_pool1d(scores.reshape(-1, 1, shape[-1]), kernel_size=3, stride=1, padding=1)
    return pooled.reshape(shape)


@register
@dataclass(frozen=True)
class NonCausalAttention(PromptScorer):
    """Per kv head, the prompt entries of highest non-causal attention within their tile of ``chunk_size`` tokens,
    times the value norm, smoothed over neighbours; decode appends."""

    chunk_size: int = 256

    name = "non_causal_attention"
    summary = "keep the entries most attended by their own prompt chunk, non-causally (Compactor, Chari 2025)"
    kvpress = "NonCausalAttnPress"
    layer_state_type = NonCausalState

    def __post_init__(self):
        super().__post_init__()
        whole("chunk_size", self.chunk_size, 1, what=" (prompt tokens per tile of non-causal attention)")
        if self.decode_every:
            raise AttnkitError(f"{self.name} scores an entry by the prompt queries of its tile, later ones included, "
                               f"which a generated token never has; decode_every={self.decode_every} is not "
                               f"supported (use 0)")

    def span(self, prompt_len: int) -> tuple[int, int]:
        """The prompt positions ``[start, end)`` scored by the tiles (the first tile starts at ``start``)."""
        return 0, prompt_len

    # ---- the prompt's tiles, chunk by chunk -------------------------------------------------------------
    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        st, n = ctx.state, ctx.session.prompt_len
        pos = ctx.q_pos
        first, after = int(pos[0]), int(pos[-1]) + 1
        if first != st.next_query or after - first != pos.shape[0]:
            raise AttnkitError(f"{self.name} reads every prompt query in order; layer {ctx.index} got positions "
                               f"{first}..{after - 1} where {st.next_query} came next (a prompt whose start this "
                               f"host did not compute, such as a cached prefix, is not supported)")
        st.next_query = after
        start, end = self.span(n)
        lo, hi = max(first, start), min(after, end)
        if lo >= hi:
            return
        queries = q[:, :, lo - first:hi - first]
        waiting = 0 if st.pending is None else st.pending.shape[2]
        if waiting:
            queries = torch.cat([st.pending, queries], dim=2)
        begin = lo - waiting  # a tile boundary
        done = hi if hi == end else begin + (hi - begin) // self.chunk_size * self.chunk_size
        st.pending = queries[:, :, done - begin:] if done < hi else None
        if done == begin:
            return
        keys, _, held = ctx.kv.view()
        if held.shape[-1] < done or not torch.equal(held[0, 0, begin:done],
                                                     torch.arange(begin, done, device=held.device)):
            raise AttnkitError(f"{self.name}: layer {ctx.index} does not hold the prompt positions {begin}..{done - 1} "
                               f"in order while the prompt arrives")
        if st.column is None:
            st.column = torch.zeros(keys.shape[0], keys.shape[1], n, dtype=torch.float32, device=keys.device)
        st.column[:, :, begin:done] = tile_sums(queries[:, :, :done - begin], keys[:, :, begin:done], self.chunk_size)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        super().after_prefill(ctx, q, k, v)
        ctx.state.column = ctx.state.pending = None  # scored once: the prompt's compression is the only one

    # ---- scores ---------------------------------------------------------------------------------------
    def span_scores(self, ctx: LayerContext) -> tuple[torch.Tensor, int, int]:
        """The z-scored ``s`` ``[b, kv, end - start]`` of the scored span's entries, and the span: the layer holds
        the whole prompt in position order (the prompt's compression, the only one)."""
        keys, values, held = ctx.kv.view()
        n = ctx.session.prompt_len
        start, end = self.span(n)
        column = ctx.state.column
        if column is None or held.shape[-1] != n or not torch.equal(
                held, torch.arange(n, device=held.device).expand_as(held)):
            raise AttnkitError(f"{self.name} ranks the whole prompt once, right after it; layer {ctx.index} holds "
                               f"{held.shape[-1]} entries of a {n}-token prompt")
        return z_scores(pooled_scores(column[:, :, start:end], values[:, :, start:end]), ctx.session), start, end

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return self.span_scores(ctx)[0]
