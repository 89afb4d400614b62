"""non_causal_attention (Compactor's attention term, arXiv 2507.08143): equal to full at an unlimited budget on every
architecture, batched; the kept positions equal a plain recomputation (every query of a tile attending to every key
of the tile, the last tile padded with zero queries and keys, summed per key, times the value norm, pooled over three
neighbours), whole or in prompt chunks of any size; through transformers' generate (AttnkitCache) the same tokens;
``decode_every``, a prompt not seen from its start and bad parameters refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Session, Step
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, drive, positions, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts,
                       parse_method_spec("non_causal_attention:budget_tokens=200,chunk_size=32"), NEW)


def tile_attention(q, k, start, end, chunk):
    """{position: a_j} over positions [start, end): a_j = mean over the kv group's query heads of the softmax weight
    (unscaled logits) every query of j's tile gives j among the tile's keys, the last tile padded with zero queries
    and zero keys to `chunk` entries. Per kv head: a list of dicts."""
    kv, heads = k.shape[1], q.shape[1]
    group = heads // kv
    out = []
    for h in range(kv):
        a = {}
        for t0 in range(start, end, chunk):
            tile = list(range(t0, min(t0 + chunk, end)))
            pad = chunk - len(tile)
            for j in tile:
                total = 0.0
                for g in range(group):
                    qs = q[0, h * group + g].double()
                    for i in tile + [None] * pad:  # a padding query: every logit zero
                        logits = [0.0 if i is None else (qs[i] @ k[0, h, jj].double()).item() for jj in tile]
                        logits += [0.0] * pad  # the padding keys
                        top = max(logits)
                        weights = [math.exp(x - top) for x in logits]
                        total += weights[tile.index(j)] / sum(weights)
                a[j] = total / group
        out.append(a)
    return out


def pooled(q, k, v, start, end, chunk):
    """Per kv head {position: avgpool_3(a * ||v||)} over [start, end) (zeros beyond both ends)."""
    out = []
    for h, a in enumerate(tile_attention(q, k, start, end, chunk)):
        s = {j: a[j] * v[0, h, j].double().norm().item() for j in a}
        out.append({j: (s.get(j - 1, 0.0) + s[j] + s.get(j + 1, 0.0)) / 3 for j in s})
    return out


def reference_kept(q, k, v, prompt_len, budget, chunk):
    scores = pooled(q, k, v, 0, prompt_len, chunk)
    return [sorted(sorted(s, key=lambda j: -s[j])[:budget]) for s in scores]


@pytest.mark.parametrize("prompt_len,chunk", [(45, 16), (48, 16), (45, 64), (45, 1), (40, 7)])
def test_kept_positions_equal_a_plain_recomputation(prompt_len, chunk):
    q, k, v = qkv(prompt_len + 4, seed=17)
    budget = 14
    method = attnkit.make_method("non_causal_attention", budget_tokens=budget, chunk_size=chunk)
    _, _, held = drive(method, q, k, v, prompt_len)
    assert held[0] == reference_kept(q, k, v, prompt_len, budget, chunk)
    for step, now in enumerate(held[1:]):  # decode appends
        assert now == [row + list(range(prompt_len, prompt_len + step + 1)) for row in held[0]]


def prefill_in_chunks(method, q, k, v, sizes):
    n = sum(sizes)
    session = Session(method, KVCache(1), 1, n, 1, rope=ROPE)
    start = 0
    for i, size in enumerate(sizes):
        s = slice(start, start + size)
        Step(session, "prefill", torch.arange(start, start + size), last_chunk=i == len(sizes) - 1).attention(
            0, q[:, :, s], k[:, :, s], v[:, :, s], q.shape[-1] ** -0.5, None)
        start += size
    return positions(session)


@pytest.mark.parametrize("sizes", [(7, 20, 18), (16, 16, 13), (1, 44), (30, 3, 3, 9)])
def test_a_prompt_in_chunks_keeps_what_the_whole_prompt_keeps(sizes):
    q, k, v = qkv(sum(sizes), seed=23)
    method = attnkit.make_method("non_causal_attention", budget_tokens=14, chunk_size=16)
    assert prefill_in_chunks(method, q, k, v, sizes) == reference_kept(q, k, v, sum(sizes), 14, 16)


def test_a_prompt_not_seen_from_its_start_is_refused():
    q, k, v = qkv(40, seed=2)
    method = attnkit.make_method("non_causal_attention", budget_tokens=10, chunk_size=16)
    session = Session(method, KVCache(1), 1, 40, 1, rope=ROPE)
    with pytest.raises(AttnkitError, match="every prompt query in order") as caught:
        Step(session, "prefill", torch.arange(8, 40)).attention(0, q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], 0.3, None)
    assert "\n" not in str(caught.value)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "non_causal_attention",
                                                 {"budget_tokens": 40, "chunk_size": 32}, 16)
    assert max(cache.kept_lengths()) <= 40 + 16


@pytest.mark.parametrize("spec,name", [("non_causal_attention:budget=0.5,chunk_size=0", "chunk_size"),
                                       ("non_causal_attention:budget=0.5,chunk_size=2.5", "chunk_size"),
                                       ("non_causal_attention:budget=0.5,decode_every=4", "decode_every=4"),
                                       ("non_causal_attention:chunk_size=8", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
