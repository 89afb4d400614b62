"""``attnkit tune``: the space of recipes, the successive-halving rules on hand-made evidence, and a whole tune on a
small random model: its files, a rerun that generates nothing, an interrupted run that resumes to the same rows
and decisions, the report's tune section, and one-line errors."""

from __future__ import annotations

import fcntl
import json

import pytest
import torch
import yaml

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.run import cells
from attnkit.eval.run import results as results_store
from attnkit.eval.run.lock import LOCK_FILE
from attnkit.eval.tune import search
from attnkit.eval.tune.rules import DOMINATED, FLOOR, HALVING, cell_summary, choose, eliminate, pareto, summarize
from attnkit.eval.tune.search import TuneSettings, run_tune, winner_entry
from attnkit.eval.tune.space import TARGETS, candidates, combinations, default_space, space_from_dict
from attnkit.recipe import load_recipe_file
from helpers import SMALL

SPEC = f"random:llama:{SMALL}"
SPACE = {"cache": ["full", "snapkv"], "budgets": [0.5], "quantize": ["none", 2]}
SETTINGS = dict(model=SPEC, tasks=["passkey", "code_completion"], lengths=[256], samples=1, rounds=2,
                space=space_from_dict(SPACE))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in results_store.VOLATILE_FIELDS} for r in rows]


def _decisions(log: dict) -> list:
    """Every round's candidates, survivors and eliminations, and the winner (not the timings of the evidence)."""
    rounds = [(e["candidates"], e["kept"], [(x["candidate"], x["rule"]) for x in e["eliminated"]]) for e in log["rounds"]]
    return [*rounds, (log["winner"]["candidate"], log["winner"]["recipe"])]


@pytest.fixture
def reports(monkeypatch) -> list:
    """The HTML reports run_tune asks for, not drawn (the whole tune's test checks its report): their paths."""
    asked = []
    monkeypatch.setattr(search, "write_report", lambda results, out: asked.append(out))
    return asked


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    return run_tune(TuneSettings(**SETTINGS), out, progress=False), out


# ---- the space -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_default_spaces_build_every_candidate(target):
    cands, skipped = candidates(space_from_dict(default_space(target, "tiny")), [1024, 2048], "query-aware")
    assert cands and not skipped
    ids = [c.id for c in cands]
    assert len(set(ids)) == len(ids) and "full" not in ids
    speculation = [i for i in ids if i.startswith("speculate:")]
    assert bool(speculation) == (target == "decode")  # lossless: it can only win on speed
    assert any(i.startswith(("minference", "a_shape")) for i in ids) == (target == "prefill")


def test_space_combinations_and_skips():
    space = space_from_dict({"prefill": ["full", "minference"], "cache": ["full", "snapkv", "streaming"],
                             "budgets": [0.25], "allocation": ["uniform", "adaptive"], "quantize": ["none", 4],
                             "decode": ["none", {"speculate": "prompt_lookup"}], "recipes": ["h2o:budget=0.3"]})
    combos = combinations(space)
    assert "snapkv:head_budgets=adaptive+kivi:bits=4" in combos and "full+kivi:bits=4" in combos
    assert not any(isinstance(c, str) and "streaming:head_budgets" in c for c in combos)  # streaming has no heads
    assert {"decode": {"speculate": "prompt_lookup"}} in combos and combos[-1] == "h2o:budget=0.3"
    cands, skipped = candidates(space, [512], "query-agnostic")
    ids = [c.id for c in cands]
    assert "snapkv:head_budgets=adaptive@0.25" in ids and "minference+snapkv@0.25" in ids and "h2o:budget=0.3" in ids
    assert [s["recipe"] for s in skipped if "protocol" in s["why"]] == ["speculate:prompt_lookup"]
    assert cands[0].recipe(512).budget == 0.25 or cands[0].budget is None


