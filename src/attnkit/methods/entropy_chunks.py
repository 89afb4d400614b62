"""ChunkKV with an entropy gate, for the prompt scorers' ``low_entropy_chunk_length`` (kvpress's
``EntropyGatedChunkKVPress``, built on ChunkKV: Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression
for Efficient Long-Context LLM Inference", arXiv 2502.00299).

ChunkKV (:mod:`attnkit.methods.chunks`) keeps or drops chunks of ``c`` consecutive tokens whole. A chunk that ranks
high because of one token then spends ``c`` slots on it. The gate measures how the scores spread inside each chunk,
by their normalised entropy: with the chunk's scores ``s`` shifted up to be non-negative when one is negative,
``p = s / (sum(s) + 1e-8)``, ``H = -sum p log(p + 1e-8) / log(m)`` for a chunk of ``m`` members (clamped to
``[0, 1]``; a one-member chunk has entropy 0). A chunk is *spiky* when its mean score is at or above the median of
the chunks' mean scores and its entropy is below the median entropy (medians: the lower middle value for an even
count, as ``torch.median``). The rule, per row and kv head (:func:`keep_entropy_gated_chunks`):

1. protected entries (SnapKV's window, sinks) first, and the chunks holding one whole, ranked above the others (as
   without the gate);
2. then the chunks in descending mean score, each contributing its members, or only its ``k`` best-scored members
   (``k = low_entropy_chunk_length``) when spiky, until the budget ``B`` is reached (the chunk that does not fit
   gives its best members);
3. when the budget is not spent (spiky chunks gave fewer members), the best-scored entries not taken yet fill it.

Every kv head holds exactly ``B`` entries. Chunks are the original positions ``[j c, (j + 1) c)`` (the last chunk of
a prompt ``c`` does not divide is shorter); on a re-compression while decoding (``decode_every``) a chunk's members are
the entries of those positions the head still holds.

A chunk holding a protected entry counts at the top of both medians (the highest mean score, entropy 1), as in
kvpress, whose scorers give their protected entries a score above every other: a chunk of protected entries only has
the highest mean and an entropy of 1 there. kvpress scores the chunks once for every kv head (the scores summed over
the kv heads) and from the batch's first row; attnkit, as for ChunkKV, gates and ranks per row and kv head, so the two
agree on a model with one kv head. A chunk mixing protected and other entries is kept whole here; kvpress may find it
spiky and keep only its best (the protected) members.
"""

from __future__ import annotations

import math

import torch

EPSILON = 1e-8


def _per_chunk(values: torch.Tensor, chunk: torch.Tensor, n_chunks: int, reduce: str = "sum") -> torch.Tensor:
    shape = (*values.shape[:-1], n_chunks)
    if reduce == "sum":
        return values.new_zeros(shape).scatter_add_(-1, chunk, values)
    return values.new_full(shape, float("inf")).scatter_reduce_(-1, chunk, values, "amin")


