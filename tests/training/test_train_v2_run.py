"""training/train_v2.py end to end on a toy geometry (the byte tokenizer, one layer of width 32): a run stopped
and resumed from its checkpoint ends with the same weights as one that was never stopped, and --init-from
carries weights into another config, also one with a raised RoPE base; training/chain_v2.py runs a curriculum's
chain stages in order, each from the last one's export, and goes on where it stopped; training/bundle_v2.py stores the chain's
model and its draft as float16 with their lineage, and refuses an unfinished draft; batches written ahead in
worker processes are the batches written in line.

One run (the uninterrupted one) is the script as a command, in a fresh interpreter; the others call the scripts'
main() in this process with their command line in sys.argv (a new interpreter spends seconds importing torch and
transformers, more than a toy run trains), on one thread as the command's --threads 1 says."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from attnkit.tokenizer import build_byte_tokenizer
from helpers import ROOT

ROOT = ROOT
sys.path.insert(0, str(ROOT / "training"))
import bundle_v2  # noqa: E402
import chain_v2  # noqa: E402
import train_v2  # noqa: E402

SCRIPTS = {"train_v2.py": train_v2, "chain_v2.py": chain_v2, "bundle_v2.py": bundle_v2}


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


def _command(name: str, *argv: str) -> str:
    """`python training/NAME ARGV --threads 1` in a fresh interpreter: what it printed."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'training'}")
    done = subprocess.run([sys.executable, str(ROOT / "training" / name), *argv, "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _main(name: str, *argv: str) -> str:
    """The script's main() in this process, with `training/NAME ARGV` as its command line: what it printed (a
    SystemExit, the script's refusal, goes up). The training scripts set torch's threads: put back after."""
    threads = torch.get_num_threads()
    out = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", [str(ROOT / "training" / name), *argv]), contextlib.redirect_stdout(out):
            SCRIPTS[name].main()
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


def _script(name: str, *argv: str) -> str:
    return _main(name, *argv, "--threads", "1")


def _train(tmp: Path, config: dict, run: str, *extra: str, command: bool = False) -> str:
    path = tmp / f"{config['name']}.json"
    path.write_text(json.dumps(config))
    run_dir = tmp / run
    if not (run_dir / "tokenizer").exists() and not {"--init-from", "--tokenizer-from"} & set(extra):
        build_byte_tokenizer().save_pretrained(run_dir / "tokenizer")  # instead of training a BPE (slow)
    return (_command if command else _script)("train_v2.py", "--config", str(path), "--run-dir", str(run_dir), *extra)


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "ckpt.pt", weights_only=False)["model"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("train_v2")
    return tmp, _train(tmp, _config("toy"), "whole", command=True)


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


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """A two-stage toy chain, stopped at once, its first stage's checkpoint then lost, run on to its end:
    (the chain file, the runs directory, what each of the two calls printed)."""
    tmp = tmp_path_factory.mktemp("chain")
    chain = tmp / "curriculum.json"
    chain.write_text(json.dumps({"stages": [
        {"chain": True, "max_steps": 4, "fp32": True, "config": _config("toy")},
        {"chain": False, "config": _config("toy_unkept")},  # not in the chain: never trained by it
        {"chain": True, "config": _config("toy_theta", base=500000.0)},
        {"chain": False, "draft": True, "fp32": True, "config": _config("toy_draft")}]}))
    runs = tmp / "runs"
    build_byte_tokenizer().save_pretrained(runs / "toy" / "tokenizer")
    first = _script("chain_v2.py", "--curriculum", str(chain), "--runs-dir", str(runs), "--max-minutes", "0.00001")
    first += f"\n(toy_theta begun: {(runs / 'toy_theta').exists()})"
    (runs / "toy" / "ckpt.pt").unlink()  # only the export is left: its weights go on with the schedule
    return chain, runs, [first, _script("chain_v2.py", "--curriculum", str(chain), "--runs-dir", str(runs))]


def test_the_chain_trains_its_stages_in_order_and_goes_on_where_it_stopped(chain):
    chain, runs, (first, out) = chain
    assert "stopping at step 1" in first and "chain: stopped in toy" in first and "(toy_theta begun: False)" in first
    assert f"initialised from {runs / 'toy' / 'export'} (toy, step 1), at step 1 of toy" in out
    assert "done: step 4" in out  # the stage's step limit
    assert f"initialised from {runs / 'toy' / 'export'} (toy, step 4), at step 0 of toy_theta" in out
    assert "RoPE base 10000 -> 500000" in out and "done: step 6" in out
    assert out.rstrip().endswith(f"chain: done; the model is {runs / 'toy_theta' / 'export'}")
    assert not (runs / "toy_unkept").exists()
    again = _script("chain_v2.py", "--curriculum", str(chain), "--runs-dir", str(runs))
    assert "chain: starts at toy_theta, stage 2 of 2" in again and "chain: toy_theta is done" in again
    assert "initialised" not in again
    # the stage marked fp32 trains in float32; the next one in bf16 autocast where this CPU runs it fast
    precision = {name: json.loads((runs / name / "export" / "training.json").read_text())["precision"]
                 for name in ("toy", "toy_theta")}
    assert precision == {"toy": "fp32", "toy_theta": "bf16 autocast" if train_v2.fast_bf16("cpu") else "fp32"}


def test_bundling_stores_the_chain_s_model_and_its_draft_in_float16_with_their_lineage(chain, tmp_path):
    from safetensors.torch import load_file

    from attnkit.eval.data.tasks import TASKS
    from attnkit.model import load_model

    chain_file, runs, _ = chain
    argv = ["--runs-dir", str(runs), "--curriculum", str(chain_file), "--draft", "toy_draft",
            "--dest", str(tmp_path / "assets"), "--log-out", str(tmp_path / "log")]
    draft = ["--config", str(chain_file), "--stage", "toy_draft", "--run-dir", str(runs / "toy_draft")]
    _script("train_v2.py", *draft, "--tokenizer-from", str(runs / "toy_theta" / "export"), "--max-steps", "2")
    with pytest.raises(SystemExit, match="the draft has not finished its schedule"):  # stopped before its end
        _main("bundle_v2.py", *argv)
    assert not (tmp_path / "assets").exists()  # nothing is written
    _script("train_v2.py", *draft)
    # one line per eval task: float16 rounding moves the logits a little
    effect = _main("bundle_v2.py", *argv, "--check", "512").splitlines()[1:]
    assert [line.split(":")[0] for line in effect] == list(TASKS)
    assert all(0 < float(line.split("difference| ")[1].split(",")[0]) < 0.1 for line in effect)
    for name, run in (("tiny", "toy_theta"), ("tiny-draft", "toy_draft")):
        stored = load_file(tmp_path / "assets" / name / "model.safetensors")
        trained = load_file(runs / run / "export" / "model.safetensors")
        assert stored.keys() == trained.keys()
        assert all(stored[k].dtype == torch.float16 and torch.equal(stored[k], trained[k].half()) for k in stored)
        model = load_model(str(tmp_path / "assets" / name))  # runs in float32, from the rounded weights
        weight = model.hf.get_input_embeddings().weight
        assert weight.dtype == torch.float32 and torch.equal(weight, trained["model.embed_tokens.weight"].half().float())
        assert model.tokenizer("pass key 123").input_ids == load_model(str(runs / run / "export")).tokenizer(
            "pass key 123").input_ids
    meta = json.loads((tmp_path / "assets" / "tiny" / "training.json").read_text())
    assert [(s["name"], s["steps"], s["precision"]) for s in meta["stages"]] == [
        ("toy", 4, "fp32"), ("toy_theta", 6, meta["stages"][1]["precision"])]
    assert meta["stored_dtype"] == "float16" and meta["model"] == "tiny"
    draft = json.loads((tmp_path / "assets" / "tiny-draft" / "training.json").read_text())
    assert [(s["name"], s["steps"]) for s in draft["stages"]] == [("toy_draft", 6)]
    stages = [json.loads(line)["stage"] for line in (tmp_path / "log").read_text().splitlines()]
    assert stages[0] == "toy" and stages[-1] == "toy_theta" and sorted(set(stages)) == ["toy", "toy_theta"]


def test_batches_written_ahead_by_workers_are_the_batches_written_in_line(tmp_path):
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
