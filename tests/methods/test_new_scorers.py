"""knorm, keydiff, tova and the prompt-time scorers' ``decode_every``: equal to full at an unlimited budget on
every architecture; the kept positions per layer and kv head equal a plain recomputation from the model's own
keys and queries; ``decode_every`` keeps the cache within ``B + N`` and re-compresses by each method's rule
(checked step by step against dense references on hand-made tensors); bad parameters refused in one line."""

from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.full import Full
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Step, layer_contexts, new_session
from helpers import assert_equals_full, drive, per_token_bytes, qkv, random_ids, recompress_dense

torch.set_num_threads(1)

NEW = 12


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


def with_params(spec: str, extra: str):
    return parse_method_spec(spec + ("," if ":" in spec else ":") + extra)


# ---- unlimited budget: exactly full -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["knorm", "keydiff", "tova", "knorm:decode_every=1", "keydiff:decode_every=3",
                                  "snapkv:window_size=8,decode_every=2"])
def test_unlimited_budget_equals_full(models, arch, spec):
    model, ids = models[arch], random_ids(150, seed=3)
    assert_equals_full(model, ids, with_params(spec, "budget_tokens=200"), NEW)


# ---- small budget: the kept positions from the model's own keys and queries ---------------------------------
@dataclass(frozen=True)
class Recorder(Full):
    """Full attention that records every layer's prompt queries and keys (after RoPE) as the methods see them."""

    def prefill_attention(self, ctx, q, k, v):
        RECORDED[ctx.index] = (q.clone(), k.clone(), ctx.scaling, ctx.native_window)
        return super().prefill_attention(ctx, q, k, v)


RECORDED: dict = {}


def record(model, ids):
    RECORDED.clear()
    with torch.inference_mode():
        prefill(model, new_session(model, Recorder(), ids.shape[-1], 1), ids)
    return [RECORDED[i] for i in range(model.geometry.n_layers)]


def held(session, layer):
    return [sorted(row.tolist()) for row in session.cache.layers[layer].view()[2][0]]


def knorm_scores(q, k, scale, window):
    return [-k[0, h].double().norm(dim=-1) for h in range(k.shape[1])]


def keydiff_scores(q, k, scale, window):
    out = []
    for h in range(k.shape[1]):
        unit = k[0, h].double() / k[0, h].double().norm(dim=-1, keepdim=True)
        anchor = unit.mean(0)
        out.append(-(unit @ anchor) / anchor.norm())  # minus the cosine to the mean unit key
    return out


def tova_scores(q, k, scale, window):
    """The last prompt query's attention, averaged over every query head, per prompt position (every kv head)."""
    n, hq, kv = k.shape[2], q.shape[1], k.shape[1]
    hidden = n - 1 - torch.arange(n) >= (window or n)  # outside the model's own sliding window
    probs = [torch.softmax((q[0, h, -1].double() @ k[0, h // (hq // kv)].double().T * scale)
                           .masked_fill(hidden, float("-inf")), -1) for h in range(hq)]
    return [torch.stack(probs).mean(0)] * kv


SCORES = {"knorm": knorm_scores, "keydiff": keydiff_scores, "tova": tova_scores}


def assert_best(kept, score, budget, forced=(), tol=1e-6):
    """`kept` is `budget` positions: the `forced` ones and the highest `score`s (ties within `tol` either way:
    RoPE keeps a key's norm, so the same token at two positions has the same norm)."""
    dropped = [p for p in range(len(score)) if p not in kept]
    assert len(kept) == budget and set(forced) <= set(kept)
    chosen = [p for p in kept if p not in forced]
    assert min(score[chosen]) >= max(score[dropped]) - tol * max(1.0, float(score.abs().max()))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["knorm:budget_tokens=40", "keydiff:budget=0.25/0.4", "tova:budget_tokens=40",
                                  "tova:budget=0.3/0.5", "knorm:budget=0.2,decode_every=3"])
def test_kept_positions_equal_a_recomputation_from_the_model(models, arch, spec):
    model, n = models[arch], 130
    ids = random_ids(n, seed=21)
    method = parse_method_spec(spec)
    recorded = record(model, ids)
    session = new_session(model, method, n, 4)
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, ids)).argmax())
    forced = [n - 1] if method.name == "tova" else []  # TOVA keeps the last prompt token
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    kept = [held(session, layer) for layer in range(len(recorded))]
    for layer, (q, k, scale, window) in enumerate(recorded):
        for h, score in enumerate(SCORES[method.name](q, k, scale, window)):
            assert_best(kept[layer][h], score, budgets[layer], forced)
        if method.name == "tova":
            assert kept[layer] == [kept[layer][0]] * k.shape[1]  # one set for every kv head
    assert budgets[0] < n
    if method.name == "tova":  # one decode-time eviction: the kept entry the last prompt query liked least
        with torch.inference_mode():
            forward(model, torch.tensor([token]), n, lambda p: Step(session, "decode", p))
        for layer, (q, k, scale, window) in enumerate(recorded):
            before, score = kept[layer][0], tova_scores(q, k, scale, window)[0]
            now = held(session, layer)
            assert now == [now[0]] * k.shape[1] and n in now[0]
            (victim,) = set(before) - set(now[0])
            assert set(now[0]) == set(before) - {victim} | {n}
            assert score[victim] == min(score[[p for p in before if p != n - 1]])  # the newest entry stays