@pytest.mark.parametrize("data,match", [
    ({"cache": ["snapkv"], "budget": [0.5]}, "unknown key(s) budget; allowed: prefill, cache"),
    ({"cache": ["nope"]}, "unknown method 'nope'"),
    ({"cache": ["snapkv+kivi"]}, "names one method"),
    ({"allocation": ["sideways"]}, "allocation must be one of"),
    ({"quantize": ["snapkv"]}, "quantize must be none, a number of bits"),
    ({"decode": ["fast"]}, "decode options are none or a mapping"),
    ({"decode": [{"speculate": "guess"}]}, "decode.speculate must be one of"),
    ({"budgets": [1.5]}, "0 < f <= 1"),
    ({"cache": []}, "cache must be a non-empty list"),
    ([1, 2], "a space must be a mapping"),
])
def test_bad_spaces(data, match):
    with pytest.raises(AttnkitError, match=match.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        space_from_dict(data)


@pytest.mark.parametrize("change,match", [
    ({"floor": 1.5}, "floor"), ({"floor": 0}, "floor"), ({"target": "ram"}, "target must be one of"),
    ({"eta": 1}, "eta"), ({"rounds": 0}, "rounds must be a whole number >= 1"),
    ({"tasks": ["passkey", "riddles"]}, "unknown task 'riddles'"), ({"lengths": [1]}, "lengths must be integers >= 2"),
    ({"protocol": "sideways"}, "unknown protocol"), ({"protocol": "multi-query", "queries": 1}, "queries >= 2"),
])
def test_bad_settings_are_one_line(change, match):
    with pytest.raises(AttnkitError, match=match):
        TuneSettings(**dict(SETTINGS, **change)).check()


def test_rounds_draw_fresh_samples():
    plan = TuneSettings(tasks=["passkey"], lengths=[128], samples=2, rounds=3, eta=3, seed=5).plan()
    assert plan == [(2, 5), (6, 7), (18, 13), (18, 31)]  # the last: the confirmation's


# ---- the rules, on hand-made evidence ---------------------------------------------------------------------------

def _row(scores, kv=50.0, decode=10.0, prefill=1.0):
    return {"scores": scores, "higher_is_better": True, "peak_kv_bytes": kv, "decode_tokens_per_s": decode,
            "prefill_s": prefill}


def _summary(cid, scores, full, kv=50.0, floor=0.95, target="kv"):
    return summarize(cid, {("passkey", 128): [(_row(scores, kv), _row(full, 100.0))]}, floor, target)


def test_cell_summary_intervals_and_floor():
    c = cell_summary("passkey", 128, [(_row([1, 1, 1, 1]), _row([1, 1, 1, 1]))], 0.95)
    assert c["rel"] == 1.0 and c["shown"] and c["point_met"] and not c["below"] and c["samples"] == 4
    c = cell_summary("passkey", 128, [(_row([0, 0]), _row([1, 1])), (_row([0, 0]), _row([1, 1]))], 0.95)
    assert c["rel"] == 0.0 and c["high"] == 0.0 and c["below"] and c["samples"] == 4  # rounds pooled
    c = cell_summary("passkey", 128, [(_row([0, 1]), _row([1, 1]))], 0.95)
    assert c["rel"] == 0.5 and c["high"] == 1.0 and not c["below"] and not c["point_met"]  # inside the noise
    one = cell_summary("passkey", 128, [(_row([0]), _row([1]))], 0.95)
    assert not one["below"] and not cell_summary("passkey", 128, [(_row([1]), _row([1]))], 0.95)["shown"]
    zero = cell_summary("passkey", 128, [(_row([0, 0]), _row([0, 0]))], 0.95)
    assert zero["full_zero"] and zero["rel"] is None and zero["shown"] and zero["point_met"]
    assert _summary("a", [1, 1], [1, 1], kv=25.0)["cost"] == 0.25
    decode = summarize("a", {("passkey", 128): [(_row([1], decode=20.0), _row([1], decode=10.0))]}, 0.95, "decode")
    assert decode["cost"] == 0.5  # twice full's decode speed


def test_eliminate_by_floor_dominance_and_halving():
    s = [_summary("below", [0, 0, 0, 0], [1, 1, 1, 1], kv=10.0),          # shown below the floor
         _summary("costly", [1, 1, 1, 1], [1, 1, 1, 1], kv=120.0),        # no cheaper than full
         _summary("cheap-unsure", [1, 0, 1, 1], [1, 1, 1, 1], kv=20.0),   # falls short on the point estimate
         _summary("held", [1, 1, 1, 1], [1, 1, 1, 1], kv=60.0),           # shown, the incumbent
         _summary("held-lean", [1, 1, 1, 1], [1, 1, 1, 1], kv=40.0),
         _summary("held-fat", [1, 1, 1, 1], [1, 1, 1, 1], kv=80.0)]
    kept, out = eliminate(s, 0.95, eta=3)
    assert kept == ["held-lean", "held"]  # Deb: meeting the floor first, by cost; 6 / 3 = 2 go on
    rules = {e["candidate"]: e["rule"] for e in out}
    assert rules == {"below": FLOOR, "costly": DOMINATED, "held-fat": HALVING, "cheap-unsure": HALVING}
    assert "below 0.95 on passkey@128" in next(e["why"] for e in out if e["candidate"] == "below")
    # the incumbent (cheapest shown) goes on even outside the cut
    s = [_summary(f"maybe{i}", [1, 1], [1, 1], kv=10.0 + i) for i in range(3)]
    s[0]["shown"] = s[1]["shown"] = s[2]["shown"] = False
    s.append(_summary("sure", [1, 1, 1, 1], [1, 1, 1, 1], kv=30.0))
    kept, _ = eliminate(s, 0.95, eta=4)
    assert kept == ["maybe0", "sure"]


def test_winner_and_pareto():
    s = [_summary("a", [1, 1, 1, 1], [1, 1, 1, 1], kv=40.0), _summary("b", [1, 1, 1, 0], [1, 1, 1, 1], kv=20.0),
         _summary("c", [1, 1, 1, 1], [1, 1, 1, 1], kv=60.0)]
    assert choose(s)["candidate"] == "a"  # b is cheaper, not shown to meet the floor
    assert choose([_summary("x", [1, 1], [1, 1], kv=100.0)]) is None  # no cheaper than full: full wins
    assert pareto(s) == ["a", "b"]  # full (cost 1, score 1) is beaten by a; c by a too
    assert pareto([_summary("d", [1, 0], [1, 1], kv=20.0)]) == ["d", "full"]


def test_no_winner_means_full_attention():
    settings = TuneSettings(**SETTINGS)
    settings.check()
    maybe = _summary("maybe", [0] + [1] * 39, [1] * 40, kv=20.0)  # 0.975 of full, not shown to be 0.95
    entry = winner_entry(None, [maybe], settings, {})
    assert entry["fallback"] and entry["candidate"] == "full" and entry["recipe"]["method"] == "full"
    assert "maybe meet it on the point estimate: run more samples" in entry["why"]
    assert "every candidate was eliminated" in winner_entry(None, [], settings, {})["why"]


# ---- a whole tune -----------------------------------------------------------------------------------------------

def test_tune_writes_the_recipe_front_log_and_report(reference):
    log, out = reference
    for name in ("recipe.json", "pareto.json", "pareto.png", "tune.json", "report.html", "results.jsonl"):
        assert (out / name).is_file(), name
    assert log["complete"] and json.loads((out / "tune.json").read_text()) == json.loads(json.dumps(log, default=str))
    assert log["candidates"] == ["full+kivi:bits=2", "snapkv@0.5", "snapkv+kivi:bits=2@0.5"]
    assert [e["samples"] for e in log["rounds"]] == [1, 2] and [e["seed"] for e in log["rounds"]] == [0, 1]
    rows = results_store.read_results(out)
    # round 1: full + 3 candidates; round 2: full + the ones kept; on each task and length
    assert len(rows) == 2 * (4 + 1 + len(log["rounds"][0]["kept"]))
    recipe = load_recipe_file(out / "recipe.json")  # a recipe file generate/eval/bench take
    assert recipe.label == log["winner"]["candidate"]
    points = json.loads((out / "pareto.json").read_text())
    assert {p["candidate"] for p in points} == set(log["candidates"]) | {"full"} and any(p["pareto"] for p in points)
    page = (out / "report.html").read_text()
    assert "Tune: least peak KV bytes" in page and f"Choice: {log['winner']['candidate']}" in page
    assert "tune: peak KV / full against the worst score" in page


def test_rerun_generates_nothing(reference, tmp_path, monkeypatch, reports):
    log, out = reference
    for name in ("results.jsonl",):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    calls = []
    monkeypatch.setattr(cells, "run_cell", lambda *a: calls.append(a[2].label))
    again = run_tune(TuneSettings(**SETTINGS), tmp_path, progress=False)
    assert calls == [] and _decisions(again) == _decisions(log) and again["winner"] == log["winner"]
    assert reports == [tmp_path / "report.html"] and (tmp_path / "recipe.json").is_file()
    assert len(results_store.read_results(tmp_path)) == len(results_store.read_results(out))


def test_interrupted_tune_resumes_to_the_same_results(reference, tmp_path, monkeypatch, reports):
    log, out = reference
    real = cells.run_cell
    calls = []

    def interrupted(*args):
        calls.append(args[2].label)
        if len(calls) == 10:  # in round 2, after round 1's 8 cells and its first decisions
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(cells, "run_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tune(TuneSettings(**SETTINGS), tmp_path, progress=False)
    assert len(results_store.read_results(tmp_path)) == 9
    with (tmp_path / results_store.RESULTS_FILE).open("a") as fh:  # and a row cut off while being written
        fh.write('{"schema": 3, "cell": "half a row')
    resumed_calls = []
    monkeypatch.setattr(cells, "run_cell", lambda *a: resumed_calls.append(a[2].label) or real(*a))
    resumed = run_tune(TuneSettings(**SETTINGS), tmp_path, progress=False)
    total = len(results_store.read_results(out))
    assert len(resumed_calls) == total - 9  # finished cells are not run again
    assert _decisions(resumed) == _decisions(log) and reports == [tmp_path / "report.html"]  # the resumed run's
    assert _stable(results_store.read_results(tmp_path)) == _stable(results_store.read_results(out))


def test_confirm_runs_the_winner_on_fresh_samples(reference, tmp_path):
    log, out = reference
    (tmp_path / "results.jsonl").write_bytes((out / "results.jsonl").read_bytes())
    confirmed = run_tune(TuneSettings(**dict(SETTINGS, confirm=True)), tmp_path, progress=False)
    if confirmed["winner"]["fallback"]:
        assert confirmed["confirm"] is None
        return
    c = confirmed["confirm"]
    assert (c["samples"], c["seed"]) == (2, 3) and isinstance(c["holds"], bool)
    rows = [r for r in results_store.read_results(tmp_path) if r["seeds"][0] == 3]
    assert sorted(r["recipe_name"] for r in rows) == sorted(["full", load_recipe_file(out / "recipe.json").label
                                                             .split("@")[0]] * 2)


def test_a_tune_into_a_directory_another_run_writes_is_refused(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cells, "run_cell", lambda *a: calls.append(a[2].label))
    with open(tmp_path / LOCK_FILE, "a+b") as fh:  # the lock as another process holds it
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(AttnkitError, match="is being written by another run"):
            run_tune(TuneSettings(**SETTINGS), tmp_path, progress=False)
    assert calls == [] and not (tmp_path / "results.jsonl").exists()


def test_tune_cli(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"cache": ["window"], "budgets": [0.5]}))
    out = tmp_path / "out"
    assert main(["tune", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1", "--rounds", "1",
                 "--space", str(space), "--out", str(out), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "winner: " in captured.out and "round 1/1: 1 candidate" in captured.err
    assert (out / "recipe.json").is_file() and (out / "report.html").is_file()


@pytest.mark.parametrize("argv,fragment", [
    (["tune", "--tasks", "passkey"], "tune needs --out DIR"),
    (["tune", "--out", "x", "--floor", "1.5"], "floor"),
    (["tune", "--out", "x", "--target", "ram"], "invalid choice: 'ram'"),
    (["tune", "--out", "x", "--eta", "1"], "eta"),
    (["tune", "--out", "x", "--workers", "2"], "--workers and --ray-address go with --ray"),
    (["tune", "--out", "x", "--space", "missing.yaml"], "missing.yaml"),
])
def test_tune_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, fragment):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnkit: error:") and "\n" not in err and fragment in err, err
