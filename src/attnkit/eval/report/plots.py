"""The report's plots (:mod:`attnkit.eval.report.page`), as :class:`attnkit.eval.report.plot_style.Plot` images in page order.

Score vs KV budget per task (:mod:`attnkit.eval.report.plot_budget`), needle heatmaps per needle task
(:mod:`attnkit.eval.report.plot_needle`), speed and memory against full and score vs decode speed with the Pareto front
(:mod:`attnkit.eval.report.plot_summary`), and (from ``benchmarks/bench_batch.py``) sequences and tokens/s under a KV
memory cap. Every figure keeps its text readable at any number of recipes (:mod:`attnkit.eval.report.plot_style`). The
figures are drawn on :class:`matplotlib.figure.Figure` objects directly (no pyplot), so plotting neither switches
the process's matplotlib backend nor keeps figures alive.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from attnkit.eval.data.task_registry import NEEDLE_TASKS
from attnkit.eval.report.plot_budget import plot_score_vs_budget
from attnkit.eval.report.plot_needle import plot_needle_heatmap
from attnkit.eval.report.plot_style import FONT, TITLE, Plot
from attnkit.eval.report.plot_summary import plot_pareto, plot_speed_memory

__all__ = ["Plot", "figures", "plot_capacity"]


def plot_capacity(rows: list[dict]) -> Plot | None:
    """Under one KV memory cap (:mod:`attnkit.bench.capacity` rows): sequences that fit and the batch's
    decoding tokens/s per method, side by side."""
    rows = [r for r in rows if r.get("sequences") is not None]
    if not rows:
        return None
    fig = Figure(figsize=(min(13.0, 1.1 * len(rows) + 3), 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = [r["spec"] for r in rows]
    for ax, key, name in ((left, "sequences", "sequences that fit"), (right, "tokens_per_s", "decode tokens/s")):
        ax.bar(range(len(rows)), [r[key] or 0 for r in rows], color=["tab:gray"] + ["tab:blue"] * (len(rows) - 1))
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=FONT)
        ax.tick_params(labelsize=FONT)
        ax.set_title(name, fontsize=TITLE)
        ax.grid(axis="y", alpha=0.3)
    cap = rows[0].get("kv_cap_bytes")
    where = f"a KV cache of {cap / 2**20:.0f} MiB, {rows[0].get('length')}-token prompts" if cap else "a KV cap"
    fig.suptitle(where, fontsize=TITLE + 1)
    alt = (f"Bar charts under {where}: the sequences that fit and the tokens per second their batch decodes, for "
           f"{', '.join(labels)} (full in grey).")
    return Plot("Batches under a KV memory cap", "capacity.png", alt, fig)


def figures(rows: list[dict], summary: list[dict]) -> list[Plot]:
    """Every plot the rows allow, in page order; columns in the summary table's order wherever a plot lists them."""
    tasks = list(dict.fromkeys(r.get("task") for r in rows))
    order = [s["label"] for s in summary]
    out: list[Plot] = []
    for task in tasks:
        out += plot_score_vs_budget(rows, task)
    for task in tasks:
        if task in NEEDLE_TASKS:
            out += plot_needle_heatmap(rows, task, order)
    protocols = list(dict.fromkeys(r.get("protocol") or "query-aware" for r in rows))
    return out + plot_speed_memory(summary) + plot_pareto(summary, protocols)
