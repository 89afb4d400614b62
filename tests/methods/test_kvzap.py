"""kvzap: a surrogate trained here (``attnkit calibrate kvzap``, a few hundred tokens) on each architecture; at an
unlimited budget or ``threshold=-inf`` exactly full (batches, AttnkitCache with a padded batch); the kept entries are
the window and the best predicted scores (budget) or those at or above the threshold (prompt and decode), the
predictions computed here from the layers' inputs taken off the model directly; the surrogate trained on ``tiny``
predicts kvzip's scores on held-out text (and one trained on shuffled targets does not); a file of another model,
bad parameters and hosts that cannot hand over the layers' inputs are refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.kvzap import collect, collect_text, fit_linear, held_out_fit, mixture_windows, text_windows
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.kvzap_predictor import load_predictor, save_predictor
from attnkit.methods.spec import make_method, parse_method_spec
from attnkit.session import Step, new_session
from helpers import SMALL, assert_equals_full, random_ids

torch.set_num_threads(1)

NEW = 10


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


@pytest.fixture(scope="module")
def configs(kvzap_configs):
    return kvzap_configs


def spec(configs, arch, params):
    return parse_method_spec(f"kvzap:config={configs[arch]},{params}")


def layer_inputs(model, ids):
    """Each layer's attention input ``[n, D]`` for the prompt `ids`, from a plain transformers forward."""
    with torch.no_grad():
        hidden = model.hf(ids[None], output_hidden_states=True).hidden_states
    return [layer.input_layernorm(hidden[i])[0] for i, layer in enumerate(model.hf.model.layers)]


# ---- exactly full where nothing is dropped --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("params", ["budget=1.0", "budget_tokens=400,window=8,decode_every=3",
                                    "budget=1.0,head_budgets=adaptive", "threshold=-inf"])
def test_unlimited_equals_full_in_a_batch(models, configs, arch, params):
    prompts = [random_ids(n, seed=s).tolist() for s, n in enumerate((120, 95, 120))]
    assert_equals_full(models[arch], prompts, spec(configs, arch, params), NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("params", ["budget=1.0", "threshold=-inf", "budget=0.4,window=8", "threshold=-3,window=16"])
def test_attnkit_cache_padded_batch_equals_each_prompt_alone(models, configs, arch, params):
    model, method = models[arch], spec(configs, arch, params)
    prompts = [random_ids(n, seed=30 + i) for i, n in enumerate((70, 50, 70))]
    width = max(p.shape[0] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[0],), 2), p]) for p in prompts])
    mask = torch.stack([(torch.arange(width) >= width - p.shape[0]).long() for p in prompts])
    cache = AttnkitCache(model, method, max_new_tokens=NEW)
    out = model.hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=2)
    full = [attnkit.generate(model, p, "full", max_new_tokens=NEW, stop_at_eos=False).token_ids for p in prompts]
    for row, p in enumerate(prompts):
        alone = attnkit.generate(model, p, method, max_new_tokens=NEW, stop_at_eos=False)
        assert out[row, width:].tolist() == alone.token_ids
        if "budget=1.0" in params or "inf" in params:
            assert alone.token_ids == full[row]


# ---- which entries stay ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_budget_keeps_the_window_and_the_best_predicted(models, configs, arch):
    model, ids, budget, window = models[arch], random_ids(150, seed=5), 40, 8
    method = spec(configs, arch, f"budget_tokens={budget},window={window}")
    predictor = load_predictor(configs[arch])
    session = new_session(model, method, ids.shape[0], 1)
    with torch.inference_mode():
        prefill(model, session, ids)
    for i, x in enumerate(layer_inputs(model, ids)):
        score = predictor.scores(i, x[None])[0]  # [kv, n]
        score[:, -window:] = math.inf
        expected = score.topk(budget, dim=-1).indices.sort(dim=-1).values
        held = session.cache.layers[i].positions[0, :, :budget].sort(dim=-1).values
        assert torch.equal(held, expected), i


