"""training/plot_curves.py: a log of several stages is drawn as one run, and the smoothing averages."""

import json
import sys
from pathlib import Path

TRAINING = Path(__file__).resolve().parent.parent / "training"
sys.path.insert(0, str(TRAINING))

import plot_curves  # noqa: E402


def test_stages_follow_each_other_and_mark_their_starts(tmp_path):
    log = tmp_path / "log.jsonl"
    records = [{"stage": "a", "step": 5, "answer_loss": {"copy": 2.0}},
               {"stage": "a", "step": 10, "answer_loss": {"copy": 1.0}, "probe": {"passkey": [0.5, 0.25]}},
               {"stage": "a", "step": 10, "event": "phase p done"},
               {"stage": "b", "step": 5, "answer_loss": {"copy": 0.5}},
               {"stage": "b", "step": 20, "answer_loss": {"copy": 0.25}, "probe": {"passkey": [1.0, 1.0]}}]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    losses, probes, marks = plot_curves.read_log(log)
    assert losses["copy"] == [(5, 2.0), (10, 1.0), (15, 0.5), (30, 0.25)]
    assert probes["passkey"] == [(10, 0.5, 0.25), (30, 1.0, 1.0)]
    assert marks == [(0, "a"), (10, "b")]  # stage starts, not the phases inside them
    assert plot_curves.smoothed(losses["copy"], 2) == ([10, 30], [1.5, 0.375])
    plot_curves.plot(log, tmp_path / "curves.png", smooth=2)
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_a_single_run_marks_its_phases(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 3, "answer_loss": {"copy": 1.0}}) + "\n"
                   + json.dumps({"step": 4, "event": "phase x done"}) + "\n")
    losses, _, marks = plot_curves.read_log(log)
    assert losses["copy"] == [(3, 1.0)] and marks == [(4, "phase x done")]


def test_a_smoothing_width_below_one_is_refused_in_one_line(tmp_path):
    import subprocess

    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 3, "answer_loss": {"copy": 1.0}}) + "\n")
    out = subprocess.run([sys.executable, str(TRAINING / "plot_curves.py"), str(log), "--smooth", "0",
                          "--out", str(tmp_path / "c.png")], capture_output=True, text=True)
    assert out.returncode == 2 and "--smooth must be a whole number >= 1, got 0" in out.stderr
    assert "Traceback" not in out.stderr
