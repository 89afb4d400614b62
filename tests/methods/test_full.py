"""`full` must reproduce transformers' own generation exactly (tokens and logits)."""

import pytest
import torch

import attnkit
from helpers import random_ids

NEW = 12


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def model(request):
    return attnkit.load_model(f"random:{request.param}:seed=3")


def hf_greedy(model, ids, new_tokens, mask=None):
    out = model.hf.generate(ids[None], max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[0]:].tolist(), [lg[0].float() for lg in out.logits]


@pytest.mark.parametrize("n", [16, 300, 2000])
def test_full_equals_model_generate(model, n):
    ids = random_ids(n, seed=n)
    ref_tokens, ref_logits = hf_greedy(model, ids, NEW)
    out = attnkit.generate(model, ids, "full", max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    assert out.token_ids == ref_tokens
    assert len(out.logits) == NEW
    for ours, theirs in zip(out.logits, ref_logits):
        assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [1, 64, 777])
def test_chunked_prefill_equals_one_shot(model, chunk):
    ids = random_ids(900, seed=7)
    one = attnkit.generate(model, ids, "full", max_new_tokens=8, stop_at_eos=False, keep_logits=True)
    if chunk == 1:
        ids = ids[:200]
        one = attnkit.generate(model, ids, "full", max_new_tokens=8, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(model, ids, "full", max_new_tokens=8, stop_at_eos=False, keep_logits=True,
                               chunk_size=chunk)
    assert chunked.token_ids == one.token_ids
    assert (chunked.logits[0] - one.logits[0]).abs().max().item() < 1e-4


def test_score_tokens_matches_model_forward(model):
    ids = random_ids(500, seed=11)
    with torch.no_grad():
        ref = model.hf(ids[None]).logits[0].float()
    ours = attnkit.score_tokens(model, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_full_cache_holds_every_token(model):
    ids = random_ids(300, seed=1)
    out = attnkit.generate(model, ids, "full", max_new_tokens=10, stop_at_eos=False)
    g = model.geometry
    per_token = 2 * g.n_layers * g.n_kv_heads * g.head_dim * 4
    # preallocated once for prompt + new tokens: peak == final, nothing reallocated
    assert out.stats.final_kv_bytes == out.stats.peak_kv_bytes == per_token * (300 + 10)
