"""Peers in the same table: kvpress presses (the repository NVIDIA/kvpress) as sweep recipes, on identical inputs.

How a press is named, and which interpreter runs it, is :mod:`attnkit.recipe.peer`'s; a sweep's budget
``f`` sets ``compression_ratio = 1 - f``. kvpress pins another transformers than attnkit, so its presses
run in their own environment through :mod:`attnkit.eval.run.kvpress_worker`, started by its file path inside
the installed package (:data:`WORKER`; it imports no attnkit, so it runs without attnkit). The worker loads the same
model (the bundled model's directory, a local model directory, or a random model saved to a temporary
directory) and answers one greedy generation per request: the same prompt token ids attnkit's methods
get, stopped at the same stop strings (the worker stops at the tokens that contain one; the text is cut
there as attnkit's runner cuts it). It reports the cache bytes held at the end; its peak is not
observable from outside, so peak KV is left empty for peers.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.generation import encode_prompt
from attnkit.model import BUNDLED, bundled_path
from attnkit.recipe.peer import require_kvpress as require_interpreter
from attnkit.runner import Generation, GenerationStats

# the worker ships inside the package, so an installed wheel finds it beside this file
WORKER = Path(__file__).resolve().with_name("kvpress_worker.py")


def require_kvpress() -> str:
    """The kvpress interpreter (:func:`attnkit.recipe.peer.require_kvpress`) and the worker it runs."""
    python = require_interpreter()
    if not WORKER.is_file():
        raise AttnkitError(f"the kvpress worker {WORKER} is missing from this attnkit installation; reinstall attnkit")
    return python


class LineWorker:
    """A worker process that answers each JSON request line with one JSON line (the kvpress worker here,
    both workers of benchmarks/compare_kvpress.py). It runs with `threads` intra-op threads; its stderr goes to
    `log` (default: a temporary file whose tail is shown when the worker dies). The first line it writes
    is its description (:attr:`meta`); an answer with an ``error`` key is raised as an error."""

    def __init__(self, cmd: list[str], threads: int, name: str, log=None):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
        self.name = name
        self._own_log = log is None
        self._log = tempfile.TemporaryFile(mode="w+") if log is None else log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.meta = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            tail = ""
            if self._own_log:
                self._log.seek(0)
                tail = ":\n" + self._log.read()[-2000:]
            raise AttnkitError(f"the {self.name} worker stopped (exit code {code}){tail or '; see its log'}")
        answer = json.loads(line)
        if "error" in answer:
            raise AttnkitError(f"{self.name}: {answer['error']}")
        return answer

    def request(self, payload: dict) -> dict:
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_log:
            self._log.close()


class KvpressRunner:
    """One kvpress worker process for `model`, answering generations until :meth:`close`."""

    def __init__(self, model, threads: int | None = None):
        if model.placed:  # the worker loads the model whole, on its own device
            raise AttnkitError(f"kvpress recipes run the model on one device in their own process; model "
                               f"{model.spec!r} is placed over several devices by device_map: drop the device_map")
        python = require_kvpress()
        self.model = model
        self._tmp = None
        if model.spec in BUNDLED:
            model_dir = str(bundled_path(model.spec))
        elif Path(model.spec).is_dir():
            model_dir = model.spec
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="attnkit-peer-")
            model.hf.save_pretrained(self._tmp.name)
            model_dir = self._tmp.name
        threads = threads or torch.get_num_threads()
        bos = list(model.tokenizer("").input_ids)
        setup = {"model_dir": model_dir, "threads": threads, "new_tokens": 4, "warmup": bos + [3] * 16}
        self.worker = LineWorker([python, str(WORKER), json.dumps(setup)], threads, "kvpress")
        self.meta = self.worker.meta
        self._stop_ids: dict[str, list[int]] = {}

    def stop_ids(self, stop: str | None) -> list[int]:
        """Token ids whose text contains `stop` (the worker stops after one), plus EOS."""
        key = stop or ""
        if key not in self._stop_ids:
            tok = self.model.tokenizer
            ids = [i for i in range(self.model.geometry.vocab_size) if stop and stop in tok.decode([i])]
            if getattr(tok, "eos_token_id", None) is not None:
                ids.append(int(tok.eos_token_id))
            self._stop_ids[key] = ids
        return self._stop_ids[key]

    def generate(self, prompt, peer: tuple[str, dict], max_new_tokens: int, stop: str | None) -> Generation:
        ids = encode_prompt(self.model, prompt).tolist()
        press, params = peer
        case = {"prompt": ids, "new_tokens": max_new_tokens, "stop_ids": self.stop_ids(stop),
                "press": {"kind": "class", "name": press, "params": params}}
        out = self.worker.request({"case": case, "mode": "timing"})
        tokens = out["tokens"]
        text = self.model.tokenizer.decode(tokens, skip_special_tokens=True)
        finish = "length"
        if stop and stop in text:
            text, finish = text[:text.index(stop)], "stop"
        elif tokens and tokens[-1] == getattr(self.model.tokenizer, "eos_token_id", None):
            finish = "eos"
        steps = max(0, len(tokens) - 1)
        stats = GenerationStats(
            method=f"kvpress:{press}", prompt_tokens=len(ids), new_tokens=len(tokens), prefill_s=out["prefill_s"],
            ttft_s=out["prefill_s"], decode_s=out["decode_s"],
            decode_tokens_per_s=steps / out["decode_s"] if steps and out["decode_s"] > 0 else 0.0,
            peak_kv_bytes=None, final_kv_bytes=out.get("kv_bytes"), peak_rss_bytes=0, finish_reason=finish)
        return Generation(text, tokens, stats)

    def close(self) -> None:
        self.worker.close()
        if self._tmp is not None:
            self._tmp.cleanup()
