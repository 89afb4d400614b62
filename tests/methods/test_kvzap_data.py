"""kvzap's training data and kvpress's weights: the default text is the mixture's nine kinds in equal shares (held
out: their held-out phrasings and filler); ``--data DIR`` trains on a folder of the user's *.txt and *.jsonl texts
(a missing or empty folder refused in one line); BOS and special tokens are no training rows, as kvpress keeps only
the text's own tokens; a ``KVzapModel.save_pretrained`` folder (written by hand, and by kvpress itself where its
environment is installed) loads as the same predictor and scores as kvpress's modules do, and one of another
geometry or that contradicts its config is refused in one line."""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.kvzap import MIXTURE, calibrate_kvzap, collect, collect_text, data_windows, mixture_windows
from attnkit.cli import main
from attnkit.methods.kvzap_predictor import load_predictor, save_predictor, tensor_names
from helpers import SMALL, random_ids

torch.set_num_threads(1)

KVPRESS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-kvpress" / "bin" / "python"


@pytest.fixture(scope="module")
def tiny():
    return attnkit.load_model("tiny")


# ---- the text ----------------------------------------------------------------------------------------------------
def test_the_default_text_is_the_mixture_in_equal_shares(tiny):
    windows, kinds = mixture_windows(tiny, "train", 18, 512, seed=0)
    assert kinds == list(MIXTURE) * 2 and len(MIXTURE) == 9
    assert all(len(w) == 512 and w[0] == tiny.tokenizer.bos_token_id for w in windows)
    assert len({tuple(w) for w in windows}) == 18
    assert (windows, kinds) == mixture_windows(tiny, "train", 18, 512, seed=0)  # seeded
    held, held_kinds = mixture_windows(tiny, "heldout", 9, 512, seed=0)
    assert held_kinds == list(MIXTURE) and not {tuple(w) for w in held} & {tuple(w) for w in windows}
    text = tiny.tokenizer.decode(windows[2][1:])  # a needle layout: the passage states a key's value
    assert any(ch.isdigit() for ch in text)


def test_bos_and_special_tokens_are_no_training_rows(arch_models):
    """The rows are the attention inputs at the text's own positions: layer 0's (the normed token embeddings) at
    every position but BOS and a special token inside the text."""
    model = arch_models["llama"]
    ids = random_ids(40, seed=3).tolist()
    special = model.tokenizer.all_special_ids
    window = [model.tokenizer.bos_token_id] + ids[:20] + [special[-1]] + ids[20:]
    xs, ys, counts = collect_text(model, [window, [model.tokenizer.bos_token_id] + ids + ids[:1]], lambda _: None)
    assert counts == [40, 41] and xs[0].shape[0] == ys[1].shape[0] == 81
    with torch.no_grad():
        layer0 = model.hf.model.layers[0].input_layernorm(model.hf.model.embed_tokens(torch.tensor([window])))[0]
    text = [i for i, t in enumerate(window) if t not in special and t != model.tokenizer.bos_token_id]
    assert text == [i for i in range(1, 42) if i != 21]
    torch.testing.assert_close(xs[0][:40], layer0[text])
    assert torch.isfinite(ys[0]).all()
    every = collect(model, [window], lambda _: None)[0][0]  # what other calibrations read: every token
    torch.testing.assert_close(every, layer0)


@pytest.fixture
def folder(tmp_path, tiny):
    data = tmp_path / "texts"
    (data / "more").mkdir(parents=True)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    texts = [" ".join(random.Random(i).choices(words, k=300)) for i in range(5)]  # distinct texts
    for i, t in enumerate(texts[:3]):
        (data / f"t{i}.txt").write_text(t)
    (data / "more" / "u.jsonl").write_text("\n".join(json.dumps({"text": t, "id": 9}) for t in texts[3:]) + "\n"
                                           + json.dumps({"id": "no text"}) + "\n")
    (data / "notes.md").write_text("not read")
    return data, texts


