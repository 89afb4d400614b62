"""The three head patterns of MInference and their parameters.

MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention (Jiang et al.
2024, arXiv 2407.02490), section 3.2, names three patterns of long-context attention; each query head gets
one:

- ``a_shape`` (n_init, n_local): key ``j`` is visible to query ``i`` iff ``j < n_init`` (the initial,
  "global" tokens) or ``i - j < n_local`` (the local window). Static: no index building.
- ``vertical_slash`` (k_v, k_s), Alg. 2: the top ``k_v`` key columns (*vertical* lines) and the top ``k_s``
  diagonals ``i - j = s`` (*slash* lines), ranked by the attention of the last queries.
- ``block_sparse`` (k_b), Alg. 3: for every query block, the top ``k_b`` key blocks, ranked by the
  attention of mean-pooled blocks.

Every pattern is causal (``j <= i``) and always keeps key block 0 and the query's own (diagonal) block,
so no query is ever left without keys and the attention sinks are never lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.errors import AttnkitError
from attnkit.validate import choice, whole

PATTERNS = ("a_shape", "vertical_slash", "block_sparse")
PATTERN_PARAMS = {"a_shape": ("n_init", "n_local"), "vertical_slash": ("k_v", "k_s"), "block_sparse": ("k_b",)}
PATTERN_KIND = {"a_shape": 0, "vertical_slash": 1, "block_sparse": 2}  # the layout's per-head pattern code
DEFAULT_BLOCK = 64
DEFAULT_LAST_Q = 64
BLOCK_SIZES = (16, 32, 64, 128)
NEVER = 1 << 40  # a position beyond any sequence: padding of column tables, "no threshold" for a_shape rules


def _count(name: str, value, where: str) -> int:
    return whole(f"{where}: {name}", value, 0)


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
                    kwargs["vertical"] = tuple(sorted(_count("vertical index", int(x), where)
                                                      for x in static["vertical"]))
                    kwargs["slash"] = tuple(sorted(_count("slash offset", int(x), where) for x in static["slash"]))
                else:
                    kwargs["blocks"] = tuple(tuple(sorted(_count("block index", int(x), where) for x in row))
                                             for row in static["blocks"])
            except (TypeError, ValueError):
                raise AttnkitError(f"{where}: 'static' indices must be lists of whole numbers") from None
        return cls(pattern, **kwargs)


def check_block(block: int) -> int:
    """A supported tile size (:data:`BLOCK_SIZES`)."""
    return choice("block size", block, BLOCK_SIZES)


def padded_length(n: int, block: int) -> int:
    """`n` rounded up to a multiple of ``max(block, 2**(bits(n) - 4))``: at most 16 sizes per octave, so
    compiled kernels are reused across prompts of nearby lengths (padding costs no tiles)."""
    step = max(block, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step
