"""A synthetic results directory of many recipes (no model runs): the rows `attnkit eval` writes, with scores that
follow the budget, so the report can be checked at the scale users reach (40 recipes and more).

Ten methods at four budgets make 40 report columns besides full. ``streaming`` scores exactly as ``window`` (the
lines hide each other in a score-vs-budget plot), and full attention scores 0 on every passkey sample at the longer
length (the cell has no score relative to full).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from attnkit.eval.run.results import RESULTS_FILE, SCHEMA, cell_key
from attnkit.eval.stats.intervals import score_interval

MODEL = "random:llama:synthetic"
METHODS = ("snapkv", "pyramidkv", "h2o", "tova", "keydiff", "knorm", "expected_attention", "kvzip", "window",
           "streaming")
BUDGETS = (0.1, 0.25, 0.5, 0.75)
TASKS = ("passkey", "code_completion")
LENGTHS = (1024, 2048)
SAMPLES = 12
# how much of full's score a method keeps at budget 1 (it falls towards small budgets)
STRENGTH = {"snapkv": 0.98, "pyramidkv": 0.96, "h2o": 0.9, "tova": 0.92, "keydiff": 0.88, "knorm": 0.7,
            "expected_attention": 0.94, "kvzip": 0.99, "window": 0.6, "streaming": 0.6}
IDENTICAL = {"streaming": "window"}  # scores, speed and memory of the first are the second's


def _scores(task: str, length: int, method: str, budget: float | None) -> list[float]:
    rng = random.Random(f"{task}/{length}/{IDENTICAL.get(method, method)}/{budget}")
    depths = [(i + 0.5) / SAMPLES for i in range(SAMPLES)]
    if method == "full":
        keep = 1.0
    else:
        keep = STRENGTH[method] * min(1.0, 0.35 + budget)
    if task == "passkey":
        if method == "full" and length == LENGTHS[-1]:
            return [0.0] * SAMPLES  # full fails every sample: no ratio to it
        # a needle late in the prompt survives a recent window; early ones need the method's selection
        return [1.0 if rng.random() < (keep if d < 0.8 else min(1.0, keep + 0.3)) else 0.0 for d in depths]
    return [round(max(0.0, min(1.0, 0.8 * keep + rng.uniform(-0.08, 0.08))), 4) for _ in depths]


def row(task: str, length: int, method: str, budget: float | None) -> dict:
    """One results row of the synthetic directory."""
    label = method if budget is None else f"{method}@{budget:g}"
    scores = _scores(task, length, method, budget)
    interval = score_interval(scores)
    base = IDENTICAL.get(method, method)
    speed = 1.0 if method == "full" else 1.0 + (1 - budget) * (0.5 + METHODS.index(base) / 10)
    kv = 2 ** 20 * length / 1024
    return {
        "schema": SCHEMA, "run_id": "synthetic", "model": MODEL, "task": task, "length": length,
        "cell": cell_key(MODEL, task, length, method, budget, SAMPLES, 0),
        "method": method, "method_params": {} if budget is None else {"budget": budget}, "method_spec": label,
        "recipe": {"name": method}, "recipe_name": method, "budget": budget, "method_seed": None,
        "protocol": "query-aware", "queries": 1, "questions": [0] * SAMPLES, "contexts": SAMPLES,
        "context_prefills": SAMPLES, "prefill_tokens": SAMPLES * length, "samples": SAMPLES,
        "depths": [(i + 0.5) / SAMPLES for i in range(SAMPLES)], "seeds": list(range(SAMPLES)),
        "score": sum(scores) / len(scores), "scores": scores, "depth_scores": None,
        "score_interval": list(interval[:2]), "interval": interval[2], "higher_is_better": True,
        "score_rel_full": None, "prefill_s": 0.5 * length / 1024 / (speed ** 0.5), "decode_tokens_per_s": 40 * speed,
        "throughput_tokens_per_s": 40 * speed, "batch_size": 8,
        "peak_kv_bytes": kv if method == "full" else kv * min(1.0, budget + 0.05),
        "final_kv_bytes": kv if method == "full" else kv * budget,
        "kept_fraction": None if budget is None else budget, "wall_s": 1.0,
        "versions": {"attnkit": "0.1.0", "torch": "2.13.0", "transformers": "5.23.0", "python": "3.11"},
        "git_commit": None, "timestamp": "2025-01-01T00:00:00+00:00", "predictions": None,
    }


def rows() -> list[dict]:
    """Every row, full first in each (task, length), each with its score relative to full."""
    out = []
    for task in TASKS:
        for length in LENGTHS:
            full = row(task, length, "full", None)
            full["score_rel_full"] = 1.0 if full["score"] else None
            out.append(full)
            for method in METHODS:
                for budget in BUDGETS:
                    r = row(task, length, method, budget)
                    r["score_rel_full"] = r["score"] / full["score"] if full["score"] else None
                    out.append(r)
    return out


def write(directory: Path) -> Path:
    """The synthetic ``results.jsonl`` in `directory` (created); returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows()), encoding="utf-8")
    return directory