# ---- decode-time rules on hand-made tensors, step by step ---------------------------------------------------
def dense_probs(q, k, t, held):
    """Per query head: softmax of q_t over the keys at positions `held` of its kv group, float64 ``[hq, len]``."""
    g, d = q.shape[1] // k.shape[1], q.shape[-1]
    return torch.stack([torch.softmax(q[0, h, t].double() @ k[0, h // g, held].double().T * d ** -0.5, -1)
                        for h in range(q.shape[1])])


def tova_dense(q, k, prompt_len, budget):
    """TOVA written plainly: sets of positions, the averaged attention of the latest query, one out per step
    (never the latest query's own entry)."""
    n = q.shape[2]
    held = list(range(prompt_len))
    score = dict(zip(held, dense_probs(q, k, prompt_len - 1, held).mean(0).tolist()))
    if prompt_len > budget:
        score_keep = {**score, prompt_len - 1: float("inf")}  # the last prompt token is kept
        held = sorted(sorted(held, key=lambda p: -score_keep[p])[:budget])
    steps = [held]
    for t in range(prompt_len, n):
        if len(held) >= budget:
            victim = min((p for p in held if p != t - 1), key=lambda p: score[p])
            held = [p for p in held if p != victim]
        held = held + [t]
        score = dict(zip(held, dense_probs(q, k, t, held).mean(0).tolist()))
        steps.append(sorted(held))
    return steps


@pytest.mark.parametrize("prompt_len,budget", [(24, 8), (10, 16)])
def test_tova_evicts_the_entry_the_latest_query_attends_to_least(prompt_len, budget):
    q, k, v = qkv(44, seed=31)
    _, _, got = drive(attnkit.make_method("tova", budget_tokens=budget), q, k, v, prompt_len)
    want = tova_dense(q, k, prompt_len, budget)
    assert got == [[s, s] for s in want]  # both kv heads keep the same positions
    assert max(len(s) for s in want) == budget


def knorm_choose(q, k, budget, **_):
    return lambda h, held, next_pos: sorted(held, key=lambda p: float(k[0, h, p].double().norm()))[:budget]


def keydiff_choose(q, k, budget, **_):
    def choose(h, held, next_pos):
        keys = k[0, h, held].double()
        unit = keys / keys.norm(dim=-1, keepdim=True)
        sim = (unit @ unit.mean(0)).tolist()
        return [p for _, p in sorted(zip(sim, held))[:budget]]
    return choose


def snapkv_choose(q, k, budget, window_size, kernel_size):
    """SnapKV's vote from the last `window_size` queries seen, pooled (zero-padded average) along the held
    entries before the window in position order; the window's own entries kept."""
    g = q.shape[1] // k.shape[1]

    def choose(h, held, next_pos):
        window = list(range(max(0, next_pos - window_size), next_pos))
        votes = torch.zeros(len(held), dtype=torch.float64)
        for t in window:
            visible = [p for p in held if p <= t]
            probs = dense_probs(q[:, h * g:(h + 1) * g], k[:, h:h + 1], t, visible).mean(0)
            votes[:len(visible)] += probs
        prefix = [p for p in held if p < window[0]]
        r = kernel_size // 2
        pooled = [sum(float(votes[j]) for j in range(i - r, i + r + 1) if 0 <= j < len(prefix)) / kernel_size
                  for i in range(len(prefix))]
        best = [p for _, p in sorted(zip(pooled, prefix), key=lambda x: -x[0])[:budget - len(window)]]
        return best + window
    return choose


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("name,choose,extra", [
    ("knorm", knorm_choose, {}), ("keydiff", keydiff_choose, {}),
    ("snapkv", snapkv_choose, {"window_size": 4, "kernel_size": 3}),
])
def test_decode_every_recompresses_by_the_methods_own_rule(name, choose, extra, every):
    q, k, v = qkv(50, seed=41)
    budget, prompt_len = 12, 30
    method = attnkit.make_method(name, budget_tokens=budget, decode_every=every, **extra)
    session, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_dense(q, k, prompt_len, budget, every, choose(q, k, budget, **extra))
    assert got == want
    assert session.cache.layers[0].capacity == budget + every
    # after prefill B, then B+1 .. B+N-1, then back to B after the N-th token
    assert [len(s[0]) for s in got[:every + 1]] == [budget] + list(range(budget + 1, budget + every)) + [budget]


@pytest.mark.parametrize("spec", ["knorm", "keydiff", "snapkv:window_size=8"])
@pytest.mark.parametrize("every", [1, 4])
def test_decode_every_keeps_the_cache_within_budget_plus_n(models, spec, every):
    model, n, budget = models["llama"], 100, 32
    method = with_params(spec, f"budget_tokens={budget},decode_every={every}")
    session = new_session(model, method, n, 30)
    assert [method.planned_slots(ctx) for ctx in layer_contexts(session)] == [budget + every] * 2
    lengths = []
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=5))).argmax())
        for i in range(30):
            hidden = forward(model, torch.tensor([token]), n + i, lambda p: Step(session, "decode", p))
            token = int(logits_of(model, hidden[-1:]).argmax())
            lengths.append(session.cache.lengths())
            assert session.cache.nbytes() == (budget + every) * per_token_bytes(model)
    assert all(length <= budget + every for step in lengths for length in step)
    if every == 1:
        assert lengths == [[budget] * 2] * 30
    else:  # compressed back to B after every 4th token
        assert [step[0] for step in lengths[:8]] == [33, 34, 35, 32, 33, 34, 35, 32]
    assert session.cache.peak_bytes <= n * per_token_bytes(model)