def test_threshold_keeps_what_scores_above_it_at_prefill_and_while_decoding(models, configs):
    """After the prompt every layer holds, per kv head, the entries predicted at or above the threshold and the
    window; while decoding an entry leaves once older than the window if below it (checked in layer 0, whose inputs
    are the token embeddings whatever was dropped before; in every layer, what stays obeys the rule)."""
    model, ids, window, threshold, steps = models["llama"], random_ids(150, seed=6), 16, -3.0, 30
    method = spec(configs, "llama", f"threshold={threshold},window={window}")
    predictor = load_predictor(configs["llama"])
    n = ids.shape[0]
    session = new_session(model, method, n, steps)
    with torch.inference_mode():
        token = logits_of(model, prefill(model, session, ids)[-1:]).argmax(-1)
        for i, x in enumerate(layer_inputs(model, ids)):
            score, layer = predictor.scores(i, x[None])[0], session.cache.layers[i]
            heads, pos = layer.extras["head"][0, 0, :layer.length], layer.positions[0, 0, :layer.length]
            for h in range(score.shape[0]):
                expected = (score[h] >= threshold) | (torch.arange(n) >= n - window)
                assert sorted(pos[heads == h].tolist()) == torch.nonzero(expected).flatten().tolist(), (i, h)
        fed = [ids]
        for step in range(steps - 1):
            fed.append(token)
            hidden = forward(model, token, n + step, lambda p: Step(session, "decode", p))
            token = logits_of(model, hidden[-1:]).argmax(-1)
    every = torch.cat(fed)
    last = every.shape[0] - 1  # the newest stored position
    score = predictor.scores(0, layer_inputs(model, every)[0][None])[0]
    layer = session.cache.layers[0]
    alive = layer.extras["head"][0, 0, :layer.length] >= 0
    heads, pos = layer.extras["head"][0, 0, :layer.length][alive], layer.positions[0, 0, :layer.length][alive]
    for h in range(score.shape[0]):
        expected = (score[h] >= threshold) | (torch.arange(last + 1) >= last - window)
        assert sorted(pos[heads == h].tolist()) == torch.nonzero(expected).flatten().tolist(), h
    assert not expected.all()  # something left while decoding
    for layer in session.cache.layers:
        alive = layer.extras["head"][0, 0, :layer.length] >= 0
        old = layer.positions[0, 0, :layer.length] < last - window
        assert bool((layer.extras["score"][0, 0, :layer.length][alive & old] >= threshold).all())
    kept = method.run_stats(session)["kvzap_kept_fraction"]
    assert 0 < kept < 1
    out = attnkit.generate(model, ids, method, max_new_tokens=steps, stop_at_eos=False)
    assert out.stats.method_stats["kvzap_kept_fraction"] == pytest.approx(kept)


# ---- the surrogate predicts kvzip ----------------------------------------------------------------------------
def test_surrogate_trained_on_tiny_predicts_kvzip_on_held_out_text():
    """Trained on 9 windows of 256 tokens of the default mixture (one of each kind), it ranks held-out entries (one
    window of each kind's held-out text) as kvzip does: the log scores correlate (Pearson, every layer) and most of
    kvzip's top 30 % is kept; the same fit on shuffled targets does neither (chance: 0 and 0.3)."""
    model = attnkit.load_model("tiny")
    xs, ys, _ = collect_text(model, mixture_windows(model, "train", 9, 256, seed=1)[0], lambda _: None)
    test_x, test_y, counts = collect_text(model, mixture_windows(model, "heldout", 9, 256, seed=1)[0], lambda _: None)
    g = torch.Generator().manual_seed(0)
    fits = [held_out_fit("linear", fit_linear(x, y, 1.0), tx, ty, counts)
            for x, y, tx, ty in zip(xs, ys, test_x, test_y)]
    shuffled = [held_out_fit("linear", fit_linear(x, y[torch.randperm(y.shape[0], generator=g)], 1.0), tx, ty, counts)
                for x, y, tx, ty in zip(xs, ys, test_x, test_y)]
    mean = {key: sum(f[key] for f in fits) / len(fits) for key in ("pearson", "kept_overlap")}
    assert min(f["pearson"] for f in fits) > 0.3 and mean["pearson"] > 0.4
    assert mean["kept_overlap"] > 0.45
    assert max(abs(f["pearson"]) for f in shuffled) < 0.15
    assert sum(f["kept_overlap"] for f in shuffled) / len(shuffled) < 0.35


