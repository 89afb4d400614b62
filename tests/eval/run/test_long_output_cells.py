"""The long-output tasks' cells (attnkit.eval.run.long_output_cells) through run_eval, sweeps and the CLI: every
method at an unlimited budget scores as full attention (the same bits per byte, the same answers), an evicting
method loses, the tokens go one per decoding step through the method's decode hooks, and what cannot run them is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import AttnkitError, load_model
from attnkit.cli import main
from attnkit.continuation import teacher_force
from attnkit.eval.data.long_output import CONTINUATION, RECALL
from attnkit.eval.run import harness
from attnkit.eval.run.results import read_results
from attnkit.eval.run.sweep import run_sweep, sweep_from_dict
from attnkit.eval.stats.table import format_table
from attnkit.methods.window import Window
from attnkit.recipe import Recipe
from attnkit.runner import token_nll

LENGTH, CONT, STRETCH = 128, 32, 32  # small: every method's decode hooks still run on each continuation token
PEER = Recipe(peer=("SnapKVPress", {"compression_ratio": 0.5}), name="kvpress:SnapKVPress")
# budgets at or above everything a cell holds (prompt + continuation, or prompt + stretch + question + answer)
UNLIMITED = ["h2o:budget_tokens=512", "snapkv:budget_tokens=512,window_size=8,decode_every=16",
             "tova:budget_tokens=512", "streaming:budget_tokens=512", "window:window=512",
             "quest:token_budget=512,dense_layers=0"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture(scope="module")
def rows(model):
    return harness.run_eval(model, [CONTINUATION, RECALL], [LENGTH], ["full", *UNLIMITED], samples=2, seed=1,
                            progress=False, continuation_tokens=CONT, stretch_tokens=STRETCH)


def _cells(rows, task):
    return {r["method_spec"]: r for r in rows if r["task"] == task}


def test_unlimited_budget_scores_as_full(rows):
    for task in (CONTINUATION, RECALL):
        cells = _cells(rows, task)
        full = cells["full"]
        for spec in UNLIMITED:
            assert cells[spec]["scores"] == pytest.approx(full["scores"], abs=1e-5), (task, spec)
            assert cells[spec]["predictions"] == full["predictions"], (task, spec)
    assert _cells(rows, RECALL)["full"]["score"] == 1.0  # the bundled model finds the key after the stretch


def test_rows_record_the_long_output_settings(rows):
    for row in rows:
        cont = row["task"] == CONTINUATION
        assert row["higher_is_better"] is not cont
        assert (row.get("continuation_tokens"), row.get("stretch_tokens")) == ((CONT, None) if cont else (None, STRETCH))
        assert json.loads(row["cell"])[-1] == ({"continuation_tokens": CONT} if cont else {"stretch_tokens": STRETCH})
        assert row["decode_tokens_per_s"] > 0 and row["peak_kv_bytes"] > 0
        assert row["batch_size"] == 2  # the samples ran as rows of one session
        if cont:
            assert row["predictions"] is None and row["depths"] is None and 0.2 < row["score"] < 4
        else:
            assert row["depth_scores"] and row["questions"] == [0, 0]
    assert "continuation: bits per byte" in format_table(rows)


def test_an_evicting_method_loses_bits_per_byte(model):
    rows = harness.run_eval(model, [CONTINUATION], [LENGTH], ["full", "window:window=32"], samples=2, progress=False,
                            continuation_tokens=64)
    full, window = rows[0], rows[1]
    assert window["score"] > full["score"]  # lower is better: the window forgets
    assert window["score_rel_full"] < 1
    assert window["peak_kv_bytes"] < full["peak_kv_bytes"]


def test_teacher_forcing_is_the_decode_path_one_token_per_step(model, monkeypatch):
    prompt = list(model.tokenizer("def f(x):\n    return x + 1\n" * 12).input_ids)
    cont = prompt[1:33]
    calls = []
    real = Window.decode_attention

    def counting(self, ctx, q, k, v):
        calls.append(q.shape[2])
        return real(self, ctx, q, k, v)

    monkeypatch.setattr(Window, "decode_attention", counting)
    got = teacher_force(model, [prompt, prompt], [cont, cont], "window:window=4096")
    layers = model.geometry.n_layers
    assert calls == [1] * (len(cont) - 1) * layers  # one token per step, every step through decode_attention
    # with nothing evicted, the same likelihoods as one prefill over prompt + continuation
    ref = token_nll(model, prompt + cont, "full")[-len(cont):].float()
    assert torch.allclose(got[0].nll, ref, atol=1e-4) and torch.equal(got[0].nll, got[1].nll)
    assert got[0].stats.new_tokens == len(cont) and got[0].stats.prompt_tokens == len(prompt)


@pytest.mark.parametrize("task", [CONTINUATION, RECALL])
def test_refusals_are_one_line(model, task):
    cases = [(dict(methods=["full"], protocols="query-agnostic"), "query-aware"),
             (dict(methods=["full", PEER]), "attnkit methods only"),
             (dict(methods=["full", {"name": "pl", "decode": {"speculate": "prompt_lookup"}}]), "speculative")]
    for kwargs, message in cases:
        with pytest.raises(AttnkitError, match=message) as err:
            harness.run_eval(model, [task], [LENGTH], samples=1, progress=False, continuation_tokens=8,
                             stretch_tokens=8, **kwargs)
        assert "\n" not in str(err.value)


def test_sweep_keys_and_resume(model, tmp_path):
    spec = {"model": "tiny", "tasks": [CONTINUATION], "lengths": [LENGTH], "samples": 1,
            "recipes": ["window:window=64"], "continuation_tokens": 16}
    sweep = sweep_from_dict(spec)
    assert sweep.long_output.continuation_tokens == 16 and sweep.to_dict()["continuation_tokens"] == 16
    assert sweep_from_dict({**spec, "stretch_tokens": 0}).long_output.stretch_tokens == 0
    with pytest.raises(AttnkitError, match="continuation_tokens"):
        sweep_from_dict({**spec, "continuation_tokens": 0})
    with pytest.raises(AttnkitError, match="query-aware"):
        sweep_from_dict({**spec, "protocol": "multi-query", "queries": 2})
    run_sweep(sweep, tmp_path, model=model, progress=False)
    run_sweep(sweep_from_dict({**spec, "continuation_tokens": 24}), tmp_path, model=model, progress=False)
    rows = read_results(tmp_path / "results.jsonl")
    assert sorted(r["continuation_tokens"] for r in rows) == [16, 16, 24, 24]  # another length is another cell
    run_sweep(sweep, tmp_path, model=model, progress=False)
    assert len(read_results(tmp_path / "results.jsonl")) == 4  # resumed: nothing ran again


def test_cli_flags(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"tasks": [CONTINUATION], "lengths": [LENGTH], "samples": 1, "recipes": ["full"]}))
    assert main(["eval", "--sweep", str(sweep), "--out", str(tmp_path / "o"), "--continuation-tokens", "8"]) != 0
    assert "--continuation-tokens" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny", "--tasks", CONTINUATION, "--lengths", "128", "--samples", "1",
                 "--continuation-tokens", "0"]) != 0
    assert "--continuation-tokens" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny", "--tasks", f"{CONTINUATION},{RECALL}", "--lengths", "128", "--samples",
                 "1", "--continuation-tokens", "8", "--stretch-tokens", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert CONTINUATION in out and RECALL in out