@pytest.mark.parametrize("spec", ["tova:budget_tokens=40", "snapkv:budget_tokens=40,window_size=8,decode_every=3",
                                  "keydiff:budget=0.3,decode_every=2"])
def test_chunked_prefill_keeps_the_same_tokens(models, spec):
    model, ids = models["llama"], random_ids(200, seed=13)
    one = attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=NEW, stop_at_eos=False,
                           keep_logits=True)
    chunked = attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=NEW, stop_at_eos=False,
                               keep_logits=True, chunk_size=70)
    assert chunked.token_ids == one.token_ids
    assert (chunked.logits[-1] - one.logits[-1]).abs().max().item() < 1e-4


# ---- parameters -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,pattern", [
    ("knorm", {}, r"knorm needs a cache budget"),
    ("keydiff", {"budget": 1.5}, r"0 < budget <= 1, got 1.5"),
    ("tova", {"budget_tokens": 0}, r"budget_tokens.*got 0"),
    ("knorm", {"budget": 0.5, "decode_every": -1}, r"decode_every must be a whole number >= 0 .*got -1"),
    ("keydiff", {"budget": 0.5, "decode_every": 1.5}, r"decode_every must be a whole number.*got 1.5"),
    ("snapkv", {"budget": 0.5, "decode_every": "x"}, r"decode_every=.x. is not a valid"),
    ("snapkv", {"budget": 0.5, "decode_every": 4, "decode_budget": 8},
     r"give decode_budget or decode_every, not both \(decode_budget=8, decode_every=4\)"),
    ("tova", {"budget": 0.5, "window_size": 2}, r"method 'tova' has no parameter window_size"),
    ("knorm", {"budget": 0.5, "gqa_reduce": "max"}, r"method 'knorm' has no parameter gqa_reduce"),
])
def test_bad_parameters_are_refused_in_one_line(name, params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method(name, **params)
    assert "\n" not in str(err.value)


def test_a_window_larger_than_the_budget_is_refused_when_decoding_recompresses(models):
    # a 20-token prompt at budget=1.0 is never compressed, but decode_every would compress to 20 slots while
    # keeping a 32-query window
    ids = random_ids(20, seed=2)
    with pytest.raises(AttnkitError, match=r"observation window \(32 tokens\) does not fit in the 20-slot budget"):
        attnkit.generate(models["llama"], ids, "snapkv", params={"budget": 1.0, "decode_every": 2}, max_new_tokens=8)
    out = attnkit.generate(models["llama"], ids, "snapkv", params={"budget": 1.0}, max_new_tokens=8, stop_at_eos=False)
    assert len(out.token_ids) == 8


def test_specs_parse_and_describe():
    m = parse_method_spec("keydiff:budget_tokens=64/32,decode_every=8")
    assert (m.budget_tokens, m.decode_every, m.decode_only_appends()) == ([64, 32], 8, False)
    assert parse_method_spec("knorm:budget=0.3").decode_only_appends()
    assert parse_method_spec("tova:budget=0.3").describe() == "tova(budget=0.3, budget_tokens=None, layer_budgets=uniform, decode_every=0)"
    assert {"knorm", "keydiff", "tova"} <= set(attnkit.methods.METHODS)


@pytest.mark.parametrize("spec", ["h2o:budget_tokens=40", "h2o:budget=0.3,gqa_reduce=max"])
def test_the_fused_prompt_pass_keeps_the_same_tokens(models, monkeypatch, spec):
    """The GPU path of H2O's prompt (two flash calls, :func:`attnkit.methods.scoring.fused_attention_with_statistics`)
    forced on a CPU: the same tokens and logits as the blocked pass, on a ragged batch; only H2O's mean over
    the group takes it (the max over the group has no such form)."""
    from attnkit.methods import eviction

    model = models["llama"]
    prompts = [random_ids(n, seed=20 + n) for n in (90, 130, 61)]
    run = lambda: attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=NEW,  # noqa: E731
                                   stop_at_eos=False, keep_logits=True)
    blocked = run()
    calls = []
    fused = eviction.fused_attention_with_statistics
    monkeypatch.setattr(eviction, "fused_pays", lambda q: True)
    monkeypatch.setattr(eviction, "fused_attention_with_statistics", lambda *a: calls.append(1) or fused(*a))
    forced = run()
    assert len(calls) == (0 if "max" in spec else model.geometry.n_layers * len(prompts))
    for a, b in zip(forced, blocked):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4