def test_data_trains_on_the_folders_texts(tiny, folder):
    data, texts = folder
    train, held = data_windows(tiny, data, 6, 2, 128, seed=1)
    ids = [tiny.tokenizer(t, add_special_tokens=False).input_ids for t in texts]

    def source(window):
        body = window[1:]
        return next(i for i, t in enumerate(ids) if any(t[s:s + len(body)] == body for s in range(len(t))))

    assert all(len(w) == 128 and w[0] == tiny.tokenizer.bos_token_id for w in train + held)
    held_from, train_from = {source(w) for w in held}, {source(w) for w in train}
    assert len(held_from) == 2 and not held_from & train_from  # held-out texts are never trained on
    layers, meta = calibrate_kvzap(tiny, samples=3, length=128, heldout=1, data=str(data))
    assert meta["training"]["data"] == str(data) and meta["training"]["tokens"] == 3 * 127


@pytest.mark.parametrize("what,match", [("missing", "is not a folder"), ("empty", "holds no text"),
                                        ("short", "2 of its texts hold 1023 tokens")])
def test_bad_data_is_refused_in_one_line(tiny, tmp_path, capsys, what, match):
    data = tmp_path / what
    if what != "missing":
        data.mkdir()
        (data / "a.jsonl").write_text(json.dumps({"other": 1}) + "\n")
    if what == "short":
        (data / "b.txt").write_text("x " * 2000)
        (data / "c.txt").write_text("y " * 2000)
        (data / "d.txt").write_text("too short")
    with pytest.raises(AttnkitError, match=match) as err:
        calibrate_kvzap(tiny, samples=2, length=1024, heldout=2, data=data)
    assert "\n" not in str(err.value)
    args = ["calibrate", "kvzap", "--model", f"random:llama:{SMALL}", "--data", str(data), "--out",
            str(tmp_path / "o.safetensors")]
    if what == "missing":
        assert main(args) == 2
        assert str(data) in capsys.readouterr().err


# ---- kvpress's weights ---------------------------------------------------------------------------------------------
def random_layers(kind, n_layers=2, d=64, h=2, m=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(h, d), (h,)] if kind == "linear" else [(m, d), (m,), (h, m), (h,)]
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(n_layers)]


