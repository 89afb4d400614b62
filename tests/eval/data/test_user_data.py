"""Data users bring: RULER's and InfiniteBench's JSONL formats beside LongBench's (attnkit.eval.data.user_data), their
metrics, the context/question split of every format, and items sharing a context as several questions. The small
samples of each format are written here (no data set can be downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit import AttnkitError, load_model
from attnkit.cli import main
from attnkit.eval.data import infinitebench, ruler_data
from attnkit.eval.data.sample import split_ids
from attnkit.eval.data.user_data import load_data
from attnkit.eval.run import harness
from helpers import ROOT

SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
LONGBENCH = ROOT / "tests" / "data" / "longbench_small.jsonl"
HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(SPEC)


def niah(key: str, value: str) -> dict:
    """A RULER niah_single_1 item as RULER's prepare.py writes it (answer prefix apart)."""
    text = (f"A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
            f"about the number afterwards.\n{HAY} One of the special magic numbers for {key} is: {value}. {HAY}\n"
            f"What is the special magic number for {key} mentioned in the provided text?")
    return {"index": 0, "input": text, "outputs": [value], "length": 120, "length_w_model_temp": 120,
            "answer_prefix": f" The special magic number for {key} mentioned in the provided text is",
            "token_position_answer": 60}


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


@pytest.fixture(scope="module")
def ruler_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ruler")
    write_jsonl(root / "niah_single_1" / "validation.jsonl", [niah("wise-owl", "8421937"), niah("red-fox", "1234567")])
    example = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nVAR AAAAA = 1"
               "\nQuestion: Find all variables that are assigned the value 1 in the text above. Answer: AAAAA\n")
    vt = (example + "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
          f"{HAY} VAR QWERT = 55555 {HAY} VAR ASDFG = VAR QWERT\nQuestion: Find all variables that are assigned the "
          "value 55555 in the text above.")
    write_jsonl(root / "vt" / "validation.jsonl", [{"index": 0, "input": vt, "outputs": ["QWERT", "ASDFG"],
                                                    "length": 150}])  # an older RULER: no answer_prefix
    return root


BOOK = "Anna kept bees behind the old mill. Every summer she sold honey in the village square to her friend Tom."


@pytest.fixture(scope="module")
def infinite_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("infinitebench")
    write_jsonl(root / "passkey.jsonl", [{"id": 0, "context": f"{HAY} The pass key is 71432. {HAY}",
                                          "input": "What is the pass key?", "answer": ["71432"], "options": []}])
    options = ["honey", "bread", "milk", "wool"]
    write_jsonl(root / "longbook_choice_eng.jsonl", [
        {"id": 0, "context": BOOK, "input": "What did Anna sell?", "answer": ["honey"], "options": options},
        {"id": 1, "context": BOOK, "input": "What stood near the bees?", "answer": ["mill"],
         "options": ["mill", "church", "river", "tower"]},
        {"id": 2, "context": "Another book.", "input": "Which?", "answer": ["milk"], "options": options}])
    write_jsonl(root / "longbook_qa_eng.jsonl", [{"id": 0, "context": BOOK, "input": "Who bought honey?",
                                                  "answer": ["Tom"], "options": []}])
    return root


def test_ruler_metrics():
    assert ruler_data.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler_data.string_match_all("QWERT, asdfg", ["QWERT", "ASDFG"]) == 1.0  # case does not matter
    assert ruler_data.string_match_part("It is Paris", ["paris", "Lyon"]) == 1.0
    assert ruler_data.string_match_part("It is Oslo", ["paris", "Lyon"]) == 0.0
    assert ruler_data.postprocess("  12\x0034\t ") == "12\n34"
    assert [ruler_data.family(t) for t in ("niah_multikey_3", "vt", "cwe", "fwe", "qa_2", "variable_tracking")] == [
        "niah", "vt", "cwe", "fwe", "qa", "vt"]
    with pytest.raises(AttnkitError, match="RULER task 'mystery' has no known metric"):
        ruler_data.family("mystery")


