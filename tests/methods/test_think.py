"""think (ThinK, arXiv 2407.21018): at key_channels=0 exactly the wrapped cache method (full at an unlimited budget on
every architecture, batched); the pruned channels equal a plain recomputation of ThinK's channel scores over the
window's queries and the keys the cache method kept, zeroed in every held prompt key, generated keys stored whole
(the decode outputs equal plain attention over those keys); the prompt's chunks give the same window; the bytes
held are the full keys' (nothing saved: the pruned channels are zeroed) plus the channel indices; through
transformers' generate (AttnkitCache) the same tokens; bad parameters, and cache methods it cannot prune, refused in
one line, in vLLM too."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_no_channel_pruned_equals_the_cache_method_batched(arch_models, arch):
    model = arch_models[arch]
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    for spec in ("think:key_channels=0", "snapkv:budget_tokens=200+think:key_channels=0"):
        assert_equals_full(model, prompts, parse_method_spec(spec), NEW)
    small = attnkit.generate(model, prompts, "snapkv:budget_tokens=40,window_size=8", max_new_tokens=NEW,
                             stop_at_eos=False, keep_logits=True)
    thin = attnkit.generate(model, prompts, "snapkv:budget_tokens=40,window_size=8+think:key_channels=0",
                            max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    for a, b in zip(small, thin):
        assert a.token_ids == b.token_ids and a.stats.final_kv_bytes == b.stats.final_kv_bytes
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_pruned_channels_equal_a_plain_recomputation_and_generated_keys_stay_whole():
    q, k, v = qkv(60, d=16, seed=91)
    prompt_len, budget, window, share = 40, 20, 6, 0.4
    method = parse_method_spec(f"knorm:budget_tokens={budget}+think:key_channels={share},window_size={window}")
    session, outs, held = drive(method, q, k, v, prompt_len)
    layer = session.cache.layers[0]
    kv, d, g = k.shape[1], k.shape[-1], q.shape[1] // k.shape[1]
    count = int(d * share)
    for h in range(kv):
        kept = held[0][h]
        score = []
        for c in range(d):
            qe = sum(float(q[0, head, t, c]) ** 2 for head in range(h * g, (h + 1) * g)
                     for t in range(prompt_len - window, prompt_len)) / (g * window)
            ke = sum(float(k[0, h, p, c]) ** 2 for p in kept) / len(kept)
            score.append(qe * ke)
        want = sorted(sorted(range(d), key=lambda c: score[c])[:count])
        assert layer.pruned[0, h].tolist() == want
        keys, _, pos = layer.view()
        for slot, p in enumerate(pos[0, h].tolist()):
            expect = k[0, h, p].clone()
            if p < prompt_len:
                expect[want] = 0
            assert torch.equal(keys[0, h, slot], expect), (h, p)
    # the last decode step's output: plain attention over the held entries, the prompt's keys zeroed
    t = q.shape[2] - 1
    for head in range(q.shape[1]):
        h = head // g
        idx = torch.tensor(held[-1][h])
        keys = k[0, h, idx].clone()
        keys[idx < prompt_len] = keys[idx < prompt_len].index_fill(-1, layer.pruned[0, h], 0)
        w = torch.softmax(q[0, head, t] @ keys.T / d ** 0.5, dim=-1)
        assert torch.allclose(outs[-1][0, head, 0], w @ v[0, h, idx], atol=1e-6)


def test_chunked_prompt_same_window_and_bytes_are_honest(arch_models):
    model = arch_models["llama"]
    ids = random_ids(150, seed=4).tolist()
    spec = "snapkv:budget_tokens=40,window_size=8+think:key_channels=0.5,window_size=24"
    whole = attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True,
                               chunk_size=16)
    assert whole.token_ids == chunked.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(whole.logits, chunked.logits)) < 1e-4
    plain = attnkit.generate(model, ids, "snapkv:budget_tokens=40,window_size=8", max_new_tokens=NEW,
                             stop_at_eos=False)
    g = model.geometry
    index_bytes = g.n_layers * g.n_kv_heads * (g.head_dim // 2) * 8  # int64 channel indices per layer and kv head
    assert whole.stats.final_kv_bytes == plain.stats.final_kv_bytes + index_bytes


def test_small_budget_batch_equals_each_prompt_alone(arch_models):
    model = arch_models["qwen3"]
    prompts = [random_ids(n, seed=n).tolist() for n in (130, 95, 130)]
    for spec in ("think:key_channels=0.5", "h2o:budget_tokens=32+think:key_channels=0.25,window_size=8"):
        batch = attnkit.generate(model, prompts, spec, max_new_tokens=NEW, stop_at_eos=False)
        for prompt, out in zip(prompts, batch):
            alone = attnkit.generate(model, prompt, spec, max_new_tokens=NEW, stop_at_eos=False)
            assert out.token_ids == alone.token_ids and out.stats.final_kv_bytes == alone.stats.final_kv_bytes


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "think",
                                                 {"key_channels": 0.5, "cache": "snapkv:budget_tokens=40"}, 16)
    assert max(cache.kept_lengths()) <= 40 + 16


@pytest.mark.parametrize("spec,match", [
    ("think:key_channels=1", "key_channels"), ("think:key_channels=-0.1", "key_channels"),
    ("think:window_size=0", "window_size"),
    ("snapkv:budget=0.3,head_budgets=adaptive+think", "flat layer"),
    ("duo_attention:pattern=RS/SR,sinks=4,recent=16+think", "flat layer"),
    ("streaming:budget=0.3,positions=reindex+think", "re-rotates"),
    ("quest:token_budget=64+think", "own cache storage"),
    ("snapkv:budget=0.3+think+kivi", "comes last, once"),
])
def test_bad_parameters_and_cache_methods_are_refused_in_one_line(spec, match):
    with pytest.raises(AttnkitError, match=match) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


def test_vllm_refuses_it_in_one_line():
    from attnkit.vllm.plan import check_supported

    with pytest.raises(AttnkitError, match="zeroes key channels of stored keys") as caught:
        check_supported(parse_method_spec("snapkv:budget=0.3+think:key_channels=0.5"), "recipe")
    assert "\n" not in str(caught.value)
