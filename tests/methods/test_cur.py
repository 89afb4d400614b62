"""cur (CurDKV, arXiv 2509.15038): equal to full at an unlimited budget on every architecture, batched; the kept
positions equal a plain recomputation of the leverage scores entry by entry (each combination, local windows or
the whole layer, a seeded sketch, ``decode_every``); the sinks are kept; through transformers' generate
(AttnkitCache) the same tokens; bad parameters refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids, recompress_dense

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("cur:budget_tokens=200"), NEW)


def cur_choose(k, v, budget, leverage, sinks, window, sketch, seed):
    def norms(rows):
        """Each row's squared norm over its window's sum (or the whole layer's)."""
        sq = [sum(x * x for x in row) for row in rows]
        if not window:
            return sq
        return [sq[i] / sum(sq[i - i % window:i - i % window + window]) for i in range(len(sq))]

    def choose(h, held, next_pos):
        keys, values = k[0, h, held].double(), v[0, h, held].double()
        if sketch:
            g = torch.randn(k.shape[-1], sketch, generator=torch.Generator().manual_seed(seed)).double()
            keys, values = keys @ g / math.sqrt(sketch), values @ g / math.sqrt(sketch)
        lk, lv = norms(keys.tolist()), norms(values.tolist())
        score = {"key": lk, "value": lv, "kv_avg": [(a + b) / 2 for a, b in zip(lk, lv)],
                 "kv_product": [a * b for a, b in zip(lk, lv)]}[leverage]
        score = [s / sum(score) for s in score]
        score[:sinks] = [1.0] * len(score[:sinks])
        order = sorted(range(len(held)), key=lambda i: -score[i])
        return [held[i] for i in order[:budget]]
    return choose


@pytest.mark.parametrize("leverage,window,sketch,every", [("kv_product", 16, 0, 0), ("kv_product", 0, 0, 3),
                                                          ("kv_avg", 8, 0, 0), ("key", 16, 0, 4),
                                                          ("value", 16, 0, 0), ("kv_product", 16, 6, 2)])
def test_kept_positions_equal_a_plain_recomputation(leverage, window, sketch, every):
    q, k, v = qkv(64, seed=61)
    budget, prompt_len, sinks, seed = 18, 45, 3, 9
    method = attnkit.make_method("cur", budget_tokens=budget, decode_every=every, leverage=leverage, sinks=sinks,
                                 local_window=window, sketch=sketch, sketch_seed=seed)
    _, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_dense(q, k, prompt_len, budget, every, cur_choose(k, v, budget, leverage, sinks, window, sketch,
                                                                      seed))
    assert got == want
    assert all(set(range(sinks)) <= set(row) for step in got for row in step)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "cur",
                                                 {"budget_tokens": 40, "decode_every": 8}, 16)
    assert max(cache.kept_lengths()) <= 48


@pytest.mark.parametrize("spec,name", [("cur:budget=0.5,leverage=query", "leverage"),
                                       ("cur:budget=0.5,sinks=-1", "sinks"),
                                       ("cur:budget=0.5,local_window=1.5", "local_window"),
                                       ("cur:budget=0.5,sketch=-2", "sketch")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
