"""training/heldout_breakdown.py: needle_heldout counted per wording, filler and kind of value, from a results
file of `attnkit eval` or from the model's own generations."""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from attnkit.eval.data.retrieval_data import EVAL_TASKS
from attnkit.model import bundled_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import heldout_breakdown  # noqa: E402


def test_value_kinds():
    assert [heldout_breakdown.value_kind(v) for v in ("466", "a4b45789", "cffe", "e1004b", "whistle", "fig")] == \
        ["digits", "hex", "hex", "hex", "word", "word"]


def test_counts_a_results_file_per_question_and_per_value(tmp_path, capsys):
    model = str(bundled_path("tiny"))
    tok = AutoTokenizer.from_pretrained(model)
    depths, seeds, scores = [0.1, 0.3, 0.5, 0.7], [0, 1, 2, 3], [1.0, 0.0, 1.0, 1.0]
    rows = [{"task": "needle_heldout", "method": "full", "length": 512, "depths": depths, "seeds": seeds,
             "scores": scores},
            {"task": "passkey", "method": "full", "length": 512, "depths": depths, "seeds": seeds, "scores": scores},
            {"task": "needle_heldout", "method": "window", "length": 512, "depths": depths, "seeds": seeds,
             "scores": [0.0] * 4}]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout_breakdown.main([model, "--results", str(path)])
    out = [line.split(None, 4) for line in capsys.readouterr().out.splitlines()]
    samples = [EVAL_TASKS["needle_heldout"].make(tok, 512, d, s, "eval") for d, s in zip(depths, seeds)]
    for what in ("question", "fact", "filler", "value"):
        counted = [(int(hit), int(n)) for w, hit, _, n, *_ in out if w == what]
        assert sum(n for _, n in counted) == 4 and sum(hit for hit, _ in counted) == 3  # the full rows only
    by_value = {text: (int(hit), int(n)) for w, hit, _, n, text in out if w == "value"}
    want: dict[str, list[int]] = {}
    for sample, score in zip(samples, scores):
        cell = want.setdefault(heldout_breakdown.value_kind(sample.answers[0]), [0, 0])
        cell[0] += int(score)
        cell[1] += 1
    assert by_value == {k: tuple(v) for k, v in want.items()}
