"""training/train_v2.py end to end on a toy geometry (the byte tokenizer, one layer of width 32): a run stopped
and resumed from its checkpoint ends with the same weights as one that was never stopped, and --init-from
carries weights into another config, also one with a raised RoPE base."""

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


def _train(tmp: Path, config: dict, run: str, *extra: str) -> str:
    path = tmp / f"{config['name']}.json"
    path.write_text(json.dumps(config))
    run_dir = tmp / run
    if not (run_dir / "tokenizer").exists() and "--init-from" not in extra:
        build_byte_tokenizer().save_pretrained(run_dir / "tokenizer")  # instead of training a BPE (slow)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'training'}")
    done = subprocess.run([sys.executable, str(ROOT / "training" / "train_v2.py"), "--config", str(path),
                           "--run-dir", str(run_dir), "--threads", "1", *extra],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


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
