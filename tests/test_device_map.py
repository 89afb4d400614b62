"""Models placed by accelerate (``device_map``; CPU and disk offload, weights moved in and out by its hooks): every
method gives the same tokens as on one device, at an unlimited budget and at a small one; every layer's cache
lives where its layer runs; placements that cannot be honoured are refused in one line.

This machine has no GPU, so every placement here runs on the CPU: what these tests prove is that attnkit reads
where each part runs from accelerate (weights on the meta device, moved in by hooks) and that every method works
on a model dispatched with hooks; a GPU run of ``benchmarks/gpu_check.py`` covers layers on different devices."""

import importlib.util
import json

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cli import main
from attnkit.eval.run.peers import KvpressRunner
from attnkit.forward import prefill
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from helpers import SMALL, random_ids
from test_batch import SMALL_BUDGET, UNLIMITED

accelerate = pytest.importorskip("accelerate")
torch.set_num_threads(1)

NEW = 8
LENGTHS = (120, 90, 120)  # two rows of one session and one alone
SPEC = f"random:llama:{SMALL}"
# layer 0, the final norm and the LM head on the disk, the rest on the CPU: accelerate loads the offloaded
# weights before each of those modules runs and drops them after
DISK = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
        "model.norm": "disk", "lm_head": "disk"}


def prompts():
    return [random_ids(n, seed=20 + i).tolist() for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def models():
    one = attnkit.load_model(SPEC)
    disk = attnkit.load_model(SPEC, device_map=DISK)
    # accelerate's CPU offload: every weight held in a CPU state dict, the parameters on meta, each module's
    # weights moved in by its hook when it runs (a model a user placed: attnkit.prepare takes it as it is)
    offloaded = attnkit.load_model(SPEC)
    accelerate.cpu_offload(offloaded.hf, execution_device=torch.device("cpu"))
    cpu = attnkit.prepare(offloaded.hf, offloaded.tokenizer, SPEC)
    return {"one": one, "disk": disk, "cpu_offload": cpu}


def test_weights_are_offloaded(models):
    for name in ("disk", "cpu_offload"):
        model = models[name]
        assert model.placed and not models["one"].placed
        assert any(p.device.type == "meta" for p in model.hf.parameters())  # moved in by the hooks only
        assert model.device == model.output_device == torch.device("cpu")
        assert model.layer_devices() == [torch.device("cpu")] * 2
    assert models["disk"].hf.hf_device_map == DISK


def _tokens(model, spec):
    out = attnkit.generate(model, prompts(), parse_method_spec(spec), max_new_tokens=NEW, stop_at_eos=False)
    return [g.token_ids for g in out], [(g.stats.final_kv_bytes, g.stats.peak_kv_bytes) for g in out]


@pytest.mark.parametrize("spec", UNLIMITED + SMALL_BUDGET)
def test_every_method_gives_the_tokens_of_one_device(models, spec):
    """The spec lists of tests/test_batch.py: every registered method at an unlimited budget and a small one."""
    want = _tokens(models["one"], spec)
    for name in ("disk", "cpu_offload"):
        assert _tokens(models[name], spec) == want, (spec, name)


@pytest.mark.parametrize("source,options", [
    ("prompt_lookup", {}),
    ("self", {"draft": "snapkv:budget_tokens=24,window_size=4", "draft_lookup": True}),
    ("draft_model", {"draft": f"{SPEC},seed=3"}),
])
def test_drafts_give_the_tokens_of_one_device(models, source, options):
    prompt = (random_ids(17, seed=11).tolist() * 8)[:120]
    want = attnkit.speculative_generate(models["one"], prompt, source, gamma=3, max_new_tokens=NEW,
                                        stop_at_eos=False, **options).token_ids
    for name in ("disk", "cpu_offload"):
        got = attnkit.speculative_generate(models[name], prompt, source, gamma=3, max_new_tokens=NEW,
                                           stop_at_eos=False, **options).token_ids
        assert got == want, (source, name)


@pytest.mark.parametrize("spec", ["snapkv:budget=0.3,window_size=8", "h2o:budget=0.3", "keyformer:budget=0.3",
                                  "snapkv:budget=0.4+kivi:bits=2,residual=16", "kvzip:budget=0.3",
                                  "select:filter_layer=0,p_decode=0.5"])
def test_questions_after_a_compressed_context_give_the_tokens_of_one_device(models, spec):
    """attnkit.generate_after (the query-agnostic and multi-query protocols) on a placed model: two contexts of one
    length as rows of one session, forked per question length (Session.fork, KVCache.copy_rows)."""
    contexts = [random_ids(90, seed=30 + i).tolist() for i in range(2)]
    questions = [[random_ids(5, seed=40 + j).tolist() for j in range(3)] for _ in contexts]
    questions[0][1] = questions[0][1][:3]  # another length: another fork

    def tokens(model):
        out = attnkit.generate_after(model, contexts, questions, parse_method_spec(spec), max_new_tokens=NEW,
                                     stop_at_eos=False)
        return [[g.token_ids for g in gens] for gens in out]

    want = tokens(models["one"])
    for name in ("disk", "cpu_offload"):
        assert tokens(models[name]) == want, (spec, name)


def test_attnkit_cache_in_model_generate(models):
    ids = torch.tensor([random_ids(100, seed=4).tolist()])
    out = {}
    for name in ("one", "disk"):
        model = models[name]
        cache = attnkit.AttnkitCache(model, "snapkv", params={"budget_tokens": 40}, max_new_tokens=NEW)
        out[name] = model.hf.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False)[0].tolist()
    assert out["disk"] == out["one"]


