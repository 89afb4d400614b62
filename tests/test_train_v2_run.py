"""training/train_v2.py end to end on a toy geometry (the byte tokenizer, one layer of width 32): a run stopped
and resumed from its checkpoint ends with the same weights as one that was never stopped, and --init-from
carries weights into another config, also one with a raised RoPE base; training/chain_v2.py runs stages in
order, each from the last one's export, and goes on where it stopped; batches written ahead in worker
processes are the batches written in line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit.tokenizer import build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _config(name: str, base: float = 10000.0) -> dict:
    return {
        "name": name, "seed": 7,
        "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                  "intermediate_size": 64, "max_position_embeddings": 512, "rope_theta": base},
        "tokenizer": {"vocab_size": 259, "individual_digits": True},
        "optimizer": {"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.1, "warmup": 2, "clip": 1.0},
        "answer_weight": 5.0, "save_every": 2,
        "probe": {"every": 1000, "n": 1, "min_len": 128},
        "phases": [
            {"name": "short", "steps": 3, "seq_len": 128, "batch": 2, "prompt_weight": 1.0,
             "mix": {"copy": 1, "code": 1}},
            {"name": "long", "steps": 3, "seq_len": 512, "batch": 1, "prompt_weight": 1.0,
             "mix": {"drill_far": 1, "code": 1}},
        ],
    }


def _script(name: str, *argv: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'training'}")
    done = subprocess.run([sys.executable, str(ROOT / "training" / name), *argv, "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _train(tmp: Path, config: dict, run: str, *extra: str) -> str:
    path = tmp / f"{config['name']}.json"
    path.write_text(json.dumps(config))
    run_dir = tmp / run
    if not (run_dir / "tokenizer").exists() and not {"--init-from", "--tokenizer-from"} & set(extra):
        build_byte_tokenizer().save_pretrained(run_dir / "tokenizer")  # instead of training a BPE (slow)
    return _script("train_v2.py", "--config", str(path), "--run-dir", str(run_dir), *extra)


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "ckpt.pt", weights_only=False)["model"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("train_v2")
    return tmp, _train(tmp, _config("toy"), "whole")


def test_a_stopped_and_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(whole):
    tmp, out = whole
    assert "done: step 6" in out
    first = _train(tmp, _config("toy"), "stopped", "--max-steps", "4")
    assert "stopping at step 4" in first
    second = _train(tmp, _config("toy"), "stopped")
    assert "resumed at step 4" in second and "done: step 6" in second
    a, b = _weights(tmp / "whole"), _weights(tmp / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    events = [json.loads(line) for line in (tmp / "whole" / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if "event" in e] == ["phase short done after 3 steps",
                                                           "phase long done after 3 steps"]


def test_init_from_carries_the_weights_into_a_config_with_a_raised_rope_base(whole):
    tmp, out = whole
    assert "RoPE base" not in out
    out = _train(tmp, _config("toy_theta", base=500000.0), "theta", "--init-from", str(tmp / "whole" / "export"))
    assert "initialised from" in out and "RoPE base 10000 -> 500000" in out and "done: step 6" in out
    exported = json.loads((tmp / "theta" / "export" / "config.json").read_text())
    theta = exported.get("rope_parameters", {}).get("rope_theta", exported.get("rope_theta"))
    assert theta == 500000.0
    start, end = _weights(tmp / "whole"), _weights(tmp / "theta")
    assert any(not torch.equal(start[k], end[k]) for k in start)  # trained on from the carried weights


def test_tokenizer_from_takes_a_tokenizer_and_no_weights(tmp_path):
    source = tmp_path / "target_export"
    tok = build_byte_tokenizer()
    tok.add_tokens(["<only-in-the-target>"])
    tok.save_pretrained(source)
    out = _train(tmp_path, _config("toy_draft"), "draft", "--tokenizer-from", str(source), "--fp32")
    assert "initialised" not in out and "vocab 260" in out and "done: step 6" in out
    embed = _weights(tmp_path / "draft")["model.embed_tokens.weight"]
    assert embed.shape[0] == 260
    # --fp32 (float32 even where bf16 autocast would be used) is said and recorded with the weights
    assert "device cpu, fp32" in out
    assert json.loads((tmp_path / "draft" / "export" / "training.json").read_text())["precision"] == "fp32"


def test_the_chain_trains_its_stages_in_order_and_goes_on_where_it_stopped(tmp_path):
    for config in (_config("toy"), _config("toy_theta", base=500000.0)):
        (tmp_path / f"{config['name']}.json").write_text(json.dumps(config))
    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"stages": [{"config": "toy.json", "max_steps": 4, "fp32": True},
                                            {"config": "toy_theta.json"}]}))
    runs = tmp_path / "runs"
    build_byte_tokenizer().save_pretrained(runs / "toy" / "tokenizer")
    out = _script("chain_v2.py", "--chain", str(chain), "--runs-dir", str(runs), "--max-minutes", "0.00001")
    assert "stopping at step 1" in out and "chain: stopped in toy" in out and not (runs / "toy_theta").exists()
    (runs / "toy" / "ckpt.pt").unlink()  # only the export is left: its weights go on with the schedule
    out = _script("chain_v2.py", "--chain", str(chain), "--runs-dir", str(runs))
    assert f"initialised from {runs / 'toy' / 'export'} (toy, step 1), at step 1 of toy" in out
    assert "done: step 4" in out  # the stage's step limit
    assert f"initialised from {runs / 'toy' / 'export'} (toy, step 4), at step 0 of toy_theta" in out
    assert "RoPE base 10000 -> 500000" in out and "done: step 6" in out
    assert out.rstrip().endswith(f"chain: done; the model is {runs / 'toy_theta' / 'export'}")
    again = _script("chain_v2.py", "--chain", str(chain), "--runs-dir", str(runs))
    assert "chain: starts at toy_theta, stage 2 of 2" in again and "chain: toy_theta is done" in again
    assert "initialised" not in again
    # the stage marked fp32 trains in float32; the next one in bf16 autocast where this CPU runs it fast
    sys.path.insert(0, str(ROOT / "training"))
    from train_v2 import fast_bf16

    precision = {name: json.loads((runs / name / "export" / "training.json").read_text())["precision"]
                 for name in ("toy", "toy_theta")}
    assert precision == {"toy": "fp32", "toy_theta": "bf16 autocast" if fast_bf16("cpu") else "fp32"}


def test_batches_written_ahead_by_workers_are_the_batches_written_in_line(tmp_path):
    sys.path.insert(0, str(ROOT / "training"))
    from data_v2 import Rows
    from prefetch_v2 import Prefetcher, shutdown

    runs = []
    for seed, name in ((7, "toy"), (8, "toy_next")):  # two runs, one after the other, in the same worker processes
        config = _config(name) | {"seed": seed}  # a worker still holding the first run's rows would fail the second
        config["phases"][1]["mix"] = {"drill_far": 1, "drill": 1}
        build_byte_tokenizer().save_pretrained(tmp_path / name / "tokenizer")
        runs.append((tmp_path / name, config))
    try:
        for run_dir, config in runs:
            rows = Rows(build_byte_tokenizer(), config)
            ahead = Prefetcher(rows, workers=1, source=(run_dir, config), ahead=3)
            short, long = config["phases"]
            # the first phase ends after step 1 (as a gate may end it), the second starts at step 2
            for phase, step in [(short, 0), (short, 1), (long, 2), (long, 3)]:
                got, want = ahead.batch(phase, step), rows.batch(phase, step)
                assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])) and got[3] == want[3]
            assert all(key[0] == "long" for key in ahead.pending)  # the left phase's work was dropped
            ahead.close()
    finally:
        shutdown()
