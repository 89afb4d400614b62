"""The documented install works: attnkit's wheel, built here, installed into a new virtual environment with the
commands docs/vllm.md gives for a machine without PyTorch's CPU index; `import attnkit` before the last command stops
with the one line that names the fix; then `attnkit serve` from that environment, started outside the repository,
answers a request with attnkit's own tokens."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from test_vllm_server import free_port

import attnkit
from attnkit.eval.data.task_registry import get_task

ROOT = Path(__file__).resolve().parents[2]
NEW = 12
# the new environment's processes: nothing of this one on their path; their imported modules' bytecode written once
# (pip installs without byte-compiling everything, below) rather than compiled again by every process
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}


def documented_commands() -> list[list[str]]:
    """The pip commands of docs/vllm.md's block for a machine without PyTorch's CPU index."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    block = re.search(r"a test runs these commands.*?```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line) for line in block.strip().splitlines()]


def run(args, **kwargs):
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{shlex.join(map(str, args))}:\n{done.stderr[-3000:]}"
    return done


def test_the_built_wheel_installs_as_documented_and_serves(tmp_path):
    commands = documented_commands()
    assert [c[:2] for c in commands] == [["pip", "install"], ["pip", "install"], ["pip", "uninstall"]]
    source = tmp_path / "source"  # a copy of what the wheel is built from: the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(source)])
    wheel = next((tmp_path / "dist").glob("attnkit-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    outside = tmp_path / "outside"  # nothing of the repository on the path
    outside.mkdir()
    for args in commands[:2]:
        args = [str(wheel) + a[len("attnkit"):] if a.startswith("attnkit[") else a for a in args]
        # --no-compile: pip's byte-compiling of every installed module (minutes of one core for torch and vLLM)
        # installs no other file; Python compiles what it imports
        run([str(python), "-m", *args, "--no-compile"], cwd=outside, env=ENV)
    broken = subprocess.run([str(python), "-c", "import attnkit.model"], capture_output=True, text=True, cwd=outside,
                            env=ENV)
    last = broken.stderr.strip().splitlines()[-1]
    assert broken.returncode != 0 and "torchvision" in last and "pip uninstall -y" in last, broken.stderr[-2000:]
    run([str(python), "-m", *commands[2]], cwd=outside, env=ENV)
    found = run([str(python), "-c", "import attnkit, vllm; print(attnkit.__file__, vllm.__version__)"], cwd=outside,
                env=ENV)
    assert str(venv) in found.stdout and "0.32" in found.stdout

    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([str(venv / "bin" / "attnkit"), "serve", "tiny", "--recipe", "snapkv:budget_tokens=64",
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                             "--num-gpu-blocks-override", "32", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=outside, env=dict(ENV, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind"),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        model = attnkit.load_model("tiny")
        prompt = get_task("passkey").make(model.tokenizer, 400, seed=7).prompt
        want = attnkit.generate(model, [prompt], "snapkv:budget_tokens=64", max_new_tokens=NEW)[0].token_ids
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                           "return_token_ids": True}).encode()
        # ./run starts this test at the lowest priority beside the others, whose engines each keep to their own core:
        # the server's threads bound to no core take what is left of any, and it may start slowly
        deadline = time.time() + 600
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(2)
        assert answer["choices"][0]["token_ids"] == want
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
