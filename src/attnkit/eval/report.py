"""``attnkit report DIR``: one self-contained HTML page and its PNG plots, from ``DIR/results.jsonl`` alone.

What it shows, per (recipe, budget) -- a *column* such as ``snapkv@0.25`` -- against ``full`` on the
same model, task and length:

- "Which method should I use?": per column, the mean score relative to full, the median prefill and
  decode speed-ups and KV-memory ratios, whether it is on the Pareto front of score vs decode speed,
  and the picks (fastest decoding / least KV memory keeping at least 95 % and 90 % of full's score);
- the score table of ``attnkit eval`` (tasks x lengths x columns);
- plots: score vs KV budget per method for each task (where a recipe has no budget, its measured KV
  bytes relative to full stand in), a needle heatmap (depth x length) per column for each needle
  task, speed and memory bars relative to full, and score vs decode speed with the Pareto front.

The PNGs are written beside the page (``DIR/report/``) and embedded in it as base64, so the page is
one file. ``summary.csv`` / ``summary.json`` hold the summary table. Rows of an older results schema
are read (missing fields count as absent); a newer schema is refused (:func:`attnkit.eval.harness.read_results`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.harness import format_table, latest_rows, mean_present, read_results
from attnkit.eval.tasks import NEEDLE_TASKS

REPORT_FILE = "report.html"
PLOT_DIR = "report"
KEEP_LEVELS = (0.95, 0.9)


# --------------------------------------------------------------------------------------------------
# numbers


def _label(row: dict, many_models: bool) -> str:
    label = str(row.get("method_spec") or row.get("recipe_name") or row.get("method") or "?")
    return f"{row.get('model')} {label}" if many_models else label


def _is_full(row: dict) -> bool:
    return row.get("method") == "full" and not row.get("method_params") and row.get("budget") is None and \
        str(row.get("recipe_name") or row.get("method_spec")) == "full"


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _median(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def enrich(rows: list[dict]) -> tuple[list[dict], dict]:
    """Rows with a ``label`` and ratios to the full row of the same (model, task, length); and the
    full rows by that key."""
    many = len({r.get("model") for r in rows}) > 1
    full = {}
    for r in rows:
        if _is_full(r):
            full.setdefault((r.get("model"), r.get("task"), r.get("length")), r)
    out = []
    for r in rows:
        r = dict(r, label=_label(r, many))
        f = full.get((r.get("model"), r.get("task"), r.get("length")))
        if f is not None:
            r["prefill_speedup"] = _ratio(f.get("prefill_s"), r.get("prefill_s"))
            r["decode_speedup"] = _ratio(r.get("decode_tokens_per_s"), f.get("decode_tokens_per_s"))
            r["peak_kv_ratio"] = _ratio(r.get("peak_kv_bytes"), f.get("peak_kv_bytes"))
            r["final_kv_ratio"] = _ratio(r.get("final_kv_bytes"), f.get("final_kv_bytes"))
        out.append(r)
    return out, full


def summarize(rows: list[dict]) -> list[dict]:
    """One line per column: cells, mean score relative to full, median speed-ups and KV ratios, Pareto."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    lines = []
    for label, rs in by.items():
        lines.append({
            "label": label, "recipe": rs[0].get("recipe_name"), "budget": rs[0].get("budget"), "cells": len(rs),
            "score_rel_full": mean_present([r.get("score_rel_full") for r in rs]),
            "prefill_speedup": _median([r.get("prefill_speedup") for r in rs]),
            "decode_speedup": _median([r.get("decode_speedup") for r in rs]),
            "peak_kv_ratio": _median([r.get("peak_kv_ratio") for r in rs]),
            "final_kv_ratio": _median([r.get("final_kv_ratio") for r in rs]),
            "decode_tokens_per_s": _median([r.get("decode_tokens_per_s") for r in rs]),
        })
    points = [(s["decode_speedup"], s["score_rel_full"]) for s in lines]
    for s, (x, y) in zip(lines, points):
        s["pareto"] = x is not None and y is not None and not any(
            ox is not None and oy is not None and ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)
    lines.sort(key=lambda s: (-(s["score_rel_full"] if s["score_rel_full"] is not None else -1), s["label"]))
    return lines


