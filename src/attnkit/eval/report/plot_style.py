"""What every report figure shares (:mod:`attnkit.eval.report.plots`): sizes that stay readable on the page, the
:class:`Plot` a figure becomes, and splitting many recipes into facets.

A figure is drawn at :data:`DPI` no wider than :data:`WIDTH` inches, so the page (at most 1400 px wide) shows it
at its own size rather than shrunk: its smallest text, :data:`FONT` points, stays :func:`font_px` pixels on screen
however many recipes it holds. Many recipes grow a figure downwards (a bar per row) or split it into facets of a
few lines each (:func:`facets`), never widen it.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.text import Text

DPI = 100
FONT = 9  # points: the smallest text of any figure (tick labels, legends, cell notes)
TITLE = 11
WIDTH = 13.0  # inches: the widest figure, shown unscaled in the page's 1352 px of content
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")  # a line is told apart by its marker too
LINE_STYLES = ("-", "--", "-.", ":")


def font_px(points: float) -> float:
    """A font size in points as pixels of the PNG (:data:`DPI`)."""
    return points * DPI / 72


def safe_name(name: str) -> str:
    """`name` as part of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def facets(items: list, most: int) -> list[list]:
    """`items` in order, cut into as few runs of at most `most` as possible, of near-equal sizes (10 lines at 8 a
    panel make two panels of 5, not 8 and 2)."""
    if not items:
        return []
    count = math.ceil(len(items) / most)
    size = math.ceil(len(items) / count)
    return [items[i:i + size] for i in range(0, len(items), size)]


def min_font_pt(fig: Figure) -> float:
    """The smallest font size, in points, of the figure's visible, non-empty texts."""
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes, default=FONT)


def render(fig: Figure, trim: bool = False) -> bytes:
    """The figure as PNG bytes at :data:`DPI`; `trim`: cut to its contents (for a figure laid out by hand, whose
    labels may reach past its edge; a constrained layout already fits its figure, and trimming draws it twice)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, **({"bbox_inches": "tight", "pad_inches": 0.08} if trim else {}))
    return buf.getvalue()


@dataclass
class Plot:
    """One image of the report: its section, file name, a text alternative saying what it shows (for readers who
    do not see it: the HTML ``alt``), a caption shown under it (facets, lines drawn over each other) and its
    figure, rendered once."""

    section: str
    name: str
    alt: str
    figure: Figure
    caption: str = ""
    trim: bool = False
    _png: bytes | None = field(default=None, repr=False)

    @property
    def png(self) -> bytes:
        if self._png is None:
            self._png = render(self.figure, self.trim)
        return self._png

    @property
    def min_font_px(self) -> float:
        """The smallest text of the image, in its own pixels."""
        return font_px(min_font_pt(self.figure))
