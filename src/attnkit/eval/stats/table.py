"""The plain-text score table of ``attnkit eval``: one line per (task, length[, protocol]), one column per recipe.

Each cell is the score with its 95 % interval (Wilson for accuracies, a bootstrap otherwise:
:mod:`attnkit.eval.stats.intervals`) and its ratio to full; ``~`` after the ratio marks a difference from full that
does not hold (the paired interval of the per-sample differences contains 0). A stochastic method's seeds are
merged into one cell (:mod:`attnkit.eval.stats.seed_rows`).
"""

from __future__ import annotations

import math

from attnkit.eval.stats.seed_rows import merge_seeds
from attnkit.eval.stats.significance import full_index, is_reference, reference_key, versus_full
from attnkit.recipe import format_budget

__all__ = ["column_label", "is_reference", "format_cell", "format_table"]


def column_label(recipe_name: str, budget) -> str:
    """How a (recipe, budget) is named in tables and plots: ``snapkv@0.25``, or the recipe's name."""
    return recipe_name if budget is None else f"{recipe_name}@{format_budget(budget)}"


def _value(score, higher: bool) -> str:
    return f"{100 * score:.1f}" if higher else f"{score:.3f}"


def format_cell(row: dict, full: dict | None = None) -> str:
    """A row's score (percent, or bits per byte where lower is better: perplexity, continuation) with its 95 %
    interval and its ratio to full, e.g. ``25.0% [8-52] (0.50x)``; ``~`` after the ratio when the difference from `full` does not hold."""
    score = row.get("score")
    higher = row.get("higher_is_better", True)
    if score is None or (isinstance(score, float) and math.isnan(score)):
        return "n/a"
    text = f"{_value(score, higher)}{'%' if higher else ''}"
    interval = row.get("score_interval")
    if interval:
        lo, hi = (f"{100 * v:.0f}" for v in interval) if higher else (f"{v:.2f}" for v in interval)
        text += f" [{lo}-{hi}]"
    rel = row.get("score_rel_full")
    if rel is not None and not is_reference(row):
        diff = versus_full(row, full)
        text += f" ({rel:.2f}x{'~' if diff is not None and not diff['holds'] else ''})"
    return text


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per (task, length), and protocol when several ran; one column per method spec.

    Scores are percent for tasks where higher is better, bits per byte (3 decimals) for the lower-is-better ones
    (``perplexity``, ``continuation``: the rows' ``higher_is_better``), each with its
    95 % interval in brackets; ``(0.96x)`` is the score relative to full (below 1 is worse than full for every
    task), ``~`` marks a ratio whose difference from full is inside the noise.
    """
    if not rows:
        return "(no results)"
    rows = merge_seeds(rows)
    fulls = full_index(rows)
    protocols = list(dict.fromkeys(r.get("protocol") or "query-aware" for r in rows))
    columns: list[str] = []
    lines: dict[tuple, dict[str, str]] = {}
    for row in rows:
        spec = str(row.get("method_spec") or row.get("method") or "?")
        if spec not in columns:
            columns.append(spec)
        key = (str(row.get("task", "?")), str(row.get("length", "?")))
        if len(protocols) > 1:
            key += (row.get("protocol") or "query-aware",)
        lines.setdefault(key, {})[spec] = format_cell(row, fulls.get(reference_key(row)))
    header = ["task", "length", *(["protocol"] if len(protocols) > 1 else []), *columns]
    lead = len(header) - len(columns)
    body = [[*key, *(cells.get(c, "-") for c in columns)] for key, cells in lines.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])] + [c.ljust(w) for c, w in
                                                                          zip(cells[2:lead], widths[2:lead])]
        return "  ".join(left + [c.rjust(w) for c, w in zip(cells[lead:], widths[lead:])]).rstrip()

    out = [render(header), "  ".join("-" * w for w in widths)] + [render(r) for r in body]
    n = sorted({r.get("samples") for r in rows if r.get("samples") is not None})
    models = sorted({str(r.get("model")) for r in rows if r.get("model")})
    notes = []
    if models:
        notes.append(f"model: {', '.join(models)}")
    if n:
        notes.append(f"samples per cell: {', '.join(map(str, n))}")
    seeds = sorted({len(r["method_seeds"]) for r in rows if r.get("method_seeds")})
    if seeds:
        notes.append(f"stochastic methods: mean over {', '.join(map(str, seeds))} seeds")
    notes.append("retrieval/code: % score (higher is better); perplexity, continuation: bits per byte (lower is "
                 "better); "
                 "[a-b] = 95 % interval (Wilson for accuracies, bootstrap otherwise); (x) = relative to full, below 1 "
                 "is worse; ~ = the difference from full is inside the noise")
    return "\n".join(out + [""] + notes)
