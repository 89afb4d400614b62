"""KV-cache eviction: streaming (StreamingLLM), h2o (H2O), keyformer (Keyformer, Adnan et al. 2024), snapkv (SnapKV).

Hand-made tensors drive a method's hooks directly (one layer, no model) to check which positions stay;
dense reference implementations of the selection rules check the chunked, per-head, in-place ones; the
small random model checks equality with `full`, constant memory and the error messages.
"""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.forward import forward, prefill
from attnkit.methods.keyformer import keyformer_tau
from attnkit.methods.keyformer_noise import keyformer_noise
from attnkit.rope import Rope
from attnkit.session import Session, Step, new_session
from helpers import SMALL, random_ids

torch.set_num_threads(1)

D = 8
ROPE = Rope(inv_freq=1.0 / (100.0 ** (torch.arange(0, D, 2).float() / D)))


# ---- driving a method's hooks on hand-made tensors --------------------------------------------------
def drive(method, q, k, v, prompt_len, rope=ROPE, scaling=None):
    """Prefill the first `prompt_len` tokens, then decode the rest one at a time (one layer).

    Returns the session, the decode outputs, and per step the sorted positions each kv head holds
    (step 0: after prefill; step i: what the i-th decode query attended to)."""
    n = q.shape[2]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    session = Session(method, KVCache(1), 1, prompt_len, n - prompt_len, rope=rope)
    p = slice(0, prompt_len)
    Step(session, "prefill", torch.arange(prompt_len)).attention(0, q[:, :, p], k[:, :, p], v[:, :, p], scaling, None)
    held, outs = [positions(session)], []
    for t in range(prompt_len, n):
        s = slice(t, t + 1)
        outs.append(Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s],
                                                                        scaling, None))
        held.append(positions(session))
    return session, outs, held


def positions(session, layer=0):
    pos = session.cache.layers[layer].view()[2][0]
    return [sorted(row.tolist()) for row in pos]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(n, hq=4, kv=2, d=D, seed=0):
    return randn(1, hq, n, d, seed=seed), randn(1, kv, n, d, seed=seed + 1), randn(1, kv, n, d, seed=seed + 2)


# ---- streaming ---------------------------------------------------------------------------------------
def test_streaming_keeps_sinks_and_recent_window():
    q, k, v = qkv(30)
    method = attnkit.make_method("streaming", budget_tokens=8, sinks=2)
    _, _, held = drive(method, q, k, v, prompt_len=20)
    assert held[0] == [[0, 1, 14, 15, 16, 17, 18, 19]] * 2  # sinks + the last B - sinks prompt tokens
    for i, step in enumerate(held[1:]):
        t = 20 + i
        assert step == [[0, 1] + list(range(t - 5, t + 1))] * 2  # incoming token included


def test_streaming_prompt_shorter_than_budget_fills_then_evicts():
    q, k, v = qkv(16)
    _, _, held = drive(attnkit.make_method("streaming", budget_tokens=10, sinks=1), q, k, v, prompt_len=6)
    assert held[0][0] == list(range(6))
    assert held[4][0] == list(range(10))  # filled up to the budget
    assert held[5][0] == [0] + list(range(2, 11))  # then the oldest non-sink leaves


