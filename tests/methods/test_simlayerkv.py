"""simlayerkv (SimLayerKV, arXiv 2410.13846; kvpress's SimLayerKVPress): equal to full when nothing can be lazy (the
threshold at 1, or prompts no longer than the sinks and the recent window) on every architecture, batched; a layer
is lazy exactly when a plain recomputation of the last queries' attention mass on the initial and recent tokens
exceeds the threshold, and then keeps exactly the sinks and the last n_recent - n_last positions; through
transformers' generate (AttnkitCache) the same tokens; the vLLM host refuses it in one line; bad parameters refused
in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm.plan import check_supported
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["simlayerkv:lazy_threshold=1.0,n_recent=16",
                                  "simlayerkv:lazy_threshold=0,n_recent=150,n_initial=4"])
def test_nothing_lazy_equals_full_batched(arch_models, arch, spec):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def attention_mass(q, k, n, n_last, n_initial, n_recent):
    """The last `n_last` prompt queries' causal softmax over the prompt, averaged over every query head and those
    queries, summed over the first `n_initial` positions and the `n_recent` before the last `n_last`."""
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    total = 0.0
    for head in range(q.shape[1]):
        for i in range(n - n_last, n):
            logits = [float(q[0, head, i].double() @ k[0, head // g, j].double()) * scale for j in range(i + 1)]
            top = max(logits)
            e = [pow(2.718281828459045, x - top) for x in logits]
            picked = list(range(n_initial)) + list(range(n - n_last - n_recent, n - n_last))
            total += sum(e[j] for j in picked) / sum(e)
    return total / (q.shape[1] * n_last)


@pytest.mark.parametrize("n_last,n_initial,n_recent", [(1, 4, 12), (3, 2, 10), (5, 0, 20)])
def test_a_layer_is_lazy_exactly_above_the_threshold(n_last, n_initial, n_recent):
    q, k, v = qkv(50, seed=81)
    n = 40
    mass = attention_mass(q, k, n, n_last, n_initial, n_recent)
    assert 0.05 < mass < 0.95
    recent = list(range(n - n_recent + n_last, n))
    for threshold, lazy in ((mass - 0.01, True), (mass + 0.01, False)):
        method = attnkit.make_method("simlayerkv", lazy_threshold=threshold, n_last=n_last, n_initial=n_initial,
                                     n_recent=n_recent)
        session, _, held = drive(method, q, k, v, n)
        prompt = list(range(n_initial)) + recent if lazy else list(range(n))
        assert held[0] == [prompt] * k.shape[1]
        assert held[-1] == [prompt + list(range(n, 50))] * k.shape[1]  # generated tokens are appended
        assert method.run_stats(session) == {"lazy_layers": int(lazy)}


def test_sink_heavy_attention_makes_a_layer_lazy_and_frees_its_entries(arch_models):
    model = arch_models["llama"]
    ids = random_ids(150, seed=4)
    full = attnkit.generate(model, ids, "full", max_new_tokens=8, stop_at_eos=False)
    out = attnkit.generate(model, ids, "simlayerkv:lazy_threshold=0,n_recent=32", max_new_tokens=8, stop_at_eos=False)
    assert out.stats.method_stats["lazy_layers"] == model.geometry.n_layers  # any attention mass is above 0
    assert out.stats.final_kv_bytes < 0.35 * full.stats.final_kv_bytes  # sinks + 31 recent + the new tokens


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "simlayerkv",
                                                 {"lazy_threshold": 0.0, "n_recent": 40, "n_last": 2}, 16)
    assert max(cache.kept_lengths()) == 4 + 38 + 15  # the last generated token is never stored


def test_the_vllm_host_refuses_it_in_one_line():
    with pytest.raises(AttnkitError, match="depends on its attention") as caught:
        check_supported(parse_method_spec("simlayerkv:lazy_threshold=0.9"), "test")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("simlayerkv:lazy_threshold=1.5", "lazy_threshold"),
                                       ("simlayerkv:n_last=0", "n_last"),
                                       ("simlayerkv:n_initial=-1", "n_initial"),
                                       ("simlayerkv:n_recent=2,n_last=2", "n_recent"),
                                       ("simlayerkv:budget=0.5", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
