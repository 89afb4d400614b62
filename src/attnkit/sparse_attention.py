"""Sparse prefill attention (MInference): the three head patterns, their dynamic index building, and the
kernels that compute them.

Jiang et al., 2024, "MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse
Attention" (seed 002). Section 3.2 names three patterns of long-context attention; each query head gets one:

- ``a_shape`` (n_init, n_local): key ``j`` is visible to query ``i`` iff ``j < n_init`` (the initial,
  "global" tokens) or ``i - j < n_local`` (the local window). Static: no index building.
- ``vertical_slash`` (k_v, k_s), Alg. 2: the last ``last_q`` (64) queries attend to every key; the
  attention summed down each column ranks the *vertical* lines (keys), summed along each diagonal
  ``i - j = s`` ranks the *slash* lines (offsets). The top ``k_v`` columns and top ``k_s`` diagonals
  are computed.
- ``block_sparse`` (k_b), Alg. 3: queries and keys are mean-pooled over blocks of ``block`` (64) tokens;
  the softmax of the pooled logits ranks, for every query block, the key blocks; the top ``k_b`` are
  computed.

Every pattern is causal (``j <= i``) and always keeps key block 0 and the query's own (diagonal) block,
so no query is ever left without keys and the attention sinks are never lost.

**Block grid and layout.** Positions are cut into tiles of ``block`` tokens. A :class:`SparseLayout`
says, per query head and query tile row, which key tiles are computed ("main" tiles) and, for
vertical-slash heads, which exact key columns are computed besides them:

- a slash line at offset ``s`` crosses, in every query tile row ``i``, the key tiles ``i - s // block``
  and ``i - ceil(s / block)``; those whole tiles are computed (*slashes as block ranges*, like Alg. 4's
  ranges of ``block`` keys, here aligned to the tile grid so a line costs at most two tiles per row,
  and neighbouring lines share tiles). As a tile set this is one set of *block diagonals* per head.
- vertical lines are computed exactly, column by column: the chosen keys are gathered into a compact
  block per head (the PIT idea of Alg. 5: sparse columns loaded into dense tiles) and appended to the
  key tensor, so the whole head is ONE softmax in ONE kernel call. A column whose tile is already a main
  tile of a row is masked out of the gathered copy for that row (never counted twice).

**Kernel.** :func:`sparse_attention` runs :func:`torch.nn.attention.flex_attention.flex_attention`
(compiled with ``torch.compile``, CPU and CUDA) with a ``BlockMask`` built directly from the layout's
tile indices (``BlockMask.from_kv_blocks``; no ``create_block_mask`` over the N x N grid). Tiles that
need no mask (strictly below the diagonal, inside the pattern) are passed as *full* blocks; only the
diagonal tile, the edges of an A-shape head's window and gathered tiles that straddle causality or
hold an already-covered column evaluate the ``mask_mod``. Sequence lengths are padded up to a few sizes
per octave (:func:`padded_length`) so a compiled graph is reused across prompts; padded rows have no
tiles and cost nothing.

**FLOPs.** What the kernel really runs: every computed tile costs ``block**2`` query-key pairs, each
``4 * head_dim`` FLOPs (``q.k`` and ``p.v``), whether or not its mask drops some pairs
(:attr:`SparseLayout.tiles`, :func:`kernel_flops`). The density of a layout is that pair count over the
``n (n + 1) / 2`` pairs of dense causal attention.

**Reference.** :func:`dense_mask` writes the same layout as a boolean ``[heads, queries, keys]`` mask
from the plain definitions (main tiles with the token rule, union the vertical columns, causal) and
:func:`reference_attention` applies it with SDPA: the tests hold every kernel to it.

Queries are the last ``nq`` of ``n`` contiguous key positions ``0 .. n-1`` (a prompt, or its last chunk);
batch size 1; q ``[1, q_heads, nq, d]``, k/v ``[1, kv_heads, n, d]`` (GQA: never expanded).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError

PATTERNS = ("a_shape", "vertical_slash", "block_sparse")
PATTERN_PARAMS = {"a_shape": ("n_init", "n_local"), "vertical_slash": ("k_v", "k_s"), "block_sparse": ("k_b",)}
DEFAULT_BLOCK = 64
DEFAULT_LAST_Q = 64
BLOCK_SIZES = (16, 32, 64, 128)
_KIND = {"a_shape": 0, "vertical_slash": 1, "block_sparse": 2}
_NEVER = 1 << 40  # a position beyond any sequence: padding of column tables, "no threshold" for a_shape rules


# ---- per-head patterns ---------------------------------------------------------------------------------
def _count(name: str, value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AttnkitError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class HeadPattern:
    """The pattern of one query head and its parameters (token counts for a_shape, line/block counts
    for the dynamic patterns). The static variant carries fixed indices instead of estimating them:
    ``vertical`` (key positions) and ``slash`` (diagonal offsets) for vertical_slash, ``blocks`` (key
    tiles per query tile row) for block_sparse."""

    pattern: str
    n_init: int = 0
    n_local: int = 0
    k_v: int = 0
    k_s: int = 0
    k_b: int = 0
    vertical: tuple[int, ...] | None = None
    slash: tuple[int, ...] | None = None
    blocks: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if self.pattern not in PATTERNS:
            raise AttnkitError(f"unknown pattern {self.pattern!r}; choose from {', '.join(PATTERNS)}")
        for name in ("n_init", "n_local", "k_v", "k_s", "k_b"):
            _count(name, getattr(self, name), f"pattern {self.pattern}")

    @property
    def is_static(self) -> bool:
        return self.vertical is not None or self.slash is not None or self.blocks is not None

    def dynamic(self) -> HeadPattern:
        """The same pattern without fixed indices (estimated per prompt)."""
        return HeadPattern(self.pattern, self.n_init, self.n_local, self.k_v, self.k_s, self.k_b)

    def to_dict(self) -> dict:
        out = {"pattern": self.pattern}
        out.update({p: getattr(self, p) for p in PATTERN_PARAMS[self.pattern]})
        if self.is_static:
            static = {}
            if self.vertical is not None:
                static["vertical"] = list(self.vertical)
            if self.slash is not None:
                static["slash"] = list(self.slash)
            if self.blocks is not None:
                static["blocks"] = [list(row) for row in self.blocks]
            out["static"] = static
        return out

    @classmethod
    def from_dict(cls, data, where: str = "pattern") -> HeadPattern:
        """Parse ``{"pattern": ..., params..., ["recall": r], ["static": {...}]}`` with clear errors."""
        if not isinstance(data, dict) or not isinstance(data.get("pattern"), str):
            raise AttnkitError(f"{where}: expected an object with a 'pattern' key, got {data!r:.80}")
        pattern = data["pattern"]
        if pattern not in PATTERNS:
            raise AttnkitError(f"{where}: unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
        needed = PATTERN_PARAMS[pattern]
        missing = [p for p in needed if p not in data]
        if missing:
            raise AttnkitError(f"{where}: pattern {pattern} needs {', '.join(needed)}; missing {', '.join(missing)}")
        unknown = sorted(set(data) - set(needed) - {"pattern", "recall", "density", "static"})
        if unknown:
            raise AttnkitError(f"{where}: unknown key(s) {', '.join(unknown)} for pattern {pattern}")
        kwargs = {p: _count(p, data[p], where) for p in needed}
        static = data.get("static")
        if static is not None:
            allowed = {"vertical_slash": {"vertical", "slash"}, "block_sparse": {"blocks"}}.get(pattern, set())
            if not isinstance(static, dict) or set(static) != allowed:
                raise AttnkitError(f"{where}: 'static' of a {pattern} head must hold exactly "
                                   f"{', '.join(sorted(allowed)) or 'nothing (a_shape is static already)'}")
            try:
                if pattern == "vertical_slash":
                    kwargs["vertical"] = tuple(sorted(_count("vertical index", int(x), where) for x in static["vertical"]))
                    kwargs["slash"] = tuple(sorted(_count("slash offset", int(x), where) for x in static["slash"]))
                else:
                    kwargs["blocks"] = tuple(tuple(sorted(_count("block index", int(x), where) for x in row))
                                             for row in static["blocks"])
            except (TypeError, ValueError):
                raise AttnkitError(f"{where}: 'static' indices must be lists of whole numbers") from None
        return cls(pattern, **kwargs)


def check_block(block: int) -> int:
    if block not in BLOCK_SIZES:
        raise AttnkitError(f"block size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block!r}")
    return block


def padded_length(n: int, block: int) -> int:
    """`n` rounded up to a multiple of ``max(block, 2**(bits(n) - 4))``: at most 16 sizes per octave, so
    compiled kernels are reused across prompts of nearby lengths (padding costs no tiles)."""
    step = max(block, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


# ---- index building (Alg. 2 and 3) ---------------------------------------------------------------------
def _head_logits(q: torch.Tensor, k: torch.Tensor, heads: torch.Tensor | None, scaling: float) -> torch.Tensor:
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
    rev = _head_logits(q[0, :, nq - m :], k[0].flip(1), heads, scaling)  # column t is key n - 1 - t
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
    logits = _head_logits(qp, kp, heads, scaling)
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
    return rank.masked_fill_(~torch.isfinite(scores), _NEVER)


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


# ---- the layout ------------------------------------------------------------------------------------------
@dataclass
class SparseLayout:
    """Which query-key pairs each query head computes (see the module docstring).

    ``main``/``main_full`` ``[h, rows, tiles]``: computed key tiles per query tile row (rows are the tiles
    ``q_start // block ..``) and the ones needing no mask. ``init``/``local`` ``[h]``: the token rule inside
    main tiles (``j < init or i - j < local``; a value beyond any position for non-a_shape heads).
    ``columns`` ``[h, C]``: the exact vertical columns of each head, ascending (padding ``_NEVER``), ``C`` a
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

    @property
    def dense(self) -> bool:
        """True when every head keeps every causal pair (the output equals dense attention)."""
        if self._dense is None:
            i, j = self._grid()
            below = j < i
            self._dense = bool((self.main == (j <= i)).all() and (self.main_full == below).all())
        return self._dense

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, nb = self.main.shape[1:]
        dev = self.main.device
        return (torch.arange(rows, device=dev)[:, None] + self.first_row, torch.arange(nb, device=dev)[None, :])


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
      :func:`slash_diagonals`) and `columns` ``[h, n_keys]`` (bool, chosen key columns);
    - block_sparse heads: `tiles` ``[h, rows, tiles]`` (bool, chosen key tiles per query tile row).

    `width` fixes the gathered-column width ``C`` (a multiple of `block`), so that the kernel's shapes do not
    depend on the data; by default the largest column count, rounded up.
    """
    check_block(block)
    kind = torch.tensor([_KIND[k] for k in kinds], device=device)
    h = kind.shape[0]
    nb = -(-n_keys // block)
    r0 = q_start // block
    rows = nb - r0
    i = torch.arange(rows, device=device)[:, None] + r0
    j = torch.arange(nb, device=device)[None, :]
    causal, below = j <= i, j < i
    forced = (j == 0) | (j == i)
    is_a = (kind == 0)[:, None, None]
    is_vs = (kind == 1)[:, None, None]

    never = torch.full((h,), _NEVER, dtype=torch.long, device=device)
    zero = torch.zeros(h, dtype=torch.long, device=device)
    a_init = torch.where(kind == 0, init.to(device) if init is not None else zero, never)
    a_local = torch.where(kind == 0, local.to(device) if local is not None else zero, zero)

    main = forced.expand(h, rows, nb).clone()
    if bool(is_a.any()):
        q_lo = torch.clamp(i * block, min=q_start)
        q_hi = torch.clamp(i * block + block - 1, max=n_keys - 1)
        k_lo, k_hi = j * block, torch.clamp(j * block + block - 1, max=n_keys - 1)
        ai, al = a_init[:, None, None], a_local[:, None, None]
        a_main = causal & ((k_lo < ai) | (q_lo - k_hi < al) | forced)
        a_full = below & ((k_hi < ai) | (q_hi - torch.maximum(k_lo, ai) < al) | (j == 0))
    else:
        a_main = a_full = torch.zeros(1, 1, 1, dtype=torch.bool, device=device)
    if diagonals is not None:
        main |= is_vs & causal & diagonals.to(device)[:, (i - j).clamp(min=0)]
    if tiles is not None:
        main |= (kind == 2)[:, None, None] & causal & tiles.to(device)
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
            pos = torch.where(sel, torch.arange(n_keys, device=device), _NEVER).sort(1).values[:, :width]
            if pos.shape[1] < width:
                pos = F.pad(pos, (0, width - pos.shape[1]), value=_NEVER)
            real = pos < _NEVER
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
    indices for the static ones, then :func:`build_layout`."""
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
            tiles[torch.tensor(dyn, device=dev)] = top_k_mask(probs, torch.tensor([patterns[h].k_b for h in dyn], device=dev))
        for h in bs:
            if patterns[h].is_static:
                tiles[h] = static_block_rows(patterns[h].blocks, q_start // block, rows, nb, dev)
    return build_layout(kinds, n, q_start, block, init=init, local=local, diagonals=diagonals, tiles=tiles,
                        columns=columns, width=width, device=dev)


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


# ---- the FlexAttention kernel ------------------------------------------------------------------------------
_COMPILED = None


def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    global _COMPILED
    if _COMPILED is None:  # one compiled function for the process; dynamo keeps one graph per shape
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def _compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[h, rows, W]`` bool -> BlockMask counts ``[1, h, rows]`` and indices ``[1, h, rows, W]`` (int32):
    the selected tile indices of each row first, ascending (work in proportion to the selected tiles)."""
    h, rows, w = sel.shape
    hh, rr, jj = sel.nonzero(as_tuple=True)  # row-major: ascending within each row
    counts = sel.sum(-1, dtype=torch.int32)
    row = hh * rows + rr
    starts = counts.flatten().cumsum(0) - counts.flatten()
    slot = torch.arange(row.shape[0], device=sel.device) - starts[row]
    idx = torch.zeros(h * rows * w, dtype=torch.int32, device=sel.device)
    idx[row * w + slot] = jj.to(torch.int32)
    return counts[None], idx.view(1, h, rows, w)


def block_mask(layout: SparseLayout, groups: int, q_len: int, n_pad: int, complete: bool = False):
    """The FlexAttention ``BlockMask`` of a layout, built from tile indices (``BlockMask.from_kv_blocks``).

    Keys are the padded keys (``n_pad``) followed, per kv head, by the gathered columns of its `groups`
    query heads (``C`` each); queries are ``q_len`` rows starting at position ``first_row * block``.
    The ``mask_mod`` is only evaluated on partial tiles by the compiled kernel; `complete` makes it exact
    on its own (eager FlexAttention applies it to every pair and ignores the tile lists)."""
    from torch.nn.attention.flex_attention import BlockMask

    B = layout.block
    h, rows, nb = layout.main.shape
    width = 0 if layout.columns is None else layout.columns.shape[1]
    cb = width // B
    nbp = n_pad // B
    q_rows = q_len // B
    dev = layout.main.device

    def lay_out(main_part, vert_part):  # [h, rows, nb] (+ [h, rows, cb]) -> [h, q_rows, nbp + groups * cb]
        out = F.pad(main_part, (0, nbp - nb, 0, q_rows - rows))
        if not cb:
            return out
        segs = torch.zeros(h, rows, groups, cb, dtype=torch.bool, device=dev)
        heads = torch.arange(h, device=dev)
        segs[heads, :, heads % groups] = vert_part
        return torch.cat([out, F.pad(segs.view(h, rows, groups * cb), (0, 0, 0, q_rows - rows))], -1)

    num_p, idx_p = _compact(lay_out(layout.main & ~layout.main_full,
                                    layout.vert & ~layout.vert_full if cb else None))
    num_f, idx_f = _compact(lay_out(layout.main_full, layout.vert_full))

    init, local, main = layout.init, layout.local, layout.main
    qbase = torch.tensor(layout.first_row * B, device=dev)
    r0 = torch.tensor(layout.first_row, device=dev)

    def token_rule(h, qa, kv):
        rule = (kv <= qa) & ((kv < init[h]) | (qa - kv < local[h]) | (kv < B) | (kv // B == qa // B))
        if complete:  # eager FlexAttention ignores the tile lists: the tile itself must be selected
            rule = rule & (kv < n_pad) & main[h, (qa // B - r0).clamp(0, rows - 1), (kv // B).clamp(0, nb - 1)]
        return rule

    if not cb:
        def mask_mod(b, h, q_idx, kv_idx):
            return token_rule(h, q_idx + qbase, kv_idx)
    else:
        cols = layout.columns

        def mask_mod(b, h, q_idx, kv_idx):
            qa = q_idx + qbase
            c = kv_idx - n_pad - (h % groups) * width
            col = cols[h, c.clamp(0, width - 1)]
            row = (qa // B - r0).clamp(0, rows - 1)
            seen = (col < (qa // B) * B) & ~main[h, row, (col // B).clamp(0, nb - 1)]
            if complete:
                seen = seen & (c >= 0) & (c < width)
            return torch.where(kv_idx < n_pad, token_rule(h, qa, kv_idx), seen)

    return BlockMask.from_kv_blocks(num_p, idx_p, num_f, idx_f, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(q_len, n_pad + groups * width), compute_q_blocks=False)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, scaling: float,
                     compiled: bool = True) -> torch.Tensor:
    """Attention of the layout's pairs in one FlexAttention call (see the module docstring) -> ``[1, hq, nq, d]``.

    `compiled=False` runs FlexAttention eagerly (it then materialises the scores: small inputs only)."""
    b, hq, nq, d = q.shape
    kvh, n = k.shape[1], k.shape[2]
    groups = hq // kvh
    B = layout.block
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise AttnkitError("sparse prefill on CPU is inference only (FlexAttention has no CPU backward); run it "
                           "under torch.inference_mode() or torch.no_grad()")
    if n != layout.n_keys or n - nq != layout.q_start or hq != layout.n_heads:
        raise AttnkitError(f"layout for {layout.n_heads} heads, {layout.n_keys} keys from query {layout.q_start} "
                           f"does not fit q {tuple(q.shape)} / k {tuple(k.shape)}")
    with timed("build"):
        front = layout.q_start - layout.first_row * B
        q_len = padded_length(front + nq, B)
        n_pad = padded_length(n, B)
        width = 0 if layout.columns is None else layout.columns.shape[1]
        qp = q.new_zeros(1, hq, q_len, d)
        qp[:, :, front : front + nq] = q
        kp = k.new_zeros(1, kvh, n_pad + groups * width, d)
        vp = v.new_zeros(1, kvh, n_pad + groups * width, v.shape[-1])
        kp[:, :, :n] = k
        vp[:, :, :n] = v
        if width:
            idx = layout.columns.clamp(max=n - 1).reshape(kvh, groups * width)
            kp[0, :, n_pad:] = k[0].gather(1, idx[..., None].expand(-1, -1, d))
            vp[0, :, n_pad:] = v[0].gather(1, idx[..., None].expand(-1, -1, v.shape[-1]))
        mask = block_mask(layout, groups, q_len, n_pad, complete=not compiled)
    # the GPU kernel's tiles must divide the block (its default tiles may be larger than 64)
    options = {"BLOCK_M": B, "BLOCK_N": B} if q.device.type == "cuda" and compiled and B < 128 else None
    with timed("kernel"):
        fn = _flex_fn(compiled)
        with torch._dynamo.config.patch(recompile_limit=64):
            out = fn(qp, kp, vp, block_mask=mask, scale=scaling, enable_gqa=groups > 1, kernel_options=options)
    return out[:, :, front : front + nq]


# ---- the reference --------------------------------------------------------------------------------------
def dense_mask(layout: SparseLayout, rows: slice | None = None) -> torch.Tensor:
    """The layout as a boolean mask ``[h, queries, keys]`` (True = computed) from the plain definitions: a
    pair is kept when its tile is a main tile and it passes the token rule, or its key is a vertical
    column of the head; always causal. `rows` restricts to a slice of the queries."""
    B, n = layout.block, layout.n_keys
    dev = layout.main.device
    qa = torch.arange(layout.q_start, n, device=dev)
    if rows is not None:
        qa = qa[rows]
    qa = qa[:, None]
    kv = torch.arange(n, device=dev)[None, :]
    tile = layout.main[:, qa // B - layout.first_row, kv // B]
    init, local = layout.init[:, None, None], layout.local[:, None, None]
    rule = (kv <= qa) & ((kv < init) | (qa - kv < local) | (kv < B) | (kv // B == qa // B))
    mask = tile & rule
    if layout.columns is not None:
        col = torch.zeros(layout.n_heads, n + 1, dtype=torch.bool, device=dev)
        col.scatter_(1, layout.columns.clamp(max=n), True)
        mask |= col[:, None, :n] & (kv <= qa)
    return mask


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout,
                        scaling: float) -> torch.Tensor:
    """Dense-mask attention of the same pairs (SDPA with :func:`dense_mask`): the tests' reference and a
    slow fallback. Quadratic memory: short sequences only."""
    groups = q.shape[1] // k.shape[1]
    mask = dense_mask(layout)[None]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scaling)


# ---- timing -------------------------------------------------------------------------------------------
@dataclass
class PrefillProfile:
    """Seconds spent in sparse prefill, by part: ``index`` (Alg. 2/3 estimates and the layout), ``build``
    (padding, gathering the vertical columns, the BlockMask) and ``kernel`` (FlexAttention); plus layer
    calls that ran sparse / fell back to dense, and the summed density of the sparse ones."""

    index_s: float = 0.0
    build_s: float = 0.0
    kernel_s: float = 0.0
    sparse_calls: int = 0
    dense_calls: int = 0
    density_sum: float = 0.0

    @property
    def overhead_s(self) -> float:
        """Everything but the kernel: what the paper calls the cost of building the sparse index."""
        return self.index_s + self.build_s

    def as_dict(self) -> dict:
        calls = self.sparse_calls
        return {"index_s": self.index_s, "build_s": self.build_s, "kernel_s": self.kernel_s,
                "sparse_calls": calls, "dense_calls": self.dense_calls,
                "mean_density": self.density_sum / calls if calls else None}


_PROFILE: PrefillProfile | None = None


@contextlib.contextmanager
def profile():
    """Collect a :class:`PrefillProfile` of the sparse prefills run inside the block (synchronising the
    device around each part, so only use it for measurements)."""
    global _PROFILE
    previous, _PROFILE = _PROFILE, PrefillProfile()
    try:
        yield _PROFILE
    finally:
        _PROFILE = previous


def _sync():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(part: str):
    """Add the time spent in the block to `part` (index, build or kernel) of the active profile, if any."""
    prof = _PROFILE
    if prof is None:
        yield
        return
    _sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        setattr(prof, f"{part}_s", getattr(prof, f"{part}_s") + time.perf_counter() - t0)


def record_call(layout: SparseLayout | None) -> None:
    """Count a layer call in the active profile (None: it ran dense)."""
    prof = _PROFILE
    if prof is None:
        return
    if layout is None or layout.dense:
        prof.dense_calls += 1
    else:
        prof.sparse_calls += 1
        prof.density_sum += float(layout.density.mean())

