"""lagkv (LagKV, arXiv 2504.04704): equal to full at an unlimited budget on every architecture, batched; the kept
positions equal a plain recomputation of the paper's score token by token (each partition against the next one's
range, ranked within its partition, the sinks and the tail kept first), also with ``cross_scoring`` and with
``decode_every``; a short layer keeps its sinks and its most recent entries; through transformers' generate
(AttnkitCache) the same tokens; bad parameters refused in one line."""

import statistics

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
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("lagkv:budget_tokens=200,lag_size=16"), NEW)


def token_score(part, ref):
    """One partition's tokens (lists of channel values) against the next partition: per token the sample standard
    deviation of its channels normalised by the reference's per-channel range, softmaxed over the partition."""
    dims = range(len(part[0]))
    low = [min(r[c] for r in ref) for c in dims]
    high = [max(r[c] for r in ref) for c in dims]
    spread = [statistics.stdev([(x[c] - low[c]) / (high[c] - low[c]) for c in dims]) for x in part]
    top = max(spread)
    weights = [pow(2.718281828459045, s - top) for s in spread]
    return [w / sum(weights) for w in weights]


def lagkv_choose(k, v, budget, sinks, lag, cross):
    def choose(h, held, next_pos):
        keys = [k[0, h, p].double().tolist() for p in held]
        values = [v[0, h, p].double().tolist() for p in held]
        n = len(held)
        if n < sinks + 2 * lag:
            score = [1.0] * sinks + [i / (n - sinks) for i in range(n - sinks)]
        else:
            parts = (n - sinks) // lag
            score = [1.0] * sinks
            for p in range(parts - 1):
                span = slice(sinks + p * lag, sinks + (p + 1) * lag)
                ref = slice(sinks + (p + 1) * lag, sinks + (p + 2) * lag)
                by_keys, by_values = token_score(keys[span], keys[ref]), token_score(values[span], values[ref])
                mixed = [(a + b) / 2 for a, b in zip(by_keys, by_values)]
                score += mixed if cross else [sorted(mixed).index(s) / lag for s in mixed]
            score += [1.0] * (n - len(score))
        order = sorted(range(n), key=lambda i: -score[i])
        return [held[i] for i in order[:budget]]
    return choose


@pytest.mark.parametrize("every,cross", [(0, False), (0, True), (3, False), (5, True)])
def test_kept_positions_equal_a_plain_recomputation(every, cross):
    q, k, v = qkv(70, seed=51)
    budget, prompt_len, sinks, lag = 22, 50, 3, 8
    method = attnkit.make_method("lagkv", budget_tokens=budget, decode_every=every, n_sink=sinks, lag_size=lag,
                                 cross_scoring=cross)
    _, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_dense(q, k, prompt_len, budget, every, lagkv_choose(k, v, budget, sinks, lag, cross))
    assert got == want
    # after the prompt: the sinks and the tail (the last whole partition and the leftover tokens) are kept
    parts = (prompt_len - sinks) // lag
    tail = range(sinks + (parts - 1) * lag, prompt_len)
    assert all(set(range(sinks)) | set(tail) <= set(row) for row in got[0])


def test_a_short_layer_keeps_its_sinks_and_most_recent_entries():
    q, k, v = qkv(30, seed=52)
    method = attnkit.make_method("lagkv", budget_tokens=12, n_sink=4, lag_size=16)  # 30 < 4 + 2 x 16
    _, _, got = drive(method, q, k, v, 30)
    assert got[0] == [list(range(4)) + list(range(22, 30))] * k.shape[1]


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "lagkv",
                                                 {"budget_tokens": 48, "lag_size": 16, "decode_every": 8}, 16)
    assert max(cache.kept_lengths()) <= 56


@pytest.mark.parametrize("spec,name", [("lagkv:budget=0.5,lag_size=1", "lag_size"),
                                       ("lagkv:budget=0.5,n_sink=-1", "n_sink"),
                                       ("lagkv:budget=0.5,cross_scoring=2", "cross_scoring")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
