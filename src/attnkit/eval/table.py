"""The plain-text score table of ``attnkit eval``: one line per (task, length), one column per recipe."""

from __future__ import annotations

import math

from attnkit.recipe import format_budget


def column_label(recipe_name: str, budget) -> str:
    """How a (recipe, budget) is named in tables and plots: ``snapkv@0.25``, or the recipe's name."""
    return recipe_name if budget is None else f"{recipe_name}@{format_budget(budget)}"


def is_reference(row: dict) -> bool:
    """Plain full attention, the reference every other column is relative to."""
    return (row.get("method") == "full" and not row.get("method_params")
            and (row.get("recipe_name") or row.get("method_spec")) == "full")


def format_cell(row: dict) -> str:
    """A row's score (percent, or bits per byte for perplexity) and its ratio to full, e.g. ``25.0% (0.50x)``."""
    score = row.get("score")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        text = "n/a"
    elif row.get("higher_is_better", True):
        text = f"{100 * score:.1f}%"
    else:
        text = f"{score:.3f}"
    rel = row.get("score_rel_full")
    if rel is not None and not is_reference(row):
        text += f" ({rel:.2f}x)"
    return text


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per (task, length), one column per method spec.

    Scores are percent for tasks where higher is better, bits per byte (3 decimals) for perplexity;
    ``(0.96x)`` is the score relative to full (below 1 is worse than full for every task).
    """
    if not rows:
        return "(no results)"
    columns: list[str] = []
    lines: dict[tuple, dict[str, str]] = {}
    for row in rows:
        spec = str(row.get("method_spec") or row.get("method") or "?")
        if spec not in columns:
            columns.append(spec)
        lines.setdefault((str(row.get("task", "?")), row.get("length", "?")), {})[spec] = format_cell(row)
    header = ["task", "length", *columns]
    body = [[task, str(length), *(cells.get(c, "-") for c in columns)] for (task, length), cells in lines.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])]
        return "  ".join(left + [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]).rstrip()

    out = [render(header), "  ".join("-" * w for w in widths)] + [render(r) for r in body]
    n = sorted({r.get("samples") for r in rows if r.get("samples") is not None})
    models = sorted({str(r.get("model")) for r in rows if r.get("model")})
    notes = []
    if models:
        notes.append(f"model: {', '.join(models)}")
    if n:
        notes.append(f"samples per cell: {', '.join(map(str, n))}")
    notes.append("retrieval/code: % score (higher is better); perplexity: bits per byte (lower is better); "
                 "(x) = relative to full, below 1 is worse")
    return "\n".join(out + [""] + notes)
