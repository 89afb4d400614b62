"""Sweeps on Ray (``attnkit eval --sweep FILE --out DIR --ray``): the same rows as without Ray; a worker killed
mid-cell loses nothing (its cell runs again, every cell once); a killed driver resumes without redoing what it
wrote; clear one-line errors. One local Ray and one pool of two workers serve the whole module."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.run import results as results_store
from attnkit.eval.run.ray_cells import CellPool
from attnkit.eval.run.sweep import run_sweep, sweep_from_dict, sweep_positions
from attnkit.eval.tune import search
from attnkit.eval.tune.search import TuneSettings, run_tune
from attnkit.eval.tune.space import space_from_dict

ray = pytest.importorskip("ray")

SPEC = "random:llama:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
# 2 tasks x 1 length x (full + snapkv@2 budgets + window@2 budgets + prompt lookup) = 12 cells
SWEEP = {
    "model": SPEC, "samples": 2, "seed": 5, "tasks": ["passkey", "code_completion"], "lengths": [256],
    "budgets": [0.25, 0.5],
    "recipes": ["snapkv", "window", {"name": "pl", "decode": {"speculate": "prompt_lookup", "gamma": 3}}],
}
CELLS = 12
# the protocols on Ray: 1 task x 1 length x 3 protocols x (full + keyformer at 2 seeds) = 9 cells, each of 2
# contexts x 2 questions
PROTOCOL_SWEEP = {
    "model": SPEC, "samples": 2, "seed": 5, "tasks": ["passkey"], "lengths": [256], "budgets": [0.25],
    "recipes": ["keyformer"], "seeds": [0, 1], "queries": 2,
    "protocols": ["query-aware", "query-agnostic", "multi-query"],
}
PROTOCOL_CELLS = 9


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in results_store.VOLATILE_FIELDS} for r in rows]


def _by_cell(rows: list[dict]) -> list[dict]:
    return sorted(_stable(rows), key=lambda r: r["cell"])


@pytest.fixture(scope="module")
def cluster():
    """A local Ray for the module: logical CPUs for this module's pool and a second driver's two workers."""
    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 2**20,
             logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    with CellPool(SPEC, positions=sweep_positions(sweep_from_dict(SWEEP)), workers=2, threads=1) as p:
        yield p


def _plain(sweep: dict, out: Path) -> list[dict]:
    torch.set_num_threads(1)
    return run_sweep(sweep_from_dict(sweep), out, progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same sweep without Ray."""
    out = tmp_path_factory.mktemp("plain")
    return _plain(SWEEP, out), out


@pytest.mark.parametrize("sweep, cells", [(SWEEP, CELLS), (PROTOCOL_SWEEP, PROTOCOL_CELLS)], ids=["sweep", "protocols"])
def test_ray_sweep_gives_the_rows_of_a_plain_sweep(pool, reference, tmp_path, sweep, cells):
    if sweep is SWEEP:
        ref_rows, ref_dir = reference
    else:
        ref_dir = tmp_path / "plain"
        ref_rows = _plain(sweep, ref_dir)
    out = tmp_path / "ray"
    rows = run_sweep(sweep_from_dict(sweep), out, progress=False, pool=pool)
    assert len(rows) == cells and _stable(rows) == _stable(ref_rows)  # plan order, scores, recipes, budgets
    written = results_store.read_results(out)
    assert len({r["cell"] for r in written}) == len(written) == cells
    assert _by_cell(written) == _by_cell(results_store.read_results(ref_dir))
    assert (out / "table.txt").read_text() == (ref_dir / "table.txt").read_text()
    assert {r["model"] for r in rows} == {SPEC} and all(r["wall_s"] > 0 for r in rows)
    if sweep is PROTOCOL_SWEEP:  # the protocols, questions and method seeds reached the workers
        assert [r["protocol"] for r in rows] == [p for p in sweep["protocols"] for _ in range(3)]
        assert [r["method_seed"] for r in rows[:3]] == [None, 0, 1]
        assert all(r["queries"] == 2 and r["questions"] == [0, 1, 0, 1] and r["contexts"] == 2 for r in rows)
        prefills = {r["protocol"]: r["context_prefills"] for r in rows}
        assert prefills == {"query-aware": 4, "query-agnostic": 4, "multi-query": 2}
        assert all(r["score_interval"] is not None for r in rows)


def _running(pid: int) -> bool:
    """Whether Ray's worker `pid` is inside a call now (Ray titles the process with the method it runs)."""
    try:
        return b"CellWorker.run" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_worker_killed_mid_cell_loses_nothing(pool, reference, tmp_path):
    ref_rows, _ = reference
    before = pool.pids()
    victim = before[1]
    results = tmp_path / results_store.RESULTS_FILE
    killed = threading.Event()

    def kill_mid_cell():
        deadline = time.time() + 300
        while time.time() < deadline:
            if results.is_file() and results.read_text().count("\n") >= 1 and _running(victim):
                os.kill(victim, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_mid_cell, daemon=True)
    killer.start()
    rows = run_sweep(sweep_from_dict(SWEEP), tmp_path, progress=False, pool=pool)
    killer.join()
    assert killed.is_set(), "the worker was never seen running a cell"
    after = pool.pids()
    assert after[0] == before[0] and after[1] != victim  # Ray restarted the killed worker
    written = results_store.read_results(results)
    assert len(written) == CELLS and len({r["cell"] for r in written}) == CELLS  # every cell exactly once
    assert _stable(rows) == _stable(ref_rows)


