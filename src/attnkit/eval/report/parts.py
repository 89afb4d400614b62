"""The HTML pieces of the report page (:mod:`attnkit.eval.report.page`): the summary table, the provenance line, the
figures with their text alternatives and captions, the batch benchmark's section, and the style sheet.

Tables are HTML tables (header cells scoped for screen readers), and the page itself never scrolls sideways: a
table too wide for a narrow window scrolls inside its own box.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from attnkit.eval.report.plot_style import Plot
from attnkit.eval.report.plots import plot_capacity

CAPACITY_FILE = "capacity.json"  # benchmarks/bench_batch.py's rows, shown when present

CSS = """body{font-family:sans-serif;margin:24px;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child,tbody th{text-align:left}th{background:#f2f2f2}thead th{text-align:center}
caption{text-align:left;color:#555;padding:2px 0}.wide{max-width:100%;overflow-x:auto}
table.scores td{white-space:nowrap;font-size:95%}figure{margin:12px 0 20px}
img{max-width:100%;border:1px solid #eee}figcaption,.note{color:#555;font-size:90%}
.same{color:#aaa}.ci{color:#777;font-size:85%}.same .ci{color:#bbb}.noratio{color:#a60}"""


def fmt(v, kind: str = "ratio") -> str:
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
    """score / full with its interval, greyed when the interval holds 1 (not distinguishable from full), and the
    share of the column's cells it is a mean over when full scored 0 on some."""
    text = fmt(s["score_rel_full"])
    partial = ""
    if s.get("no_ratio") and not s.get("is_full"):
        partial = (f" <span class=noratio title='no ratio where full scored 0: {html.escape(', '.join(s['no_ratio']))}'>"
                   f"over {s['ratio_cells']} of {s['cells']} cells</span>")
    if s.get("rel_low") is None or s.get("is_full"):
        return f"<td>{text}{partial}</td>"
    same = s["rel_low"] <= 1.0 <= s["rel_high"]
    return (f"<td{' class=same' if same else ''}>{text} <span class=ci>[{s['rel_low']:.2f}-{s['rel_high']:.2f}]"
            f"</span>{partial}</td>")


def summary_table(summary: list[dict]) -> str:
    head = "".join(f"<th scope=col>{h}</th>" for h in (
        "method@budget", "rank", "cells", "samples", "score / full [95 %]", "prefill speed-up", "decode speed-up",
        "decode tok/s", "peak KV / full", "final KV / full", "Pareto"))
    body = "".join(
        f"<tr><th scope=row>{html.escape(s['label'])}</th><td>{_rank(s)}</td><td>{s['cells']}</td>"
        f"<td>{s['samples']}</td>{_rel_cell(s)}<td>{fmt(s['prefill_speedup'])}</td><td>{fmt(s['decode_speedup'])}</td>"
        f"<td>{fmt(s['decode_tokens_per_s'], 'num')}</td><td>{fmt(s['peak_kv_ratio'])}</td>"
        f"<td>{fmt(s['final_kv_ratio'])}</td><td>{'&#9733;' if s['pareto'] else ''}</td></tr>"
        for s in summary)
    return f"<div class=wide><table class=summary><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def no_ratio_note(summary: list[dict]) -> str:
    """A paragraph naming the cells where full scored 0 (no score / full there), or nothing."""
    cells = sorted({(s["protocol"], c) for s in summary for c in s.get("no_ratio") or []})
    if not cells:
        return ""
    many = len({p for p, _ in cells}) > 1
    names = ", ".join(f"{c} tokens" + (f" ({p})" if many else "") for p, c in cells)
    return (f"<p class='note'><span class=noratio>Full attention scored 0 on {len(cells)} "
            f"cell{'s' if len(cells) > 1 else ''} ({names})</span>: there a method has no score relative to full, "
            f"so those cells count in no score / full above (\"over k of n cells\" says how many do). Their scores "
            f"are in the score tables below.</p>")


def provenance(rows: list[dict]) -> str:
    """Models, cells, when, and which attnkit (version, and commit where it ran from a checkout) and libraries."""
    models = sorted({str(r.get("model")) for r in rows})
    stamps = sorted(str(r.get("timestamp")) for r in rows if r.get("timestamp"))
    parts = [f"model: {', '.join(models)}", f"{len(rows)} cells"]
    if stamps:
        parts.append(f"run {stamps[0]} .. {stamps[-1]}")
    builds = sorted({(str((r.get("versions") or {}).get("attnkit", "?")), str(r.get("git_commit") or "")[:12])
                     for r in rows})
    parts.append("; ".join(f"attnkit {v}" + (f" at commit {c}" if c else " (no commit: not run from a git checkout)")
                           for v, c in builds))
    others = sorted({json.dumps({k: x for k, x in (r.get("versions") or {}).items() if k != "attnkit"}, sort_keys=True)
                     for r in rows if r.get("versions")})
    for v in others:
        parts.append(", ".join(f"{k} {x}" for k, x in json.loads(v).items()))
    return " &middot; ".join(html.escape(p) for p in parts)


def figure(plot: Plot) -> str:
    """The plot as a figure of the page: the PNG inline, its text alternative, its caption."""
    data = base64.b64encode(plot.png).decode("ascii")
    caption = f"<figcaption>{html.escape(plot.caption)}</figcaption>" if plot.caption else ""
    return (f"<figure><img alt=\"{html.escape(plot.alt)}\" data-file=\"{html.escape(plot.name)}\" "
            f"data-min-font-px=\"{plot.min_font_px:.1f}\" src='data:image/png;base64,{data}'>{caption}</figure>")


def capacity_section(base: Path, plot_dir: Path) -> list[str]:
    """The batch benchmark's table and plot under a KV memory cap, when ``DIR/capacity.json`` exists
    (``benchmarks/bench_batch.py --out DIR``)."""
    path = base / CAPACITY_FILE
    if not path.is_file():
        return []
    rows = json.loads(path.read_text(encoding="utf-8")).get("capacity") or []
    if not rows:
        return []
    head = "".join(f"<th scope=col>{h}</th>" for h in ("method", "KV bytes / sequence", "sequences", "vs full",
                                                          "decode tokens/s", "vs full"))
    body = "".join(f"<tr><th scope=row>{html.escape(r['spec'])}</th><td>{r['kv_bytes_per_sequence']}</td>"
                   f"<td>{r['sequences']}</td><td>{fmt(r.get('sequences_vs_full'))}</td>"
                   f"<td>{r['tokens_per_s']:.1f}</td><td>{fmt(r.get('tokens_per_s_vs_full'))}</td></tr>" for r in rows)
    out = [f"<h2>Batches under a KV memory cap of {rows[0]['kv_cap_bytes'] / 2**20:.1f} MiB</h2>",
           f"<div class=wide><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>",
           "<p class='note'>sequences of the same prompt length that fit in the cap (from one sequence's measured "
           "peak KV bytes) and the tokens per second that batch decodes, medians over repeats, methods "
           "interleaved (benchmarks/bench_batch.py).</p>"]
    plot = plot_capacity(rows)
    if plot:
        (plot_dir / plot.name).write_bytes(plot.png)
        out.append(figure(plot))
    return out
