"""The report's score tables (:mod:`attnkit.eval.report`): one HTML table per protocol, a line per (task, length),
a column per recipe; every cell is the score with its sample count and 95 % interval and the ratio to full on the
same samples, greyed when the paired difference from full is inside the noise
(:func:`attnkit.eval.significance.versus_full`). Rows are those :func:`attnkit.eval.report.enrich` returns.
"""

from __future__ import annotations

import html
import math

from attnkit.eval.significance import full_index, is_reference, reference_key, versus_full


def _value(v: float, higher: bool) -> str:
    return f"{100 * v:.1f}%" if higher else f"{v:.3f}"


def score_cell(row: dict, full: dict | None) -> str:
    """One ``<td>``: score, interval, n, ratio to full; class ``same`` when the difference from full does not
    hold, ``ref`` for full itself."""
    score = row.get("score")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "<td>n/a</td>"
    higher = row.get("higher_is_better", True)
    text = _value(score, higher)
    interval = row.get("score_interval")
    if interval:
        lo, hi = (f"{100 * v:.0f}" for v in interval) if higher else (f"{v:.2f}" for v in interval)
        text += f" <span class=ci>[{lo}-{hi}] n={len(row.get('scores') or [])}</span>"
    if row.get("method_seeds"):
        text += f" <span class=ci>{len(row['method_seeds'])} seeds</span>"
    if is_reference(row):
        return f"<td class=ref>{text}</td>"
    rel = row.get("score_rel_full")
    diff = versus_full(row, full)
    if rel is not None:
        text += f" ({rel:.2f}x)"
    same = diff is not None and not diff["holds"]
    title = "" if diff is None else (f" title='difference from full {diff['diff']:+.3f}, 95 % interval "
                                     f"[{diff['low']:+.3f}, {diff['high']:+.3f}]'")
    return f"<td{' class=same' if same else ''}{title}>{text}</td>"


def score_tables(rows: list[dict]) -> str:
    """Every protocol's table, headed by the protocol when several ran, and a note on reading them."""
    fulls = full_index(rows)
    protocols = list(dict.fromkeys(r.get("protocol") or "query-aware" for r in rows))
    parts = []
    for protocol in protocols:
        rs = [r for r in rows if (r.get("protocol") or "query-aware") == protocol]
        columns = list(dict.fromkeys(str(r.get("method_spec") or r.get("method") or "?") for r in rs))
        lines: dict[tuple, dict[str, str]] = {}
        for r in rs:
            key = (str(r.get("model")), str(r.get("task")), str(r.get("length")))
            spec = str(r.get("method_spec") or r.get("method") or "?")
            lines.setdefault(key, {})[spec] = score_cell(r, fulls.get(reference_key(r)))
        many_models = len({k[0] for k in lines}) > 1
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = "".join(
            f"<tr><td>{html.escape((key[0] + ' ') if many_models else '')}{html.escape(key[1])}</td>"
            f"<td>{html.escape(key[2])}</td>{''.join(cells.get(c, '<td>-</td>') for c in columns)}</tr>"
            for key, cells in lines.items())
        if len(protocols) > 1:
            parts.append(f"<h3>{html.escape(protocol)}</h3>")
        parts.append(f"<table class=scores><tr><th>task</th><th>length</th>{head}</tr>{body}</table>")
    parts.append("<p class='note'>Scores: % (higher is better), or bits per byte for perplexity (lower is better); "
                 "[a-b] n=: the 95 % interval over n samples (Wilson for accuracies, bootstrap otherwise; several "
                 "questions about one context are not independent, so their intervals are somewhat too narrow); (x): "
                 "relative to full on the same samples. Grey: the difference from full is inside the noise (the "
                 "paired bootstrap interval of the per-sample differences holds 0). A stochastic method's cell is "
                 "the mean over its seeds.</p>")
    return "\n".join(parts)
