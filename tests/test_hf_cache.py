"""AttnkitCache: attnkit methods inside transformers' own `model.generate`, same tokens as attnkit.generate."""

import threading

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.hf_cache import AttnkitCache
from helpers import SMALL, random_ids

torch.set_num_threads(1)

N = 25

CASES = [
    ("full", {}),
    ("streaming", {"budget_tokens": 40}),
    ("streaming", {"budget_tokens": 40, "positions": "reindex"}),
    ("h2o", {"budget_tokens": 40}),
    ("h2o", {"budget": 0.3, "gqa_reduce": "max"}),
    ("keyformer", {"budget_tokens": 40}),
    ("keyformer", {"budget_tokens": 40, "score": "shared", "noise": "gaussian"}),
    ("keyformer", {"budget": 0.3, "positions": "new"}),
    ("snapkv", {"budget_tokens": 40, "window_size": 8, "decode_budget": 10}),
]


def hf_generate(model, ids, cache, new_tokens=N, **kwargs):
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True,
                            **kwargs)
    return out.sequences[0, ids.shape[0]:].tolist(), [lg[0] for lg in out.logits]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return attnkit.load_model(f"random:{request.param}:{SMALL}")


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES])
def test_model_generate_equals_attnkit_generate(model, name, params):
    ids = random_ids(150, seed=3)
    ours = attnkit.generate(model, ids, name, params=params, max_new_tokens=N, stop_at_eos=False, keep_logits=True)
    cache = AttnkitCache(model, name, params=params, max_new_tokens=N)
    tokens, logits = hf_generate(model, ids, cache)
    assert tokens == ours.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ours.logits)) < 1e-4
    # positions stay original: the cache reports every token seen while holding only the kept ones
    assert cache.get_seq_length() == 150 + N - 1
    assert cache.nbytes() == ours.stats.final_kv_bytes
    if name != "full":
        assert max(cache.kept_lengths()) < 150


def test_full_cache_equals_transformers_dynamic_cache(model):
    ids = random_ids(120, seed=4)
    ref = model.hf.generate(ids[None], max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=2)
    tokens, _ = hf_generate(model, ids, AttnkitCache(model, "full", max_new_tokens=N))
    assert tokens == ref[0, 120:].tolist()


def test_sampling_and_reset(model):
    ids = random_ids(100, seed=5)
    cache = AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=10)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=10, do_sample=True, top_k=20,
                                eos_token_id=None, pad_token_id=2)
        runs.append(out[0, 100:].tolist())
        cache.reset()
    assert runs[0] == runs[1]


def test_threads_do_not_mix(model):
    ids = random_ids(90, seed=6)
    expected = attnkit.generate(model, ids, "keyformer", params={"budget_tokens": 30}, max_new_tokens=12,
                                stop_at_eos=False).token_ids
    results = {}

    def work(i):
        cache = AttnkitCache(model, "keyformer", params={"budget_tokens": 30}, max_new_tokens=12)
        results[i] = hf_generate(model, ids, cache, new_tokens=12)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: expected, 1: expected}


def test_errors(model):
    ids = random_ids(60, seed=7)
    sdpa_model = attnkit.load_model(f"random:llama:{SMALL}")
    sdpa_model.hf.set_attn_implementation("sdpa")
    with pytest.raises(AttnkitError, match="attn_implementation='sdpa'.*'attnkit'"):
        AttnkitCache(sdpa_model, "h2o", params={"budget_tokens": 30}, max_new_tokens=5)
    with pytest.raises(AttnkitError, match="max_new_tokens must be the generation length"):
        AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=0)
    with pytest.raises(AttnkitError, match="recent window larger than the budget"):
        AttnkitCache(model, "h2o", params={"budget_tokens": 30, "recent_tokens": 31}, max_new_tokens=5)
    with pytest.raises(AttnkitError, match="built for max_new_tokens=5"):
        hf_generate(model, ids, AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=5),
                    new_tokens=9)
    with pytest.raises(AttnkitError, match="batch size 1"):
        model.hf.generate(torch.stack([ids, ids]), past_key_values=AttnkitCache(model, "full", max_new_tokens=3),
                          max_new_tokens=3, do_sample=False, pad_token_id=2)
    with pytest.raises(AttnkitError, match="batch size 1.*no beam search"):
        model.hf.generate(ids[None], past_key_values=AttnkitCache(model, "full", max_new_tokens=3),
                          max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=2)
    with pytest.raises(AttnkitError, match="one token per forward"):
        hf_generate(model, ids, AttnkitCache(model, "full", max_new_tokens=5), new_tokens=5, prefill_chunk_size=16)


def test_a_padded_prompt_is_refused_never_silently_wrong(model):
    """A left-padded prompt's mask hides the padding; the method masks by position and cannot honour it, so
    the cache refuses it. An all-ones mask is plain causal attention and gives the unpadded tokens."""
    ids = random_ids(30, seed=5)
    padded = torch.cat([torch.full((3,), 2), ids])
    mask = torch.cat([torch.zeros(3, dtype=torch.long), torch.ones(30, dtype=torch.long)])[None]
    with pytest.raises(AttnkitError, match="hides tokens .* padding"):
        hf_generate(model, padded, AttnkitCache(model, "h2o", params={"budget_tokens": 20}, max_new_tokens=5),
                    new_tokens=5, attention_mask=mask)
    ours = attnkit.generate(model, ids, "h2o", params={"budget_tokens": 20}, max_new_tokens=5, stop_at_eos=False)
    tokens, _ = hf_generate(model, ids, AttnkitCache(model, "h2o", params={"budget_tokens": 20}, max_new_tokens=5),
                            new_tokens=5, attention_mask=torch.ones(1, 30, dtype=torch.long))
    assert tokens == ours.token_ids


def test_a_sliding_window_model_mask_is_honoured():
    """Mistral's own sliding window is in transformers' mask and in the method's positions alike: accepted."""
    model = attnkit.load_model(f"random:mistral:{SMALL},sliding_window=16")
    ids = random_ids(60, seed=6)
    ours = attnkit.generate(model, ids, "full", max_new_tokens=8, stop_at_eos=False)
    tokens, _ = hf_generate(model, ids, AttnkitCache(model, "full", max_new_tokens=8), new_tokens=8,
                            attention_mask=torch.ones(1, 60, dtype=torch.long))
    assert tokens == ours.token_ids
