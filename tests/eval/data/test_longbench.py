"""LongBench-format data: loading, metrics chosen by dataset, middle truncation, chat template, eval --data."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import AttnkitError, load_model
from attnkit.cli import main
from attnkit.eval.data import longbench
from attnkit.eval.data.longbench import LongBenchData, prompt_ids, score, truncate_middle
from attnkit.eval.run import harness
from attnkit.eval.run import results as results_store
from attnkit.tokenizer import build_byte_tokenizer
from helpers import ROOT

DATA = ROOT / "tests" / "data" / "longbench_small.jsonl"
SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(SPEC)


def test_qa_f1_normalises_like_longbench():
    assert score("hotpotqa", "The Eiffel Tower!", ["eiffel tower"]) == 1.0
    # tokens {paris, france} vs {paris}: precision 1/2, recall 1 -> F1 2/3
    assert score("hotpotqa", "Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    assert score("hotpotqa", "London", ["Paris", "london"]) == 1.0  # best over the answers
    assert score("2wikimqa_e", "an apple", ["Apple"]) == 1.0  # LongBench-E names score as their base
    assert score("multifieldqa_zh", "上海。", ["上海"]) == 1.0
    assert score("multifieldqa_zh", "上海市", ["上海"]) == pytest.approx(0.8)  # chars: P 2/3, R 1


def test_rouge_classification_retrieval_count_code():
    assert score("gov_report", "the cat sat", ["the cat sat"]) == 1.0
    # LCS "the cat" = 2 tokens: P 2/2, R 2/3 -> F1 0.8
    assert score("qmsum", "the cat", ["the cat sat"]) == pytest.approx(0.8)
    assert score("vcsum", "今天下雨", ["今天下雨"]) == 1.0
    classes = ["Location", "Human being", "Numeric value", "Entity"]
    assert score("trec", "Numeric value", ["Numeric value"], classes) == 1.0
    assert score("trec", "Entity or Numeric value", ["Numeric value"], classes) == 0.5
    assert score("trec", "Location", ["Numeric value"], classes) == 0.0
    assert score("trec", "\nNumeric value\nLocation", ["Numeric value"], classes) == 1.0  # first line only
    assert score("passage_retrieval_en", "Paragraph 2", ["Paragraph 2"]) == 1.0
    assert score("passage_retrieval_en", "2 or 3", ["Paragraph 2"]) == 0.5
    assert score("passage_retrieval_zh", "段落5", ["段落5"]) == 1.0
    assert score("passage_count", "There are 4 paragraphs, 4.", ["4"]) == 1.0
    assert score("passage_count", "none", ["4"]) == 0.0
    assert score("lcc", "# comment\n    return a * b", ["    return a * b"]) == 1.0
    assert score("repobench-p", "// c\nx = 1", ["x = 2"]) == pytest.approx(0.8)


def test_unknown_dataset_and_bad_items(tmp_path):
    with pytest.raises(AttnkitError, match="dataset 'mystery' has no known metric"):
        score("mystery", "a", ["a"])
    bad = [({"context": "c", "input": "i", "dataset": "hotpotqa"}, "missing field answers"),
           ({"context": "c", "input": "i", "answers": [], "dataset": "hotpotqa"}, "'answers' must be"),
           ({"context": "c", "input": "i", "answers": ["x"], "dataset": "trec"}, "needs 'all_classes'"),
           ({"context": 3, "input": "i", "answers": ["x"], "dataset": "hotpotqa"}, "'context' must be a string")]
    for item, match in bad:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(item) + "\n")
        with pytest.raises(AttnkitError, match=match):
            LongBenchData.load(path)
    with pytest.raises(AttnkitError, match="does not exist"):
        LongBenchData.load(tmp_path / "none.jsonl")


def test_truncate_middle_keeps_both_ends():
    ids = list(range(100))
    assert truncate_middle(ids, 200) == ids
    cut = truncate_middle(ids, 11)
    assert cut == list(range(5)) + list(range(94, 100))


def test_prompt_ids_truncate_and_template():
    tok = build_byte_tokenizer()
    text = "BEGIN " + "x" * 500 + " END"
    ids = prompt_ids(tok, text, 64, chat=True)
    assert len(ids) <= 64 and ids[0] == tok.bos_token_id
    decoded = tok.decode(ids, skip_special_tokens=True)
    assert decoded.startswith("BEGIN") and decoded.endswith(" END")
    tok.chat_template = "{% for m in messages %}[user]{{ m['content'] }}{% endfor %}[bot]"
    ids = prompt_ids(tok, text, 64, chat=True)
    decoded = tok.decode(ids)
    assert len(ids) <= 64 and decoded.startswith("[user]BEGIN") and decoded.endswith(" END[bot]")
    plain = tok.decode(prompt_ids(tok, "short", 64, chat=False), skip_special_tokens=True)
    assert plain == "short"  # few-shot and code prompts: no template


def test_eval_on_longbench_data(model, tmp_path):
    data = LongBenchData.load(DATA)
    assert data.datasets() == ["hotpotqa", "gov_report", "trec", "passage_retrieval_en", "passage_count", "lcc",
                               "multifieldqa_zh"]
    tasks = ["longbench:" + d for d in ("hotpotqa", "trec", "lcc")]
    rows = harness.run_eval(model, tasks, [96], ["full", "window:window=32"], samples=3, data=data,
                            out_dir=tmp_path, progress=False)
    assert len(rows) == 6
    for row in rows:
        assert row["samples"] == 1 and 0.0 <= row["score"] <= 1.0 and row["depth_scores"] is None
    samples = data.samples(model, "hotpotqa", 96, 5)
    assert len(samples) == 1 and len(samples[0].prompt) <= 96 and samples[0].max_new_tokens == 32
    assert samples[0].meta["stop"] is None
    with pytest.raises(AttnkitError, match="unknown task 'longbench:musique'"):
        harness.run_eval(model, ["longbench:musique"], [96], ["full"], samples=1, data=data, progress=False)


def test_eval_cli_data(tmp_path, capsys):
    assert main(["eval", "--model", SPEC, "--data", str(DATA), "--tasks", "longbench:passage_count,longbench:gov_report",
                 "--lengths", "128", "--samples", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "longbench:passage_count" in out and "longbench:gov_report" in out
    rows = results_store.read_results(tmp_path)
    assert [r["task"] for r in rows] == ["longbench:passage_count", "longbench:gov_report"]


def test_metric_table_covers_longbench():
    assert set(longbench.DATASETS) >= {"narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                                       "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
                                       "passage_count", "passage_retrieval_en", "lcc", "repobench-p"}
