"""One writer per results directory (attnkit.eval.run.lock): a second sweep or eval into a directory being written is
refused in one line naming the directory, the holder and how to clear a stale lock; a holder that died (killed)
leaves no lock; one process may nest its own lock."""

from __future__ import annotations

import contextlib
import fcntl
import json

import pytest
import torch

from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.run import lock
from attnkit.eval.run.lock import LOCK_FILE, results_lock
from attnkit.eval.run.sweep import run_sweep, sweep_from_dict

SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
SWEEP = {"model": SPEC, "samples": 1, "tasks": ["passkey"], "lengths": [256], "budgets": [0.5], "recipes": ["window"]}
OTHER = {"pid": 4242, "host": "other-host", "command": "attnkit eval --sweep s.yaml --out d", "since": "then"}


@contextlib.contextmanager
def another_run(directory):
    """The directory's lock as another process holds it: its own open file, flocked, recording its pid and host."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fh.write(json.dumps(OTHER).encode())
        fh.flush()
        yield


def _check_refusal(message: str, directory) -> None:
    assert "\n" not in message
    assert str(directory) in message and "pid 4242 on other-host" in message and "--sweep s.yaml" in message
    assert f"delete {directory / LOCK_FILE}" in message


def test_a_second_writer_is_refused(tmp_path):
    with another_run(tmp_path / "d"):
        with pytest.raises(AttnkitError) as info:
            with results_lock(tmp_path / "d"):
                pass
        _check_refusal(str(info.value), tmp_path / "d")
    with results_lock(tmp_path / "d") as path:  # released: the next run takes it, and records itself
        held = json.loads(path.read_text())
        assert held["pid"] != OTHER["pid"] and held["host"] and held["since"]
        with results_lock(tmp_path / "d"):  # the same process nests its own lock
            pass
        assert path.is_file()
    assert not path.exists()


def test_a_killed_holder_leaves_no_lock(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    fh = open(d / LOCK_FILE, "a+b")
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
    fh.write(json.dumps(OTHER).encode())
    fh.close()  # what the kernel does for a killed process: the file stays, the lock goes
    with results_lock(d) as path:
        assert json.loads(path.read_text())["pid"] != OTHER["pid"]


def test_without_flock_the_file_is_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "fcntl", None)
    d = tmp_path / "d"
    d.mkdir()
    (d / LOCK_FILE).write_text(json.dumps(OTHER))  # left by a run that died
    with pytest.raises(AttnkitError) as info:
        with results_lock(d):
            pass
    _check_refusal(str(info.value), d)
    (d / LOCK_FILE).unlink()  # as the message says
    with results_lock(d) as path:
        assert path.is_file()
    assert not path.exists()


def test_sweep_and_eval_into_a_locked_directory_are_refused(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    with another_run(out):
        with pytest.raises(AttnkitError) as info:
            run_sweep(sweep_from_dict(SWEEP), out, progress=False)
        _check_refusal(str(info.value), out)
        sweep = tmp_path / "s.json"
        sweep.write_text(json.dumps(SWEEP))
        for args in (["eval", "--sweep", str(sweep)],
                     ["eval", "--model", SPEC, "--tasks", "passkey", "--lengths", "256", "--samples", "1"]):
            assert main([*args, "--out", str(out), "--no-progress"]) == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]  # a sweep first says what it would run
            assert err.startswith("attnkit: error:")
            _check_refusal(err, out)
    assert not (out / "results.jsonl").exists()
    run_sweep(sweep_from_dict(SWEEP), out, progress=False)  # once the other run ends
    assert (out / "results.jsonl").is_file() and not (out / LOCK_FILE).exists()