def lower_median(x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``[..., 1]``: the lower median of `x` ``[..., chunks]`` over the chunks `present` (``torch.median``'s rule)."""
    ordered = x.masked_fill(~present, float("inf")).sort(dim=-1).values
    middle = (present.sum(dim=-1, keepdim=True) - 1).clamp(min=0).div(2, rounding_mode="floor")
    return ordered.gather(-1, middle)


def chunk_entropy(r: torch.Tensor, chunk: torch.Tensor, n_chunks: int, members: torch.Tensor) -> torch.Tensor:
    """``[..., chunks]``: each chunk's normalised score entropy (see the module docstring)."""
    low = _per_chunk(r, chunk, n_chunks, "amin").clamp(max=0.0)
    shifted = r - low.gather(-1, chunk)
    total = _per_chunk(shifted, chunk, n_chunks)
    p = shifted / (total.gather(-1, chunk) + EPSILON)
    h = _per_chunk(-(p * (p + EPSILON).log()), chunk, n_chunks)
    norm = members.clamp(min=2).double().log().float()  # log(m) rounded once, as a Python float would be
    return (h / norm).clamp(0.0, 1.0).masked_fill(members <= 1, 0.0)


def _contiguous_stats(r: torch.Tensor, chunk_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's mean score and entropy ``[..., chunks]`` when every head holds positions ``0 .. L-1`` in order (the
    prompt's compression): whole chunks by a reshape and the shorter last one apart, the operations in the order of the
    general path's formula, so that the values are those of a plain per-chunk computation to the last bit."""
    length = r.shape[-1]
    whole_chunks, rest = divmod(length, chunk_length)
    scores = r[..., :whole_chunks * chunk_length].unflatten(-1, (whole_chunks, chunk_length))
    means, entropies = [scores.mean(dim=-1)], []
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0.0)
    p = shifted / (shifted.sum(dim=-1, keepdim=True) + EPSILON)
    entropies.append((-(p * (p + EPSILON).log()).sum(dim=-1) / math.log(chunk_length)).clamp(0.0, 1.0))
    if rest:
        tail = r[..., whole_chunks * chunk_length:]
        means.append(tail.mean(dim=-1, keepdim=True))
        if rest == 1:
            entropies.append(torch.zeros_like(means[-1]))
        else:
            tail = tail - tail.amin(dim=-1, keepdim=True).clamp(max=0.0)
            p = tail / (tail.sum(dim=-1, keepdim=True) + EPSILON)
            entropies.append((-(p * (p + EPSILON).log()).sum(dim=-1, keepdim=True) / math.log(rest)).clamp(0.0, 1.0))
    return torch.cat(means, dim=-1), torch.cat(entropies, dim=-1)


def keep_entropy_gated_chunks(rank: torch.Tensor, protect: torch.Tensor | None, positions: torch.Tensor, count: int,
                              chunk_length: int, low_entropy_chunk_length: int) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) kept per kv head by the entropy-gated chunk rule of the module
    docstring; `rank`, `protect`, `positions` are ``[b, kv, L]``."""
    r = rank.float()
    length = r.shape[-1]
    chunk = positions.long().div(chunk_length, rounding_mode="floor")
    n_chunks = int(chunk.max()) + 1 if chunk.numel() else 1
    members = _per_chunk(torch.ones_like(r), chunk, n_chunks)
    present = members > 0
    if torch.equal(positions, torch.arange(length, device=positions.device).expand_as(positions)):
        mean, entropy = _contiguous_stats(r, chunk_length)
    else:  # a re-compression while decoding: each chunk's members are the entries of its positions still held
        mean = _per_chunk(r, chunk, n_chunks) / members.clamp(min=1)
        entropy = chunk_entropy(r, chunk, n_chunks, members)
    order_key = mean.masked_fill(~present, float("-inf"))
    if protect is not None:  # a chunk holding a protected entry: first, whole, counted at the top of both medians
        guarded = _per_chunk(protect.float(), chunk, n_chunks) > 0
        order_key = order_key.masked_fill(guarded, float("inf"))
        mean, entropy = mean.masked_fill(guarded, float("inf")), entropy.masked_fill(guarded, 1.0)
    spiky = (mean >= lower_median(mean, present)) & (entropy < lower_median(entropy, present))
    if protect is not None:
        spiky &= ~guarded
    order = order_key.argsort(dim=-1, descending=True, stable=True)
    place = torch.empty_like(order).scatter_(-1, order, torch.arange(n_chunks, device=r.device).expand_as(order))
    # each entry's rank among its chunk's members by score (0 = the chunk's best)
    by_score = r.argsort(dim=-1, descending=True, stable=True)
    grouped = by_score.gather(-1, chunk.gather(-1, by_score).argsort(dim=-1, stable=True))  # by chunk, best first
    starts = members.cumsum(dim=-1) - members
    within = torch.empty_like(grouped).scatter_(
        -1, grouped, torch.arange(length, device=r.device).expand_as(grouped) - starts.long().gather(
            -1, chunk.gather(-1, grouped)))
    takes = torch.where(spiky, torch.full_like(members, low_entropy_chunk_length).minimum(members), members)
    taken = within < takes.long().gather(-1, chunk)
    # the order of step 1 and 2 (protected, then chunk by chunk, members best first), then step 3 (by score)
    score_place = torch.empty_like(by_score).scatter_(-1, by_score, torch.arange(length, device=r.device)
                                                      .expand_as(by_score))
    key = torch.where(taken, place.gather(-1, chunk) * length + within, n_chunks * length + score_place)
    if protect is not None:
        key = key.masked_fill(protect, -1)
    chosen = key.argsort(dim=-1, stable=True)[..., :count]
    return chosen.sort(dim=-1).values


def check_gate(chunk_length: int, low_entropy_chunk_length: int) -> str | None:
    """Why the two parameters do not go together (None: they do)."""
    if low_entropy_chunk_length and not chunk_length:
        return (f"low_entropy_chunk_length={low_entropy_chunk_length} gates ChunkKV's chunks; give chunk_length too "
                f"(tokens per chunk, larger than it)")
    if low_entropy_chunk_length and low_entropy_chunk_length >= chunk_length:
        return (f"low_entropy_chunk_length={low_entropy_chunk_length} must be smaller than chunk_length="
                f"{chunk_length} (the members a spiky chunk keeps)")
    return None

