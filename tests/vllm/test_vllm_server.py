"""attnkit's recipe through vLLM's OpenAI-compatible server (what ``vllm serve`` runs), over loopback with the
OpenAI client: streamed and not, the engine's recipe and a per-request method (``vllm_xargs``), and a bad
per-request method answered with a 400 while the server serves on."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import attnkit
from attnkit.eval.data.task_registry import get_task

TINY = os.path.join(os.path.dirname(attnkit.__file__), "assets", "tiny")
NEW = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import openai

    recipe = tmp_path_factory.mktemp("serve") / "recipe.yaml"
    recipe.write_text("cache: {method: snapkv, params: {budget: 0.3}}\n")
    port = free_port()
    config = json.dumps({"attnkit": {"recipe": str(recipe), "allow": ["streaming", "full"]}})
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TINY,
                             "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--host", "127.0.0.1",
                             "--port", str(port), "--num-gpu-blocks-override", "96", "--additional-config", config],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
    deadline = time.time() + 240
    while True:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the server did not start: {open(log.name).read()[-3000:]}")
            time.sleep(1)
    yield client
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def model():
    return attnkit.load_model("tiny")


@pytest.mark.parametrize("spec", [None, "streaming:budget_tokens=256"])
def test_completions_give_attnkit_tokens(server, model, spec):
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=40 + i).prompt for i, n in enumerate((1500, 2500))]
    extra = {"return_token_ids": True}
    if spec is not None:
        extra["vllm_xargs"] = {"attnkit": spec}
    expected = [g.token_ids for g in attnkit.generate(model, prompts, spec or "snapkv:budget=0.3", max_new_tokens=NEW)]
    for prompt, want in zip(prompts, expected):
        plain = server.completions.create(model=TINY, prompt=prompt, max_tokens=NEW, temperature=0, extra_body=extra)
        assert list(plain.choices[0].token_ids) == want
        stream = server.completions.create(model=TINY, prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                           extra_body=extra)
        streamed = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
        assert streamed == want


def test_a_method_the_server_does_not_allow_is_a_400(server, model):
    import openai

    prompt = get_task("passkey").make(model.tokenizer, 600, seed=3).prompt
    with pytest.raises(openai.BadRequestError, match="not allowed by this engine"):
        server.completions.create(model=TINY, prompt=prompt, max_tokens=4, extra_body={"vllm_xargs": {
            "attnkit": "window:window=128"}})
    ok = server.completions.create(model=TINY, prompt=prompt, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"