def test_infinitebench_metrics():
    s = infinitebench.score_one
    assert s("passkey", "The pass key is 71432.", ("71432",), {}) == 1.0
    assert s("passkey", "12, then 71432", ("71432",), {}) == 0.0  # the first number counts
    assert s("kv_retrieval", 'The value is "a1b2-c3d4".', ("a1b2-c3d4",), {}) == 1.0
    assert s("math_find", "The largest number is 7.", ("7",), {}) == 1.0
    assert s("math_find", "It is 17", ("7",), {}) == 0.0
    assert s("code_run", "The return value is 42", ("42",), {}) == 1.0
    assert s("code_run", "42 is the value", ("42",), {}) == 0.0  # the last word counts
    assert s("math_calc", "1, 4, 9, 3", ("1", "4", "8"), {}) == pytest.approx(2 / 3)
    assert s("longdialogue_qa_eng", "It is John.", ("JOHN",), {}) == 1.0
    choice = {"label": ["honey", "A"]}
    assert s("longbook_choice_eng", "A", ("honey",), choice) == 1.0
    assert s("longbook_choice_eng", "B. bread", ("honey",), choice) == 0.0
    assert s("longbook_choice_eng", "I think the answer is: A", ("honey",), choice) == 1.0
    debug = {"label": ["func_b", "B"]}
    assert s("code_debug", "B. func_b", ("func_b",), debug) == 1.0
    assert s("code_debug", "The answer is: func_b", ("func_b",), debug) == 1.0
    assert s("code_debug", "C", ("func_b",), debug) == 0.0
    assert s("longbook_qa_eng", "Tom did", ("Tom",), {}) == pytest.approx(2 / 3)
    assert s("longbook_sum_eng", "the cat sat", ("the cat sat",), {}) == 1.0


def test_formats_are_told_apart(ruler_dir, infinite_dir):
    data = load_data([ruler_dir, infinite_dir, LONGBENCH])
    tasks = data.tasks()
    assert {"ruler:niah_single_1", "ruler:vt", "infinitebench:passkey", "infinitebench:longbook_choice_eng",
            "longbench:hotpotqa"} <= set(tasks)
    assert data.expand("ruler") == ["ruler:niah_single_1", "ruler:vt"]


@pytest.mark.parametrize("item, message", [
    ({"text": "x"}, "not a known data format"),
    ({"input": "x", "outputs": []}, "'outputs' must be a non-empty list"),
])
def test_bad_items_are_one_line(tmp_path, item, message):
    path = write_jsonl(tmp_path / "niah_single_1" / "validation.jsonl", [item])
    with pytest.raises(AttnkitError, match=message) as err:
        load_data(path)
    assert "\n" not in str(err.value)


def test_more_bad_data(tmp_path, model):
    with pytest.raises(AttnkitError, match="InfiniteBench task 'mystery' is unknown"):
        load_data(write_jsonl(tmp_path / "mystery.jsonl", [{"context": "c", "input": "i", "answer": ["a"]}]))
    with pytest.raises(AttnkitError, match="the answer 'x' is none of the options"):
        load_data(write_jsonl(tmp_path / "code_debug.jsonl", [{"context": "c", "input": "", "answer": ["x"],
                                                               "options": ["a", "b", "c", "d"]}]))
    data = load_data(write_jsonl(tmp_path / "r" / "niah_single_2" / "validation.jsonl", [niah("a-b", "1")]))
    with pytest.raises(AttnkitError, match="over the length budget 64; RULER data is made for one length"):
        data.samples(model, "ruler:niah_single_2", 64, 1)
    with pytest.raises(AttnkitError, match="does not exist"):
        load_data(tmp_path / "none.jsonl")


