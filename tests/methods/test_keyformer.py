"""Keyformer (attnkit.methods.keyformer, Adnan et al. 2024): the noisy, tempered score against a dense
reference, its temperature schedule, new positions, shared and per-layer scores."""

import pytest
import torch

import attnkit
from attnkit.cache import KVCache
from attnkit.forward import forward, prefill
from attnkit.methods.buffered import FILL_QUEUE
from attnkit.methods.keyformer import keyformer_tau
from attnkit.methods.keyformer_noise import keyformer_noise
from attnkit.session import Session, Step, new_session
from helpers import ROPE, D, dense_reference, drive, positions, qkv, random_ids, streaming_reference

torch.set_num_threads(1)


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
        session = new_session(small_llama, method, 120, 40)
        with torch.inference_mode():
            logits = prefill(small_llama, session, ids)
            token = int(logits.argmax())
            for i in range(steps):
                logits = forward(small_llama, torch.tensor([token]), 120 + i, lambda p: Step(session, "decode", p))
                token = int(logits[-1].argmax())
        return session

    # no eviction: compare the raw accumulated scores after prefill + FILL_QUEUE steps (per_layer takes the steps
    # that fill its budget together, every FILL_QUEUE-th of them)
    per_layer, shared = run("per_layer", 159, FILL_QUEUE), run("shared", 159, FILL_QUEUE)  # 159 < 120 + 40: scored
    seen = 120 + FILL_QUEUE
    total = torch.zeros(seen)
    for layer in per_layer.cache.layers:
        pos = layer.view()[2][0]
        total.index_add_(0, pos.reshape(-1), layer.extras["score"][0, :, :layer.length].reshape(-1))
    state = shared.state
    assert torch.allclose(state.score[0, :seen] + state.pending[0, :seen], total, atol=1e-4)

    # with eviction: shared keeps one token set everywhere, per_layer does not
    per_layer, shared = run("per_layer", 40, 20), run("shared", 40, 20)
    shared_sets = [positions(shared, i) for i in range(layers)]
    assert all(s == [shared_sets[0][0]] * len(s) for s in shared_sets)
    per_layer_sets = [head for i in range(layers) for head in positions(per_layer, i)]
    assert any(s != per_layer_sets[0] for s in per_layer_sets)