def test_each_layer_cache_lives_on_its_layer_device(models):
    model = models["disk"]
    session = new_session(model, parse_method_spec("h2o:budget_tokens=40"), 100, 4)
    prefill(model, session, torch.tensor(random_ids(100).tolist(), device=model.device))
    for layer, device in zip(session.cache.layers, model.layer_devices(), strict=True):
        assert layer.keys.device == layer.values.device == layer.positions.device == device


def test_a_placed_bundled_model(tmp_path):
    """transformers' from_pretrained path: the bundled model's layers placed one by one, some on the disk."""
    placement = {"model.embed_tokens": "cpu", "lm_head": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                 **{f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(6)}}
    one, placed = attnkit.load_model("tiny"), attnkit.load_model("tiny", device_map=placement, offload_dir=tmp_path)
    # the odd layers' weights stay on disk (transformers reads them from the checkpoint), loaded as they run
    assert placed.placed and placed.hf.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    prompt = "def add(a, b):\n    return a + b\n\n" * 8
    for spec in ("full", "snapkv:budget_tokens=64", "minference:k_v=8,k_s=32", "gemfilter:filter_layer=1,k=48"):
        want = attnkit.generate(one, prompt, parse_method_spec(spec), max_new_tokens=NEW).token_ids
        assert attnkit.generate(placed, prompt, parse_method_spec(spec), max_new_tokens=NEW).token_ids == want, spec
    assert attnkit.load_model("tiny", device_map="auto").device == torch.device("cpu")  # no GPU: all on the CPU


def test_cli_device_map(tmp_path, capsys):
    base = ["generate", "--model", SPEC, "--prompt", "the key is 1234. " * 6, "--max-new-tokens", "6", "--json",
            "--method", "snapkv:budget_tokens=32"]
    assert main(base) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    pairs = ",".join(f"{k}={v}" for k, v in DISK.items())
    assert main(base + ["--device-map", pairs]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    path = tmp_path / "map.json"
    path.write_text(json.dumps(DISK))
    assert main(base + ["--device-map", str(path), "--offload-dir", str(tmp_path / "off")]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    assert main(base + ["--offload-dir", str(tmp_path)]) == 2
    assert "give --device-map with it" in capsys.readouterr().err


@pytest.mark.parametrize("device_map,match", [
    ({"model.layerz.0": "cpu", "": "cpu"}, "names no module 'model.layerz.0'"),
    ({"model.embed_tokens": "cpu"}, "places no device for module"),
    ({"": "gpu7"}, r"device_map\[''\] = 'gpu7' is not a device"),
    ({"": 3}, "GPU 3, but this machine has 0 CUDA device"),
    ({"": True}, "is not a device"),
    ("everywhere", "device_map must be 'auto' or a non-empty mapping"),
    ({}, "non-empty mapping"),
])
def test_bad_device_maps(device_map, match):
    with pytest.raises(AttnkitError, match=match):
        attnkit.load_model(SPEC, device_map=device_map)


def test_placements_that_cannot_be_honoured():
    tied = {"model.embed_tokens": "cpu", "lm_head": "disk", "model.norm": "cpu", "model.layers": "cpu"}
    with pytest.raises(AttnkitError, match="ties lm_head to model.embed_tokens"):
        attnkit.load_model("tiny", device_map=tied)
    with pytest.raises(AttnkitError, match="give device .* or device_map, not both"):
        attnkit.load_model(SPEC, device="cpu", device_map="auto")
    with pytest.raises(AttnkitError, match="offload_dir is where device_map's 'disk' entries go"):
        attnkit.load_model(SPEC, offload_dir="x")


def test_what_needs_one_device_is_refused(models):
    with pytest.raises(AttnkitError, match="int8 draft weights need the model's weights in memory on one device"):
        attnkit.speculative_generate(models["disk"], "abc " * 20, "self", draft="window:window=16",
                                     draft_weights="int8", max_new_tokens=4)
    with pytest.raises(AttnkitError, match="kvpress recipes run the model on one device"):
        KvpressRunner(models["disk"])


def test_without_accelerate(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(AttnkitError, match=r"device_map needs accelerate, which is not installed: pip install "
                                           r"'attnkit\[accelerate\]'"):
        attnkit.load_model(SPEC, device_map="auto")
