"""The report's score tables (:mod:`attnkit.eval.report.page`): per protocol, a row per report column (recipe@budget) in
the summary table's order and a column per (task, length), so 40 recipes make 40 rows, not a table 40 cells wide.
Tasks are split over several tables of at most :data:`MOST_COLUMNS` score columns, each task's lengths kept
together, so no table scrolls sideways.

Every cell is the score with its sample count and 95 % interval and the ratio to full on the same samples, greyed
when the paired difference from full is inside the noise (:func:`attnkit.eval.stats.significance.versus_full`); where
full scored 0 the cell says that it has no ratio. Rows are those :func:`attnkit.eval.report.summary.enrich` returns.
"""

from __future__ import annotations

import html
import math

from attnkit.eval.stats.significance import full_index, is_reference, reference_key, versus_full

MOST_COLUMNS = 6


def _value(v: float, higher: bool) -> str:
    return f"{100 * v:.1f}%" if higher else f"{v:.3f}"


def score_cell(row: dict, full: dict | None) -> str:
    """One ``<td>``: score and ratio to full, then interval and n; class ``same`` when the difference from full does
    not hold, ``ref`` for full itself."""
    score = row.get("score")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "<td>n/a</td>"
    higher = row.get("higher_is_better", True)
    text = _value(score, higher)
    notes = []
    interval = row.get("score_interval")
    if interval:
        lo, hi = (f"{100 * v:.0f}" for v in interval) if higher else (f"{v:.2f}" for v in interval)
        notes.append(f"[{lo}-{hi}]")
    notes.append(f"n={len(row.get('scores') or [])}")
    if row.get("method_seeds"):
        notes.append(f"{len(row['method_seeds'])} seeds")
    if is_reference(row):
        return f"<td class=ref>{text}<br><span class=ci>{' '.join(notes)}</span></td>"
    rel = row.get("score_rel_full")
    if rel is not None:
        text += f" ({rel:.2f}x)"
    elif full is not None and full.get("score") == 0:
        text += " <span class=noratio>(no ratio: full 0)</span>"
    diff = versus_full(row, full)
    same = diff is not None and not diff["holds"]
    title = "" if diff is None else (f" title='difference from full {diff['diff']:+.3f}, 95 % interval "
                                     f"[{diff['low']:+.3f}, {diff['high']:+.3f}]'")
    return f"<td{' class=same' if same else ''}{title}>{text}<br><span class=ci>{' '.join(notes)}</span></td>"


def _column_groups(keys: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """(task, length) keys cut into tables of at most :data:`MOST_COLUMNS`, a task's lengths together where they
    fit in one table."""
    tasks: dict[str, list] = {}
    for key in keys:
        tasks.setdefault(key[0], []).append(key)
    groups: list[list] = [[]]
    for cols in tasks.values():
        if groups[-1] and len(groups[-1]) + len(cols) > MOST_COLUMNS:
            groups.append([])
        for key in cols:
            if len(groups[-1]) == MOST_COLUMNS:
                groups.append([])
            groups[-1].append(key)
    return groups


def _table(names: list[str], cells: dict, columns: list[tuple[str, str]], caption: str) -> str:
    tasks: dict[str, int] = {}
    for task, _ in columns:
        tasks[task] = tasks.get(task, 0) + 1
    top = "".join(f"<th scope=colgroup colspan={n}>{html.escape(t)}</th>" for t, n in tasks.items())
    sub = "".join(f"<th scope=col>{html.escape(length)} tokens</th>" for _, length in columns)
    body = "".join(f"<tr><th scope=row>{html.escape(name)}</th>"
                   f"{''.join(cells.get((name, c), '<td>-</td>') for c in columns)}</tr>" for name in names)
    return (f"<div class=wide><table class=scores><caption>{html.escape(caption)}</caption><thead><tr>"
            f"<th scope=col rowspan=2>method@budget</th>{top}</tr><tr>{sub}</tr></thead><tbody>{body}</tbody>"
            f"</table></div>")


def score_tables(rows: list[dict], order: list[str] | None = None) -> str:
    """Every protocol's tables, rows in `order` (the summary's labels; else as they come), and a note on reading
    them."""
    fulls = full_index(rows)
    protocols = list(dict.fromkeys(r.get("protocol") or "query-aware" for r in rows))
    many_models = len({r.get("model") for r in rows}) > 1
    place = {label: i for i, label in enumerate(order or [])}
    parts = []
    for protocol in protocols:
        rs = [r for r in rows if (r.get("protocol") or "query-aware") == protocol]
        rs.sort(key=lambda r: place.get(r.get("label"), len(place)))
        names, cells, columns = [], {}, []
        for r in rs:
            name = (f"{r.get('model')} " if many_models else "") + str(r.get("method_spec") or r.get("method") or "?")
            column = (str(r.get("task")), str(r.get("length")))
            names += [name] if name not in names else []
            columns += [column] if column not in columns else []
            cells[(name, column)] = score_cell(r, fulls.get(reference_key(r)))
        groups = _column_groups(columns)
        if len(protocols) > 1:
            parts.append(f"<h3>{html.escape(protocol)}</h3>")
        for k, group in enumerate(groups, start=1):
            caption = (f"{protocol}: " if len(protocols) > 1 else "") + "scores" + (
                f", table {k} of {len(groups)} ({', '.join(dict.fromkeys(t for t, _ in group))})" if len(groups) > 1
                else "")
            parts.append(_table(names, cells, group, caption))
    parts.append("<p class='note'>A row per method@budget (in the summary table's order), a column per task and "
                 "prompt length. Scores: % (higher is better), or bits per byte for perplexity and continuation (lower is "
                 "better); (x): "
                 "relative to full on the same samples; [a-b] n=: the 95 % interval over n samples (Wilson for "
                 "accuracies, bootstrap otherwise; several questions about one context are not independent, so their "
                 "intervals are somewhat too narrow). Grey: the difference from full is inside the noise (the paired "
                 "bootstrap interval of the per-sample differences holds 0). No ratio: full scored 0 on that cell, so "
                 "the cell has no score / full and counts in no mean of score / full. A stochastic method's cell is "
                 "the mean over its seeds.</p>")
    return "\n".join(parts)
