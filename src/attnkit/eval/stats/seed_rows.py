"""One row per cell from the rows of a stochastic method's seeds (``eval --seeds``): what tables and the report show.

A stochastic recipe (Keyformer's Gumbel noise) writes one results row per seed, all under one label. Merged, a
sample's score is its mean over the seeds (so the interval is over samples, with each sample's seed noise
averaged in), the cell's score is their mean, and ``seed_scores`` keeps every seed's own score, whose spread shows
how much one draw could mislead.
"""

from __future__ import annotations

import statistics

from attnkit.eval.stats.intervals import score_interval


def _key(row: dict) -> tuple:
    return (row.get("model"), row.get("task"), row.get("length"), row.get("recipe_name") or row.get("method_spec"),
            row.get("budget"), row.get("protocol") or "query-aware", row.get("queries") or 1, row.get("samples"))


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def merge_seeds(rows: list[dict]) -> list[dict]:
    """`rows` with the rows of one cell's seeds (``method_seed`` set) merged into one, in the first one's place."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("method_seed") is not None:
            groups.setdefault(_key(row), []).append(row)
    out, done = [], set()
    for row in rows:
        if row.get("method_seed") is None:
            out.append(row)
            continue
        key = _key(row)
        if key in done:
            continue
        done.add(key)
        out.append(merged(groups[key]))
    return out


def merged(rows: list[dict]) -> dict:
    """The rows of one cell's seeds as one row (one seed alone: the row itself, with its seed listed)."""
    first = rows[0]
    seeds = [r["method_seed"] for r in rows]
    per_sample = [_mean(values) for values in zip(*[r.get("scores") or [] for r in rows])]
    interval = score_interval(per_sample)
    depth = None
    if all(r.get("depth_scores") for r in rows):
        by_depth: dict[float, list[float]] = {}
        for r in rows:
            for d, v in r["depth_scores"]:
                by_depth.setdefault(d, []).append(v)
        depth = [[d, sum(v) / len(v)] for d, v in sorted(by_depth.items())]
    return dict(
        first, method_seed=None, method_seeds=seeds, seed_scores=[r.get("score") for r in rows],
        scores=per_sample, score=_mean(per_sample), depth_scores=depth,
        score_interval=None if interval is None else list(interval[:2]),
        interval=None if interval is None else interval[2],
        score_rel_full=_mean([r.get("score_rel_full") for r in rows]),
        prefill_s=_mean([r.get("prefill_s") for r in rows]),
        decode_tokens_per_s=_mean([r.get("decode_tokens_per_s") for r in rows]),
        peak_kv_bytes=max((r["peak_kv_bytes"] for r in rows if r.get("peak_kv_bytes") is not None), default=None),
        final_kv_bytes=max((r["final_kv_bytes"] for r in rows if r.get("final_kv_bytes") is not None), default=None),
        seed_spread=statistics.pstdev([r["score"] for r in rows if r.get("score") is not None] or [0.0]),
    )
