"""Whole-chunk selection for the prompt scorers' ``chunk_length`` (ChunkKV: Liu et al., 2025,
"ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference", arXiv 2502.00299).

Scoring tokens one by one keeps isolated tokens and tears apart the phrases they belong to; ChunkKV keeps
*chunks* of consecutive tokens instead, ranked by a score over the chunk, so what stays reads as text. Any
per-entry score works underneath (the paper uses SnapKV's observation-window attention; kvpress's ``ChunkKVPress``
wraps any scorer press), so the selection is written once here and every prompt scorer takes it
(:class:`~attnkit.methods.prompt_scorer.PromptScorer`'s ``chunk_length``).

The rule, per row and kv head (:func:`keep_chunks`):

- chunk ``j`` is the original positions ``[j*c, (j+1)*c)``; the last chunk of a prompt that ``c`` does not
  divide is shorter (as kvpress's partial chunk). On the prompt a head holds every position, so the chunks are
  ``c`` consecutive slots; on a re-compression while decoding (``decode_every``) a chunk's members are the entries
  of those positions the head still holds, so the chunks stay the same spans of text from one compression to the
  next.
- a chunk's score is the mean of its members' scores (kvpress: the mean over the chunk, the last partial chunk
  averaged over its own members);
- protected entries (SnapKV's observation window, sinks) are kept first, as without chunks, and a chunk holding
  one ranks above every other chunk: a chunk is kept or dropped whole, and such a chunk cannot be dropped (kvpress's
  scorers give their protected entries the highest score, which lifts their chunks the same way). Then whole chunks
  in descending score, each adding its members not kept yet, until the budget ``B``. The budget is exact (every kv
  head holds ``B`` entries, the cache's bytes those of the method without chunks): the chunk that does not fit
  whole fills the remaining slots with its own best-scored members. kvpress instead keeps
  ``max(1, int(chunks x (1 - compression_ratio)))`` whole chunks, the partial chunk counted as one, whatever
  tokens they hold; at a budget of ``k x c`` over a prompt that ``c`` divides, with no protected entry straddling
  a chunk, both keep the same ``k`` whole chunks.

Differences from kvpress's ``ChunkKVPress`` by design: the chunk scores are per kv head (each head keeps its own
chunks, as every attnkit scorer keeps its own entries), where kvpress sums the scores over the kv heads so that
all heads keep the same chunks; and each sequence of a batch is ranked alone (kvpress applies the first row's
chunks to every row).
"""

from __future__ import annotations

import torch


def chunk_order(rank: torch.Tensor, protect: torch.Tensor | None, positions: torch.Tensor,
                chunk_length: int) -> torch.Tensor:
    """``[b, kv, L]``: where each entry's chunk stands when the chunks of its row and kv head are sorted by mean
    score, best first (0 = the best chunk), the chunks holding a `protect`-ed entry first. `rank`, `protect` and
    `positions` are ``[b, kv, L]``; a chunk is the original positions ``[j * chunk_length, (j + 1) * chunk_length)``."""
    r = rank.float()
    chunk = positions.long().div(chunk_length, rounding_mode="floor")
    n_chunks = int(chunk.max()) + 1 if chunk.numel() else 1
    shape = (*r.shape[:-1], n_chunks)
    total = r.new_zeros(shape).scatter_add_(-1, chunk, r)
    count = r.new_zeros(shape).scatter_add_(-1, chunk, torch.ones_like(r))
    mean = (total / count).masked_fill_(count == 0, float("-inf")).nan_to_num_(nan=float("-inf"))
    if protect is not None:
        mean.masked_fill_(r.new_zeros(shape).scatter_add_(-1, chunk, protect.float()) > 0, float("inf"))
    order = mean.argsort(dim=-1, descending=True, stable=True)
    place = torch.empty_like(order).scatter_(-1, order, torch.arange(n_chunks, device=r.device).expand_as(order))
    return place.gather(-1, chunk)


def keep_chunks(rank: torch.Tensor, protect: torch.Tensor | None, positions: torch.Tensor, count: int,
                chunk_length: int) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) kept per kv head: the protected entries, then whole chunks (those
    holding a protected entry first) by descending mean `rank`, the last chunk that does not fit whole cut to its best-ranked members (see the module
    docstring). The counterpart of :func:`~attnkit.methods.scoring.keep_top` for chunks."""
    r = rank.float()
    place = chunk_order(r, protect, positions, chunk_length)
    if protect is not None:
        place = place.masked_fill(protect, -1)
    by_score = r.argsort(dim=-1, descending=True, stable=True)  # within a chunk: its best members first
    by_chunk = place.gather(-1, by_score).argsort(dim=-1, stable=True)
    chosen = by_score.gather(-1, by_chunk[..., :count])
    return chosen.sort(dim=-1).values
