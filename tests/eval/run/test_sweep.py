"""Recipes, sweeps (resumable after an interruption or a kill), kvpress peers as recipes, the decode floor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from attnkit import AttnkitError
from attnkit.bench.speed import decode_weight_bytes, format_bench, measure_bandwidth, run_bench
from attnkit.cli import main
from attnkit.eval.run import cells
from attnkit.eval.run import results as results_store
from attnkit.eval.run.sweep import load_sweep, run_sweep, sweep_from_dict
from attnkit.recipe import Recipe, as_recipe, load_recipe_file, peer
from helpers import ROOT

ROOT = ROOT
SPEC = "random:llama:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
SWEEP = {
    "model": SPEC, "samples": 2, "seed": 5, "tasks": ["passkey", "code_completion"], "lengths": [256],
    "budgets": [0.25, 0.5],
    "recipes": ["snapkv", "window", "streaming:budget=0.3",
                {"name": "pl", "decode": {"speculate": "prompt_lookup", "gamma": 3}}],
}
PASSKEY = dict(SWEEP, tasks=["passkey"])  # the sweep's cells of its cheaper task: every recipe


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _write(tmp_path: Path, data: dict, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in results_store.VOLATILE_FIELDS} for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    rows = run_sweep(sweep_from_dict(SWEEP), out, progress=False)
    return rows, out


# ---- recipes -------------------------------------------------------------------------------------


def test_recipe_forms(tmp_path):
    r = as_recipe({"name": "sp", "prefill": "minference:pattern=vertical_slash",
                   "cache": {"method": "snapkv", "params": {"budget": 0.3}}})
    assert r.method().name == "compose" and r.method().cache_method.budget == 0.3
    assert not r.takes_budget() and r.label == "sp"
    assert Recipe.from_dict(r.to_dict()).to_dict() == r.to_dict()
    open_ = as_recipe("minference+snapkv")
    assert open_.takes_budget() and open_.budget_role() == "cache"
    assert open_.with_budget(0.25, 1000).method().cache_method.budget == 0.25
    assert open_.with_budget(64).method().cache_method.budget_tokens == 64
    assert as_recipe("window").with_budget(0.25, 1000).method().window == 250
    spec = as_recipe({"decode": {"speculate": "prompt_lookup", "gamma": 4}})
    assert spec.method().name == "full" and spec.decode.gamma == 4 and not spec.is_full
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ncache: {method: h2o, params: {budget: 0.5}}\ndecode: null\n")
    assert load_recipe_file(path).method().name == "h2o"


@pytest.mark.parametrize("data,match", [
    ({"cache": "snapkv:budget=0.3", "decode": {"speculate": "prompt_lookup"}}, "verifies with full attention"),
    ({"decode": {"speculate": "guess"}}, "decode.speculate must be one of"),
    ({"decode": {"speculate": "self", "gamma": 0}}, "decode.gamma"),
    ({"decode": {"speculate": "self", "draft_lookup": "yes"}}, "decode.draft_lookup must be true or false"),
    ({"decode": {"speculate": "self", "draft_confidence": 1.2}}, "decode.draft_confidence must be a probability"),
    ({"prefill": "minference", "heads": "full"}, "cannot be combined"),
    ({"method": "window", "cache": "snapkv"}, "not both"),
    ({"cache": {"method": "snapkv", "extra": 1}}, "a part is a method spec"),
    ({"cache": "snapkv:budget=2.0"}, "budget must be a fraction"),
    ({"prefill": "nosuch"}, "unknown method 'nosuch'"),
])
def test_bad_recipes(data, match):
    with pytest.raises(AttnkitError, match=match):
        as_recipe(data)


def test_generate_with_a_speculative_recipe(small_llama):
    recipe = as_recipe({"decode": {"speculate": "prompt_lookup", "gamma": 3}})
    plain = as_recipe("full").generate(small_llama, "abc abc abc abc", max_new_tokens=6, stop_at_eos=False)
    spec = recipe.generate(small_llama, "abc abc abc abc", max_new_tokens=6, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids and spec.stats.rounds >= 1
    hierarchy = as_recipe({"decode": {"speculate": "self", "draft": "snapkv:budget_tokens=8,window_size=2",
                                      "draft_lookup": True, "gamma": 4}})
    spec = hierarchy.generate(small_llama, "abc abc abc abc", max_new_tokens=6, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids and "prompt_lookup" in spec.stats.draft
    confident = as_recipe({"decode": {"speculate": "self", "draft": "snapkv:budget_tokens=8,window_size=2",
                                      "draft_confidence": 0.4, "gamma": 4}})
    spec = confident.generate(small_llama, "abc abc abc abc", max_new_tokens=6, stop_at_eos=False)
    assert spec.token_ids == plain.token_ids and "stop<0.4" in spec.stats.draft


# ---- sweep files ---------------------------------------------------------------------------------


def test_example_sweep_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # the DuoAttention recipes name their calibration file from the repository's root
    sweep = load_sweep(ROOT / "sweeps" / "eviction_budgets.yaml")
    budgeted = ["window", "streaming", "h2o", "keyformer", "tova", "snapkv", "snapkv-adakv", "snapkv-pyramid",
                "expected_attention", "expected_attention-adakv", "knorm", "keydiff", "random", "lagkv", "cur",
                "observed_attention", "leverage", "non_causal_attention", "compactor", "cap", "qfilter",
                "expected_attention-stats", "finch", "snapkv-think", "keydiff-chunkkv", "keydiff-chunkkv-gated",
                "simlayerkv", "kvcompose", "kvgrad", "fastkvzip", "lukv", "rkv", "kvzip", "restorekv", "kvzap",
                "triattention", "minference+snapkv"]
    assert [r.label for r in sweep.recipes] == budgeted + ["duo@0.25", "duo@0.5", "duo@0.75"]
    assert sweep.budgets == [0.1, 0.3, 0.5, 0.7, 0.9] and sweep.samples == 20 and sweep.seeds == [0, 1, 2]
    assert sweep.tasks == ["niah_multikey", "needle_heldout", "passkey", "code_completion"] and sweep.lengths == [2048]
    assert sweep.protocols == ["query-aware", "query-agnostic"]
    entries = sweep.entries(2048)
    # full once, every budgeted recipe at five budgets (Keyformer and random at three seeds), simlayerkv (no budget)
    # and DuoAttention once per share
    assert entries[0].is_full and len(entries) == 1 + (len(budgeted) - 1 + 4) * 5 + 1 + 3
    assert sum(e.label.startswith("keyformer") for e in entries) == 15
    assert sum(e.label.startswith("random") for e in entries) == 15
    assert sum(e.label == "simlayerkv" for e in entries) == 1
    assert sweep.cell_count() == 4 * 2 * 205
    # every eviction method registered is in the sweep (the "every eviction method, old and new")
    from attnkit.methods.eviction import EvictionMethod
    from attnkit.methods.spec import METHODS
    evicting = {name for name, cls in METHODS.items() if issubclass(cls, EvictionMethod)}
    assert evicting - {"cam"} <= {r.label.split("-")[0] for r in sweep.recipes}  # cam: the file's header says why


@pytest.mark.parametrize("change,match", [
    ({"budgets": None}, "take a KV budget"),
    ({"budgets": [1.5]}, "0 < f <= 1"),
    ({"budgets": [0.5, 0.5]}, "duplicates"),
    ({"recipes": ["snapkv", "snapkv"]}, "must differ"),
    ({"tasks": ["passkee"]}, "unknown task 'passkee'"),
    ({"lengths": [1]}, "whole numbers >= 2"),
    ({"samples": 0}, "samples must be"),
    ({"colour": "red"}, "unknown key"),
    ({"recipes": ["kvpress:snapkv"]}, "press is named by its class"),
    ({"batch_size": 0}, "batch_size must be a whole number >= 1, got 0"),
    ({"batch_size": "4"}, "batch_size must be a whole number >= 1, got '4'"),
])
def test_bad_sweeps(change, match):
    data = dict(SWEEP, **change)
    with pytest.raises(AttnkitError, match=match):
        sweep_from_dict(data)


# ---- running and resuming ------------------------------------------------------------------------


def test_sweep_rows(reference):
    rows, out = reference
    labels = [r["method_spec"] for r in rows[:7]]
    assert labels == ["full", "snapkv@0.25", "snapkv@0.5", "window@0.25", "window@0.5", "streaming:budget=0.3", "pl"]
    assert len(rows) == 14 and results_store.read_results(out) == rows
    for row in rows:
        assert row["schema"] == results_store.SCHEMA and set(results_store.ROW_FIELDS) <= set(row)
        assert row["model"] == SPEC and row["samples"] == 2 and row["git_commit"] is not None
    window = next(r for r in rows if r["method_spec"] == "window@0.25")
    assert window["budget"] == 0.25 and window["method_params"] == {"window": 64}
    passkey = next(r for r in rows if r["task"] == "passkey" and r["method_spec"] == "snapkv@0.5")
    assert passkey["depth_scores"] == [[0.25, passkey["scores"][0]], [0.75, passkey["scores"][1]]]
    code_full = next(r for r in rows if r["task"] == "code_completion" and r["method_spec"] == "full")
    assert code_full["score_rel_full"] == 1.0 and code_full["depth_scores"] is None
    assert (out / "table.txt").is_file() and json.loads((out / "sweep.json").read_text())["budgets"] == [0.25, 0.5]
    # the default batch of 8 holds both samples, speculative decoding (pl) included
    assert window["batch_size"] == 2 and next(r for r in rows if r["method_spec"] == "pl")["batch_size"] == 2
    assert json.loads((out / "sweep.json").read_text())["batch_size"] == 8


def test_sweep_batch_size_keeps_the_scores(reference, tmp_path):
    """A sweep file's batch_size changes how the samples are generated, not what they score."""
    rows, _ = reference
    one = run_sweep(sweep_from_dict(dict(PASSKEY, batch_size=1)), tmp_path, progress=False)
    assert len(one) == 7 and {r["batch_size"] for r in one} == {1}  # every recipe, speculative decoding included
    assert _stable(one) == _stable([r for r in rows if r["task"] == "passkey"])


