"""The evaluation harness (attnkit.eval.run.harness), the task scorers, and the train/eval split."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from attnkit import AttnkitError, load_model
from attnkit.cli import main
from attnkit.eval.data import corpus, task_registry, tasks
from attnkit.eval.data.tasks import TASKS, Sample, edit_similarity, string_match_score
from attnkit.eval.run import cells, harness
from attnkit.eval.run import results as results_store
from attnkit.eval.stats.table import format_table

SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
METHODS = ["full", "window:window=64"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(SPEC)


@pytest.fixture(scope="module")
def rows_and_dir(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    rows = harness.run_eval(model, ["passkey", "perplexity"], [256], METHODS, samples=2, seed=3, out_dir=out,
                            progress=False)
    return rows, out


def test_rows_have_every_field(rows_and_dir):
    rows, _ = rows_and_dir
    assert len(rows) == 4  # 2 tasks x 1 length x 2 methods
    for row in rows:
        assert set(results_store.ROW_FIELDS) <= set(row)
        assert row["model"] == SPEC and row["length"] == 256 and row["samples"] == 2
        assert len(row["scores"]) == 2 and row["score"] == pytest.approx(sum(row["scores"]) / 2)
        assert row["seeds"] == [3, 4]
        assert set(row["versions"]) == {"attnkit", "torch", "transformers", "python"}
        assert row["wall_s"] >= 0 and row["prefill_s"] > 0
    window = [r for r in rows if r["method"] == "window"]
    assert all(r["method_params"] == {"window": 64} and r["method_spec"] == "window:window=64" for r in window)
    passkey = [r for r in rows if r["task"] == "passkey"]
    for row in passkey:
        assert row["depths"] == [0.25, 0.75]
        assert row["higher_is_better"] is True
        assert len(row["predictions"]) == 2 and not any("\n" in p for p in row["predictions"])  # stop="\n"
        assert row["peak_kv_bytes"] > 0 and row["final_kv_bytes"] > 0
    by_method = {r["method"]: r for r in passkey}
    assert by_method["window"]["peak_kv_bytes"] < by_method["full"]["peak_kv_bytes"]
    # the default batch holds both samples; perplexity is scored by a prefill per sample
    assert [r["batch_size"] for r in rows] == [2, 2, 1, 1]
    assert all(r["throughput_tokens_per_s"] > 0 for r in passkey)
    assert all(r["throughput_tokens_per_s"] is None for r in rows if r["task"] == "perplexity")


def test_eval_out_twice_keeps_one_row_per_cell(tmp_path, capsys):
    args = ["eval", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1", "--out", str(tmp_path),
            "--no-progress", "--methods"]
    assert main([*args, "full,window:window=64"]) == 0
    first = results_store.read_results(tmp_path)
    assert len(first) == 2
    capsys.readouterr()
    assert main([*args, "full,window:window=64"]) == 0  # nothing new to run: the rows are those of the first run
    out = capsys.readouterr()
    assert "2 of 2 cells were already in" in out.err and "window:window=64" in out.out
    assert results_store.read_results(tmp_path) == first
    assert main([*args, "full,window:window=32"]) == 0  # a new method: only its cell runs, full is reused
    rows = results_store.read_results(tmp_path)
    assert rows[:2] == first and [r["method_spec"] for r in rows[2:]] == ["window:window=32"]
    assert rows[2]["score_rel_full"] == cells.rel_full(rows[2]["score"], first[0]["score"], True)


def test_full_row_is_relative_one(rows_and_dir):
    rows, _ = rows_and_dir
    ppl_full = next(r for r in rows if r["task"] == "perplexity" and r["method"] == "full")
    assert ppl_full["score_rel_full"] == 1.0
    ppl_window = next(r for r in rows if r["task"] == "perplexity" and r["method"] == "window")
    assert ppl_window["score_rel_full"] == pytest.approx(ppl_full["score"] / ppl_window["score"])


def test_relative_for_higher_is_better_task(model, monkeypatch):
    fake = dataclasses.replace(TASKS["passkey"], score=lambda prediction, sample: 0.5)
    monkeypatch.setitem(task_registry.TASKS, "passkey", fake)
    rows = harness.run_eval(model, ["passkey"], [256], ["window:window=64", "full"], samples=1, progress=False)
    assert [r["method"] for r in rows] == ["full", "window"]  # full runs first
    assert all(r["score_rel_full"] == 1.0 for r in rows)
    rows = harness.run_eval(model, ["passkey"], [256], ["window:window=64"], samples=1, progress=False)
    assert rows[0]["score_rel_full"] is None  # no full to compare with


def test_perplexity_of_random_model_is_about_eight_bits(rows_and_dir):
    rows, _ = rows_and_dir
    for row in rows:
        if row["task"] == "perplexity":
            assert row["higher_is_better"] is False
            assert all(math.isfinite(s) and 5 < s < 12 for s in row["scores"])  # log2(259) ~ 8.02


def test_jsonl_and_table_written(rows_and_dir):
    rows, out = rows_and_dir
    lines = (out / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(rows))
    assert results_store.read_results(out) == json.loads(json.dumps(rows))
    table = (out / "table.txt").read_text()
    assert "passkey" in table and "perplexity" in table and "window:window=64" in table


def test_same_seed_same_results(model, rows_and_dir):
    rows, _ = rows_and_dir
    again = harness.run_eval(model, ["passkey", "perplexity"], [256], METHODS, samples=2, seed=3, progress=False)
    assert [r["scores"] for r in again] == [r["scores"] for r in rows]
    assert [r["predictions"] for r in again] == [r["predictions"] for r in rows]


def test_explicit_depths(model):
    rows = harness.run_eval(model, ["kv_retrieval"], [256], ["full"], samples=2, depths=[0.0, 1.0],
                            progress=False)
    assert rows[0]["depths"] == [0.0, 0.0, 1.0, 1.0] and rows[0]["samples"] == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(tasks=["passkey", "nope"]), "unknown task 'nope'"),
    (dict(tasks=[]), "tasks must be a non-empty list"),
    (dict(lengths=[]), "lengths must be a non-empty list"),
    (dict(methods=[]), "methods must be a non-empty list"),
    (dict(samples=0), "samples must be an integer >= 1"),
    (dict(lengths=[64]), "too short"),
    (dict(lengths=[10**6]), "exceeds"),
    (dict(methods=["nope"]), "unknown method"),
    (dict(depths=[1.5]), "depths"),
    (dict(batch_size=0), "batch_size must be a whole number >= 1, got 0"),
])
def test_bad_input(model, kwargs, message):
    args = dict(tasks=["passkey"], lengths=[256], methods=["full"], samples=1, progress=False)
    args.update(kwargs)
    with pytest.raises(AttnkitError, match=message):
        harness.run_eval(model, **args)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _outcome(rows):
    return [(r["task"], r["method_spec"], r["scores"], r["predictions"]) for r in rows]


@pytest.mark.parametrize("methods", [["full", "window:window=64"], ["snapkv:budget=0.3", "h2o:budget=0.3"],
                                     [{"name": "lookup", "decode": {"speculate": "prompt_lookup", "gamma": 3}}]])
def test_batched_eval_scores_as_one_at_a_time(tiny, methods):
    """Samples generated 4 at a time (batches of 4 and 1) score and predict exactly as one at a time, on the
    bundled model, for full attention and window, for eviction methods (whose choices are per sequence) and
    for speculative decoding (each sequence accepts its own drafts). One task: its answers, copied from the
    prompt, run to different lengths in a batch."""
    args = dict(tasks=["kv_retrieval"], lengths=[256], methods=methods, samples=5, seed=1, progress=False)
    one = harness.run_eval(tiny, batch_size=1, **args)
    four = harness.run_eval(tiny, batch_size=4, **args)
    assert _outcome(four) == _outcome(one)
    assert [r["batch_size"] for r in one] == [1] * len(one) and [r["batch_size"] for r in four] == [4] * len(four)
    assert all(len(set(r["predictions"])) > 1 for r in one)  # real answers, sample by sample
    if "full" in methods:
        assert any(any(r["scores"]) for r in one)  # tiny finds some: scores that could differ
    for row in four:
        assert row["prefill_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["throughput_tokens_per_s"] > 0
        assert row["peak_kv_bytes"] == next(r for r in one if r["cell"] == row["cell"])["peak_kv_bytes"]


def test_generation_calls_keep_settings_apart():
    """Samples with another token limit or stop string go into another generate call; order is kept."""
    Item = dataclasses.make_dataclass("Item", ["max_new_tokens", "meta"])
    items = [Item(8, {}), Item(8, {}), Item(16, {}), Item(8, {"stop": "."}), Item(8, {}), Item(16, {})]
    assert cells.generation_calls(items, 2) == [[0, 1], [4], [2, 5], [3]]
    assert cells.generation_calls(items, 8) == [[0, 1, 4], [2, 5], [3]]


def test_unknown_task_lists_available(model):
    with pytest.raises(AttnkitError, match="perplexity"):
        harness.run_eval(model, ["nope"], [256], ["full"], samples=1, progress=False)


def test_format_table():
    rows = [
        dict(task="passkey", length=1024, method="full", method_params={}, method_spec="full", score=0.5,
             higher_is_better=True, score_rel_full=1.0, samples=4, model="m"),
        dict(task="passkey", length=1024, method="window", method_params={"window": 8},
             method_spec="window:window=8", score=0.25, higher_is_better=True, score_rel_full=0.5, samples=4),
        dict(task="perplexity", length=1024, method="window", method_params={"window": 8},
             method_spec="window:window=8", score=2.5, higher_is_better=False, score_rel_full=None, samples=4),
    ]
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["task", "length", "full", "window:window=8"]
    assert "50.0%" in lines[2] and "25.0% (0.50x)" in lines[2]
    assert lines[3].split() == ["perplexity", "1024", "-", "2.500"]
    assert format_table([]) == "(no results)"


# --------------------------------------------------------------------------------------------------
# scorers and splits (attnkit.eval.data.tasks, attnkit.eval.data.corpus)


def test_code_completion_scores_the_first_code_line_after_blank_and_comment_lines(model):
    """LongBench lcc scores the first predicted line that is no comment, after leading newlines: a model that
    writes a blank line or a comment first is scored on the code line after it, so a code sample's generation
    must not stop at the first newline (it runs to its token limit)."""
    sample = TASKS["code_completion"].make(model.tokenizer, 256, seed=3)
    assert cells.stop_of(sample) is None and sample.max_new_tokens > 16
    line = sample.answers[0]
    assert tasks.code_score("\n\n    # a comment first\n" + line + "\nx = 1", sample) == 1.0
    assert tasks.code_score(line[: len(line) // 2], sample) < 1.0
    assert cells.stop_of(TASKS["passkey"].make(model.tokenizer, 256, seed=3)) == "\n"


def test_edit_similarity_by_hand():
    # LCS("kitten", "sitting") = "ittn" (4): 2 * 4 / (6 + 7)
    assert edit_similarity("kitten", "sitting") == pytest.approx(8 / 13)
    assert edit_similarity("abc", "abc") == 1.0
    assert edit_similarity("abc", "xyz") == 0.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("", "a") == 0.0


def test_string_match_score_fraction():
    sample = Sample("t", "p", ("111", "222", "333", "444"), " 111\n", 10, 0.5, 0, 8)
    assert string_match_score("111 and 333\n222 444", sample) == 0.5  # only the first line counts
    assert string_match_score("\n\n111 222 333 444", sample) == 1.0  # leading newlines skipped
    assert string_match_score("", sample) == 0.0


def test_eval_and_train_samples_differ(model, monkeypatch):
    # the real train haystack is the whole standard library (~10 MB, ~15 s to tokenize): use a slice of it
    train_text = "\n".join(corpus.read_text(p) for p in corpus.stdlib_files("train")[:10])  # ~70k tokens
    train_ids = model.tokenizer.encode(train_text, add_special_tokens=False)  # once, not for every prompt made
    real = tasks._haystack_ids

    def haystack_ids(tokenizer, split):
        if split == "train":
            assert tokenizer is model.tokenizer
            return list(train_ids)
        return real(tokenizer, split)

    monkeypatch.setattr(tasks, "_haystack_ids", haystack_ids)
    for name in TASKS:
        ev = TASKS[name].make(model.tokenizer, 512, depth=0.5, seed=0, split="eval")
        tr = TASKS[name].make(model.tokenizer, 512, depth=0.5, seed=0, split="train")
        assert ev.prompt != tr.prompt, name
        assert ev == TASKS[name].make(model.tokenizer, 512, depth=0.5, seed=0, split="eval"), name


def test_corpus_splits_are_disjoint():
    train, heldout = corpus.stdlib_files("train"), corpus.stdlib_files("heldout")
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(heldout) == len(corpus.HELD_OUT_FILES)
