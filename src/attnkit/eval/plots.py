"""The report's plots (:mod:`attnkit.eval.report`), each a PNG in bytes or None when the rows hold nothing to plot.

Score vs KV budget per method for each task (where a recipe has no budget, its measured KV bytes
relative to full stand in), a needle heatmap (depth x length) per column for each needle task, speed
and memory bars relative to full, score vs decode speed with the Pareto front, and (from
``benchmarks/bench_batch.py``) sequences and tokens/s under a KV memory cap. The figures are
drawn on :class:`matplotlib.figure.Figure` objects directly (no pyplot), so plotting neither switches
the process's matplotlib backend nor keeps figures alive.
"""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict

import numpy as np
from matplotlib.figure import Figure

from attnkit.eval.table import is_reference
from attnkit.eval.task_registry import NEEDLE_TASKS
from attnkit.validate import is_number


def is_full(row: dict) -> bool:
    """The row of plain full attention (no budget), the reference of its (model, task, length)."""
    return is_reference(row) and row.get("budget") is None


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _x_budget(r: dict):
    b = r.get("budget")
    if is_number(b):
        if isinstance(b, float) and b <= 1:
            return b
        return b / r["length"] if r.get("length") else None
    return r.get("final_kv_ratio")


def plot_score_vs_budget(rows: list[dict], task: str) -> bytes | None:
    rs = [r for r in rows if r.get("task") == task and r.get("score") is not None]
    if not rs:
        return None
    lengths = sorted({r["length"] for r in rs})
    many_protocols = len({r.get("protocol") or "query-aware" for r in rs}) > 1  # a line per recipe and protocol
    fig = Figure(figsize=(4.6 * len(lengths), 3.6), layout="constrained")
    axes = fig.subplots(1, len(lengths), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        cell = [r for r in rs if r["length"] == length]
        series: dict[str, list] = defaultdict(list)
        for r in cell:
            suffix = f" · {r.get('protocol') or 'query-aware'}" if many_protocols else ""
            if is_full(r):
                ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full" + suffix)
                continue
            x = _x_budget(r)
            if x is not None:
                series[str(r.get("recipe_name") or r["label"]) + suffix].append((x, r["score"]))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"{task}, {length} tokens")
        ax.set_xlim(0, 1.05)  # fixed axes, so panels and methods compare at a glance
        if cell[0].get("higher_is_better", True):
            ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("KV budget (fraction of the prompt)")
        ax.set_ylabel("score" if cell[0].get("higher_is_better", True) else "bits per byte (lower is better)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=min(4, len(labels)),
                   fontsize=8)
    return _png(fig)


def _depth_bins(depths: list[float]) -> list[float]:
    distinct = sorted(set(depths))
    if len(distinct) <= 10:
        return distinct
    return [(i + 0.5) / 10 for i in range(10)]


def _bin(depth: float, bins: list[float]) -> int:
    return min(range(len(bins)), key=lambda i: abs(bins[i] - depth))


def plot_needle_heatmap(rows: list[dict], task: str) -> bytes | None:
    rs = [r for r in rows if r.get("task") == task and (r.get("depths") and r.get("scores"))]
    if not rs:
        return None
    labels = list(dict.fromkeys(r["label"] for r in rs))
    lengths = sorted({r["length"] for r in rs})
    bins = _depth_bins([d for r in rs for d in r["depths"] if d is not None])
    ncols = min(4, len(labels))
    nrows = math.ceil(len(labels) / ncols)
    fig = Figure(figsize=(3.2 * ncols + 1, 3.0 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    image = None
    for ax in axes.flat[len(labels):]:
        ax.axis("off")
    for ax, label in zip(axes.flat, labels):
        grid = np.full((len(bins), len(lengths)), np.nan)
        acc: dict[tuple, list] = defaultdict(list)
        for r in rs:
            if r["label"] != label:
                continue
            for d, s in zip(r["depths"], r["scores"]):
                if d is not None and s is not None:
                    acc[(_bin(d, bins), lengths.index(r["length"]))].append(s)
        for (i, j), v in acc.items():
            grid[i, j] = sum(v) / len(v)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_title(label, fontsize=9)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(bins)), [f"{b:.2f}" for b in bins], fontsize=7)
        ax.set_xlabel("length", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="score")
    fig.suptitle(f"{task}: score by needle depth and length")
    return _png(fig)