def picks(summary: list[dict]) -> list[str]:
    """Sentences naming the fastest and the leanest columns that keep most of full's score."""
    out = []
    for keep in KEEP_LEVELS:
        ok = [s for s in summary if s["score_rel_full"] is not None and s["score_rel_full"] >= keep
              and s["label"] != "full"]
        fast = [s for s in ok if s["decode_speedup"] is not None]
        lean = [s for s in ok if s["final_kv_ratio"] is not None]
        if fast:
            best = max(fast, key=lambda s: s["decode_speedup"])
            out.append(f"Fastest decoding keeping >= {keep:.0%} of full's score: {best['label']} "
                       f"({best['decode_speedup']:.2f}x full's decode speed, {best['score_rel_full']:.2f}x its score)")
        if lean:
            best = min(lean, key=lambda s: s["final_kv_ratio"])
            out.append(f"Least KV memory keeping >= {keep:.0%} of full's score: {best['label']} "
                       f"({best['final_kv_ratio']:.2f}x full's final KV bytes, {best['score_rel_full']:.2f}x its score)")
        if not ok:
            out.append(f"No method other than full keeps >= {keep:.0%} of full's score in these results.")
    return out


# --------------------------------------------------------------------------------------------------
# plots


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _x_budget(r: dict):
    b = r.get("budget")
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        if isinstance(b, float) and b <= 1:
            return b
        return b / r["length"] if r.get("length") else None
    return r.get("final_kv_ratio")


def plot_score_vs_budget(rows: list[dict], task: str) -> bytes | None:
    rs = [r for r in rows if r.get("task") == task and r.get("score") is not None]
    if not rs:
        return None
    plt = _plt()
    lengths = sorted({r["length"] for r in rs})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths), 3.6), squeeze=False,
                             layout="constrained")
    for ax, length in zip(axes[0], lengths):
        cell = [r for r in rs if r["length"] == length]
        series: dict[str, list] = defaultdict(list)
        for r in cell:
            if _is_full(r):
                ax.axhline(r["score"], color="black", linestyle="--", linewidth=1, label="full")
                continue
            x = _x_budget(r)
            if x is not None:
                series[str(r.get("recipe_name") or r["label"])].append((x, r["score"]))
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
    plt = _plt()
    import numpy as np

    labels = list(dict.fromkeys(r["label"] for r in rs))
    lengths = sorted({r["length"] for r in rs})
    bins = _depth_bins([d for r in rs for d in r["depths"] if d is not None])
    ncols = min(4, len(labels))
    nrows = math.ceil(len(labels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols + 1, 3.0 * nrows + 0.6), squeeze=False,
                             layout="constrained")
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
    plt = _plt()
    keys = [("prefill_speedup", "prefill speed-up"), ("decode_speedup", "decode speed-up"),
            ("peak_kv_ratio", "peak KV / full"), ("final_kv_ratio", "final KV / full")]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(lines) + 2), 4.0))
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
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
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


# --------------------------------------------------------------------------------------------------
# the page


def _fmt(v, kind: str = "ratio") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "ratio":
        return f"{v:.2f}x"
    if kind == "num":
        return f"{v:.1f}"
    return html.escape(str(v))


def _summary_table(summary: list[dict]) -> str:
    head = ("<tr><th>method@budget</th><th>cells</th><th>score / full</th><th>prefill speed-up</th>"
            "<th>decode speed-up</th><th>decode tok/s</th><th>peak KV / full</th><th>final KV / full</th>"
            "<th>Pareto</th></tr>")
    body = "".join(
        f"<tr><td>{html.escape(s['label'])}</td><td>{s['cells']}</td><td>{_fmt(s['score_rel_full'])}</td>"
        f"<td>{_fmt(s['prefill_speedup'])}</td><td>{_fmt(s['decode_speedup'])}</td>"
        f"<td>{_fmt(s['decode_tokens_per_s'], 'num')}</td><td>{_fmt(s['peak_kv_ratio'])}</td>"
        f"<td>{_fmt(s['final_kv_ratio'])}</td><td>{'&#9733;' if s['pareto'] else ''}</td></tr>"
        for s in summary)
    return f"<table>{head}{body}</table>"