def test_interrupted_sweep_resumes_to_the_same_results(reference, tmp_path, monkeypatch):
    rows, ref_dir = reference
    rows = [r for r in rows if r["task"] == "passkey"]  # the sweep's cells of one task: every recipe's
    sweep = sweep_from_dict(PASSKEY)
    real = cells.run_cell
    calls = []

    def interrupted(model, task, recipe, items, bar, peers_, *batch_size):
        calls.append(recipe.label)
        if len(calls) == 4:  # the interruption comes in the middle of the fourth cell
            real(model, task, recipe, items[:1], bar, peers_, *batch_size)
            raise KeyboardInterrupt
        return real(model, task, recipe, items, bar, peers_, *batch_size)

    monkeypatch.setattr(cells, "run_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, tmp_path, progress=False)
    results = tmp_path / results_store.RESULTS_FILE
    assert len(results_store.read_results(results)) == 3
    with results.open("a") as fh:  # and a row cut off while being written
        fh.write('{"schema": 2, "cell": "half a row')
    monkeypatch.setattr(cells, "run_cell", real)
    resumed_calls = []
    monkeypatch.setattr(cells, "run_cell", lambda *a: resumed_calls.append(a[2].label) or real(*a))
    resumed = run_sweep(sweep, tmp_path, progress=False)
    assert len(resumed_calls) == len(rows) - 3  # finished cells are not run again
    ref_file = [r for r in results_store.read_results(ref_dir) if r["task"] == "passkey"]
    assert _stable(results_store.read_results(results)) == _stable(ref_file)
    assert _stable(resumed) == _stable(rows)
    again = run_sweep(sweep, tmp_path, progress=False)  # all done: nothing runs, nothing is appended
    assert len(resumed_calls) == len(rows) - 3 and len(again) == len(rows)
    assert len(results_store.read_results(results)) == len(rows)


PROTOCOL_FIELDS = ("method_seed", "protocol", "queries", "questions", "contexts", "context_prefills", "prefill_tokens",
                   "score_interval", "interval")


def test_a_results_directory_from_before_protocols_resumes(reference, tmp_path, monkeypatch):
    """Rows written before protocols existed (schema 2, keys without protocol/queries/method seed) are the
    query-aware cells of one question they measured: a rerun finds every cell done."""
    rows, _ = reference
    old = []
    for row in results_store.read_results(reference[1]):
        assert row["protocol"] == "query-aware" and row["queries"] == 1 and row["method_seed"] is None
        assert row["cell"] == json.dumps([row["model"], row["task"], row["length"], row["recipe_name"], row["budget"],
                                          row["samples"], SWEEP["seed"]])  # the key a schema-2 row has
        old.append(dict({k: v for k, v in row.items() if k not in PROTOCOL_FIELDS}, schema=2))
    (tmp_path / results_store.RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    calls = []
    monkeypatch.setattr(cells, "run_cell", lambda *a: calls.append(a[2].label))
    resumed = run_sweep(sweep_from_dict(SWEEP), tmp_path, progress=False)
    assert calls == [] and len(resumed) == len(rows) == len(old)
    assert (tmp_path / results_store.TABLE_FILE).read_text().strip()


def test_killed_sweep_resumes_to_the_same_results(reference, tmp_path):
    rows, ref_dir = reference
    path = _write(tmp_path, SWEEP)
    out = tmp_path / "out"
    results = out / results_store.RESULTS_FILE
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "attnkit.cli", "eval", "--sweep", str(path), "--out", str(out),
                             "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 180  # the subprocess imports torch and transformers first: slow on a busy machine
    while time.time() < deadline and proc.poll() is None:
        if results.is_file() and results.read_text().count("\n") >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert results.is_file(), proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    n_before = results.read_text().count("\n")
    assert n_before >= 2
    assert main(["eval", "--sweep", str(path), "--out", str(out), "--no-progress"]) == 0
    assert _stable(results_store.read_results(results)) == _stable(results_store.read_results(ref_dir))


def test_eval_cli_recipes_and_sweep_errors(tmp_path, capsys):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"name": "snap30", "cache": {"method": "snapkv", "params": {"budget": 0.3}}}))
    assert main(["eval", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1",
                 "--methods", "full", "--recipe", str(recipe), "--no-progress"]) == 0
    assert "snap30" in capsys.readouterr().out
    assert main(["eval", "--sweep", str(_write(tmp_path, SWEEP)), "--no-progress"]) == 2
    assert "--sweep needs --out" in capsys.readouterr().err
    assert main(["eval", "--sweep", str(_write(tmp_path, SWEEP)), "--out", str(tmp_path), "--tasks", "x"]) == 2
    assert "drop --tasks" in capsys.readouterr().err
    assert main(["eval", "--sweep", str(_write(tmp_path, SWEEP)), "--out", str(tmp_path), "--only", "snapkv,h2o"]) == 2
    err = capsys.readouterr().err
    assert "--only 'snapkv,h2o': h2o is not a recipe of" in err and "its recipes: snapkv, window" in err
    assert err.count("\n") == 1
    assert main(["eval", "--methods", "full", "--only", "snapkv"]) == 2
    assert "--only picks recipes of a sweep" in capsys.readouterr().err


