"""95 % intervals (attnkit.eval.stats.intervals) against known values, and the report's use of them
(attnkit.eval.stats.significance, attnkit.eval.report.score_table): differences inside the noise are greyed, columns are
ranked only where their intervals do not overlap, a method is said to keep 95 % of full only when shown to."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from attnkit.eval.report.page import write_report
from attnkit.eval.report.score_table import score_cell
from attnkit.eval.run.results import RESULTS_FILE, SCHEMA
from attnkit.eval.stats import intervals, significance
from attnkit.eval.stats.seed_rows import merge_seeds


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """Wilson (1927), eq. as usually written: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    z = 1.959963984540054
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


@pytest.mark.parametrize("k, n, known", [(0, 10, (0.0, 0.2775)), (5, 10, (0.2366, 0.7634)),
                                         (10, 10, (0.7225, 1.0)), (1, 20, (0.0089, 0.2361))])
def test_wilson_known_values(k, n, known):
    low, high = intervals.wilson(k, n)
    assert (low, high) == pytest.approx(known, abs=5e-5)
    assert (low, high) == pytest.approx(wilson_by_hand(k, n), abs=1e-12)
    assert intervals.score_interval([1.0] * k + [0.0] * (n - k)) == (low, high, "wilson")


def test_wilson_refuses_bad_counts():
    for k, n in ((0, 0), (11, 10), (-1, 10)):
        with pytest.raises(ValueError):
            intervals.wilson(k, n)


def test_bootstrap_is_deterministic_and_covers():
    scores = [0.2, 0.9, 0.55, 0.31, 0.74, 0.12, 0.66]
    first = intervals.bootstrap_mean(scores)
    assert intervals.bootstrap_mean(scores) == first  # same scores, same interval
    assert first[0] < sum(scores) / len(scores) < first[1]
    assert intervals.score_interval(scores)[2] == "bootstrap"
    assert intervals.bootstrap_mean([0.4, 0.4, 0.4]) == (0.4, 0.4)
    # coverage of the true mean over many seeded data sets: near the nominal 95 %
    rng = np.random.default_rng(7)
    hits = 0
    for trial in range(200):
        x = rng.beta(2.0, 5.0, size=40)  # mean 2/7
        low, high = intervals.bootstrap_mean(x.tolist(), resamples=400, seed=trial)
        hits += low <= 2 / 7 <= high
    assert 0.88 <= hits / 200 <= 0.99


def test_paired_difference():
    full = [1.0] * 30
    clearly_worse = [0.0] * 30
    near = [1.0] * 29 + [0.0]
    d = intervals.paired_difference(clearly_worse, full)
    assert d["diff"] == -1.0 and d["holds"] and d["n"] == 30
    d = intervals.paired_difference(near, full)
    assert d["low"] < 0 <= d["high"] and not d["holds"]
    assert intervals.paired_difference([None, 1.0], [1.0, None]) is None


def test_ratio_interval():
    cells = [([1.0] * 20, [1.0] * 20), ([0.5] * 10, [1.0] * 10)]
    assert intervals.ratio_interval(cells, [True, True]) == pytest.approx((0.75, 0.75))
    assert intervals.ratio_interval([([0.0, 1.0], [0.0, 0.0])], [True]) is None  # full scores 0: no ratio
    low, high = intervals.ratio_interval([([1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0])], [True])
    assert low < 0.8 < high


def _row(label: str, scores: list[float], **extra) -> dict:
    method = label.split(":")[0]
    row = {"schema": SCHEMA, "model": "m", "task": "passkey", "length": 256, "method": method,
           "method_params": {} if method == "full" else {"budget": 0.3}, "method_spec": label, "recipe_name": label,
           "budget": None, "protocol": "query-aware", "queries": 1, "samples": len(scores), "scores": scores,
           "score": sum(scores) / len(scores), "higher_is_better": True, "prefill_s": 0.1,
           "decode_tokens_per_s": 100.0, "peak_kv_bytes": 1000, "final_kv_bytes": 1000,
           "depths": [0.5] * len(scores), "seeds": list(range(len(scores))), "predictions": [""] * len(scores)}
    interval = intervals.score_interval(scores)
    row.update(score_interval=list(interval[:2]), interval=interval[2], score_rel_full=row["score"], **extra)
    row["cell"] = json.dumps([label, row.get("method_seed")])
    return row


FULL = _row("full", [1.0] * 30)
WORSE = _row("h2o:budget=0.3", [0.0] * 25 + [1.0] * 5, final_kv_bytes=300, decode_tokens_per_s=150.0)
NEAR = _row("snapkv:budget=0.3", [1.0] * 29 + [0.0], final_kv_bytes=300, decode_tokens_per_s=120.0)


def test_cells_inside_the_noise_are_greyed():
    assert "class=same" in score_cell(NEAR, FULL) and "n=30" in score_cell(NEAR, FULL)
    assert "class=same" not in score_cell(WORSE, FULL)
    assert "class=ref" in score_cell(FULL, FULL)


def test_ranks_only_differences_that_hold():
    summary = [{"label": "a", "rel_low": 0.9, "rel_high": 1.0}, {"label": "b", "rel_low": 0.85, "rel_high": 0.95},
               {"label": "c", "rel_low": 0.2, "rel_high": 0.4}, {"label": "d", "rel_low": None, "rel_high": None}]
    significance.rank(summary)
    assert [(s["rank"], s["tied"]) for s in summary] == [(1, True), (1, True), (3, False), (None, False)]


def test_picks_need_the_interval_above_the_level():
    base = {"decode_speedup": 1.2, "final_kv_ratio": 0.3, "protocol": "query-aware", "is_full": False}
    shown = dict(base, label="shown", score_rel_full=0.99, rel_low=0.96, rel_high=1.0)
    unsure = dict(base, label="unsure", score_rel_full=0.97, rel_low=0.5, rel_high=1.0, final_kv_ratio=0.1)
    text = " ".join(significance.picks([shown, unsure]))
    assert "Least KV memory shown to keep >= 95% of full's score: shown" in text  # not the leaner, unsure one
    text = " ".join(significance.picks([unsure]))
    assert "No method other than full is shown to keep >= 95%" in text and "unsure (0.97x [0.50-1.00]) may" in text


def test_report_greys_and_ranks(tmp_path):
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in (FULL, WORSE, NEAR)))
    page = write_report(tmp_path).read_text()
    summary = {s["label"]: s for s in json.loads((tmp_path / "summary.json").read_text())}
    assert summary["snapkv:budget=0.3"]["rank"] == 1 and summary["h2o:budget=0.3"]["rank"] == 2
    assert summary["snapkv:budget=0.3"]["rel_low"] < 1.0 <= summary["snapkv:budget=0.3"]["rel_high"] + 1e-9
    assert page.count("class=same") >= 2  # snapkv's score cell and its score / full
    assert "No method other than full is shown to keep &gt;= 95%" in page  # 29/30 is not enough to be sure


def test_seeds_merge_into_one_cell():
    a = _row("keyformer:budget=0.3", [1.0, 0.0, 1.0, 1.0], method_seed=0)
    b = _row("keyformer:budget=0.3", [1.0, 1.0, 0.0, 1.0], method_seed=1)
    (merged,) = merge_seeds([a, b])
    assert merged["method_seeds"] == [0, 1] and merged["scores"] == [1.0, 0.5, 0.5, 1.0]
    assert merged["score"] == 0.75 and merged["seed_scores"] == [0.75, 0.75] and merged["interval"] == "bootstrap"
