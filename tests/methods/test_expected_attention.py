"""expected_attention: equal to full at an unlimited budget on every architecture; the kept positions per layer
and kv head equal the paper's formula written plainly in float64 from the model's own queries before RoPE (caught
by hooks on the projections, not recovered as the method does), keys and values; chunked prefill keeps the same
positions; decode_every re-compresses with the moments of every query seen (hand-made tensors, step by step);
bad parameters refused in one line."""

from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import logits_of, prefill
from attnkit.methods.full import Full
from attnkit.methods.spec import parse_method_spec
from attnkit.rope import Rope
from attnkit.session import layer_contexts, new_session
from helpers import ROPE, D, assert_equals_full, drive, per_token_bytes, randn, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


# ---- unlimited budget: exactly full -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("extra", ["", ",decode_every=2", ",use_covariance=false,use_vnorm=false,n_sink=0"])
def test_unlimited_budget_equals_full(models, arch, extra):
    model, ids = models[arch], random_ids(150, seed=3)
    assert_equals_full(model, ids, parse_method_spec("expected_attention:budget_tokens=200" + extra), NEW)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_unlimited_budget_batch_equals_full(models, arch):
    model = models[arch]
    prompts = [random_ids(n, seed=s).tolist() for s, n in enumerate((120, 120, 90))]
    method = parse_method_spec("expected_attention:budget_tokens=400,decode_every=3")
    assert_equals_full(model, prompts, method, NEW)


# ---- small budget: the paper's formula from the model's own queries before RoPE ----------------------------
@dataclass(frozen=True)
class Recorder(Full):
    """Full attention that records every layer's keys and values (after RoPE) as the method sees them."""

    def prefill_attention(self, ctx, q, k, v):
        RECORDED[ctx.index] = (k.clone(), v.clone(), ctx.scaling)
        return super().prefill_attention(ctx, q, k, v)


RECORDED: dict = {}


def record(model, ids):
    """Per layer: the queries before RoPE ``[hq, n, d]`` (the output of q_proj, or of Qwen3's q_norm, caught by
    forward hooks), and the keys, values and scaling the method sees."""
    g = model.geometry
    queries, hooks = {}, []
    for i, layer in enumerate(model.hf.model.layers):
        attn = layer.self_attn
        module = getattr(attn, "q_norm", None) or attn.q_proj

        def hook(mod, args, out, i=i):
            queries[i] = out.detach().reshape(out.shape[0], -1, g.n_q_heads, g.head_dim)[0].transpose(0, 1).clone()
        hooks.append(module.register_forward_hook(hook))
    RECORDED.clear()
    try:
        with torch.inference_mode():
            prefill(model, new_session(model, Recorder(), ids.shape[-1], 1), ids)
    finally:
        for h in hooks:
            h.remove()
    return [(queries[i],) + RECORDED[i] for i in range(g.n_layers)]