def test_every_format_splits_context_and_question(model, ruler_dir, infinite_dir):
    data = load_data([ruler_dir, infinite_dir, LONGBENCH])
    tok = model.tokenizer
    (s, _) = data.samples(model, "ruler:niah_single_1", 768, 2)
    assert s.prompt.endswith("provided text is") and s.question.startswith("\nWhat is the special magic number")
    context, question = split_ids(tok, s)
    assert context + question == tok(s.prompt).input_ids
    (vt,) = data.samples(model, "ruler:vt", 768, 1)
    assert vt.question.startswith("\nQuestion: Find all variables that are assigned the value 55555")  # the last one
    (pk,) = data.samples(model, "infinitebench:passkey", 768, 1)
    assert tok.decode(list(pk.question)).endswith("What is the pass key?\nThe pass key is")
    assert "71432" in tok.decode(list(pk.context)) and "71432" not in tok.decode(list(pk.question))
    (hp,) = data.samples(model, "longbench:hotpotqa", 768, 1)
    assert tok.decode(list(hp.question)).endswith("Question: Which city did Marie move to?\nAnswer:")
    assert "Oslo" in tok.decode(list(hp.context))
    (lcc,) = data.samples(model, "longbench:lcc", 768, 1)
    assert lcc.question == ()  # lcc asks nothing after the code


def test_items_sharing_a_context_are_questions_about_it(model, infinite_dir):
    data = load_data(infinite_dir)
    one = data.samples(model, "infinitebench:longbook_choice_eng", 768, 2)
    assert [s.meta["id"] for s in one] == [0, 1]  # queries=1: the first items
    many = data.samples(model, "infinitebench:longbook_choice_eng", 768, 2, queries=2)
    assert [(s.meta["id"], s.query) for s in many] == [(0, 0), (1, 1), (2, 0)]
    assert many[0].context == many[1].context != many[2].context


def test_eval_runs_every_format_under_every_protocol(model, ruler_dir, infinite_dir, tmp_path):
    data = load_data([ruler_dir, infinite_dir, LONGBENCH])
    tasks = ["ruler:niah_single_1", "infinitebench:longbook_choice_eng", "longbench:hotpotqa"]
    rows = harness.run_eval(model, tasks, [768], ["full"], samples=2, data=data, progress=False,
                            protocols=["query-aware", "query-agnostic", "multi-query"], queries=2)
    for task in tasks:
        by = {r["protocol"]: r for r in rows if r["task"] == task}
        assert by["query-aware"]["predictions"] == by["query-agnostic"]["predictions"] == by["multi-query"][
            "predictions"], task
    choice = {r["protocol"]: r for r in rows if r["task"] == "infinitebench:longbook_choice_eng"}
    assert choice["multi-query"]["context_prefills"] == 2 and choice["query-agnostic"]["context_prefills"] == 3
    assert main(["eval", "--model", SPEC, "--data", str(ruler_dir), "--data", str(infinite_dir), "--lengths", "768",
                 "--samples", "1", "--protocol", "query-agnostic", "--no-progress", "--out", str(tmp_path)]) == 0


def test_a_cell_beyond_the_models_positions_is_refused_in_one_line():
    from types import SimpleNamespace

    from attnkit.eval.data.prompting import check_positions
    model = SimpleNamespace(geometry=SimpleNamespace(max_positions=4096), spec="tiny")
    check_positions(model, "ruler:niah_single_1", 4000, 96)  # 4096 positions: fits exactly
    with pytest.raises(AttnkitError, match=r"^task 'ruler:niah_single_1' at length 4000 needs 4000 \+ 97 positions; "
                                           r"model 'tiny' allows 4096$"):
        check_positions(model, "ruler:niah_single_1", 4000, 97)
    with pytest.raises(AttnkitError, match=r"^task 'passkey' at length 4000 needs 4010 \+ 96 positions"):
        check_positions(model, "passkey", 4000, 96, used=4010)
