"""The numbers of the report (:mod:`attnkit.eval.report.page`): every row against full attention on the same cell, and
one summary line per report *column* (recipe@budget, and its protocol when several ran).

A row's ratios to full (speed-ups, KV ratios) come from full's row of the same (model, task, length, protocol,
questions). Its score relative to full does not exist where full scored 0; such cells are not left out silently:
each summary line counts the cells its score / full is a mean over (``ratio_cells``) and names those without a ratio
(``no_ratio``), and the page says so beside the number.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from attnkit.eval.run.cells import mean_present
from attnkit.eval.stats.seed_rows import merge_seeds
from attnkit.eval.stats.significance import column_interval, full_index, is_reference, rank, reference_key


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


def cell_name(r: dict) -> str:
    """A cell as the page names it: its task and length (a column's label names its model where several ran)."""
    return f"{r.get('task')} {r.get('length')}"


def summarize(rows: list[dict]) -> list[dict]:
    """One line per column: cells, samples, mean score relative to full with its 95 % interval and rank, the cells
    that have that ratio and those that do not (full scored 0), median speed-ups and KV ratios, Pareto."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    fulls = full_index(rows)
    lines = []
    for label, rs in by.items():
        interval = column_interval(rs, fulls)
        scored = [r for r in rs if r.get("score") is not None]
        lines.append({
            "label": label, "recipe": rs[0].get("recipe_name"), "budget": rs[0].get("budget"), "cells": len(rs),
            "protocol": rs[0].get("protocol") or "query-aware", "is_full": is_reference(rs[0]),
            "samples": sum(r.get("samples") or 0 for r in rs),
            "score_rel_full": mean_present([r.get("score_rel_full") for r in rs]),
            "ratio_cells": sum(r.get("score_rel_full") is not None for r in rs),
            "no_ratio": [cell_name(r) for r in scored if r.get("score_rel_full") is None],
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