def streaming_reference(q_raw, k_raw, v, t, kept, scaling):
    """StreamingLLM's re-indexed attention from keys before RoPE: cache entries at 0..C-1, query at C-1."""
    g = q_raw.shape[1] // k_raw.shape[1]
    outs = []
    for h in range(q_raw.shape[1]):
        idx = torch.tensor(kept[h // g])
        keys = ROPE.rotate(k_raw[0, h // g, idx], torch.arange(len(idx)))
        query = ROPE.rotate(q_raw[0, h, t:t + 1], len(idx) - 1)
        w = torch.softmax(query @ keys.T * scaling, dim=-1)
        outs.append(w @ v[0, h // g, idx])
    return torch.stack(outs)[None]


def test_streaming_reindex_equals_in_cache_positions_reference():
    n, prompt = 40, 12
    q_raw, k_raw, v = qkv(n, seed=3)
    pos = torch.arange(n)
    q, k = ROPE.rotate(q_raw, pos), ROPE.rotate(k_raw, pos)  # cached after RoPE at original positions
    method = attnkit.make_method("streaming", budget_tokens=9, sinks=3, positions="reindex")
    _, outs, held = drive(method, q, k, v, prompt_len=prompt)
    original = attnkit.make_method("streaming", budget_tokens=9, sinks=3)
    _, outs_orig, _ = drive(original, q, k, v, prompt_len=prompt)
    for i, out in enumerate(outs):
        ref = streaming_reference(q_raw, k_raw, v, prompt + i, held[i + 1], D ** -0.5)
        assert (out - ref).abs().max().item() < 1e-5
    assert (outs[-1] - outs_orig[-1]).abs().max().item() > 1e-4  # re-indexing does change the result


# ---- h2o -----------------------------------------------------------------------------------------------
def heavy_hitter_tensors(n, heavy=(3, 9), kv=2, g=2):
    """Every query points along e0; keys `heavy` are long along e0, the others short and random."""
    k = randn(1, kv, n, D, seed=5) * 0.1
    k[:, :, list(heavy), 0] = 4.0
    q = randn(1, kv * g, n, D, seed=6) * 0.1
    q[..., 0] = 2.0
    return q, k, randn(1, kv, n, D, seed=7)


def test_h2o_keeps_heavy_hitters_and_recent_window():
    q, k, v = heavy_hitter_tensors(30)
    method = attnkit.make_method("h2o", budget_tokens=5, recent_tokens=2)
    _, _, held = drive(method, q, k, v, prompt_len=16)
    for head in held[0]:
        assert {3, 9, 14, 15} <= set(head) and len(head) == 5
    for i, step in enumerate(held[1:]):
        t = 16 + i
        assert step == [[3, 9, t - 2, t - 1, t]] * 2  # B - 1 - w heavy hitters, w recent, the incoming token


def dense_reference(q, k, prompt_len, budget, recent, weights, reduce="mean"):
    """The eviction rule written plainly: full attention matrices, Python sets, no chunks, no slots.

    `weights(x, head, q_pos, k_pos, t)` turns logits x [g, queries, keys] into per-key weights.
    Returns per step (0 = after prefill) the sorted positions each kv head holds.
    """
    _, hq, n, d = q.shape
    kv = k.shape[1]
    g = hq // kv
    scale = d ** -0.5
    per_head = []
    for h in range(kv):
        score = torch.zeros(n, dtype=torch.float64)
        qh = q[0, h * g:(h + 1) * g]
        x = qh[:, :prompt_len] @ k[0, h, :prompt_len].T * scale
        x = x.masked_fill(torch.ones(prompt_len, prompt_len, dtype=torch.bool).triu(1), float("-inf"))
        w = weights(x, h, torch.arange(prompt_len), torch.arange(prompt_len), 0)
        w = w.mean(0) if reduce == "mean" else w.amax(0)
        score[:prompt_len] += w.sum(0).double()
        held = list(range(prompt_len))
        if prompt_len > budget:
            keep = [p for p in held if p >= prompt_len - recent]
            rest = sorted((p for p in held if p not in keep), key=lambda p: -score[p])
            held = sorted(keep + rest[:budget - len(keep)])
        steps = [sorted(held)]
        for t in range(prompt_len, n):
            if len(held) >= budget:
                held.remove(min((p for p in held if p < t - recent), key=lambda p: score[p]))
            held.append(t)
            x = (qh[:, t] @ k[0, h, held].T * scale)[:, None]
            w = weights(x, h, torch.tensor([t]), torch.tensor(held), t - prompt_len + 1)
            w = w.mean(0) if reduce == "mean" else w.amax(0)
            score[held] += w[0].double()
            steps.append(sorted(held))
        per_head.append(steps)
    return [[per_head[h][s] for h in range(kv)] for s in range(n - prompt_len + 1)]


def softmax_weights(x, head, q_pos, k_pos, t):
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_h2o_matches_dense_reference(reduce):
    q, k, v = qkv(60, seed=11)
    method = attnkit.make_method("h2o", budget_tokens=14, recent_tokens=4, gqa_reduce=reduce)
    _, _, held = drive(method, q, k, v, prompt_len=40)
    assert held == dense_reference(q, k, 40, 14, 4, softmax_weights, reduce)


# ---- keyformer -----------------------------------------------------------------------------------------
def keyformer_weights(noise, seed, kv, g, T, tau_init=1.0, tau_end=2.0):
    def weights(x, head, q_pos, k_pos, t):
        zeta = keyformer_noise(noise, seed, 0, kv, g, q_pos, k_pos)
        if isinstance(zeta, torch.Tensor):
            zeta = zeta[0, head]
        tau = tau_init + t * (tau_end - tau_init) / T  # eq. 10
        return torch.softmax((x + zeta) / tau, dim=-1)  # eq. 9
    return weights


@pytest.mark.parametrize("noise", ["gumbel", "gaussian"])
def test_keyformer_matches_dense_reference_with_fixed_seed(noise):
    q, k, v = qkv(50, seed=21)
    method = attnkit.make_method("keyformer", budget_tokens=12, recent_tokens=3, noise=noise, seed=7)
    _, _, held = drive(method, q, k, v, prompt_len=30)
    assert held == dense_reference(q, k, 30, 12, 3, keyformer_weights(noise, 7, 2, 2, 20))
    _, _, again = drive(attnkit.make_method("keyformer", budget_tokens=12, recent_tokens=3, noise=noise, seed=7),
                        q, k, v, prompt_len=30)
    assert again == held
    _, _, other = drive(attnkit.make_method("keyformer", budget_tokens=12, recent_tokens=3, noise=noise, seed=8),
                        q, k, v, prompt_len=30)
    assert other != held


def test_keyformer_without_noise_or_temperature_is_h2o():
    q, k, v = qkv(50, seed=31)
    kf = attnkit.make_method("keyformer", budget_tokens=12, recent_tokens=3, noise="none", tau_end=1.0)
    h2o = attnkit.make_method("h2o", budget_tokens=12, recent_tokens=3)
    _, out_kf, held_kf = drive(kf, q, k, v, prompt_len=30)
    _, out_h2o, held_h2o = drive(h2o, q, k, v, prompt_len=30)
    assert held_kf == held_h2o
    assert all(torch.equal(a, b) for a, b in zip(out_kf, out_h2o))


def test_keyformer_constant_noise_selects_as_none():
    q, k, v = qkv(50, seed=41)
    runs = [drive(attnkit.make_method("keyformer", budget_tokens=12, noise=n), q, k, v, prompt_len=30)[2]
            for n in ("constant", "none")]
    assert runs[0] == runs[1]


def test_keyformer_temperature_follows_eq10():
    assert keyformer_tau(0, 20) == 1.0
    assert keyformer_tau(5, 20) == pytest.approx(1.25)
    assert keyformer_tau(20, 20) == pytest.approx(2.0)
    assert keyformer_tau(10, 20, 0.5, 1.5) == pytest.approx(1.0)
    q, k, v = qkv(40, seed=2)
    method = attnkit.make_method("keyformer", budget_tokens=10, tau_init=1.0, tau_end=3.0)
    session = Session(method, KVCache(1), 1, 20, 20, rope=ROPE)
    Step(session, "prefill", torch.arange(20)).attention(0, q[:, :, :20], k[:, :, :20], v[:, :, :20], 0.3, None)
    for t in range(20, 40):
        s = slice(t, t + 1)
        Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s], 0.3, None)
        step = t - 20 + 1  # the first generated token fed back is decode iteration 1
        assert session.layer_state[0].tau == pytest.approx(1.0 + step * (3.0 - 1.0) / 20)


def keyformer_new_reference(q_raw, k_raw, v, t, kept, scaling):
    """Keys at their rank in the cache, the query last (Keyformer "new positions"), from keys before RoPE."""
    return streaming_reference(q_raw, k_raw, v, t, kept, scaling)


def test_keyformer_new_positions_equal_rank_reference():
    n, prompt = 36, 20
    q_raw, k_raw, v = qkv(n, seed=51)
    pos = torch.arange(n)
    q, k = ROPE.rotate(q_raw, pos), ROPE.rotate(k_raw, pos)
    method = attnkit.make_method("keyformer", budget_tokens=8, positions="new")
    _, outs, held = drive(method, q, k, v, prompt_len=prompt)
    assert held[-1][0] != held[-1][1]  # per-head selections, so ranks differ per head
    for i, out in enumerate(outs):
        ref = keyformer_new_reference(q_raw, k_raw, v, prompt + i, held[i + 1], D ** -0.5)
        assert (out - ref).abs().max().item() < 1e-5


def test_keyformer_shared_vs_per_layer_scores(small_llama):
    """per_layer: each layer accumulates its own f and keeps its own tokens per head; shared: one score per
    token summed over layers and heads, so every layer and head keeps the same tokens."""
    ids = random_ids(120, seed=4)
    layers = small_llama.geometry.n_layers

    def run(score, budget_tokens, steps):
        method = attnkit.make_method("keyformer", budget_tokens=budget_tokens, score=score, seed=1)
        session = new_session(small_llama, method, 120, 30)
        with torch.inference_mode():
            logits = prefill(small_llama, session, ids)
            token = int(logits.argmax())
            for i in range(steps):
                logits = forward(small_llama, torch.tensor([token]), 120 + i, lambda p: Step(session, "decode", p))
                token = int(logits[-1].argmax())
        return session

    # no eviction: compare the raw accumulated scores after prefill + 1 step
    per_layer, shared = run("per_layer", 149, 1), run("shared", 149, 1)  # 149 < 120 + 30: scored
    total = torch.zeros(121)
    for layer in per_layer.cache.layers:
        pos = layer.view()[2][0]
        total.index_add_(0, pos.reshape(-1), layer.extras["score"][0, :, :layer.length].reshape(-1))
    state = shared.state
    assert torch.allclose(state.score[0, :121] + state.pending[0, :121], total, atol=1e-4)

    # with eviction: shared keeps one token set everywhere, per_layer does not
    per_layer, shared = run("per_layer", 40, 20), run("shared", 40, 20)
    shared_sets = [positions(shared, i) for i in range(layers)]
    assert all(s == [shared_sets[0][0]] * len(s) for s in shared_sets)
    per_layer_sets = [head for i in range(layers) for head in positions(per_layer, i)]
    assert any(s != per_layer_sets[0] for s in per_layer_sets)


# ---- snapkv --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_pooling_keeps_the_voted_cluster_and_the_window(pooling):
    n, prompt = 30, 24
    q, k, v = heavy_hitter_tensors(n, heavy=(10,))
    method = attnkit.make_method("snapkv", budget_tokens=7, window_size=4, kernel_size=3, pooling=pooling)
    _, _, held = drive(method, q, k, v, prompt_len=prompt)
    assert held[0] == [[9, 10, 11, 20, 21, 22, 23]] * 2  # the voted key, its pooled neighbours, the window
    assert held[-1] == [[9, 10, 11, 20, 21, 22, 23] + list(range(24, 30))] * 2  # decode appends
    # without pooling the neighbours are not favoured
    _, _, plain = drive(attnkit.make_method("snapkv", budget_tokens=7, window_size=4, kernel_size=1), q, k, v,
                        prompt_len=prompt)
    assert 10 in plain[0][0] and plain[0][0] != held[0][0]


def test_snapkv_decode_budget_rolls_generated_tokens():
    q, k, v = heavy_hitter_tensors(40, heavy=(10,))
    method = attnkit.make_method("snapkv", budget_tokens=7, window_size=4, kernel_size=3, decode_budget=5)
    _, _, held = drive(method, q, k, v, prompt_len=24)
    assert held[-1] == [[9, 10, 11, 20, 21, 22, 23] + list(range(35, 40))] * 2


# ---- the shared machinery ------------------------------------------------------------------------------
def test_decode_writes_in_place_no_reallocation():
    q, k, v = qkv(80, seed=71)
    for spec in ("h2o", "keyformer", "streaming"):
        method = attnkit.make_method(spec, budget_tokens=16)
        session = Session(method, KVCache(1), 1, 40, 40, rope=ROPE)
        Step(session, "prefill", torch.arange(40)).attention(0, q[:, :, :40], k[:, :, :40], v[:, :, :40], 0.3, None)
        layer = session.cache.layers[0]
        ptrs = (layer.keys.data_ptr(), layer.values.data_ptr())
        for t in range(40, 80):
            s = slice(t, t + 1)
            Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s], 0.3, None)
            assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs and layer.capacity == 16


def test_rope_rotation_matches_the_model():
    model = attnkit.load_model(f"random:llama:{SMALL}")
    rope = Rope.from_model(model)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    raw = randn(1, 2, 5, 16, seed=81)
    pos = torch.tensor([[3, 7, 100, 2000, 5]])
    cos, sin = model.hf.model.rotary_emb(raw, pos)
    at_pos, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    moved = torch.tensor([[0, 50, 90, 10, 4]])
    cos2, sin2 = model.hf.model.rotary_emb(raw, moved)
    at_moved, _ = apply_rotary_pos_emb(raw, raw, cos2, sin2)
    assert (rope.rotate(at_pos, moved[0] - pos[0]) - at_moved).abs().max().item() < 1e-4


# ---- on the small model --------------------------------------------------------------------------------
BIG = ["streaming", "streaming:positions=reindex", "h2o", "h2o:gqa_reduce=max", "keyformer",
       "keyformer:noise=gaussian,positions=new", "keyformer:score=shared", "snapkv", "snapkv:decode_budget=30"]


@pytest.mark.parametrize("spec", BIG)
def test_budget_at_or_above_everything_equals_full(small_llama, spec):
    ids = random_ids(180, seed=12)
    full = attnkit.generate(small_llama, ids, "full", max_new_tokens=20, stop_at_eos=False, keep_logits=True)
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=200")
    out = attnkit.generate(small_llama, ids, method, max_new_tokens=20, stop_at_eos=False, keep_logits=True)
    assert out.token_ids == full.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, full.logits)) < 1e-4
    assert out.stats.final_kv_bytes == full.stats.final_kv_bytes