def rotation_matrix(inv_freq: torch.Tensor, pos: int) -> torch.Tensor:
    """RoPE at `pos` as a dense ``[d, d]`` float64 matrix: ``x -> cos * x + sin * rotate_half(x)``."""
    angles = pos * inv_freq.double()
    cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
    half = 2 * inv_freq.numel()
    rotate_half = torch.zeros(half, half, dtype=torch.float64)
    rotate_half[:half // 2, half // 2:] = -torch.eye(half // 2)
    rotate_half[half // 2:, :half // 2] = torch.eye(half // 2)
    return torch.diag(cos) + torch.diag(sin) @ rotate_half


def reference_scores(q_pre, keys, values, inv_freq, start, method):
    """Expected Attention written plainly (float64): ``q_pre`` ``[hq, m, d]`` the queries the moments come from,
    ``keys``/``values`` ``[kv, L, d]`` with the first ``n_sink`` being sinks; per kv head ``[L]``."""
    d, hq, kv = keys.shape[-1], q_pre.shape[0], keys.shape[0]
    q = q_pre.double()
    mu = q.mean(1)
    dev = q - mu[:, None]
    sigma = dev.transpose(1, 2) @ dev / q.shape[1]
    rbar = torch.stack([rotation_matrix(inv_freq, p) for p in range(start, start + method.n_future_positions)]).mean(0)
    out = []
    for h in range(kv):
        k, probs = keys[h].double(), []
        for j in range(h * hq // kv, (h + 1) * hq // kv):
            m, s = rbar @ mu[j], rbar @ sigma[j] @ rbar.T
            z = k @ m / d ** 0.5
            if method.use_covariance:
                z = z + torch.einsum("ld,de,le->l", k, s, k) / (2 * d)
            z[:method.n_sink] = float("-inf")
            probs.append(torch.softmax(z, -1))
        score = torch.stack(probs).mean(0)
        if method.use_vnorm:
            score = (score + method.epsilon) * values[h].double().norm(dim=-1)
        out.append(score)
    return out


def assert_best(kept, score, budget, forced, tol=1e-6):
    """`kept` is `budget` positions: the `forced` ones and the highest `score`s (up to float32 rounding)."""
    dropped = [p for p in range(len(score)) if p not in kept]
    assert len(kept) == budget and set(forced) <= set(kept)
    chosen = [p for p in kept if p not in forced]
    assert min(score[chosen]) >= max(score[dropped]) - tol * float(score[chosen].abs().max())


def held(session, layer):
    return [sorted(row.tolist()) for row in session.cache.layers[layer].view()[2][0]]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", [
    "expected_attention:budget_tokens=40", "expected_attention:budget=0.3/0.5,n_future_positions=64",
    "expected_attention:budget_tokens=40,use_covariance=false,use_vnorm=false,n_sink=0",
    "expected_attention:budget_tokens=30,epsilon=0.01,n_sink=2,decode_every=3",
])
def test_kept_positions_equal_the_formula_from_the_models_queries(models, arch, spec):
    model, n = models[arch], 130
    ids = random_ids(n, seed=21)
    method = parse_method_spec(spec)
    recorded = record(model, ids)
    session = new_session(model, method, n, 4)
    with torch.inference_mode():
        prefill(model, session, ids)
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    inv_freq = model.hf.model.rotary_emb.inv_freq
    for layer, (q_pre, k, v, scale) in enumerate(recorded):
        assert scale == pytest.approx(model.geometry.head_dim ** -0.5)
        scores = reference_scores(q_pre[:, method.n_sink:], k[0], v[0], inv_freq, n, method)
        for h, score in enumerate(scores):
            assert_best(held(session, layer)[h], score, budgets[layer], range(method.n_sink))
    assert max(budgets) < n
    # the kv heads choose for themselves
    assert any(len({tuple(row) for row in held(session, layer)}) > 1 for layer in range(len(recorded)))


@pytest.mark.parametrize("spec", ["expected_attention:budget_tokens=40",
                                  "expected_attention:budget=0.3,decode_every=2,n_future_positions=100"])
def test_chunked_prefill_keeps_the_same_positions_and_tokens(models, spec):
    model, n = models["qwen3"], 200
    ids = random_ids(n, seed=13)
    method = parse_method_spec(spec)
    kept = []
    for chunk in (None, 70, 33):
        session = new_session(model, method, n, 1)
        with torch.inference_mode():
            prefill(model, session, ids, chunk_size=chunk)
        kept.append([held(session, layer) for layer in range(model.geometry.n_layers)])
    assert kept[0] == kept[1] == kept[2]
    one = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True,
                               chunk_size=70)
    assert chunked.token_ids == one.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(chunked.logits, one.logits)) < 1e-4


# ---- decode_every: re-compression with the moments of every query seen (hand-made tensors) -----------------
def recompress_reference(q_raw, k, v, prompt_len, budget, every, method):
    """The prompt compressed to `budget` with the moments of its queries (sinks left out) and the rotations
    averaged from position `prompt_len`; then tokens appended and, every `every` of them, the held entries
    compressed back to `budget` with the moments of every query up to the newest, rotations from the next
    position. Held positions per step and kv head."""
    kv, n = k.shape[1], q_raw.shape[2]

    def choose(h, held, last):  # `last`: the newest token, whose query is in the moments
        score = reference_scores(q_raw[0, :, method.n_sink:last + 1], k[0, :, held], v[0, :, held], ROPE.inv_freq,
                                 last + 1, method)[h]
        sinks = [p for p in held if p < method.n_sink]
        others = sorted((p for p in held if p >= method.n_sink), key=lambda p: -float(score[held.index(p)]))
        return sorted(sinks + others[:budget - len(sinks)])

    held = [list(range(prompt_len)) for _ in range(kv)]
    if prompt_len > budget:
        held = [choose(h, held[h], prompt_len - 1) for h in range(kv)]
    steps = [held]
    for i, t in enumerate(range(prompt_len, n), 1):
        held = [row + [t] for row in held]
        if every and i % every == 0 and len(held[0]) > budget:
            held = [choose(h, held[h], t) for h in range(kv)]
        steps.append(held)
    return steps


