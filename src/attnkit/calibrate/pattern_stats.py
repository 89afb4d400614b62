"""The statistics of MInference's kernel-aware pattern search: candidates scaled to a FLOPs budget and the
attention recall of their layouts (MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic
Sparse Attention, Jiang et al. 2024, arXiv 2407.02490, Alg. 1; search space of Table 7).

- :func:`estimate_ranks`: Alg. 2 and Alg. 3 estimates of every head on one prompt, as ranks, so that the
  top-k of any k (any scaled candidate) is one comparison.
- :func:`fit_to_budget`: Alg. 1's "build kernel-aware search space": a candidate's parameters are multiplied
  by a factor, found by bisection, until the tiles the kernel really computes
  (:attr:`attnkit.sparse.layout.SparseLayout.tiles`) reach the budget, averaged over the prompts.
- :func:`dense_stats` and :func:`layout_recall`: Alg. 1's "search for optimal head pattern" compares the
  sparse attention with ``softmax(QK^T / sqrt(d))``; here as the dense attention mass that falls inside the
  pattern, averaged over queries (1.0 = nothing lost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError
from attnkit.sparse.index import (
    descending_rank,
    estimate_block_sparse,
    estimate_vertical_slash,
    head_logits,
    slash_diagonals,
)
from attnkit.sparse.layout import SparseLayout, build_layout
from attnkit.sparse.patterns import PATTERN_PARAMS, PATTERNS
from attnkit.sparse.reference import dense_mask

SEARCH_SPACE: dict[str, tuple[tuple[int, ...], ...]] = {
    "a_shape": ((1024, 4096),),
    "vertical_slash": ((30, 2048), (100, 1800), (500, 1500), (3000, 200)),
    "block_sparse": ((100,),),
}
_BISECTIONS = 24
_STATS_ELEMENTS = 1 << 24  # probabilities held at once by the dense pass


@dataclass(frozen=True)
class Candidate:
    pattern: str
    base: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.pattern}{self.base}"


def candidates(space: dict[str, Sequence[Sequence[int]]] = SEARCH_SPACE) -> list[Candidate]:
    out = []
    for pattern in PATTERNS:
        for base in space.get(pattern, ()):
            base = tuple(int(x) for x in base)
            if len(base) != len(PATTERN_PARAMS[pattern]) or min(base) < 1:
                raise AttnkitError(f"search space: {pattern} takes {len(PATTERN_PARAMS[pattern])} positive "
                                   f"numbers ({', '.join(PATTERN_PARAMS[pattern])}), got {base}")
            out.append(Candidate(pattern, base))
    if not out:
        raise AttnkitError("the search space is empty")
    return out


# ---- index estimates and the layouts of scaled candidates ----------------------------------------------
@dataclass
class Ranks:
    """Dynamic index estimates of one layer on one prompt, as ranks (0 = best), so that the top-k of any k
    is one comparison: vertical ``[h, n]`` (key tile 0 excluded), slash ``[h, n]``, blocks ``[h, nb, nb]``."""

    n: int
    vertical: torch.Tensor
    slash: torch.Tensor
    blocks: torch.Tensor


def estimate_ranks(q, k, scaling, block: int, last_q: int) -> Ranks:
    """Alg. 2 and 3 estimates of every head (kept on the CPU: the search runs there)."""
    vertical, slash = estimate_vertical_slash(q, k, scaling, last_q)
    vertical[:, :block] = float("-inf")  # key tile 0 is always kept
    probs = estimate_block_sparse(q, k, scaling, block)
    nb = probs.shape[-1]
    probs.masked_fill_(torch.ones(nb, nb, dtype=torch.bool, device=probs.device).triu(1), float("-inf"))
    return Ranks(k.shape[2], descending_rank(vertical).cpu(), descending_rank(slash).cpu(),
                 descending_rank(probs).cpu())


def candidate_layout(pattern: str, params: torch.Tensor, ranks: Ranks, block: int) -> SparseLayout:
    """The layout every head would get with `pattern` and its per-head `params` ``[h, n_params]`` on the
    prompt the `ranks` came from (the same selection rule as at inference: top-k of the estimates)."""
    h, n = params.shape[0], ranks.n
    nb = -(-n // block)
    if pattern == "a_shape":
        return build_layout(["a_shape"] * h, n, 0, block, init=params[:, 0], local=params[:, 1])
    if pattern == "vertical_slash":
        columns = ranks.vertical < params[:, :1]
        diagonals = slash_diagonals(ranks.slash < params[:, 1:2], block, nb)
        return build_layout(["vertical_slash"] * h, n, 0, block, diagonals=diagonals, columns=columns)
    tiles = ranks.blocks < params[:, :1, None]
    return build_layout(["block_sparse"] * h, n, 0, block, tiles=tiles)


def _scaled(base: tuple[int, ...], alpha: torch.Tensor, n: int) -> torch.Tensor:
    """Parameters ``round(alpha * base)`` per head, capped at the length: ``[h, len(base)]``."""
    b = torch.tensor(base, dtype=torch.float64)
    return torch.round(alpha.double()[:, None] * b[None, :]).clamp(0, n).long()


def fit_to_budget(cand: Candidate, ranks: list[Ranks], budget: float, block: int, n_heads: int) -> torch.Tensor:
    """Alg. 1, ``while |t_i - t| > eps: sigma_i <- ChangeSpace(sigma_i)``: per head, the largest multiple of
    the candidate's parameters whose kernel FLOPs (mean density over the prompts) stay within `budget`.
    Returns the parameters ``[h, n_params]``."""
    n_max = max(r.n for r in ranks)

    def density(alpha):
        return torch.stack([candidate_layout(cand.pattern, _scaled(cand.base, alpha, r.n), r, block).density
                            for r in ranks]).mean(0)

    lo = torch.zeros(n_heads, dtype=torch.float64)
    hi = torch.full((n_heads,), n_max / min(cand.base) + 1.0, dtype=torch.float64)
    fits = density(hi) <= budget
    lo = torch.where(fits, hi, lo)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        ok = density(mid) <= budget
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return _scaled(cand.base, lo, n_max)


# ---- recall: the dense attention mass a layout keeps ---------------------------------------------------
@dataclass
class DenseStats:
    """Dense attention of one layer on one prompt, pooled: per query tile row, the mass on each key tile
    (``tile [h, rows, nb]``) and on each key (``column [h, rows, n]``), plus the exact mass an a_shape
    layout keeps (token rule inside its tiles)."""

    tile: torch.Tensor
    column: torch.Tensor
    a_shape: torch.Tensor | None


def dense_stats(q, k, scaling: float, block: int, a_layout: SparseLayout | None) -> DenseStats:
    """One pass over the dense causal attention of a layer (in query chunks); results on the CPU. Memory:
    ``heads x n^2 / block`` floats for the per-key masses."""
    hq, n, dev = q.shape[1], k.shape[2], q.device
    nb = -(-n // block)
    tile = torch.zeros(hq, nb, nb)
    column = torch.zeros(hq, nb, n)
    a_mass = torch.zeros(hq, dtype=torch.float64) if a_layout is not None else None
    a_dev = None if a_layout is None else dataclasses.replace(
        a_layout, init=a_layout.init.to(dev), local=a_layout.local.to(dev), main=a_layout.main.to(dev),
        main_full=a_layout.main_full.to(dev))
    step = max(1, _STATS_ELEMENTS // (hq * n * block))
    for r0 in range(0, nb, step):
        r1 = min(nb, r0 + step)
        s, e = r0 * block, min(n, r1 * block)
        logits = head_logits(q[0, :, s:e], k[0], None, scaling)
        pos = torch.arange(s, e, device=dev)[:, None]
        logits.masked_fill_(torch.arange(n, device=dev)[None, :] > pos, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        padded = probs.new_zeros(hq, (r1 - r0) * block, nb * block)
        padded[:, : e - s, :n] = probs
        tile[:, r0:r1] = padded.view(hq, r1 - r0, block, nb, block).sum((2, 4)).cpu()
        column[:, r0:r1] = padded[:, :, :n].reshape(hq, r1 - r0, block, n).sum(2).cpu()
        if a_dev is not None:
            a_mass += (probs * dense_mask(a_dev, rows=slice(s, e))).sum((1, 2)).double().cpu()
    return DenseStats(tile, column, a_mass)


def layout_recall(layout: SparseLayout, stats: DenseStats) -> torch.Tensor:
    """Mean over queries of the dense attention mass inside the layout, per head ``[h]`` (tile-level
    layouts: vertical_slash and block_sparse, whose main tiles keep every causal pair)."""
    n, B = layout.n_keys, layout.block
    kept = (layout.main * stats.tile).sum((1, 2))
    if layout.columns is not None:
        hq, rows, nb = layout.main.shape
        chosen = torch.zeros(hq, n + 1)
        chosen.scatter_(1, layout.columns.clamp(max=n), 1.0)
        on_columns = stats.column * chosen[:, None, :n]
        per_tile = F.pad(on_columns, (0, nb * B - n)).view(hq, rows, nb, B).sum(-1)
        i, j = layout.grid()
        kept = kept + ((j < i) & ~layout.main).float().mul(per_tile).sum((1, 2))
    return kept / (n - layout.q_start)