def test_only_runs_the_named_recipes_with_full(reference, tmp_path, capsys):
    rows, _ = reference
    out = tmp_path / "out"
    assert main(["eval", "--sweep", str(_write(tmp_path, SWEEP)), "--out", str(out), "--only", "window",
                 "--no-progress"]) == 0
    got = results_store.read_results(out / results_store.RESULTS_FILE)
    want = [r for r in rows if r["method_spec"] in ("full", "window@0.25", "window@0.5")]
    assert len(want) == 6 and len(got) == 6  # (full + window at two budgets) x two tasks
    assert _stable(got) == _stable(want)


def test_protocol_runs_only_the_named_protocols_of_a_sweep(reference, tmp_path, capsys):
    """A sweep of two protocols: ``--protocol query-aware`` writes the rows of a one-protocol sweep; then
    ``--protocol query-agnostic --only window`` adds that protocol's cells of full and window alone; a protocol the
    sweep does not name is refused in one line."""
    rows, _ = reference
    both = _write(tmp_path, dict(SWEEP, protocols=["query-aware", "query-agnostic"], tasks=["passkey"],
                                 recipes=SWEEP["recipes"][:3]))  # the speculative recipe runs query-aware only
    out = tmp_path / "out"
    assert main(["eval", "--sweep", str(both), "--out", str(out), "--protocol", "query-aware", "--no-progress"]) == 0
    got = results_store.read_results(out / results_store.RESULTS_FILE)
    assert _stable(got) == _stable([r for r in rows if r["task"] == "passkey" and r["recipe_name"] != "pl"])
    assert main(["eval", "--sweep", str(both), "--out", str(out), "--protocol", "query-agnostic", "--only", "window",
                 "--no-progress"]) == 0
    got = results_store.read_results(out / results_store.RESULTS_FILE)[len(got):]
    assert [(r["protocol"], r["method_spec"]) for r in got] == [
        ("query-agnostic", s) for s in ("full", "window@0.25", "window@0.5")]
    capsys.readouterr()
    assert main(["eval", "--sweep", str(both), "--out", str(out), "--protocol", "multi-query"]) == 2
    err = capsys.readouterr().err
    assert "--protocol 'multi-query': multi-query is not a protocol of" in err and err.count("\n") == 1