@pytest.mark.parametrize("every", [0, 1, 3])
@pytest.mark.parametrize("extra", [{}, {"use_covariance": False, "n_sink": 0}, {"n_sink": 2, "epsilon": 0.5}])
def test_decode_every_recompresses_with_the_moments_of_every_query_seen(every, extra):
    n, prompt_len, budget = 46, 30, 12
    q_raw = randn(1, 4, n, D, seed=51) + randn(1, 4, 1, D, seed=52) * 2  # queries before RoPE, a common offset
    k, v = randn(1, 2, n, D, seed=53), randn(1, 2, n, D, seed=54)
    q = ROPE.rotate(q_raw, torch.arange(n))  # as attnkit hands them to the method: after RoPE at their positions
    method = attnkit.make_method("expected_attention", budget_tokens=budget, decode_every=every,
                                 n_future_positions=20, **extra)
    session, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_reference(q_raw, k, v, prompt_len, budget, every, method)
    assert got == want
    assert session.cache.layers[0].capacity == (budget + every if every else budget + n - prompt_len)


def test_decode_every_keeps_the_cache_within_budget_plus_n(models):
    model, n, budget, every = models["llama"], 100, 32, 4
    method = parse_method_spec(f"expected_attention:budget_tokens={budget},decode_every={every}")
    session = new_session(model, method, n, 20)
    assert [method.planned_slots(ctx) for ctx in layer_contexts(session)] == [budget + every] * 2
    out = attnkit.generate(model, random_ids(n, seed=5), method, max_new_tokens=20, stop_at_eos=False)
    assert out.stats.peak_kv_bytes <= n * per_token_bytes(model)
    assert out.stats.final_kv_bytes <= (budget + every) * per_token_bytes(model)


def test_the_moments_leave_with_finished_rows(models):
    model = models["llama"]
    method = parse_method_spec("expected_attention:budget_tokens=32,decode_every=3")
    ids = torch.stack([random_ids(90, seed=s) for s in (1, 2, 3)])
    session = new_session(model, method, 90, 4, rows=3)
    with torch.inference_mode():
        logits_of(model, prefill(model, session, ids)[:, -1])
    before = [st.mean.clone() for st in session.layer_state]
    session.keep_rows([0, 2])
    for st, old in zip(session.layer_state, before):
        assert st.mean.shape[0] == st.scatter.shape[0] == 2 and torch.equal(st.mean, old[[0, 2]])


# ---- parameters -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,pattern", [
    ({}, r"expected_attention needs a cache budget"),
    ({"budget": 0.5, "n_future_positions": 0}, r"n_future_positions must be a whole number >= 1 .*got 0"),
    ({"budget": 0.5, "n_sink": -1}, r"n_sink must be a whole number >= 0 .*got -1"),
    ({"budget": 0.5, "use_covariance": 1}, r"use_covariance must be True or False, got 1"),
    ({"budget": 0.5, "use_vnorm": "maybe"}, r"use_vnorm=.maybe. is not a valid"),
    ({"budget": 0.5, "epsilon": -0.1}, r"epsilon must be a number >= 0.0 .*got -0.1"),
    ({"budget": 0.5, "decode_every": -2}, r"decode_every must be a whole number >= 0"),
    ({"budget": 0.5, "window_size": 8}, r"method 'expected_attention' has no parameter window_size"),
])
def test_bad_parameters_are_refused_in_one_line(params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method("expected_attention", **params)
    assert "\n" not in str(err.value)


def test_what_it_cannot_honour_is_refused_in_one_line(models):
    q, k, v = randn(1, 4, 20, D, seed=1), randn(1, 2, 20, D, seed=2), randn(1, 2, 20, D, seed=3)
    cases = [
        (dict(budget_tokens=4), {}, r"n_sink=4 sinks leave no slot to choose in the 4-slot budget of layer 0"),
        (dict(budget_tokens=8), {"rope": None}, r"needs the model's rotary embedding"),
        (dict(budget_tokens=8), {"rope": Rope(inv_freq=ROPE.inv_freq[:2])},
         r"RoPE over the whole head \(head_dim 8, rotary dimension 4\)"),
    ]
    for params, options, pattern in cases:
        with pytest.raises(AttnkitError, match=pattern) as err:
            drive(attnkit.make_method("expected_attention", **params), q, k, v, 16, **options)
        assert "\n" not in str(err.value)
    # the same sinks at a budget that is never reached: nothing to choose, nothing refused
    drive(attnkit.make_method("expected_attention", budget_tokens=40), q, k, v, 16)
    with pytest.raises(AttnkitError, match=r"n_sink=4 sinks leave no slot"):
        attnkit.generate(models["llama"], random_ids(50, seed=1), "expected_attention",
                         params={"budget_tokens": 3}, max_new_tokens=2)


def test_spec_parses_and_describes():
    m = parse_method_spec("expected_attention:budget_tokens=64/32,n_sink=0,use_covariance=false,decode_every=8")
    assert (m.budget_tokens, m.n_sink, m.use_covariance, m.decode_every) == ([64, 32], 0, False, 8)
    assert not m.decode_only_appends() and parse_method_spec("expected_attention:budget=0.3").decode_only_appends()
    assert "expected_attention" in attnkit.methods.METHODS