@pytest.mark.parametrize("spec", ["h2o", "keyformer", "keyformer:score=shared", "snapkv:window_size=16"])
def test_chunked_prefill_keeps_the_same_tokens(small_llama, spec):
    ids = random_ids(300, seed=13)
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=64")
    one = attnkit.generate(small_llama, ids, method, max_new_tokens=15, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(small_llama, ids, method, max_new_tokens=15, stop_at_eos=False, keep_logits=True,
                               chunk_size=70)
    assert chunked.token_ids == one.token_ids
    assert (chunked.logits[-1] - one.logits[-1]).abs().max().item() < 1e-4


def per_token_bytes(model) -> int:
    g = model.geometry
    return 2 * g.n_layers * g.n_kv_heads * g.head_dim * 4


@pytest.mark.parametrize("spec", ["streaming", "h2o", "keyformer", "snapkv:window_size=8,decode_budget=16"])
def test_cache_bytes_constant_over_500_decode_steps(small_llama, spec):
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=32")
    ids = random_ids(100, seed=14)
    session = new_session(small_llama, method, 100, 501)
    sizes = []
    with torch.inference_mode():
        token = int(prefill(small_llama, session, ids).argmax())
        for i in range(500):
            token = int(forward(small_llama, torch.tensor([token]), 100 + i,
                                lambda p: Step(session, "decode", p))[-1].argmax())
            sizes.append(session.cache.nbytes())
    slots = 32 + (16 if spec.startswith("snapkv") else 0)
    assert set(sizes) == {slots * per_token_bytes(small_llama)}
    assert session.cache.lengths() == [slots] * small_llama.geometry.n_layers


@pytest.mark.parametrize("name", ["streaming", "h2o", "keyformer", "snapkv"])
def test_bytes_fall_with_the_budget(small_llama, name):
    ids = random_ids(200, seed=15)
    sizes = []
    for params in ({"budget": 0.1}, {"budget_tokens": 50}, {"budget": 0.5}, None):
        method = "full" if params is None else name
        if name == "snapkv" and params is not None:
            params = dict(params, window_size=8)
        out = attnkit.generate(small_llama, ids, method, params=params, max_new_tokens=10, stop_at_eos=False)
        sizes.append(out.stats.final_kv_bytes)
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    if name != "snapkv":
        assert sizes[:3] == [20 * per_token_bytes(small_llama), 50 * per_token_bytes(small_llama),
                             100 * per_token_bytes(small_llama)]


def test_per_layer_budgets(small_llama):
    ids = random_ids(150, seed=16)
    out = attnkit.generate(small_llama, ids, attnkit.parse_method_spec("h2o:budget_tokens=40/20"),
                           max_new_tokens=5, stop_at_eos=False)
    g = small_llama.geometry
    assert out.stats.final_kv_bytes == (40 + 20) * 2 * g.n_kv_heads * g.head_dim * 4
    with pytest.raises(AttnkitError, match="lists 3 values but the model has 2 layers"):
        attnkit.generate(small_llama, ids, "h2o", params={"budget_tokens": [40, 20, 10]}, max_new_tokens=2)


def test_native_sliding_window_model():
    """A model with its own sliding window (Mistral): big budgets equal full, small ones run."""
    model = attnkit.load_model(f"random:mistral:{SMALL},sliding_window=48")
    ids = random_ids(160, seed=17)
    full = attnkit.generate(model, ids, "full", max_new_tokens=12, stop_at_eos=False)
    for name in ("h2o", "keyformer", "streaming", "snapkv"):
        out = attnkit.generate(model, ids, name, params={"budget_tokens": 200}, max_new_tokens=12, stop_at_eos=False)
        assert out.token_ids == full.token_ids
        small = attnkit.generate(model, ids, name, params={"budget_tokens": 40}, max_new_tokens=12,
                                 stop_at_eos=False)
        assert small.stats.final_kv_bytes == 40 * per_token_bytes(model) or name == "snapkv"


# ---- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,pattern", [
    ("h2o", {"budget": 0}, r"0 < budget <= 1, got 0"),
    ("h2o", {"budget": 1.5}, r"got 1.5"),
    ("keyformer", {"budget": "-0.2"}, r"got -0.2"),
    ("snapkv", {"budget": 0.5, "budget_tokens": 100}, r"not both.*budget=0.5.*budget_tokens=100"),
    ("streaming", {}, r"needs a cache budget"),
    ("h2o", {"budget_tokens": 0}, r"budget_tokens.*got 0"),
    ("h2o", {"budget_tokens": 32, "recent_tokens": 40}, r"recent window larger than the budget.*recent_tokens=40"),
    ("keyformer", {"budget_tokens": 32, "recent_tokens": 32}, r"recent window larger than the budget"),
    ("keyformer", {"budget": 0.5, "recent": 1.5}, r"recent window larger than the budget.*1.5"),
    ("keyformer", {"budget": 0.5, "noise": "uniform"}, r"noise must be one of gumbel, gaussian, constant, none; "
                                                        r"got 'uniform'"),
    ("keyformer", {"budget": 0.5, "score": "global"}, r"score.*'global'"),
    ("keyformer", {"budget": 0.5, "positions": "reindex"}, r"positions.*'reindex'"),
    ("keyformer", {"budget": 0.5, "tau_init": 0}, r"tau_init.*got 0"),
    ("h2o", {"budget": 0.5, "gqa_reduce": "sum"}, r"gqa_reduce.*'sum'"),
    ("streaming", {"budget_tokens": 4, "sinks": 4}, r"sinks=4.*budget"),
    ("snapkv", {"budget_tokens": 16, "window_size": 32}, r"window_size=32.*budget_tokens=16"),
    ("snapkv", {"budget": 0.5, "kernel_size": 4}, r"kernel_size must be odd.*4"),
    ("snapkv", {"budget": 0.5, "pooling": "median"}, r"pooling.*'median'"),
])
def test_bad_parameters(name, params, pattern):
    with pytest.raises(AttnkitError, match=pattern):
        attnkit.make_method(name, **params)