def plot_speed_memory(summary: list[dict]) -> bytes | None:
    lines = [s for s in summary if any(s[k] is not None for k in ("prefill_speedup", "decode_speedup",
                                                                    "peak_kv_ratio", "final_kv_ratio"))]
    if not lines:
        return None
    keys = [("prefill_speedup", "prefill speed-up"), ("decode_speedup", "decode speed-up"),
            ("peak_kv_ratio", "peak KV / full"), ("final_kv_ratio", "final KV / full")]
    fig = Figure(figsize=(max(6.0, 0.9 * len(lines) + 2), 4.0))
    ax = fig.subplots()
    width = 0.8 / len(keys)
    for k, (key, name) in enumerate(keys):
        values = [s[key] if s[key] is not None else float("nan") for s in lines]
        ax.bar([i + (k - 1.5) * width for i in range(len(lines))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(lines)), [s["label"] for s in lines], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("relative to full (median over cells)")
    ax.set_title("speed and KV memory relative to full")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def plot_pareto(summary: list[dict]) -> bytes | None:
    pts = [s for s in summary if s["decode_speedup"] is not None and s["score_rel_full"] is not None]
    if not pts:
        return None
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for s in pts:
        ax.scatter(s["decode_speedup"], s["score_rel_full"], color="tab:red" if s["pareto"] else "tab:blue",
                   zorder=3)
        ax.annotate(s["label"], (s["decode_speedup"], s["score_rel_full"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    front = sorted((s["decode_speedup"], s["score_rel_full"]) for s in pts if s["pareto"])
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", linewidth=1, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("decode speed relative to full (median)")
    ax.set_ylabel("score relative to full (mean)")
    ax.set_title("score vs decode speed")
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_capacity(rows: list[dict]) -> bytes | None:
    """Under one KV memory cap (:mod:`attnkit.bench.capacity` rows): sequences that fit and the batch's
    decoding tokens/s per method, side by side."""
    rows = [r for r in rows if r.get("sequences") is not None]
    if not rows:
        return None
    fig = Figure(figsize=(max(6.0, 1.1 * len(rows) + 3), 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = [r["spec"] for r in rows]
    for ax, key, name in ((left, "sequences", "sequences that fit"), (right, "tokens_per_s", "decode tokens/s")):
        ax.bar(range(len(rows)), [r[key] or 0 for r in rows], color=["tab:gray"] + ["tab:blue"] * (len(rows) - 1))
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    cap = rows[0].get("kv_cap_bytes")
    fig.suptitle(f"a KV cache of {cap / 2**20:.0f} MiB, {rows[0].get('length')}-token prompts" if cap else "KV cap")
    return _png(fig)


def figures(rows: list[dict], summary: list[dict]) -> list[tuple[str, str, bytes]]:
    """Every plot the rows allow, as (section, file name, PNG) in page order."""
    tasks = list(dict.fromkeys(r.get("task") for r in rows))
    out: list[tuple[str, str, bytes]] = []
    for task in tasks:
        png = plot_score_vs_budget(rows, task)
        if png:
            out.append(("Score vs KV budget", f"score_vs_budget_{_safe(task)}.png", png))
    for task in tasks:
        if task in NEEDLE_TASKS:
            png = plot_needle_heatmap(rows, task)
            if png:
                out.append(("Needle heatmaps", f"needle_{_safe(task)}.png", png))
    for section, name, fn in (("Speed and memory", "speed_memory.png", plot_speed_memory),
                              ("Score vs decode speed", "pareto.png", plot_pareto)):
        png = fn(summary)
        if png:
            out.append((section, name, png))
    return out
