"""Evaluation protocols (attnkit.eval.data.protocols): full attention predicts the same under query-aware, query-agnostic
and multi-query; multi-query prefills each context once (counted in the rows); rows record the protocol; recipes,
tasks and settings a protocol cannot honour are refused in one line; every generated task says where its question
starts; a stochastic method runs over seeds."""

from __future__ import annotations

import pytest
import torch

from attnkit import AttnkitError, load_model
from attnkit.cli import main
from attnkit.eval.data.protocols import PROTOCOLS, refusal
from attnkit.eval.data.sample import split_ids
from attnkit.eval.data.task_registry import TASKS
from attnkit.eval.run import harness
from attnkit.eval.run.sweep import run_sweep, sweep_from_dict
from attnkit.eval.stats.table import format_table
from attnkit.recipe import Recipe, as_recipe

SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model(SPEC)


@pytest.fixture(scope="module")
def rows(model):
    return harness.run_eval(model, ["niah_multikey", "code_completion"], [512], ["full", "snapkv:budget=0.3"],
                            samples=2, protocols=list(PROTOCOLS), queries=3, progress=False)


def test_full_predicts_the_same_under_every_protocol(rows):
    for task in ("niah_multikey", "code_completion"):
        full = {r["protocol"]: r for r in rows if r["task"] == task and r["method"] == "full"}
        assert set(full) == set(PROTOCOLS)
        first = full["query-aware"]
        for r in full.values():
            assert r["predictions"] == first["predictions"] and r["scores"] == first["scores"]
            assert r["questions"] == first["questions"]
    # 2 contexts of niah_multikey, 3 questions each (the task's own, then two other keys); code has one question
    mk = next(r for r in rows if r["task"] == "niah_multikey")
    assert mk["questions"] == [0, 1, 2, 0, 1, 2] and mk["contexts"] == 2 and mk["samples"] == 6
    code = next(r for r in rows if r["task"] == "code_completion")
    assert code["questions"] == [0, 0] and code["contexts"] == 2


def test_multi_query_prefills_each_context_once(rows):
    by = {(r["protocol"], r["method"]): r for r in rows if r["task"] == "niah_multikey"}
    for method in ("full", "snapkv"):
        aware, agnostic, multi = (by[p, method] for p in PROTOCOLS)
        assert aware["context_prefills"] == agnostic["context_prefills"] == 6  # one per question
        assert multi["context_prefills"] == 2  # one per context
        assert multi["prefill_tokens"] * 3 == agnostic["prefill_tokens"]  # the same contexts, once instead of 3x
        assert agnostic["prefill_tokens"] < aware["prefill_tokens"]  # the questions are not prefilled
    assert all(r["protocol"] in PROTOCOLS and r["queries"] == 3 for r in rows)


def test_rows_carry_intervals_and_table_shows_protocols(rows):
    for r in rows:
        lo, hi = r["score_interval"]
        assert lo <= r["score"] <= hi and r["interval"] in ("wilson", "bootstrap")
    table = format_table(rows)
    assert "protocol" in table.splitlines()[0] and "multi-query" in table and "[" in table


def test_every_generated_task_says_where_its_question_starts(model):
    for name, task in TASKS.items():
        sample = task.make(model.tokenizer, 512, depth=0.5, seed=0)
        assert sample.question is not None, name
        context, question = split_ids(model.tokenizer, sample)
        assert context + question == model.tokenizer(sample.prompt).input_ids
        assert (len(question) == 0) == (name == "code_completion") and len(context) > 400
        for asked in sample.questions(4)[1:]:  # follow-ups keep the context and change the question
            assert asked.context == sample.context and asked.question != sample.question and asked.query > 0


def test_refusals_are_one_line(model):
    speculative = as_recipe({"decode": {"speculate": "prompt_lookup"}})
    peer = Recipe(peer=("SnapKVPress", {}), name="kvpress:SnapKVPress")
    for recipe, fragment in ((speculative, "speculative decoding"), (peer, "kvpress worker")):
        message = refusal(recipe, "query-agnostic")
        assert fragment in message and "query-agnostic" in message and recipe.label in message
        assert refusal(recipe, "query-aware") is None
    cases = [
        (dict(tasks=["perplexity"], protocols="query-agnostic"), "task 'perplexity' has no question"),
        (dict(protocols="multi-query"), "give queries >= 2"),
        (dict(protocols="sideways"), "unknown protocol 'sideways'"),
        (dict(protocols=["query-aware", "query-aware"]), "duplicates"),
        (dict(queries=0), "queries must be a whole number >= 1"),
        (dict(seeds=[1, 1]), "seeds has duplicates"),
        (dict(methods=[speculative], protocols="query-agnostic"), "speculative decoding"),
    ]
    for kwargs, message in cases:
        args = dict(tasks=["passkey"], methods=["full"]) | kwargs
        with pytest.raises(AttnkitError, match=message) as err:
            harness.run_eval(model, args.pop("tasks"), [256], args.pop("methods"), samples=1, progress=False, **args)
        assert "\n" not in str(err.value)


def test_stochastic_method_runs_over_seeds(model, tmp_path):
    sweep = sweep_from_dict({"model": SPEC, "samples": 2, "tasks": ["passkey"], "lengths": [256],
                             "budgets": [0.3], "recipes": ["keyformer", "h2o"], "seeds": [0, 1],
                             "protocols": ["query-agnostic"]})
    assert sweep.cell_count() == 4  # full, keyformer at seeds 0 and 1, h2o (not stochastic) once
    rows = run_sweep(sweep, tmp_path, progress=False, model=load_model(SPEC))
    seeds = [(r["method"], r["method_seed"]) for r in rows]
    assert seeds == [("full", None), ("keyformer", 0), ("keyformer", 1), ("h2o", None)]
    assert {r["method_params"].get("seed") for r in rows if r["method"] == "keyformer"} == {0, 1}
    assert len({r["cell"] for r in rows}) == 4 and all(r["protocol"] == "query-agnostic" for r in rows)
    table = format_table(rows)
    assert table.count("keyformer@0.3") == 1 and "mean over 2 seeds" in table
    again = run_sweep(sweep, tmp_path, progress=False, model=load_model(SPEC))  # resumed: nothing to run
    assert [r["run_id"] for r in again] == [r["run_id"] for r in rows]
    with pytest.raises(AttnkitError, match="give protocol or protocols, not both"):
        sweep_from_dict({"samples": 1, "tasks": ["passkey"], "lengths": [256], "recipes": ["full"],
                         "protocol": "query-aware", "protocols": ["query-aware"]})


def test_eval_cli_protocols(tmp_path, capsys):
    assert main(["eval", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1",
                 "--methods", "full", "--protocol", "query-agnostic,multi-query", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "query-agnostic" in out and "multi-query" in out
    assert main(["eval", "--model", SPEC, "--tasks", "perplexity", "--lengths", "256", "--samples", "1",
                 "--protocol", "query-agnostic", "--no-progress"]) == 2
    assert "has no question" in capsys.readouterr().err