def test_runtime_budget_errors(small_llama):
    ids = random_ids(100, seed=18)
    with pytest.raises(AttnkitError, match="recent window larger than the budget: recent_tokens=30"):
        attnkit.generate(small_llama, ids, "h2o", params={"budget": 0.2, "recent_tokens": 30}, max_new_tokens=2)
    with pytest.raises(AttnkitError, match="observation window.*does not fit"):
        attnkit.generate(small_llama, ids, "snapkv", params={"budget": 0.2}, max_new_tokens=2)


def test_cli_specs_parse():
    m = attnkit.parse_method_spec("keyformer:budget_tokens=2048,noise=gaussian,score=shared,recent=0.3")
    assert (m.budget_tokens, m.noise, m.score, m.recent) == (2048, "gaussian", "shared", 0.3)
    assert attnkit.parse_method_spec("h2o:budget=0.25/0.5").budget == [0.25, 0.5]
    from attnkit.methods.spec import split_spec_list

    specs = split_spec_list("full,h2o:budget_tokens=2048,keyformer:budget_tokens=2048,noise=none,streaming:"
                           "budget_tokens=2048,sinks=4,snapkv:budget_tokens=2048")
    assert [attnkit.parse_method_spec(s).name for s in specs] == ["full", "h2o", "keyformer", "streaming", "snapkv"]
    assert math.isclose(attnkit.parse_method_spec(specs[2]).tau_end, 2.0)
