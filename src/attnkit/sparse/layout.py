"""The layout of one layer's sparse prefill: which query-key pairs each query head computes.

Positions are cut into tiles of ``block`` tokens. A :class:`SparseLayout` says, per query head and query tile
row, which key tiles are computed ("main" tiles) and, for vertical-slash heads, which exact key columns are
computed besides them (MInference 1.0, Jiang et al. 2024, arXiv 2407.02490):

- a slash line at offset ``s`` crosses, in every query tile row ``i``, the key tiles ``i - s // block`` and
  ``i - ceil(s / block)``; those whole tiles are computed (*slashes as block ranges*, like Alg. 4's ranges of
  ``block`` keys, here aligned to the tile grid so a line costs at most two tiles per row, and neighbouring
  lines share tiles). As a tile set this is one set of *block diagonals* per head.
- vertical lines are computed exactly, column by column: the chosen keys are gathered into a compact block
  per head (the PIT idea of Alg. 5: sparse columns loaded into dense tiles) and appended to the key tensor,
  so the whole head is ONE softmax in ONE kernel call. A column whose tile is already a main tile of a row is
  masked out of the gathered copy for that row (never counted twice).
- inside main tiles the *token rule* holds: causal, and for A-shape heads ``j < n_init or i - j < n_local``
  (plus key tile 0 and the diagonal tile, which every pattern keeps) -- :meth:`SparseLayout.token_rule`,
  written with the rules of :mod:`attnkit.masks`.

**FLOPs.** What the kernel really runs: every computed tile costs ``block**2`` query-key pairs, each
``4 * head_dim`` FLOPs (``q.k`` and ``p.v``), whether or not its mask drops some pairs
(:attr:`SparseLayout.tiles`, :func:`kernel_flops`). The density of a layout is that pair count over the
``n (n + 1) / 2`` pairs of dense causal attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError
from attnkit.masks import Rule, and_, causal, key_in, or_, same_block, sinks, window
from attnkit.sparse.index import (
    estimate_block_sparse,
    estimate_vertical_slash,
    slash_diagonals,
    static_block_rows,
    top_k_mask,
)
from attnkit.sparse.patterns import DEFAULT_BLOCK, DEFAULT_LAST_Q, NEVER, PATTERN_KIND, HeadPattern, check_block


@dataclass
class SparseLayout:
    """Which query-key pairs each query head computes (see the module docstring).

    ``main``/``main_full`` ``[h, rows, tiles]``: computed key tiles per query tile row (rows are the tiles
    ``q_start // block ..``) and the ones needing no mask. ``init``/``local`` ``[h]``: the token rule inside
    main tiles (``j < init or i - j < local``; a value beyond any position for non-a_shape heads).
    ``columns`` ``[h, C]``: the exact vertical columns of each head, ascending (padding ``NEVER``), ``C`` a
    multiple of the block; ``vert``/``vert_full`` ``[h, rows, C / block]``: computed tiles of the gathered
    columns per row (a gathered tile of row ``i`` holds columns before tile ``i`` whose tile is not a main
    tile of row ``i``)."""

    block: int
    n_keys: int
    q_start: int
    init: torch.Tensor
    local: torch.Tensor
    main: torch.Tensor
    main_full: torch.Tensor
    columns: torch.Tensor | None = None
    vert: torch.Tensor | None = None
    vert_full: torch.Tensor | None = None
    _dense: bool | None = field(default=None, repr=False)

    @property
    def n_heads(self) -> int:
        return self.main.shape[0]

    @property
    def first_row(self) -> int:
        return self.q_start // self.block

    @property
    def tiles(self) -> torch.Tensor:
        """Tiles the kernel computes per head ``[h]`` (int64)."""
        t = self.main.sum((1, 2))
        return t if self.vert is None else t + self.vert.sum((1, 2))

    @property
    def causal_pairs(self) -> int:
        """Query-key pairs of dense causal attention for these queries."""
        n, s = self.n_keys, self.q_start
        return (n * (n + 1) - s * (s + 1)) // 2

    @property
    def density(self) -> torch.Tensor:
        """Pairs the kernel computes over the pairs of dense causal attention, per head ``[h]``."""
        return self.tiles.double() * self.block**2 / self.causal_pairs

    def without_heads(self, heads: torch.Tensor) -> SparseLayout:
        """The same layout with no tiles for `heads` (bool ``[h]``): a kernel over it computes nothing there."""
        keep = ~heads.to(self.main.device)[:, None, None]
        cut = {name: getattr(self, name) & keep for name in ("main", "main_full", "vert", "vert_full")
               if getattr(self, name) is not None}
        return replace(self, **cut, _dense=False)

    def with_dense_heads(self, heads: torch.Tensor) -> SparseLayout:
        """The same layout with every causal tile for `heads` (bool ``[h]``), no token rule and no gathered columns: a
        kernel over it computes their dense causal attention, and the other heads' pairs as before."""
        h = heads.to(self.main.device)
        i, j = self.grid()
        cut = {"main": torch.where(h[:, None, None], j <= i, self.main),
               "main_full": torch.where(h[:, None, None], j < i, self.main_full),
               "init": torch.where(h, NEVER, self.init), "local": torch.where(h, 0, self.local)}
        if self.vert is not None:
            cut.update(vert=self.vert & ~h[:, None, None], vert_full=self.vert_full & ~h[:, None, None])
        return replace(self, **cut, _dense=None)

    @property
    def dense(self) -> bool:
        """True when every head keeps every causal pair (the output equals dense attention)."""
        if self._dense is None:
            i, j = self.grid()
            below = j < i
            self._dense = bool((self.main == (j <= i)).all() and (self.main_full == below).all())
        return self._dense

    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Query tile rows ``[rows, 1]`` (absolute) and key tiles ``[1, tiles]`` of the main-tile grid."""
        rows, nb = self.main.shape[1:]
        dev = self.main.device
        return (torch.arange(rows, device=dev)[:, None] + self.first_row, torch.arange(nb, device=dev)[None, :])

    # ---- the pairs as rules over positions (attnkit.masks) ----
    def token_rule(self) -> Rule:
        """The rule inside main tiles: causal, and ``j < init or i - j < local`` or key tile 0 or the query's
        own tile (per head)."""
        b = self.block
        return and_(causal, or_(sinks(self.init), window(self.local), sinks(b),
                                                  same_block(b)))

    def tile_rule(self) -> Rule:
        """Pairs whose tile is a main tile of the head (indices clamped to the grid, for padded positions)."""
        b, main, r0 = self.block, self.main, self.first_row
        rows, nb = main.shape[1:]

        def rule(h, q, k):
            return main[h, (q // b - r0).clamp(0, rows - 1), (k // b).clamp(0, nb - 1)]

        return rule

    def column_member(self) -> torch.Tensor | None:
        """The vertical columns as a key set ``[h, n_keys]`` (bool), or None without columns."""
        if self.columns is None:
            return None
        n = self.n_keys
        col = torch.zeros(self.n_heads, n + 1, dtype=torch.bool, device=self.main.device)
        col.scatter_(1, self.columns.clamp(max=n), True)
        return col[:, :n]

    def rule(self) -> Rule:
        """Every pair the layout computes: a main tile's pair passing the token rule, or a causal pair whose
        key is a vertical column of the head."""
        kept = and_(self.tile_rule(), self.token_rule())
        member = self.column_member()
        return kept if member is None else or_(kept, and_(causal, key_in(member)))


def kernel_flops(layout: SparseLayout, head_dim: int) -> torch.Tensor:
    """FLOPs the kernel runs per head: computed tiles x block^2 pairs x 4 head_dim (``q.k`` and ``p.v``)."""
    return layout.tiles.double() * layout.block**2 * 4 * head_dim


def build_layout(kinds: Sequence[str], n_keys: int, q_start: int, block: int, *,
                 init: torch.Tensor | None = None, local: torch.Tensor | None = None,
                 diagonals: torch.Tensor | None = None, tiles: torch.Tensor | None = None,
                 columns: torch.Tensor | None = None, width: int | None = None,
                 device: torch.device | str = "cpu") -> SparseLayout:
    """The layout of one layer from each head's pattern kind and its selection:

    - a_shape heads: `init`, `local` ``[h]`` (token counts; other heads' entries are ignored);
    - vertical_slash heads: `diagonals` ``[h, tiles]`` (block diagonals of the chosen slash lines, see
      :func:`attnkit.sparse.index.slash_diagonals`) and `columns` ``[h, n_keys]`` (bool, chosen key columns);
    - block_sparse heads: `tiles` ``[h, rows, tiles]`` (bool, chosen key tiles per query tile row).

    `width` fixes the gathered-column width ``C`` (a multiple of `block`), so that the kernel's shapes do not
    depend on the data; by default the largest column count, rounded up.
    """
    check_block(block)
    kind = torch.tensor([PATTERN_KIND[k] for k in kinds], device=device)
    h = kind.shape[0]
    nb = -(-n_keys // block)
    r0 = q_start // block
    rows = nb - r0
    i = torch.arange(rows, device=device)[:, None] + r0
    j = torch.arange(nb, device=device)[None, :]
    causal_tiles, below = j <= i, j < i
    forced = (j == 0) | (j == i)
    is_a = (kind == 0)[:, None, None]
    is_vs = (kind == 1)[:, None, None]

    never = torch.full((h,), NEVER, dtype=torch.long, device=device)
    zero = torch.zeros(h, dtype=torch.long, device=device)
    a_init = torch.where(kind == 0, init.to(device) if init is not None else zero, never)
    a_local = torch.where(kind == 0, local.to(device) if local is not None else zero, zero)

    main = forced.expand(h, rows, nb).clone()
    if bool(is_a.any()):
        q_lo = torch.clamp(i * block, min=q_start)
        q_hi = torch.clamp(i * block + block - 1, max=n_keys - 1)
        k_lo, k_hi = j * block, torch.clamp(j * block + block - 1, max=n_keys - 1)
        ai, al = a_init[:, None, None], a_local[:, None, None]
        a_main = causal_tiles & ((k_lo < ai) | (q_lo - k_hi < al) | forced)
        a_full = below & ((k_hi < ai) | (q_hi - torch.maximum(k_lo, ai) < al) | (j == 0))
    else:
        a_main = a_full = torch.zeros(1, 1, 1, dtype=torch.bool, device=device)
    if diagonals is not None:
        main |= is_vs & causal_tiles & diagonals.to(device)[:, (i - j).clamp(min=0)]
    if tiles is not None:
        main |= (kind == 2)[:, None, None] & causal_tiles & tiles.to(device)
    main = torch.where(is_a, a_main, main)
    main_full = torch.where(is_a, a_full & a_main, main & below)

    layout = SparseLayout(block, n_keys, q_start, a_init, a_local, main, main_full)
    if columns is not None and bool((kind == 1).any()):
        sel = columns.to(device) & (kind == 1)[:, None]
        sel[:, :block] = False  # key tile 0 is always a main tile
        count = int(sel.sum(1).max())
        if width is None:
            width = max(block, -(-count // block) * block)
        if width % block or count > width:
            raise AttnkitError(f"gathered-column width {width} must be a multiple of the block ({block}) and hold "
                               f"{count} columns")
        if count > 0:
            pos = torch.where(sel, torch.arange(n_keys, device=device), NEVER).sort(1).values[:, :width]
            if pos.shape[1] < width:
                pos = F.pad(pos, (0, width - pos.shape[1]), value=NEVER)
            real = pos < NEVER
            seg = torch.arange(width, device=device) // block
            cb = width // block
            member = torch.zeros(h, nb * cb, device=device)  # columns of segment tile t lying in key tile tau
            member.scatter_add_(1, torch.where(real, pos // block, 0) * cb + seg, real.float())
            uncovered = (below & ~main).float()  # key tiles whose columns a row sees through the gathered copy
            cnt = torch.bmm(uncovered, member.view(h, nb, cb))
            layout.columns, layout.vert, layout.vert_full = pos, cnt > 0, cnt == block
    return layout


def layout_for_patterns(patterns: Sequence[HeadPattern], q: torch.Tensor, k: torch.Tensor, scaling: float, *,
                        block: int = DEFAULT_BLOCK, last_q: int = DEFAULT_LAST_Q,
                        width: int | None = None) -> SparseLayout:
    """Build one layer's layout: Alg. 2 / Alg. 3 estimates for the dynamic heads (only those), fixed
    indices for the static ones, then :func:`build_layout`. Queries are the last ``nq`` of the ``n``
    contiguous key positions (batch size 1)."""
    hq, n, nq = q.shape[1], k.shape[2], q.shape[2]
    if len(patterns) != hq:
        raise AttnkitError(f"{len(patterns)} head patterns given for {hq} query heads")
    if q.shape[0] != 1:
        raise AttnkitError(f"sparse prefill supports batch size 1, got {q.shape[0]}")
    dev = q.device
    q_start = n - nq
    nb = -(-n // block)
    rows = nb - q_start // block
    kinds = [p.pattern for p in patterns]
    init = torch.tensor([p.n_init for p in patterns], device=dev)
    local = torch.tensor([p.n_local for p in patterns], device=dev)
    diagonals = columns = tiles = None

    vs = [h for h, p in enumerate(patterns) if p.pattern == "vertical_slash"]
    if vs:
        columns = torch.zeros(hq, n, dtype=torch.bool, device=dev)
        offsets = torch.zeros(hq, n, dtype=torch.bool, device=dev)
        dyn = [h for h in vs if not patterns[h].is_static]
        if dyn:
            heads = None if len(dyn) == hq else torch.tensor(dyn, device=dev)
            vertical, slash = estimate_vertical_slash(q, k, scaling, last_q, heads)
            vertical[:, :block] = float("-inf")  # key tile 0 is kept anyway
            idx = torch.tensor(dyn, device=dev)
            columns[idx] = top_k_mask(vertical, torch.tensor([patterns[h].k_v for h in dyn], device=dev))
            offsets[idx] = top_k_mask(slash, torch.tensor([patterns[h].k_s for h in dyn], device=dev))
        for h in vs:
            p = patterns[h]
            if p.is_static:
                cols = torch.tensor([c for c in p.vertical if c < n], dtype=torch.long, device=dev)
                offs = torch.tensor([s for s in p.slash if s < n], dtype=torch.long, device=dev)
                columns[h, cols] = True
                offsets[h, offs] = True
        diagonals = slash_diagonals(offsets, block, nb)

    bs = [h for h, p in enumerate(patterns) if p.pattern == "block_sparse"]
    if bs:
        tiles = torch.zeros(hq, rows, nb, dtype=torch.bool, device=dev)
        dyn = [h for h in bs if not patterns[h].is_static]
        if dyn:
            heads = None if len(dyn) == hq else torch.tensor(dyn, device=dev)
            probs = estimate_block_sparse(q, k, scaling, block, heads)
            k_b = torch.tensor([patterns[h].k_b for h in dyn], device=dev)
            tiles[torch.tensor(dyn, device=dev)] = top_k_mask(probs, k_b)
        for h in bs:
            if patterns[h].is_static:
                tiles[h] = static_block_rows(patterns[h].blocks, q_start // block, rows, nb, dev)
    return build_layout(kinds, n, q_start, block, init=init, local=local, diagonals=diagonals, tiles=tiles,
                        columns=columns, width=width, device=dev)
