"""``attnkit report DIR``: one self-contained HTML page and its PNG plots, from ``DIR/results.jsonl`` alone.

What it shows, per (recipe, budget) -- a *column* such as ``snapkv@0.25``, and its protocol when several ran
(``snapkv@0.25 · query-agnostic``) -- against ``full`` on the same model, task, length and protocol:

- "Which method should I use?": per column, the mean score relative to full with its 95 % interval and
  its rank (columns whose intervals overlap share a rank: :mod:`attnkit.eval.significance`), the median
  prefill and decode speed-ups and KV-memory ratios, whether it is on the Pareto front of score vs decode
  speed, and the picks per protocol (fastest decoding / least KV memory *shown* to keep at least 95 % and
  90 % of full's score: the interval's lower end at or above the level);
- the score tables (one per protocol): every score with its sample count and 95 % interval, greyed where its
  difference from full is inside the noise (:mod:`attnkit.eval.score_table`);
- plots: score vs KV budget per method for each task (where a recipe has no budget, its measured KV
  bytes relative to full stand in), a needle heatmap (depth x length) per column for each needle
  task, speed and memory bars relative to full, and score vs decode speed with the Pareto front.

The PNGs are written beside the page (``DIR/report/``) and embedded in it as base64, so the page is
one file. ``summary.csv`` / ``summary.json`` hold the summary table. Rows of an older results schema
are read (missing fields count as absent); a newer schema is refused (:func:`attnkit.eval.results.read_results`).
The plots are drawn by :mod:`attnkit.eval.plots`.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.cells import mean_present
from attnkit.eval.plots import figures, plot_capacity
from attnkit.eval.results import latest_rows, read_results
from attnkit.eval.score_table import score_tables
from attnkit.eval.seed_rows import merge_seeds
from attnkit.eval.significance import column_interval, full_index, is_reference, picks, rank, reference_key

REPORT_FILE = "report.html"
CAPACITY_FILE = "capacity.json"  # benchmarks/bench_batch.py's rows, shown when present
PLOT_DIR = "report"


# --------------------------------------------------------------------------------------------------
# numbers


def _label(row: dict, many_models: bool, many_protocols: bool) -> str:
    label = str(row.get("method_spec") or row.get("recipe_name") or row.get("method") or "?")
    label = f"{row.get('model')} {label}" if many_models else label
    return f"{label} · {row.get('protocol') or 'query-aware'}" if many_protocols else label


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _median(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def enrich(rows: list[dict]) -> tuple[list[dict], dict]:
    """Rows (a stochastic method's seeds merged) with a ``label`` and ratios to the full row of the same
    (model, task, length, protocol, questions); and the full rows by that key."""
    rows = merge_seeds(rows)
    many = len({r.get("model") for r in rows}) > 1
    many_protocols = len({r.get("protocol") or "query-aware" for r in rows}) > 1
    full = full_index(rows)
    out = []
    for r in rows:
        r = dict(r, label=_label(r, many, many_protocols))
        f = full.get(reference_key(r))
        if f is not None:
            r["prefill_speedup"] = _ratio(f.get("prefill_s"), r.get("prefill_s"))
            r["decode_speedup"] = _ratio(r.get("decode_tokens_per_s"), f.get("decode_tokens_per_s"))
            r["peak_kv_ratio"] = _ratio(r.get("peak_kv_bytes"), f.get("peak_kv_bytes"))
            r["final_kv_ratio"] = _ratio(r.get("final_kv_bytes"), f.get("final_kv_bytes"))
        out.append(r)
    return out, full


def summarize(rows: list[dict]) -> list[dict]:
    """One line per column: cells, samples, mean score relative to full with its 95 % interval and rank, median
    speed-ups and KV ratios, Pareto."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    fulls = full_index(rows)
    lines = []
    for label, rs in by.items():
        interval = column_interval(rs, fulls)
        lines.append({
            "label": label, "recipe": rs[0].get("recipe_name"), "budget": rs[0].get("budget"), "cells": len(rs),
            "protocol": rs[0].get("protocol") or "query-aware", "is_full": is_reference(rs[0]),
            "samples": sum(r.get("samples") or 0 for r in rs),
            "score_rel_full": mean_present([r.get("score_rel_full") for r in rs]),
            "rel_low": None if interval is None else interval[0], "rel_high": None if interval is None else interval[1],
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
    rank(lines)
    lines.sort(key=lambda s: (-(s["score_rel_full"] if s["score_rel_full"] is not None else -1), s["label"]))
    return lines


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


def _rank(s: dict) -> str:
    if s.get("rank") is None or s.get("is_full"):
        return "-"
    return f"{'=' if s.get('tied') else ''}{s['rank']}"


def _rel_cell(s: dict) -> str:
    """score / full with its interval, greyed when the interval holds 1 (not distinguishable from full)."""
    text = _fmt(s["score_rel_full"])
    if s.get("rel_low") is None or s.get("is_full"):
        return f"<td>{text}</td>"
    same = s["rel_low"] <= 1.0 <= s["rel_high"]
    return (f"<td{' class=same' if same else ''}>{text} <span class=ci>[{s['rel_low']:.2f}-{s['rel_high']:.2f}]"
            f"</span></td>")


def _summary_table(summary: list[dict]) -> str:
    head = ("<tr><th>method@budget</th><th>rank</th><th>cells</th><th>samples</th><th>score / full [95 %]</th>"
            "<th>prefill speed-up</th><th>decode speed-up</th><th>decode tok/s</th><th>peak KV / full</th>"
            "<th>final KV / full</th><th>Pareto</th></tr>")
    body = "".join(
        f"<tr><td>{html.escape(s['label'])}</td><td>{_rank(s)}</td><td>{s['cells']}</td><td>{s['samples']}</td>"
        f"{_rel_cell(s)}<td>{_fmt(s['prefill_speedup'])}</td><td>{_fmt(s['decode_speedup'])}</td>"
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
img{max-width:100%;border:1px solid #eee;margin:6px 0}.note{color:#555;font-size:90%}
.same{color:#aaa}.ci{color:#777;font-size:85%}.same .ci{color:#bbb}"""


def _capacity_section(base: Path, plot_dir: Path) -> list[str]:
    """The batch benchmark's table and plot under a KV memory cap, when ``DIR/capacity.json`` exists
    (``benchmarks/bench_batch.py --out DIR``)."""
    path = base / CAPACITY_FILE
    if not path.is_file():
        return []
    rows = json.loads(path.read_text(encoding="utf-8")).get("capacity") or []
    if not rows:
        return []
    head = ("<tr><th>method</th><th>KV bytes / sequence</th><th>sequences</th><th>vs full</th>"
            "<th>decode tokens/s</th><th>vs full</th></tr>")
    body = "".join(f"<tr><td>{html.escape(r['spec'])}</td><td>{r['kv_bytes_per_sequence']}</td>"
                   f"<td>{r['sequences']}</td><td>{_fmt(r.get('sequences_vs_full'))}</td>"
                   f"<td>{r['tokens_per_s']:.1f}</td><td>{_fmt(r.get('tokens_per_s_vs_full'))}</td></tr>" for r in rows)
    out = [f"<h2>Batches under a KV memory cap of {rows[0]['kv_cap_bytes'] / 2**20:.1f} MiB</h2>",
           f"<table>{head}{body}</table>",
           "<p class='note'>sequences of the same prompt length that fit in the cap (from one sequence's measured "
           "peak KV bytes) and the tokens per second that batch decodes, medians over repeats, methods "
           "interleaved (benchmarks/bench_batch.py).</p>"]
    png = plot_capacity(rows)
    if png:
        (plot_dir / "capacity.png").write_bytes(png)
        out.append(f"<div><img alt='sequences and tokens per second under the KV cap' "
                   f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'></div>")
    return out


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
    plots = figures(rows, summary)  # (section, file name, png)
    for _, name, png in plots:
        (plot_dir / name).write_bytes(png)

    fields = ["label", "recipe", "budget", "cells", "score_rel_full", "prefill_speedup", "decode_speedup",
              "decode_tokens_per_s", "peak_kv_ratio", "final_kv_ratio", "pareto", "protocol", "samples", "rel_low",
              "rel_high", "rank"]
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
             "task, length and protocol (below 1 is worse; for perplexity, full's bits per byte over the method's), "
             "with its 95 % bootstrap interval (every cell's samples resampled; grey: the interval holds 1, the "
             "method is not distinguishable from full). rank: 1 + the columns whose interval lies wholly above this "
             "one's (=: shared). The picks above count a method only where the interval's lower end reaches the "
             "level. Speed-ups and KV ratios: medians over cells, against full on the same cell (above 1 is faster; "
             "below 1 is less memory). Pareto &#9733;: no other column is both faster and better.</p>",
             "<h2>Scores</h2>", score_tables(rows)]
    parts += _capacity_section(base, plot_dir)
    section = None
    for sec, name, png in plots:
        if sec != section:
            parts.append(f"<h2>{html.escape(sec)}</h2>")
            section = sec
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<div><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'></div>")
    parts.append("</body></html>")
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