# ---- peers ---------------------------------------------------------------------------------------


def test_peer_spec_parsing():
    assert peer.parse_peer_spec("kvpress:SnapKVPress:compression_ratio=0.5,window_size=8") == \
        ("SnapKVPress", {"compression_ratio": 0.5, "window_size": 8})
    assert peer.parse_peer_spec("kvpress:StreamingLLMPress") == ("StreamingLLMPress", {})
    for bad, match in (("kvpress:snap", "named by its class"), ("kvpress:SnapKVPress:ratio", "key=value")):
        with pytest.raises(AttnkitError, match=match):
            peer.parse_peer_spec(bad)


def test_peer_without_kvpress_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(peer.ENV_VAR, str(tmp_path / "no-python"))
    with pytest.raises(AttnkitError, match="kvpress is not installed"):
        as_recipe("kvpress:SnapKVPress")
    with pytest.raises(AttnkitError, match="kvpress is not installed"):
        sweep_from_dict(dict(SWEEP, recipes=["kvpress:SnapKVPress"]))


def test_peer_budgets_and_tasks(monkeypatch):
    if peer.kvpress_python() is None:
        monkeypatch.setenv(peer.ENV_VAR, sys.executable)  # parsing only: nothing is started
    r = as_recipe("kvpress:SnapKVPress:window_size=8")
    assert r.takes_budget() and r.with_budget(0.25).peer == ("SnapKVPress", {"window_size": 8, "compression_ratio": 0.75})
    with pytest.raises(AttnkitError, match="fractional budgets"):
        r.with_budget(64)
    with pytest.raises(AttnkitError, match="perplexity"):
        sweep_from_dict(dict(SWEEP, tasks=["perplexity"], recipes=["kvpress:SnapKVPress"]))


