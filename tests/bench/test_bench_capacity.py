"""attnkit.bench.capacity and benchmarks/bench_batch.py: sequences under a KV cap, batch throughput rows, and the
report's cap section (no timing is asserted: only counts, bytes and how the ratios are formed)."""

import json
import runpy
import shutil
import sys

import pytest
import torch

import attnkit
from attnkit.bench.capacity import batch_run, capacity_rows, fixed_batch_rows, prompts_of, scaling_rows
from attnkit.methods.spec import parse_method_spec
from helpers import SMALL, per_token_bytes
from helpers import fresh_dir as _fresh_dir

torch.set_num_threads(1)
METHODS = ["full", "h2o:budget_tokens=16"]


@pytest.fixture(scope="module")
def model():
    return attnkit.load_model(f"random:llama:{SMALL}")


def test_batch_run_counts_every_sequence(model):
    run = batch_run(model, parse_method_spec("full"), prompts_of(model, 40, 3), 5)
    assert run.batch_size == 3 and run.decode_tokens_per_s > 0
    assert run.peak_kv_bytes == (40 + 5) * per_token_bytes(model)
    assert run.peak_kv_bytes_total == 3 * run.peak_kv_bytes == run.final_kv_bytes_total


def test_sequences_that_fit_a_cap(model):
    per_full = (64 + 4) * per_token_bytes(model)
    rows = capacity_rows(model, METHODS, 64, 4, kv_cap_bytes=3 * per_full + 1, max_batch=50, repeats=1)
    full, h2o = rows
    assert (full["sequences"], full["kv_bytes_per_sequence"]) == (3, per_full)
    # h2o's peak: one layer holds the whole prompt until it is compressed, the other its 16 slots
    assert h2o["kv_bytes_per_sequence"] == (64 + 16) * per_token_bytes(model) // 2
    assert h2o["sequences"] == (3 * per_full + 1) // h2o["kv_bytes_per_sequence"]
    assert h2o["sequences_vs_full"] == h2o["sequences"] / 3
    assert h2o["tokens_per_s_vs_full"] == h2o["tokens_per_s"] / full["tokens_per_s"]


def test_fixed_and_scaling_rows(model):
    fixed = fixed_batch_rows(model, METHODS, 64, 2, 4, repeats=1)
    assert fixed[0]["held_kv_vs_full"] == 1.0
    assert fixed[1]["held_kv_bytes_total"] == 2 * 16 * per_token_bytes(model)
    scaling = scaling_rows(model, METHODS[:1], 24, [1, 3], 4, repeats=1)
    assert [r["batch"] for r in scaling] == [1, 3] and scaling[0]["vs_first_batch"] == 1.0


def test_script_writes_tables_plot_and_the_report_shows_them(report_sweep, tmp_path, monkeypatch):
    out = _fresh_dir(tmp_path, report_sweep)
    argv = ["bench_batch.py", "--model", f"random:llama:{SMALL}", "--context", "64", "--batch", "2",
            "--budget-tokens", "40", "--new-tokens", "3", "--short-context", "16", "--batches", "1,2",
            "--short-new-tokens", "3", "--repeats", "1", "--eval-model", f"random:llama:{SMALL}", "--eval-tasks",
            "passkey", "--eval-methods", "full,h2o:budget_tokens=40", "--eval-length", "256", "--eval-samples", "3",
            "--eval-batch", "2", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path("benchmarks/bench_batch.py", run_name="__main__")
    assert done.value.code == 0
    data = json.loads((out / "capacity.json").read_text())
    assert {"fixed", "scaling", "capacity", "eval"} <= set(data)
    assert [(r["batch_size"], r["same_scores"]) for r in data["eval"]] == [(1, True), (2, True)]
    assert (out / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    assert "### A KV cap of" in (out / "capacity.md").read_text()
    from attnkit.eval.report.page import write_report
    text = write_report(out).read_text()
    assert "Batches under a KV memory cap" in text and "h2o:budget_tokens=40" in text
    shutil.rmtree(out)