# ---- the command, the file, refusals ------------------------------------------------------------------------
def test_calibrate_writes_a_file_that_refuses_another_model(models, tmp_path, capsys):
    path = tmp_path / "kvzap.safetensors"
    assert main(["calibrate", "kvzap", "--model", f"random:llama:{SMALL}", "--samples", "2", "--length", "96",
                 "--heldout", "1", "--kind", "mlp", "--hidden-dim", "16", "--epochs", "2", "--out", str(path)]) == 0
    assert "pearson" in capsys.readouterr().out
    predictor = load_predictor(path)
    assert (predictor.kind, predictor.n_layers, predictor.kv_heads) == ("mlp", 2, 2)
    ids = random_ids(100, seed=2)
    out = attnkit.generate(models["llama"], ids, f"kvzap:config={path},budget_tokens=40,window=8",
                           max_new_tokens=4, stop_at_eos=False)
    assert len(out.token_ids) == 4
    for other, why in ((f"random:llama:{SMALL},seed=1", "weights"), ("random:llama:layers=3,hidden=64,heads=4,"
                                                                       "kv_heads=2,head_dim=16,intermediate=128",
                                                                       "trained for")):
        with pytest.raises(AttnkitError, match=why) as err:
            attnkit.generate(attnkit.load_model(other), ids, f"kvzap:config={path},budget_tokens=40,window=8",
                             max_new_tokens=2)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("params,match", [
    ("budget=0.3", "needs config=FILE"),
    ("config=CFG", "needs threshold=T"),
    ("config=CFG,budget=0.3,threshold=-3", "applies to a budget"),
    ("config=CFG,threshold=-3,decode_every=2", "applies to a budget"),
    ("config=CFG,threshold=-3,head_budgets=adaptive", "applies to a budget"),
    ("config=CFG,threshold=nan", "threshold must be"),
    ("config=CFG,budget=0.3,window=-1", "window must be"),
    ("config=/nonexistent.safetensors,budget=0.3", "does not exist"),
    ("config=NOTSAFE,budget=0.3", "not a kvzap surrogate"),
    ("config=KVZIP,budget=0.3", "not a kvzap surrogate"),
])
def test_bad_parameters_are_refused_in_one_line(configs, tmp_path, params, match):
    bad = tmp_path / "bad.safetensors"
    bad.write_text("{}")
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "something-else"})
    params = params.replace("CFG", configs["llama"]).replace("NOTSAFE", str(bad)).replace("KVZIP", str(other))
    with pytest.raises(AttnkitError, match=match) as err:
        parse_method_spec(f"kvzap:{params}")
    assert "\n" not in str(err.value)


def test_what_cannot_run_is_refused_in_one_line(models, configs):
    model, ids = models["llama"], random_ids(100, seed=4)
    with pytest.raises(AttnkitError, match="window=128 recent tokens fill the 40-slot budget"):
        attnkit.generate(model, ids, spec(configs, "llama", "budget_tokens=40"), max_new_tokens=2)
    from attnkit.vllm.plan import check_supported
    check_supported(make_method("kvzap", config=configs["llama"], budget=0.3), "vllm")  # vLLM hands the inputs over
    with pytest.raises(AttnkitError, match="not supported inside vLLM.*threshold=-3.0 keeps a count per kv head"):
        check_supported(make_method("kvzap", config=configs["llama"], threshold=-3.0), "vllm")


def test_a_sweep_budget_applies_unless_a_threshold_sizes_the_cache(configs):
    from attnkit.recipe.core import as_recipe
    assert as_recipe(f"kvzap:config={configs['llama']}", "test").takes_budget()
    assert not as_recipe(f"kvzap:config={configs['llama']},threshold=-3", "test").takes_budget()
    assert as_recipe(f"kvzap:config={configs['llama']}", "test").with_budget(0.3).method().budget == 0.3


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_file_loads_into_modules_laid_out_as_kvpress_kvzap_model(models, tmp_path, kind):
    """kvpress's KVzapModel holds ``layers`` = one ``nn.Linear(D, H)``, or ``nn.Sequential(nn.Linear(D, M), nn.GELU(),
    nn.Linear(M, H))``, per layer, and KVzapPress scores ``module(hidden).transpose(1, 2)``: the same modules take
    this file's tensors strictly and score as kvzap does."""
    from safetensors.torch import load_file
    from torch import nn

    from attnkit.calibrate.kvzap import fit_mlp
    model = models["llama"]
    xs, ys = collect(model, text_windows(model, "train", 2, 64, seed=0), lambda _: None)
    layers = [fit_linear(x, y, 1.0) for x, y in zip(xs, ys)] if kind == "linear" else \
        fit_mlp(xs, ys, 8, 1, 1e-3, 64, 0, lambda _: None)
    path = save_predictor(tmp_path / "p.safetensors", kind, layers, {"model": "m"})
    d, h = xs[0].shape[1], ys[0].shape[1]
    modules = nn.ModuleList(nn.Linear(d, h) if kind == "linear" else
                            nn.Sequential(nn.Linear(d, 8), nn.GELU(), nn.Linear(8, h)) for _ in layers)
    modules.load_state_dict({k.removeprefix("layers."): v for k, v in load_file(str(path)).items()}, strict=True)
    predictor, hidden = load_predictor(path), torch.randn(2, 5, d)
    for i, module in enumerate(modules):
        assert torch.allclose(module(hidden).transpose(1, 2), predictor.scores(i, hidden), atol=1e-5)
