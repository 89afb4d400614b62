"""The report's plots of its summary lines (one per column: recipe@budget and protocol): speed and memory against
full as bars, and score against decode speed with the Pareto front.

- Speed and memory: a panel per measure (prefill and decode speed-up, peak and final KV relative to full), a
  horizontal bar per column in the order of the summary table, sharing one column of labels: 40 columns grow the
  figure downwards and keep every label at the figure's font size (:data:`attnkit.eval.report.plot_style.FONT`).
- Score vs decode speed: a panel per protocol; the points' labels stand in a column at the right, joined to their
  points (:func:`attnkit.eval.report.label_layout.spread`), so they never overlap; columns with the same point share one
  label.
"""

from __future__ import annotations

import matplotlib.lines
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch

from attnkit.eval.report.label_layout import spread
from attnkit.eval.report.plot_style import FONT, TITLE, WIDTH, Plot, facets, safe_name

MOST_BARS = 50  # columns in one speed-and-memory image
MEASURES = (("prefill_speedup", "prefill speed-up"), ("decode_speedup", "decode speed-up"),
            ("peak_kv_ratio", "peak KV / full"), ("final_kv_ratio", "final KV / full"))
LINE = FONT * 1.45 / 72  # inches between two labels of the column


def plot_speed_memory(summary: list[dict]) -> list[Plot]:
    lines = [s for s in summary if any(s.get(k) is not None for k, _ in MEASURES)]
    groups = facets(lines, MOST_BARS)
    plots = []
    for k, group in enumerate(groups, start=1):
        fig = Figure(figsize=(WIDTH, 0.24 * len(group) + 1.5), layout="constrained")
        axes = fig.subplots(1, len(MEASURES), sharey=True, squeeze=False)[0]
        y = list(range(len(group)))
        for ax, (key, name), colour in zip(axes, MEASURES, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            ax.barh(y, [s[key] if s.get(key) is not None else float("nan") for s in group], height=0.7, color=colour)
            ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
            ax.set_title(name, fontsize=TITLE)
            ax.tick_params(labelsize=FONT)
            ax.grid(axis="x", alpha=0.3)
            ax.set_xlim(left=0)
        axes[0].set_yticks(y, [s["label"] for s in group], fontsize=FONT)
        axes[0].set_ylim(len(group) - 0.5, -0.5)  # the summary table's order, top to bottom
        span = f"columns {lines.index(group[0]) + 1}-{lines.index(group[-1]) + 1} of {len(lines)}"
        fig.suptitle("speed and KV memory relative to full (medians over cells; 1 = full, dashed)"
                     + (f", {span}" if len(groups) > 1 else ""), fontsize=TITLE + 1)
        fast = max((s for s in group if s.get("decode_speedup") is not None), key=lambda s: s["decode_speedup"],
                   default=None)
        lean = min((s for s in group if s.get("final_kv_ratio") is not None), key=lambda s: s["final_kv_ratio"],
                   default=None)
        alt = (f"Bar charts, one per measure (prefill speed-up, decode speed-up, peak KV and final KV relative to "
               f"full), a bar per column for {len(group)} columns in the order of the summary table"
               + (f"; fastest decoding: {fast['label']} ({fast['decode_speedup']:.2f}x)" if fast else "")
               + (f"; least final KV: {lean['label']} ({lean['final_kv_ratio']:.2f}x)" if lean else "") + ".")
        caption = f"Facet {k} of {len(groups)}: {span} of the summary table." if len(groups) > 1 else ""
        name = "speed_memory" + (f"_{k}" if len(groups) > 1 else "") + ".png"
        plots.append(Plot("Speed and memory", name, alt, fig, caption))
    return plots


def _points(lines: list[dict]) -> list[tuple[float, float, list[dict]]]:
    """(speed-up, score / full, the columns there): columns at the same point (to the plot's precision) share it."""
    at: dict[tuple, list[dict]] = {}
    for s in lines:
        at.setdefault((round(s["decode_speedup"], 3), round(s["score_rel_full"], 3)), []).append(s)
    return [(same[0]["decode_speedup"], same[0]["score_rel_full"], same) for same in at.values()]


def plot_pareto(summary: list[dict], protocols: list[str] | None = None) -> list[Plot]:
    """Score vs decode speed, an image per protocol, in the order of `protocols` (else as the summary meets them)."""
    usable = [s for s in summary if s.get("decode_speedup") is not None and s.get("score_rel_full") is not None]
    present = list(dict.fromkeys(s.get("protocol") or "query-aware" for s in usable))
    protocols = [p for p in protocols or [] if p in present] + [p for p in present if p not in (protocols or [])]
    plots = []
    for protocol in protocols:
        lines = [s for s in usable if (s.get("protocol") or "query-aware") == protocol]
        fig, front = _pareto_figure(lines)
        where = f" ({protocol})" if len(protocols) > 1 else ""
        fig.suptitle(f"score vs decode speed{where}", fontsize=TITLE + 1)
        alt = (f"Scatter plot{where}: score relative to full (mean over cells) against decode speed relative to full "
               f"(median) for {len(lines)} columns, each labelled in a column at the right; the Pareto front (no "
               f"other column both faster and better), in red, joins {', '.join(front) or 'no column'}.")
        name = "pareto" + (f"_{safe_name(protocol)}" if len(protocols) > 1 else "") + ".png"
        plots.append(Plot("Score vs decode speed", name, alt, fig, trim=True))
    return plots


def _pareto_figure(lines: list[dict]) -> tuple[Figure, list[str]]:
    points = sorted(_points(lines), key=lambda p: -p[1])
    height = max(4.8, LINE * len(points) + 1.4)
    fig = Figure(figsize=(WIDTH * 0.8, height))
    left, bottom, top = 0.8, 0.7, 0.85  # inches of margin around the axes (the legend and title above)
    ax_w, ax_h = WIDTH * 0.8 * 0.52, height - bottom - top
    ax = fig.add_axes((left / (WIDTH * 0.8), bottom / height, ax_w / (WIDTH * 0.8), ax_h / height))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    pad_x, pad_y = 0.05 * (max(xs) - min(xs) or 1), 0.05 * (max(ys) - min(ys) or 1)
    ax.set_xlim(min(xs) - pad_x, max(xs) + pad_x)
    ax.set_ylim(min(ys) - pad_y, max(ys) + pad_y)
    y_low, y_high = ax.get_ylim()
    on_front = [any(s["pareto"] for s in same) for _, _, same in points]
    ax.scatter(xs, ys, c=["tab:red" if f else "tab:blue" for f in on_front], zorder=3, s=22)
    front = sorted((x, y) for (x, y, _), f in zip(points, on_front) if f)
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", linewidth=1, zorder=2)
    wanted = [(y - y_low) / (y_high - y_low) * ax_h for y in ys]
    placed = spread(wanted, LINE, 0.0, ax_h)
    for (x, y, same), at, f in zip(points, placed, on_front):
        colour = "tab:red" if f else "#999"
        # the leader: inside the plot from the point to the right edge at the label's height, then straight to it,
        # so no leader crosses a label of the column
        fig.add_artist(ConnectionPatch((x, y), (1.0, at / ax_h), coordsA="data", coordsB="axes fraction", axesA=ax,
                                       axesB=ax, color=colour, linewidth=0.6))
        ax.plot([1.0, 1.035], [at / ax_h] * 2, transform=ax.transAxes, color=colour, linewidth=0.6, clip_on=False)
        ax.text(1.04, at / ax_h, " = ".join(s["label"] for s in same), transform=ax.transAxes, va="center",
                ha="left", fontsize=FONT, color="tab:red" if f else "#333", fontweight="bold" if f else "normal")
    ax.set_xlabel("decode speed relative to full (median over cells)", fontsize=FONT + 1)
    ax.set_ylabel("score relative to full (mean over cells)", fontsize=FONT + 1)
    ax.tick_params(labelsize=FONT)
    ax.grid(alpha=0.3)
    ax.legend(handles=[matplotlib.lines.Line2D([], [], color="tab:red", marker="o", label="Pareto front"),
                       matplotlib.lines.Line2D([], [], color="tab:blue", marker="o", linestyle="", label="other")],
              fontsize=FONT, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=2, frameon=False)
    return fig, [" = ".join(s["label"] for s in same) for (_, _, same), f in zip(points, on_front) if f]
