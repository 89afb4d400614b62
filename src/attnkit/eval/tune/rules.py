"""What ``attnkit tune`` decides from its evidence: which candidates a round eliminates, and which one wins.

A candidate's evidence on a (task, length) is every sample it ran there, over the rounds so far (each round draws
fresh samples), paired with full attention's score on the same sample. Its score relative to full is the ratio of
the means (:func:`attnkit.eval.run.cells.rel_full`: below 1 is worse) with the paired bootstrap interval of that ratio
(:func:`attnkit.eval.stats.intervals.ratio_interval`, the interval of the report's "score / full"). Its cost on the
target is the median, over its cells and rounds, of its measurement relative to full's in the same group:
peak KV bytes (``kv``), full's decode tokens/s over its own (``decode``), its prefill seconds over full's
(``prefill``); below 1 beats full.

Between rounds (successive halving: K. Jamieson and A. Talwalkar, 2016, "Non-stochastic Best Arm Identification
and Hyperparameter Optimization", arXiv 1502.07943; L. Li et al., 2017, "Hyperband: A Novel Bandit-Based Approach
to Hyperparameter Optimization", arXiv 1603.06560), in this order:

1. ``floor``: a candidate whose interval lies wholly below the floor on some (task, length) is out: the evidence,
   not the noise, says it loses too much. A one-sample interval is a point, not an interval: it decides nothing
   (neither this nor "shown" below).
2. ``dominated``: a candidate no cheaper than full attention on the target is out: full always meets the floor
   (it is the reference), so such a candidate cannot win.
3. ``halving``: of the rest, the best ``ceil(alive / eta)`` go on, ranked by Deb's feasibility rules (K. Deb,
   2000, "An efficient constraint handling method for genetic algorithms", Computer Methods in Applied Mechanics
   and Engineering 186(2-4), 311-338): candidates whose point estimate meets the floor first, by cost; then the
   others by how far they fall short, then cost. So a candidate is cut when enough candidates that meet the floor
   as far as the evidence goes are cheaper (dominated on the target among the feasible ones), or when it falls
   further short than those kept. Halving on the target alone would keep the cheapest candidates, which are the
   likeliest to fail the floor; on the score alone, the costliest. The *incumbent*, the cheapest candidate *shown*
   to meet the floor (its interval's lower end at or above it on every task and length), always goes on, so the
   best candidate that holds is never traded for ones not yet shown to. Candidates costlier than the incumbent
   are not dropped outright: two or four samples can show a candidate that more samples do not, and the
   candidates kept by halving are then the fallbacks.

The winner is the cheapest candidate of the last round whose interval's lower end meets the floor on every task
and length and which beats full on the target; with none, full attention itself. The lower end, not the point
estimate: picking the best of many noisy estimates favours the luckiest (the winner's curse), and "shown to keep
the floor" is the claim the report makes (:func:`attnkit.eval.stats.significance.picks`). The percentile bootstrap is
optimistic with few samples (a candidate that agrees with full on every sample gets a zero-width interval, however
few the samples), which is why the last round runs the most samples and ``--confirm`` checks the winner on fresh
ones.
"""

from __future__ import annotations

import math
import statistics

from attnkit.eval.run.cells import mean_present, rel_full
from attnkit.eval.stats.intervals import ratio_interval

FLOOR, DOMINATED, HALVING = "floor", "dominated", "halving"


def pair_cost(row: dict, full: dict, target: str) -> float | None:
    """`row`'s measurement on `target` relative to full's on the same samples (below 1 beats full)."""
    if target == "kv":
        a, b = row.get("peak_kv_bytes"), full.get("peak_kv_bytes")
    elif target == "decode":
        a, b = full.get("decode_tokens_per_s"), row.get("decode_tokens_per_s")
    else:
        a, b = row.get("prefill_s"), full.get("prefill_s")
    return a / b if a is not None and b else None


def cell_summary(task: str, length: int, pairs: list[tuple[dict, dict]], floor: float) -> dict:
    """One (task, length) of a candidate's evidence: `pairs` of (its row, full's row on the same samples)."""
    m, f, higher = [], [], True
    for row, full in pairs:
        m += row.get("scores") or []
        f += full.get("scores") or []
        higher = row.get("higher_is_better", True)
    mean_m, mean_f = mean_present(m), mean_present(f)
    # full scoring nothing: no fraction of it can be lost (a random model's scores, say)
    full_zero = higher and mean_f == 0
    rel = None if full_zero else rel_full(mean_m, mean_f, higher)
    interval = None if full_zero or len(m) != len(f) else ratio_interval([(m, f)], [higher])
    low, high = (None, None) if interval is None else interval
    n = len([s for s in m if s is not None])
    return {"task": task, "length": length, "samples": n, "score": mean_m, "full_score": mean_f, "rel": rel,
            "low": low, "high": high, "full_zero": full_zero,
            "shown": full_zero or (n >= 2 and low is not None and low >= floor),
            "below": n >= 2 and high is not None and high < floor,
            "point_met": full_zero or (rel is not None and rel >= floor)}