def test_a_killed_driver_resumes_without_redoing_anything(cluster, pool, reference, tmp_path):
    ref_rows, _ = reference
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    out = tmp_path / "out"
    results = out / results_store.RESULTS_FILE
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "attnkit.cli", "eval", "--sweep", str(path), "--out", str(out),
                             "--ray", "--ray-address", cluster, "--workers", "1", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 400  # a second driver imports torch and starts a worker that loads the model
    while time.time() < deadline and proc.poll() is None:
        if results.is_file() and results.read_text().count("\n") >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    err = proc.stderr.read().decode()[-2000:]
    proc.stderr.close()
    assert results.is_file(), err
    written_before = results.read_text()
    assert 2 <= written_before.count("\n") < CELLS, err
    rows = run_sweep(sweep_from_dict(SWEEP), out, progress=False, pool=pool)
    text = results.read_text()
    assert text.startswith(written_before)  # what the killed driver wrote stays as it was ...
    written = results_store.read_results(results)
    assert len(written) == CELLS and len({r["cell"] for r in written}) == CELLS  # ... and none of it ran again
    assert _stable(rows) == _stable(ref_rows)


def test_cli_errors(cluster, tmp_path, capsys, monkeypatch):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    sweep = ["eval", "--sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    for args, match in [
        (["eval", "--model", SPEC, "--ray"], "--ray run a sweep's cells on Ray: give --sweep FILE --out DIR"),
        (sweep + ["--workers", "2"], "--workers and --ray-address go with --ray"),
        (sweep + ["--ray", "--device-map", "auto"], "--ray runs a whole model in each worker"),
        (sweep + ["--ray", "--workers", "0"], "--workers"),
        (sweep + ["--ray", "--workers", "64"], "--workers 64 needs 64 CPUs; the Ray cluster has 4,"),
        (sweep + ["--ray", "--ray-address", "127.0.0.1:1"], "could not reach the Ray cluster at '127.0.0.1:1'"),
    ]:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()  # progress lines, then the error in one line
        assert err[-1].startswith("attnkit: error: ") and match in err[-1], (args, err)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert main(sweep + ["--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--ray needs Ray, which is not installed: pip install 'attnkit[ray]'"), err


def test_pool_errors(pool):
    with pytest.raises(AttnkitError, match="the Ray workers hold model .* the sweep names 'tiny'"):
        run_sweep(sweep_from_dict(dict(SWEEP, model="tiny")), "unused", pool=pool)
    with pytest.raises(AttnkitError, match="unknown random architecture"):
        CellPool("random:nope", workers=1, threads=1)  # the actor's own error, in one line
    assert json.loads(json.dumps(pool.pids()))  # the pool still works after a failed one


def test_tune_on_ray_gives_the_rows_and_choice_of_a_plain_tune(pool, tmp_path, capsys, monkeypatch):
    """``attnkit tune --ray``: the cells run on the pool's actors (CellPool.run), the driver writes them; the rows,
    eliminations and winner are those without Ray."""
    settings = dict(model=SPEC, tasks=["passkey"], lengths=[256], samples=1, rounds=2,  # round 1 eliminates one
                    space=space_from_dict({"cache": ["full", "snapkv"], "budgets": [0.5], "quantize": ["none", 2]}))
    torch.set_num_threads(1)
    reports = []  # the HTML reports asked for, not drawn (tests/eval/tune draws them): what is compared is below
    monkeypatch.setattr(search, "write_report", lambda results, out: reports.append(out))
    plain = run_tune(TuneSettings(**settings), tmp_path / "plain", progress=False)
    on_ray = run_tune(TuneSettings(**settings), tmp_path / "ray", pool=pool, progress=False)
    assert reports == [tmp_path / "plain" / "report.html", tmp_path / "ray" / "report.html"]
    assert [(e["kept"], e["eliminated"]) for e in on_ray["rounds"]] == [(e["kept"], e["eliminated"])
                                                                        for e in plain["rounds"]]
    assert on_ray["winner"]["recipe"] == plain["winner"]["recipe"]
    assert _by_cell(results_store.read_results(tmp_path / "ray")) == _by_cell(results_store.read_results(tmp_path /
                                                                                                          "plain"))
    # the command line, on the module's Ray (a worker of its own), reuses every cell: nothing runs
    assert main(["tune", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1",
                 "--rounds", "2", "--space", str(_write_space(tmp_path)), "--out", str(tmp_path / "ray"), "--ray",
                 "--workers", "1", "--no-progress"]) == 0
    assert "1 Ray workers" in capsys.readouterr().err and reports[2:] == [tmp_path / "ray" / "report.html"]
    assert len(results_store.read_results(tmp_path / "ray")) == len(results_store.read_results(tmp_path / "plain"))


def _write_space(tmp_path: Path) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"cache": ["full", "snapkv"], "budgets": [0.5], "quantize": ["none", 2]}))
    return path
