"""observed_attention (kvpress's ObservedAttentionPress): equal to full at an unlimited budget on every
architecture, batched; the kept positions equal a dense recomputation (the full causal attention matrix per query
head, summed over the queries, divided by the number of queries seeing each key, averaged over the kv group) for a
whole prompt and a chunked one; through transformers' generate (AttnkitCache) the same tokens; decode_every
refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Session, Step
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("observed_attention:budget_tokens=200"), NEW)


def dense_kept(q, k, budget):
    """Per kv head, the `budget` positions of highest mean causal attention (float64, the whole matrix)."""
    n, g = q.shape[2], q.shape[1] // k.shape[1]
    logits = q.double() @ k.double().repeat_interleave(g, dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    received = logits.softmax(-1).sum(dim=2) / torch.arange(n, 0, -1).double()  # [1, hq, n]
    score = received.view(1, k.shape[1], g, n).mean(2)[0]
    return [sorted(row.topk(budget).indices.tolist()) for row in score]


@pytest.mark.parametrize("chunks", [[90], [40, 25, 25]])
def test_kept_positions_equal_a_dense_recomputation(chunks):
    q, k, v = qkv(90, seed=71)
    method = attnkit.make_method("observed_attention", budget_tokens=30)
    session = Session(method, KVCache(1), 1, 90, 2)
    start = 0
    for size in chunks:
        s = slice(start, start + size)
        Step(session, "prefill", torch.arange(start, start + size), last_chunk=start + size == 90).attention(
            0, q[:, :, s], k[:, :, s], v[:, :, s], q.shape[-1] ** -0.5, None)
        start += size
    held = [sorted(row.tolist()) for row in session.cache.layers[0].view()[2][0]]
    assert held == dense_kept(q, k, 30)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "observed_attention", {"budget_tokens": 40}, 16)


def test_decode_every_is_refused_in_one_line():
    with pytest.raises(AttnkitError, match="decode_every=4") as caught:
        parse_method_spec("observed_attention:budget=0.5,decode_every=4")
    assert "\n" not in str(caught.value)