def summarize(cid: str, evidence: dict[tuple, list[tuple[dict, dict]]], floor: float, target: str) -> dict:
    """A candidate's standing: its cells (:func:`cell_summary`), cost on the target, worst score / full, and
    whether it is shown to meet the floor, shown below it, or meets it on the point estimate."""
    cells = [cell_summary(task, length, pairs, floor) for (task, length), pairs in evidence.items()]
    costs = [c for pairs in evidence.values() for row, full in pairs if (c := pair_cost(row, full, target)) is not None]
    rels = [c["rel"] for c in cells if c["rel"] is not None]
    rows = [row for pairs in evidence.values() for row, _ in pairs]
    return {
        "candidate": cid, "cells": cells, "samples": min((c["samples"] for c in cells), default=0),
        "cost": statistics.median(costs) if costs else None,
        "peak_kv_bytes": max((r["peak_kv_bytes"] for r in rows if r.get("peak_kv_bytes") is not None), default=None),
        "decode_tokens_per_s": _median([r.get("decode_tokens_per_s") for r in rows]),
        "prefill_s": _median([r.get("prefill_s") for r in rows]),
        "worst_rel": min(rels) if rels else None,
        "shown": bool(cells) and all(c["shown"] for c in cells),
        "below": [f"{c['task']}@{c['length']}" for c in cells if c["below"]],
        "point_met": bool(cells) and all(c["point_met"] for c in cells),
        "shortfall": max((floor - c["rel"] for c in cells if not c["point_met"] and c["rel"] is not None), default=0.0),
    }


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cost(s: dict) -> float:
    return math.inf if s["cost"] is None else s["cost"]


def _worst(s: dict) -> float:
    """The worst score / full; 1 where full scores 0 everywhere (nothing of it can be lost)."""
    return 1.0 if s["worst_rel"] is None else s["worst_rel"]


def preference(s: dict) -> tuple:
    """Deb's order: meeting the floor on the point estimate first, by cost; then by shortfall, then cost."""
    met = s["point_met"]
    return (0 if met else 1, 0.0 if met else s["shortfall"], _cost(s), -_worst(s), s["candidate"])


def incumbent(summaries: list[dict]) -> dict | None:
    """The cheapest candidate shown to meet the floor on every task and length (None: none is)."""
    shown = [s for s in summaries if s["shown"] and s["cost"] is not None]
    return min(shown, key=lambda s: (s["cost"], -_worst(s), s["candidate"])) if shown else None


def describe(s: dict) -> str:
    """A candidate's worst cell as text: ``passkey@2048 0.50 [0.00-1.00] n=2``."""
    cells = [c for c in s["cells"] if c["rel"] is not None]
    if not cells:
        return "full scores 0 on every task and length"
    c = min(cells, key=lambda c: c["rel"])
    interval = "" if c["low"] is None else f" [{c['low']:.2f}-{c['high']:.2f}]"
    return f"{c['task']}@{c['length']} {c['rel']:.2f}{interval} n={c['samples']}"


def eliminate(summaries: list[dict], floor: float, eta: int) -> tuple[list[str], list[dict]]:
    """The candidates that go on to the next round (best first) and those eliminated, each with its rule and why
    (module docstring: floor, then dominated by full, then halving)."""
    out: list[dict] = []
    survivors = []
    for s in summaries:
        if s["below"]:
            out.append({"candidate": s["candidate"], "rule": FLOOR,
                        "why": f"score / full is below {floor:g} on {', '.join(s['below'])} ({describe(s)})"})
        elif s["cost"] is not None and s["cost"] >= 1.0:
            out.append({"candidate": s["candidate"], "rule": DOMINATED,
                        "why": f"no better than full on the target ({s['cost']:.2f}x full's cost)"})
        else:
            survivors.append(s)
    best = choose(survivors)
    keep = max(1, math.ceil(len(summaries) / eta))
    ranked = sorted(survivors, key=preference)
    kept = ranked[:keep]
    if best is not None and best not in kept:
        kept.append(best)
    for rank, s in enumerate(ranked, start=1):
        if s not in kept:
            met = "meets the floor on the point estimate" if s["point_met"] else f"falls short: {describe(s)}"
            cost = "no measure of" if s["cost"] is None else f"{s['cost']:.2f}x"
            out.append({"candidate": s["candidate"], "rule": HALVING,
                        "why": f"ranked {rank} of {len(ranked)}, {keep} go on ({met}; {cost} full's cost)"})
    return [s["candidate"] for s in kept], out


def choose(summaries: list[dict]) -> dict | None:
    """The winner among the last round's candidates: the cheapest shown to meet the floor that beats full on the
    target; None when none is (full attention then)."""
    eligible = [s for s in summaries if s["cost"] is not None and s["cost"] < 1.0]
    return incumbent(eligible)


def pareto(summaries: list[dict]) -> list[str]:
    """The candidates no other (full attention included, at cost 1 and score / full 1) beats on both cost and
    worst score / full; a candidate whose full scores 0 everywhere counts as 1."""
    points = [(s["candidate"], _cost(s), _worst(s)) for s in summaries]
    points.append(("full", 1.0, 1.0))
    return [c for c, x, y in points
            if not any(ox <= x and oy >= y and (ox < x or oy > y) for _, ox, oy in points)]