def kvpress_folder(path, kind, layers, dtype=torch.float32, config=None):
    """A folder as ``KVzapModel.save_pretrained`` writes it (config.json, model.safetensors with {"format": "pt"})."""
    path.mkdir(parents=True)
    d, h = layers[0][0].shape[1], layers[0][-1].shape[0]
    (path / "config.json").write_text(json.dumps(config or {
        "architectures": ["KVzapModel"], "dtype": str(dtype).removeprefix("torch."), "input_dim": d,
        "output_dim": h, "n_modules": len(layers), "hidden_dim": None if kind == "linear" else layers[0][0].shape[0],
        "model_type": "kvzap", "transformers_version": "5.2.0"}))
    save_file({n: t.to(dtype).contiguous() for i, layer in enumerate(layers) for n, t in
               zip(tensor_names(kind, i), layer)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_kvpress_folder_loads_as_the_same_predictor(arch_models, kvzap_configs, tmp_path, kind):
    layers = load_predictor(kvzap_configs["llama"]).layers if kind == "linear" else random_layers("mlp")
    ours = load_predictor(save_predictor(tmp_path / "ours.safetensors", kind, layers, {"model": "m"}))
    folder = kvpress_folder(tmp_path / f"KVzap-{kind}-m", kind, layers)
    hidden = torch.randn(2, 7, 64)
    for path in (folder, folder / "model.safetensors"):
        theirs = load_predictor(str(path))
        assert (theirs.kind, theirs.n_layers, theirs.hidden_size, theirs.kv_heads) == (kind, 2, 64, 2)
        for i in range(2):
            assert torch.equal(theirs.scores(i, hidden), ours.scores(i, hidden))
    half = load_predictor(kvpress_folder(tmp_path / "bf16", kind, layers, dtype=torch.bfloat16))
    assert half.layers[0][0].dtype == torch.float32
    if kind == "linear":  # the same entries kept as with attnkit's file of the same weights
        ids = random_ids(120, seed=8)
        runs = [attnkit.generate(arch_models["llama"], ids, f"kvzap:config={p},budget_tokens=40,window=8",
                                 max_new_tokens=6, stop_at_eos=False).token_ids for p in (kvzap_configs["llama"], folder)]
        assert runs[0] == runs[1]


def test_a_kvpress_folder_of_another_geometry_or_inconsistent_is_refused_in_one_line(arch_models, tmp_path):
    other = kvpress_folder(tmp_path / "three", "linear", random_layers("linear", n_layers=3))
    with pytest.raises(AttnkitError, match="3 layers, hidden size 64, 2 kv heads.*the model has 2 layers") as err:
        attnkit.generate(arch_models["llama"], random_ids(60), f"kvzap:config={other},budget_tokens=30,window=4",
                         max_new_tokens=2)
    bad = kvpress_folder(tmp_path / "bad", "mlp", random_layers("mlp"), config={
        "model_type": "kvzap", "input_dim": 64, "output_dim": 2, "n_modules": 2, "hidden_dim": None})
    none = tmp_path / "none"
    none.mkdir()
    (none / "config.json").write_text(json.dumps({"model_type": "kvzap", "input_dim": 4, "output_dim": 2,
                                                  "n_modules": 1}))
    errors = [err.value]
    for path, match in ((bad, "tensors missing or unexpected"), (none, "without model.safetensors"),
                        (tmp_path, "not a kvzap surrogate")):
        with pytest.raises(AttnkitError, match=match) as err:
            load_predictor(str(path))
        errors.append(err.value)
    assert not any("\n" in str(e) for e in errors)


@pytest.mark.skipif(not KVPRESS_PYTHON.is_file(), reason="kvpress's environment (.venv-kvpress) is not installed")
def test_kvpress_save_pretrained_loads_and_scores_as_kvpress(tmp_path):
    """kvpress's own KVzapModel takes attnkit's tensors strictly, saves them with save_pretrained and scores
    `module(hidden).transpose(1, 2)` as KVzapPress does; attnkit loads that folder and scores the same."""
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    script = ["import sys, torch", "from safetensors.torch import load_file, save_file",
              "from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel",
              "out = {}",
              "for kind, m in (('linear', None), ('mlp', 8)):",
              "    model = KVzapModel(KVzapConfig(input_dim=64, output_dim=2, n_modules=2, hidden_dim=m))",
              "    model.load_state_dict(load_file(f'{sys.argv[1]}/{kind}.safetensors'), strict=True)",
              "    model.save_pretrained(f'{sys.argv[1]}/{kind}')",
              "    x = load_file(f'{sys.argv[1]}/hidden.safetensors')['x']",
              "    with torch.no_grad():",
              "        for i, layer in enumerate(model.layers):",
              "            out[f'{kind}.{i}'] = layer(x).transpose(1, 2).contiguous()",
              "save_file(out, f'{sys.argv[1]}/scores.safetensors')"]
    for kind in ("linear", "mlp"):
        save_predictor(tmp_path / f"{kind}.safetensors", kind, random_layers(kind, seed=2), {"model": "m"})
    save_file({"x": hidden}, str(tmp_path / "hidden.safetensors"))
    done = subprocess.run([str(KVPRESS_PYTHON), "-c", "\n".join(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load_file
    expected = load_file(str(tmp_path / "scores.safetensors"))
    for kind in ("linear", "mlp"):
        predictor = load_predictor(str(tmp_path / kind))
        assert predictor.kind == kind
        for i in range(2):
            torch.testing.assert_close(predictor.scores(i, hidden), expected[f"{kind}.{i}"], rtol=1e-5, atol=1e-5)
