"""Which differences hold: a cell against full attention on the same samples, and a report column's score
relative to full, with 95 % intervals (:mod:`attnkit.eval.stats.intervals`), so that the report greys out what is
inside the noise and ranks only differences that hold.

- A cell (method, task, length, protocol) differs from full when the paired bootstrap interval of its
  per-sample differences to full's excludes 0 (both scored the same samples).
- A column's score relative to full (the mean over its cells of score / full's score) gets a bootstrap interval
  that resamples every cell's samples (:func:`attnkit.eval.stats.intervals.ratio_interval`). Columns of a protocol are
  ranked by it only where intervals do not overlap: a column's rank is 1 + the number of columns whose interval
  lies wholly above its own, so columns inside each other's noise share a rank.
- "Keeps >= 95 % of full" is claimed only when the interval's lower end is at or above 0.95.
"""

from __future__ import annotations

from attnkit.eval.stats.intervals import paired_difference, ratio_interval

KEEP_LEVELS = (0.95, 0.9)


def is_reference(row: dict) -> bool:
    """Plain full attention, the reference every other column is relative to."""
    return (row.get("method") == "full" and not row.get("method_params")
            and (row.get("recipe_name") or row.get("method_spec")) == "full")


def reference_key(row: dict) -> tuple:
    """What a row is compared with full on: the same model, task, length, protocol and questions."""
    return (row.get("model"), row.get("task"), row.get("length"), row.get("protocol") or "query-aware",
            row.get("queries") or 1)


def full_index(rows: list[dict]) -> dict[tuple, dict]:
    """Plain full attention's row of every (model, task, length, protocol, questions)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if is_reference(r) and r.get("budget") is None:
            out.setdefault(reference_key(r), r)
    return out


def versus_full(row: dict, full: dict | None) -> dict | None:
    """The paired difference of `row`'s per-sample scores to full's (oriented so below 0 is worse than full: for
    a lower-is-better score such as bits per byte, full's minus the row's), its interval and whether it holds;
    None for full itself or when there is nothing to pair."""
    if full is None or row is full or is_reference(row):
        return None
    a, b = row.get("scores") or [], full.get("scores") or []
    if not a or len(a) != len(b):
        return None
    if not row.get("higher_is_better", True):
        a, b = b, a
    return paired_difference(a, b)


def column_interval(rows: list[dict], fulls: dict[tuple, dict]) -> tuple[float, float] | None:
    """The 95 % interval of a column's mean score relative to full over its cells `rows`."""
    cells, higher = [], []
    for r in rows:
        f = fulls.get(reference_key(r))
        if f is None or r is f or not r.get("scores") or len(r["scores"]) != len(f.get("scores") or []):
            continue
        cells.append((r["scores"], f["scores"]))
        higher.append(r.get("higher_is_better", True))
    return ratio_interval(cells, higher)


def rank(summary: list[dict]) -> None:
    """Give every summary line but full's a ``rank`` among the lines of its protocol: 1 + the number of them whose
    interval of score / full lies wholly above its own (lines without an interval get none); ``tied`` when another
    line shares the rank."""
    for s in summary:
        s["rank"], s["tied"] = None, False
    for protocol in {s.get("protocol") or "query-aware" for s in summary}:
        ranked = [s for s in summary if (s.get("protocol") or "query-aware") == protocol and not s.get("is_full")
                  and s.get("rel_low") is not None]
        for s in ranked:
            s["rank"] = 1 + sum(o["rel_low"] > s["rel_high"] for o in ranked)
        ranks = [s["rank"] for s in ranked]
        for s in ranked:
            s["tied"] = ranks.count(s["rank"]) > 1


def picks(summary: list[dict]) -> list[str]:
    """Sentences naming, per protocol, the fastest and the leanest columns shown to keep most of full's score
    (the interval of score / full at or above the level), and the columns that might but are not shown to."""
    out = []
    protocols = list(dict.fromkeys(s.get("protocol") or "query-aware" for s in summary))
    for protocol in protocols:
        lines = [s for s in summary if (s.get("protocol") or "query-aware") == protocol and not s.get("is_full")]
        where = f" ({protocol})" if len(protocols) > 1 else ""
        for keep in KEEP_LEVELS:
            shown = [s for s in lines if s.get("rel_low") is not None and s["rel_low"] >= keep]
            fast = [s for s in shown if s["decode_speedup"] is not None]
            lean = [s for s in shown if s["final_kv_ratio"] is not None]
            if fast:
                best = max(fast, key=lambda s: s["decode_speedup"])
                out.append(f"Fastest decoding shown to keep >= {keep:.0%} of full's score{where}: {best['label']} "
                           f"({best['decode_speedup']:.2f}x full's decode speed, {_rel(best)} its score)")
            if lean:
                best = min(lean, key=lambda s: s["final_kv_ratio"])
                out.append(f"Least KV memory shown to keep >= {keep:.0%} of full's score{where}: {best['label']} "
                           f"({best['final_kv_ratio']:.2f}x full's final KV bytes, {_rel(best)} its score)")
            if not shown:
                maybe = [s for s in lines if s.get("score_rel_full") is not None and s["score_rel_full"] >= keep]
                text = f"No method other than full is shown to keep >= {keep:.0%} of full's score{where}"
                if maybe:
                    names = ", ".join(f"{s['label']} ({_rel(s)})" for s in maybe[:3])
                    text += f"; {names} may, but the interval is too wide: run more samples"
                out.append(text + ".")
    return out


def _rel(s: dict) -> str:
    text = f"{s['score_rel_full']:.2f}x"
    if s.get("rel_low") is not None:
        text += f" [{s['rel_low']:.2f}-{s['rel_high']:.2f}]"
    return text