def _provenance(rows: list[dict]) -> str:
    models = sorted({str(r.get("model")) for r in rows})
    commits = sorted({str(r.get("git_commit"))[:12] for r in rows if r.get("git_commit")})
    versions = sorted({json.dumps(r.get("versions"), sort_keys=True) for r in rows if r.get("versions")})
    stamps = sorted(str(r.get("timestamp")) for r in rows if r.get("timestamp"))
    parts = [f"model: {', '.join(models)}", f"{len(rows)} cells"]
    if stamps:
        parts.append(f"run {stamps[0]} .. {stamps[-1]}")
    if commits:
        parts.append(f"git {', '.join(commits)}")
    for v in versions:
        parts.append(", ".join(f"{k} {x}" for k, x in json.loads(v).items()))
    return " &middot; ".join(html.escape(p) for p in parts)


CSS = """body{font-family:sans-serif;margin:24px;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f2f2f2}pre{background:#f8f8f8;padding:8px;overflow:auto}
img{max-width:100%;border:1px solid #eee;margin:6px 0}.note{color:#555;font-size:90%}"""


def write_report(results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML page (default ``DIR/report.html``), its PNGs (``DIR/report/``) and
    ``DIR/summary.csv`` / ``summary.json`` from ``DIR/results.jsonl``; returns the page's path."""
    results_dir = Path(results_dir)
    rows = latest_rows(read_results(results_dir))
    if not rows:
        raise AttnkitError(f"{results_dir}: the results file holds no rows")
    base = results_dir if results_dir.is_dir() else results_dir.parent
    page = Path(out) if out is not None else base / REPORT_FILE
    page.parent.mkdir(parents=True, exist_ok=True)
    plot_dir = page.parent / PLOT_DIR
    plot_dir.mkdir(exist_ok=True)
    rows, _ = enrich(rows)
    summary = summarize(rows)
    tasks = list(dict.fromkeys(r.get("task") for r in rows))

    figures: list[tuple[str, str, bytes]] = []  # (section, file name, png)
    for task in tasks:
        png = plot_score_vs_budget(rows, task)
        if png:
            figures.append(("Score vs KV budget", f"score_vs_budget_{_safe(task)}.png", png))
    for task in tasks:
        if task in NEEDLE_TASKS:
            png = plot_needle_heatmap(rows, task)
            if png:
                figures.append(("Needle heatmaps", f"needle_{_safe(task)}.png", png))
    for section, name, fn in (("Speed and memory", "speed_memory.png", plot_speed_memory),
                              ("Score vs decode speed", "pareto.png", plot_pareto)):
        png = fn(summary)
        if png:
            figures.append((section, name, png))
    for _, name, png in figures:
        (plot_dir / name).write_bytes(png)

    fields = ["label", "recipe", "budget", "cells", "score_rel_full", "prefill_speedup", "decode_speedup",
              "decode_tokens_per_s", "peak_kv_ratio", "final_kv_ratio", "pareto"]
    with open(page.parent / "summary.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(summary)
    (page.parent / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>attnkit report: {html.escape(str(base))}"
             f"</title><style>{CSS}</style></head><body>",
             "<h1>attnkit report</h1>", f"<p class='note'>{_provenance(rows)}</p>",
             "<h2>Which method should I use?</h2><ul>",
             "".join(f"<li>{html.escape(p)}</li>" for p in picks(summary)), "</ul>", _summary_table(summary),
             "<p class='note'>score / full: mean over the method's cells of its score relative to full on the same "
             "task and length (below 1 is worse; for perplexity, full's bits per byte over the method's). Speed-ups "
             "and KV ratios: medians over cells, against full on the same cell (above 1 is faster; below 1 is less "
             "memory). Pareto &#9733;: no other column is both faster and better.</p>",
             "<h2>Scores</h2>", f"<pre>{html.escape(format_table(rows))}</pre>"]
    section = None
    for sec, name, png in figures:
        if sec != section:
            parts.append(f"<h2>{html.escape(sec)}</h2>")
            section = sec
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<div><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'></div>")
    parts.append("</body></html>")
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
