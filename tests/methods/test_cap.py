"""cap (CAPKV, arXiv 2604.25975): equal to full at an unlimited budget on every architecture, batched; the kept
positions equal the paper's score written plainly in float64 (capacity matrix inverted explicitly, the anchor the
mean of the queries before RoPE given directly, rotated by a dense averaged RoPE matrix), after the prompt and with
``decode_every``; chunked prefill keeps the same positions; through transformers' generate (AttnkitCache) the same
tokens; bad parameters refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from helpers import ROPE, D, assert_attnkit_cache_equals_generate, assert_equals_full, drive, randn, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("cap:budget_tokens=200"), NEW)
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("cap:budget_tokens=200,decode_every=3"), NEW)


def rope_matrix(pos: int) -> torch.Tensor:
    """RoPE at `pos` as a dense float64 matrix (the half-split pairing: dimension i turns with i + d/2)."""
    half = D // 2
    m = torch.zeros(D, D, dtype=torch.float64)
    for i in range(half):
        a = pos * float(ROPE.inv_freq[i])
        m[i, i], m[i, i + half] = math.cos(a), -math.sin(a)
        m[i + half, i], m[i + half, i + half] = math.sin(a), math.cos(a)
    return m


def cap_choose(q_raw, k, v, budget, method):
    """``choose(h, held, next_pos)``: the sinks, then the best of CAPKV's ``w_i u_i^T A^-1 u_i`` averaged over the
    kv group, the anchor the mean of the queries before RoPE at positions ``n_sink..next_pos-1``."""
    hq, kv = q_raw.shape[1], k.shape[1]
    g = hq // kv

    def choose(h, held, next_pos):
        rbar = sum(rope_matrix(p) for p in range(next_pos, next_pos + method.n_future_positions))
        rbar = rbar / method.n_future_positions
        free = [p for p in held if p >= method.n_sink]
        keys, values = k[0, h, free].double(), v[0, h, free].double()
        total = [0.0] * len(free)
        for j in range(h * g, (h + 1) * g):
            anchor = rbar @ q_raw[0, j, method.n_sink:next_pos].double().mean(0)
            cos = [float(anchor @ key / (anchor.norm() * key.norm())) for key in keys]
            w = [math.exp(method.tau * (c - max(cos))) for c in cos]
            a = torch.eye(D, dtype=torch.float64)
            for wi, u in zip(w, values):
                a += (wi + method.epsilon) * torch.outer(u, u)
            inverse = torch.linalg.inv(a)
            for i, (wi, u) in enumerate(zip(w, values)):
                total[i] += wi * float(u @ inverse @ u) / g
        sinks = [p for p in held if p < method.n_sink]
        order = sorted(range(len(free)), key=lambda i: -total[i])
        return sinks + [free[i] for i in order[:budget - len(sinks)]]
    return choose


def recompress_reference(q_raw, k, prompt_len, budget, every, choose):
    """As helpers.recompress_dense, but a re-compression after token ``t`` is anchored on the queries up to ``t``."""
    kv, n = k.shape[1], q_raw.shape[2]
    held = [list(range(prompt_len)) for _ in range(kv)]
    if prompt_len > budget:
        held = [sorted(choose(h, held[h], prompt_len)) for h in range(kv)]
    steps = [held]
    for i, t in enumerate(range(prompt_len, n), 1):
        held = [row + [t] for row in held]
        if every and i % every == 0 and len(held[0]) > budget:
            held = [sorted(choose(h, held[h], t + 1)) for h in range(kv)]
        steps.append(held)
    return steps


@pytest.mark.parametrize("every,params", [(0, {}), (0, {"tau": 1.5, "n_sink": 0, "epsilon": 0.3}),
                                          (3, {"n_sink": 2}), (1, {"tau": 8.0})])
def test_kept_positions_equal_a_plain_recomputation(every, params):
    n, prompt_len, budget = 52, 36, 14
    q_raw = randn(1, 4, n, D, seed=71) + randn(1, 4, 1, D, seed=72) * 2  # queries before RoPE, a common offset
    k, v = randn(1, 2, n, D, seed=73), randn(1, 2, n, D, seed=74)
    q = ROPE.rotate(q_raw, torch.arange(n))  # as attnkit hands them over: after RoPE at their positions
    method = attnkit.make_method("cap", budget_tokens=budget, decode_every=every, n_future_positions=24, **params)
    _, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_reference(q_raw, k, prompt_len, budget, every, cap_choose(q_raw, k, v, budget, method))
    assert got == want
    assert all(set(range(method.n_sink)) <= set(row) for step in got for row in step)
    assert len({tuple(row) for row in got[0]}) > 1  # the kv heads choose for themselves


def test_chunked_prefill_keeps_the_same_positions(arch_models):
    model, n = arch_models["qwen3"], 180
    ids = random_ids(n, seed=17)
    method = parse_method_spec("cap:budget_tokens=50")
    kept = []
    for chunk in (None, 64, 29):
        session = new_session(model, method, n, 1)
        with torch.inference_mode():
            prefill(model, session, ids, chunk_size=chunk)
        kept.append([[sorted(r.tolist()) for r in layer.view()[2][0]] for layer in session.cache.layers])
    assert kept[0] == kept[1] == kept[2]
    assert all(len(row) == 50 for layer in kept[0] for row in layer)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "cap",
                                                 {"budget_tokens": 40, "decode_every": 8}, 16)
    assert max(cache.kept_lengths()) <= 48


@pytest.mark.parametrize("spec,name", [("cap:budget=0.5,tau=0", "tau"),
                                       ("cap:budget=0.5,n_future_positions=0", "n_future_positions"),
                                       ("cap:budget=0.5,n_sink=-1", "n_sink"),
                                       ("cap:budget=0.5,epsilon=-1", "epsilon")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


def test_too_many_sinks_for_the_budget_are_refused(arch_models):
    with pytest.raises(AttnkitError, match="n_sink=8") as caught:
        attnkit.generate(arch_models["llama"], random_ids(60, seed=2), "cap:budget_tokens=8,n_sink=8",
                         max_new_tokens=2)
    assert "\n" not in str(caught.value)
