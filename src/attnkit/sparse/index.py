"""Dynamic index building of MInference: which lines and blocks each head computes on this prompt.

MInference 1.0 (Jiang et al. 2024, arXiv 2407.02490):

- Alg. 2 (vertical-slash): the last ``last_q`` (64) queries attend to every key; the attention summed down
  each column ranks the *vertical* lines (keys), summed along each diagonal ``i - j = s`` ranks the *slash*
  lines (offsets) -- :func:`estimate_vertical_slash`.
- Alg. 3 (block-sparse): queries and keys are mean-pooled over blocks of ``block`` (64) tokens; the softmax of
  the pooled logits ranks, for every query block, the key blocks -- :func:`estimate_block_sparse`.

The top-k of the estimates (:func:`top_k_mask`, or :func:`descending_rank` for every k at once) is the
selection; a chosen slash line becomes the block diagonals it crosses (:func:`slash_diagonals`). Queries are
the last ``nq`` of ``n`` contiguous key positions ``0 .. n-1``; batch size 1; q ``[1, q_heads, nq, d]``,
k ``[1, kv_heads, n, d]`` (GQA: never expanded).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from attnkit.sparse.patterns import DEFAULT_BLOCK, DEFAULT_LAST_Q, NEVER


def head_logits(q: torch.Tensor, k: torch.Tensor, heads: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """float32 logits ``[h, m, n]`` of queries ``q [hq, m, d]`` (or the query heads `heads`) against the keys
    ``k [kv, n, d]`` of their kv heads; the kv heads are read in place when every query head is wanted."""
    hq, m, d = q.shape
    kv = k.shape[0]
    g = hq // kv
    if heads is None:
        out = torch.matmul(q.reshape(kv, g * m, d), k.transpose(-1, -2))
        return out.float().mul_(scaling).view(hq, m, -1)
    out = torch.matmul(q[heads], k[heads // g].transpose(-1, -2))
    return out.float().mul_(scaling)


def estimate_vertical_slash(q: torch.Tensor, k: torch.Tensor, scaling: float, last_q: int = DEFAULT_LAST_Q,
                            heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2, lines 1-3: ``A = softmax(Q[-last_q:] K^T * scaling + causal)``; returns the vertical scores
    (A summed over its rows, per key ``[h, n]``) and the slash scores (A summed along each diagonal
    ``i - j = s``, per offset ``[h, n]``), float32, for all query heads or the ones in `heads`.

    The keys are taken in reverse order, so that row ``r`` of A (the query at ``p = n - m + r``) holds the
    diagonals ``s = 0 .. p`` as one contiguous run: the slash sums are ``m`` vector additions."""
    n, nq = k.shape[2], q.shape[2]
    m = min(last_q, nq)
    rev = head_logits(q[0, :, nq - m :], k[0].flip(1), heads, scaling)  # column t is key n - 1 - t
    r = torch.arange(m, device=q.device)
    rev[:, :, :m].masked_fill_(r[:, None] + r[None, :] < m - 1, float("-inf"))  # keys after the query
    probs = torch.softmax(rev, dim=-1)
    slash = probs.new_zeros(probs.shape[0], n)
    for row in range(m):  # query n - m + row sees diagonals 0 .. n - m + row, from column m - 1 - row on
        slash[:, : n - m + row + 1] += probs[:, row, m - 1 - row :]
    return probs.sum(1).flip(-1), slash


def _pool(x: torch.Tensor, start: int, block: int) -> torch.Tensor:
    """Mean of ``x [h, L, d]`` (positions ``start .. start+L-1``) over the tiles of `block` positions that
    hold them; only real positions count. -> ``[h, tiles, d]`` (float32)."""
    h, length, d = x.shape
    front = start % block
    tiles = -(-(front + length) // block)
    back = tiles * block - front - length
    padded = F.pad(x.float(), (0, 0, front, back)) if front or back else x.float()
    pos = torch.arange(tiles * block, device=x.device) - front
    count = ((pos >= 0) & (pos < length)).view(tiles, block).sum(1).clamp(min=1)
    return padded.reshape(h, tiles, block, d).sum(2) / count[None, :, None]


def estimate_block_sparse(q: torch.Tensor, k: torch.Tensor, scaling: float, block: int = DEFAULT_BLOCK,
                          heads: torch.Tensor | None = None) -> torch.Tensor:
    """Alg. 3, lines 1-3: ``softmax(MeanPool(Q) MeanPool(K)^T * scaling + block-causal)`` -> ``[h, rows, tiles]``
    (float32) for every query tile row of the queries against every key tile."""
    n, nq = k.shape[2], q.shape[2]
    q_start = n - nq
    qp = _pool(q[0], q_start, block)
    kp = _pool(k[0], 0, block)
    logits = head_logits(qp, kp, heads, scaling)
    rows, nb = logits.shape[1], logits.shape[2]
    i = torch.arange(rows, device=q.device)[:, None] + q_start // block
    logits.masked_fill_(torch.arange(nb, device=q.device)[None, :] > i, float("-inf"))
    return torch.softmax(logits, dim=-1)


def top_k_mask(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the ``k[h]`` largest entries along the last axis, per head ``h`` (`scores`
    ``[h, ..., L]``; ``-inf`` entries are never chosen)."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    kmax = min(int(k.max()), scores.shape[-1]) if k.numel() else 0
    if kmax <= 0:
        return mask
    top = scores.topk(kmax, dim=-1)
    keep = torch.arange(kmax, device=scores.device) < k.view(-1, *([1] * (scores.dim() - 1))).to(scores.device)
    mask.scatter_(-1, top.indices, keep.expand_as(top.indices) & torch.isfinite(top.values))
    return mask


def descending_rank(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry along the last axis, 0 = largest (``-inf`` entries rank last); ``rank < k`` is
    the top-k mask, nested in k (the calibration search scans k without re-sorting)."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return rank.masked_fill_(~torch.isfinite(scores), NEVER)


def slash_diagonals(offsets: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """Selected slash offsets ``[h, n]`` (bool) -> the block diagonals ``d = i - j`` (query tile row minus
    key tile) whose tiles they cross, ``[h, n_blocks]``: offset ``s`` crosses ``s // block`` and
    ``ceil(s / block)``."""
    h, n = offsets.shape
    s = torch.arange(n, device=offsets.device)
    hits = torch.zeros(h, n_blocks + 1, dtype=torch.int32, device=offsets.device)
    for d in (s // block, (s + block - 1) // block):
        hits.scatter_add_(1, d.clamp(max=n_blocks).expand(h, n), offsets.to(torch.int32))
    return hits[:, :n_blocks] > 0


def static_block_rows(blocks: Sequence[Sequence[int]], first_row: int, rows: int, nb: int, device) -> torch.Tensor:
    """Fixed block_sparse tiles ``[rows, nb]`` from per-row lists (row = absolute query tile); rows past the
    stored ones reuse the last stored row (the static variant was estimated at one length)."""
    if not blocks:
        return torch.zeros(rows, nb, dtype=torch.bool, device=device)
    pairs = [(r, b) for r, row in enumerate(blocks) for b in row if b < nb]
    stored = torch.zeros(len(blocks), nb, dtype=torch.bool, device=device)
    if pairs:
        stored[tuple(torch.tensor(pairs, device=device).T)] = True
    return stored[(torch.arange(rows, device=device) + first_row).clamp(max=len(blocks) - 1)]
