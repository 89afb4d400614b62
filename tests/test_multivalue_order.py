"""training/multivalue_order.py: its spaced prompts hold niah_multivalue's four facts exactly N filler tokens
apart, in order, and it counts a model's listing step by step."""

import sys
from pathlib import Path

import pytest

from attnkit.eval.data import tasks
from attnkit.model import bundled_path
from attnkit.tokenizer import build_byte_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import multivalue_order  # noqa: E402

TOK = build_byte_tokenizer()


@pytest.mark.parametrize("gap", [0, 37, 300])
def test_spaced_prompt_puts_the_facts_gap_tokens_apart_in_order(gap):
    ids, values = multivalue_order.spaced(TOK, gap, seed=3)
    key = tasks.make_niah_multivalue(TOK, 1024, 0.5, 3, "eval").meta["key"]
    assert len(values) == 4 and len(set(values)) == 4
    facts = [TOK.encode("\n" + tasks.MAGIC_NEEDLE.format(key=key, value=v) + "\n", add_special_tokens=False)
             for v in values]
    starts = [next(i for i in range(len(ids)) if ids[i : i + len(f)] == f) for f in facts]
    assert [b - (a + len(f)) for a, b, f in zip(starts, starts[1:], facts)] == [gap] * 3
    assert TOK.decode(ids).endswith(tasks.MULTIVALUE_QUESTION.format(key=key))


def test_counts_every_step_of_a_model_s_listing(capsys):
    multivalue_order.main([str(bundled_path("tiny")), "--samples", "2", "--gap", "0", "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    rows = [list(map(int, line.split()[1:])) for line in out[2:6]]
    assert [line.split()[0] for line in out[1:6]] == ["step", "1", "2", "3", "4"]
    assert all(sum(r) == 2 for r in rows)  # each step of each sample counted once
    assert out[-1].startswith("every step right: ") and out[-1].endswith(" of 2")