@pytest.mark.skipif(peer.kvpress_python() is None, reason="kvpress is not installed (.venv-kvpress)")
def test_kvpress_in_the_same_table(tmp_path):
    sweep = sweep_from_dict(dict(SWEEP, tasks=["passkey"], samples=1, budgets=[0.5],
                                 recipes=["snapkv:window_size=8,kernel_size=1", "kvpress:SnapKVPress:window_size=8,kernel_size=1"]))
    rows = run_sweep(sweep, tmp_path, progress=False)
    ours, theirs = rows[1], rows[2]
    assert theirs["method"] == "kvpress:SnapKVPress" and theirs["method_params"]["compression_ratio"] == 0.5
    assert theirs["peak_kv_bytes"] is None and 0 < theirs["final_kv_bytes"] < rows[0]["final_kv_bytes"]
    assert theirs["predictions"][0] is not None and theirs["score"] is not None
    assert ours["method_spec"] == "snapkv:window_size=8,kernel_size=1@0.5"


@pytest.mark.parametrize("sizes,match", [([], "batch_sizes must be a non-empty list"),
                                         ([1, 0], "every one of batch_sizes must be a whole number >= 1, got 0"),
                                         ([2, 2], "batch_sizes has duplicates"),
                                         ([1, 2], "pl decodes speculatively, one prompt at a time")])
def test_bench_batch_sizes_refused(small_llama, sizes, match):
    pl = {"name": "pl", "decode": {"speculate": "prompt_lookup", "gamma": 3}}
    with pytest.raises(AttnkitError, match=match):
        run_bench(small_llama, 40, 3, ["full", pl], repeats=1, batch_sizes=sizes)


# ---- the decode floor ----------------------------------------------------------------------------


def test_bandwidth_and_decode_floor(small_llama, capsys):
    bw = measure_bandwidth("cpu", 8 * 2**20, repeats=3)
    assert 1e8 < bw < 1e13
    weights = decode_weight_bytes(small_llama)
    all_params = sum(p.numel() * 4 for p in small_llama.hf.parameters())
    emb = small_llama.hf.get_input_embeddings().weight
    assert weights == all_params - emb.numel() * 4 + emb.shape[1] * 4
    rows = run_bench(small_llama, 64, 4, ["full", "window:window=16"], repeats=1, bandwidth=bw, batch_sizes=[1, 2])
    for row in rows[:2]:
        expected = 1000 * (weights + row["final_kv_bytes"]) / bw
        assert row["decode_floor_ms_per_token"] == pytest.approx(expected)
    for row in rows[2:]:  # a batch's step reads the weights once and yields a token per sequence
        assert row["batch_size"] == 2 and row["final_kv_bytes_total"] == 2 * row["final_kv_bytes"]
        expected = 1000 * (weights + row["final_kv_bytes_total"]) / bw / 2
        assert row["decode_floor_ms_per_token"] == pytest.approx(expected)
    assert rows[1]["decode_floor_ms_per_token"] < rows[0]["decode_floor_ms_per_token"]
    assert rows[2]["decode_floor_ms_per_token"] < rows[0]["decode_floor_ms_per_token"]
    assert "floor ms" in format_bench(rows)
    assert main(["bench", "--model", SPEC, "--context", "64", "--new-tokens", "3", "--repeats", "1",
                 "--bandwidth-mib", "8", "--methods", "full"]) == 0
    captured = capsys.readouterr()
    assert "floor ms" in captured.out and "memory bandwidth" in captured.err
