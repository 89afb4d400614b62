"""The report's needle heatmaps: per needle task and report column, the mean score by needle depth (rows) and
prompt length (columns), every cell labelled with its mean and its sample count ``n``.

Default depths differ per sample (``(i + 0.5) / samples``), so a cell per depth would hold one sample, a 0 or a 1
that looks like a finding. Depths are therefore pooled into at most :data:`MOST_BINS` equal bins of about
:data:`PER_CELL` samples (at least one), or kept as they are when the run asked for a few depths (``depths:``);
only each context's own question counts (a follow-up question of multi-query asks about another place). Many
columns are split into images of at most :data:`PANELS` heatmaps, in the order of the summary table.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from matplotlib.figure import Figure

from attnkit.eval.report.plot_style import FONT, TITLE, WIDTH, Plot, facets, safe_name

MOST_BINS = 5
PER_CELL = 3
PANELS = 12
PANELS_PER_ROW = 4
SECTION = "Needle heatmaps"


def _samples(r: dict) -> list[tuple[float, float]]:
    """(depth, score) of the row's samples that ask their context's own question."""
    questions = r.get("questions") or [0] * len(r.get("scores") or [])
    return [(d, s) for d, s, q in zip(r["depths"], r["scores"], questions)
            if d is not None and s is not None and not q]


def depth_bins(rs: list[dict]) -> list[tuple[float, float, str]]:
    """The depth bins of a task's rows: (low, high, tick label), from the top of the prompt down."""
    depths = sorted({round(d, 6) for r in rs for d, _ in _samples(r)})
    if len(depths) <= MOST_BINS:
        return [(d, d, f"{d:.2f}") for d in depths]
    per_row = min(len(_samples(r)) for r in rs)
    count = max(1, min(MOST_BINS, per_row // PER_CELL))
    return [(i / count, (i + 1) / count, f"{round(i / count, 2):g}-{round((i + 1) / count, 2):g}") for i in range(count)]


def _bin(depth: float, bins: list[tuple[float, float, str]]) -> int:
    for i, (low, high, _) in enumerate(bins):
        if low == high and abs(depth - low) < 1e-6:
            return i
        if low < high and (low <= depth < high or (i == len(bins) - 1 and depth == high)):
            return i
    return min(range(len(bins)), key=lambda i: abs((bins[i][0] + bins[i][1]) / 2 - depth))


def plot_needle_heatmap(rows: list[dict], task: str, order: list[str]) -> list[Plot]:
    """The task's heatmaps, columns in `order` (the summary table's), :data:`PANELS` to an image."""
    rs = [r for r in rows if r.get("task") == task and r.get("depths") and r.get("scores") and _samples(r)]
    if not rs:
        return []
    present = {r["label"] for r in rs}
    labels = [label for label in order if label in present] + sorted(present - set(order))
    lengths = sorted({r["length"] for r in rs})
    bins = depth_bins(rs)
    groups = facets(labels, PANELS)
    plots = []
    for k, group in enumerate(groups, start=1):
        fig = _figure([r for r in rs if r["label"] in group], group, lengths, bins)
        span = f"columns {labels.index(group[0]) + 1}-{labels.index(group[-1]) + 1} of {len(labels)}"
        fig.suptitle(f"{task}: score by needle depth and prompt length" + (f" ({span})" if len(groups) > 1 else ""),
                     fontsize=TITLE + 1)
        n = sorted({len(v) for r in rs if r["label"] in group for v in _cells(r, bins).values()})
        alt = (f"Heatmaps of {task}, one per column ({', '.join(group)}): the mean score by needle depth (rows: "
               f"{', '.join(b[2] for b in bins)} of the prompt) and prompt length (columns: "
               f"{', '.join(map(str, lengths))} tokens), green 1, red 0; each cell is labelled with its mean and its "
               f"n samples ({'-'.join(map(str, (n[0], n[-1]))) if len(n) > 1 else n[0]}).")
        caption = (f"Facet {k} of {len(groups)}: {span}, in the order of the summary table. " if len(groups) > 1
                   else "") + "Each cell: mean score and its number of samples n."
        name = f"needle_{safe_name(task)}" + (f"_{k}" if len(groups) > 1 else "") + ".png"
        plots.append(Plot(SECTION, name, alt, fig, caption))
    return plots


def _cells(r: dict, bins) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for d, s in _samples(r):
        out[_bin(d, bins)].append(s)
    return out


def _figure(rs: list[dict], labels: list[str], lengths: list[int], bins) -> Figure:
    ncols = min(PANELS_PER_ROW, len(labels))
    nrows = -(-len(labels) // ncols)
    fig = Figure(figsize=(min(WIDTH, 2.9 * ncols + 1.3), (0.42 * len(bins) + 1.3) * nrows + 0.6),
                 layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(labels):]:
        ax.axis("off")
    image = None
    for k, (ax, label) in enumerate(zip(axes.flat, labels)):
        mean = np.full((len(bins), len(lengths)), np.nan)
        count = np.zeros((len(bins), len(lengths)), dtype=int)
        for r in rs:
            if r["label"] == label:
                for i, v in _cells(r, bins).items():
                    j = lengths.index(r["length"])
                    mean[i, j], count[i, j] = sum(v) / len(v), len(v)
        image = ax.imshow(mean, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for (i, j), n in np.ndenumerate(count):
            if n:
                value = mean[i, j]
                ax.text(j, i, f"{value:.2f} n={n}", ha="center", va="center", fontsize=FONT, in_layout=False,
                        color="white" if value < 0.2 or value > 0.85 else "black")  # inside its cell: no margin
        ax.set_title(label, fontsize=FONT + 1)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=FONT)
        ax.set_yticks(range(len(bins)), [b[2] for b in bins] if k % ncols == 0 else [], fontsize=FONT)
        ax.set_xlabel("prompt length", fontsize=FONT)
        if k % ncols == 0:  # the rows of a panel are the same depths across a row of panels
            ax.set_ylabel("needle depth", fontsize=FONT)
    if image is not None:
        bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, aspect=30)
        bar.set_label("mean score", fontsize=FONT)
        bar.ax.tick_params(labelsize=FONT)
    return fig
