"""qfilter (Q-Filters, arXiv 2503.02812): `attnkit calibrate qfilter` writes one unit query direction per layer and kv
head, the first right singular vector of the group's queries (after RoPE) signed along their mean; equal to full at an
unlimited budget on every architecture, batched; the kept positions equal a plain recomputation (the keys' projections
on the filter, entry by entry); through transformers' generate (AttnkitCache) the same tokens; a file of another
model, or a missing or malformed one, refused in one line."""

import json

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.qfilter import calibrate_qfilter
from attnkit.cli import main
from attnkit.methods.qfilter import dumps_filters
from attnkit.methods.spec import parse_method_spec
from helpers import (
    ROPE,
    SMALL,
    assert_attnkit_cache_equals_generate,
    assert_equals_full,
    drive,
    qkv,
    random_ids,
    recompress_dense,
)

torch.set_num_threads(1)

NEW = 12


@pytest.fixture(scope="module")
def configs(arch_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qfilter")
    out = {}
    for arch, model in arch_models.items():
        path = folder / f"{arch}.json"
        path.write_text(dumps_filters(calibrate_qfilter(model, samples=2, length=96)))
        out[arch] = str(path)
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, configs, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(f"qfilter:config={configs[arch]},"
                                                                     f"budget_tokens=200"), NEW)


def test_small_budget_batch_equals_each_prompt_alone(arch_models, configs):
    model = arch_models["llama"]
    prompts = [random_ids(n, seed=n).tolist() for n in (130, 95, 130)]
    method = parse_method_spec(f"qfilter:config={configs['llama']},budget_tokens=32,decode_every=3")
    batch = attnkit.generate(model, prompts, method, max_new_tokens=NEW, stop_at_eos=False)
    for prompt, out in zip(prompts, batch):
        alone = attnkit.generate(model, prompt, method, max_new_tokens=NEW, stop_at_eos=False)
        assert out.token_ids == alone.token_ids
        assert out.stats.final_kv_bytes == alone.stats.final_kv_bytes


def test_the_filter_is_the_first_singular_vector_of_the_group_queries(tmp_path):
    """An independent recomputation: every layer's queries after RoPE, captured by transformers' own attention
    (eager), stacked per kv head over the group's query heads; the filter is the SVD's first right singular vector,
    signed so that the queries' mean projection is positive."""
    model = attnkit.load_model(f"random:llama:{SMALL}")
    config = calibrate_qfilter(model, samples=2, length=64, seed=3)
    from attnkit.calibrate.kvzap import text_windows

    windows = torch.tensor(text_windows(model, "train", 2, 64, 3))
    captured = {}
    import transformers.models.llama.modeling_llama as llama

    original = llama.eager_attention_forward

    def capture(module, query, *args, **kwargs):
        captured[module.layer_idx] = query.detach().clone()
        return original(module, query, *args, **kwargs)

    model.hf.config._attn_implementation = "eager"
    for layer in model.hf.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    llama.eager_attention_forward = capture
    try:
        with torch.no_grad():
            model.hf(windows)
    finally:
        llama.eager_attention_forward = original
    g = model.geometry
    group = g.n_q_heads // g.n_kv_heads
    for i in range(g.n_layers):
        q = captured[i].double()  # [b, hq, n, d]
        for h in range(g.n_kv_heads):
            rows = q[:, h * group:(h + 1) * group].reshape(-1, g.head_dim)
            u = torch.linalg.svd(rows, full_matrices=False).Vh[0]
            if float(rows.sum(0) @ u) < 0:
                u = -u
            got = torch.tensor(config["layers"][i]["filters"][h], dtype=torch.float64)
            assert torch.allclose(got, u, atol=1e-4), (i, h)
            assert float(rows.mean(0) @ got) > 0


def test_kept_positions_equal_a_plain_recomputation(tmp_path):
    q, k, v = qkv(64, seed=71)
    kv, d = k.shape[1], k.shape[-1]
    u = torch.nn.functional.normalize(torch.randn(kv, d, generator=torch.Generator().manual_seed(4)), dim=-1)
    path = tmp_path / "f.json"
    path.write_text(dumps_filters({"format": "attnkit.qfilter/1", "model": "hand-made", "n_layers": 1,
                                   "n_heads": q.shape[1], "n_kv_heads": kv, "head_dim": d,
                                   "inv_freq": ROPE.inv_freq.tolist(), "layers": [{"filters": u.tolist()}]}))
    budget, prompt_len = 18, 45
    for every in (0, 4):
        method = attnkit.make_method("qfilter", config=str(path), budget_tokens=budget, decode_every=every)
        _, _, got = drive(method, q, k, v, prompt_len)

        def choose(h, held, next_pos):
            score = {p: sum(float(a) * float(b) for a, b in zip(k[0, h, p], u[h])) for p in held}
            return sorted(held, key=lambda p: -score[p])[:budget]

        assert got == recompress_dense(q, k, prompt_len, budget, every, choose)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models, configs):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "qfilter",
                                                 {"config": configs["llama"], "budget_tokens": 40, "decode_every": 8},
                                                 16)
    assert max(cache.kept_lengths()) <= 48


def test_the_command_writes_a_file_the_method_reads(tmp_path, capsys):
    out = tmp_path / "qf.json"
    spec = f"random:llama:{SMALL}"
    assert main(["calibrate", "qfilter", "--model", spec, "--samples", "1", "--length", "64", "--out", str(out)]) == 0
    assert "explained per kv head" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["format"] == "attnkit.qfilter/1" and len(data["layers"]) == 2
    gen = attnkit.generate(attnkit.load_model(spec), random_ids(80).tolist(), f"qfilter:config={out},budget=0.5",
                           max_new_tokens=3, stop_at_eos=False)
    assert len(gen.token_ids) == 3


def test_a_file_of_another_model_is_refused_in_one_line(configs):
    other = attnkit.load_model("random:llama:layers=3,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128")
    with pytest.raises(AttnkitError, match="not this model: layers 3") as caught:
        attnkit.generate(other, random_ids(80).tolist(), f"qfilter:config={configs['llama']},budget=0.5",
                         max_new_tokens=2, stop_at_eos=False)
    assert "\n" not in str(caught.value)
    wide = attnkit.load_model("random:llama:layers=2,hidden=64,heads=4,kv_heads=1,head_dim=16,intermediate=128")
    with pytest.raises(AttnkitError, match="kv heads 1") as caught:
        attnkit.generate(wide, random_ids(80).tolist(), f"qfilter:config={configs['llama']},budget=0.5",
                         max_new_tokens=2, stop_at_eos=False)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,match", [("qfilter:budget=0.5", "needs config=FILE"),
                                        ("qfilter:config=/nonexistent.json,budget=0.5", "does not exist"),
                                        ("qfilter:config={bad},budget=0.5", "not a q-filter file"),
                                        ("qfilter:config={good},budget=1.5", "budget")])
def test_bad_parameters_are_refused_in_one_line(configs, tmp_path, spec, match):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(AttnkitError, match=match) as caught:
        parse_method_spec(spec.format(bad=bad, good=configs["llama"]))
    assert "\n" not in str(caught.value)
