"""Sampling, stop conditions, streaming, statistics."""

import dataclasses

import pytest
import torch

import attnkit
from attnkit.sampling import SamplingConfig, next_token_distribution
from helpers import random_ids


def test_seeded_sampling_is_reproducible(small_llama):
    kw = dict(max_new_tokens=20, do_sample=True, temperature=1.5, seed=123, stop_at_eos=False)
    a = attnkit.generate(small_llama, "hello there", **kw)
    b = attnkit.generate(small_llama, "hello there", **kw)
    c = attnkit.generate(small_llama, "hello there", **{**kw, "seed": 124})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_1_is_greedy(small_llama):
    greedy = attnkit.generate(small_llama, "abc", max_new_tokens=15, stop_at_eos=False)
    sampled = attnkit.generate(small_llama, "abc", max_new_tokens=15, do_sample=True, top_k=1, seed=0,
                               stop_at_eos=False)
    assert sampled.token_ids == greedy.token_ids


def test_distribution_processing_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = next_token_distribution(logits, SamplingConfig(do_sample=True, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = next_token_distribution(logits, SamplingConfig(do_sample=True, top_k=3))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    p = next_token_distribution(logits, SamplingConfig(do_sample=True, temperature=2.0))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(p, expected / expected.sum())


def test_stop_string_and_streaming(small_llama):
    free = attnkit.generate(small_llama, "stop test", max_new_tokens=30, stop_at_eos=False)
    stop = free.text[10:13]
    assert len(stop) == 3
    pieces = []
    out = attnkit.generate(small_llama, "stop test", max_new_tokens=30, stop_at_eos=False, stop=[stop],
                           on_token=lambda tok, delta: pieces.append(delta))
    assert out.stats.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    assert "".join(pieces) == out.text


def test_eos_stops(small_llama):
    free = attnkit.generate(small_llama, random_ids(20), max_new_tokens=10, stop_at_eos=False)
    eos_at = free.token_ids[3]

    class Tok:
        def __init__(self, inner):
            self.inner = inner
            self.eos_token_id = eos_at

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *a, **k):
            return self.inner(*a, **k)

    model = dataclasses.replace(small_llama, tokenizer=Tok(small_llama.tokenizer))
    out = attnkit.generate(model, random_ids(20), max_new_tokens=10)
    first = free.token_ids.index(eos_at)
    assert out.token_ids == free.token_ids[:first]
    assert out.stats.finish_reason == "eos"


def test_stats_are_filled(small_llama):
    out = attnkit.generate(small_llama, random_ids(100), max_new_tokens=8, stop_at_eos=False)
    s = out.stats
    assert s.prompt_tokens == 100 and s.new_tokens == 8 and s.finish_reason == "length"
    assert 0 < s.prefill_s <= s.ttft_s
    assert s.decode_tokens_per_s > 0
    assert s.peak_kv_bytes >= s.final_kv_bytes > 0
    assert s.peak_rss_bytes > 10 * 2**20
    assert s.method == "full"


def test_method_instance_and_spec(small_llama):
    method = attnkit.parse_method_spec("window:window=16")
    assert method.window == 16 and method.describe() == "window(window=16)"
    a = attnkit.generate(small_llama, "xyz", method, max_new_tokens=5, stop_at_eos=False)
    b = attnkit.generate(small_llama, "xyz", "window", params={"window": "16"}, max_new_tokens=5, stop_at_eos=False)
    assert a.token_ids == b.token_ids
    with pytest.raises(attnkit.AttnkitError, match="params are given"):
        attnkit.generate(small_llama, "xyz", method, params={"window": 3})
