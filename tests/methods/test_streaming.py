"""StreamingLLM (attnkit.methods.streaming): attention sinks plus the recent window, and re-indexed
positions."""

import torch

import attnkit
from helpers import ROPE, D, drive, qkv, streaming_reference

torch.set_num_threads(1)


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


def test_the_arithmetic_victim_is_the_ranked_one(monkeypatch):
    """StreamingLLM names its victim slot without ranking (victim_slot); the generic rule (lowest position
    outside the sinks, per head) must pick the very same entries: same tokens, logits and held positions, for
    prompts longer and shorter than the budget, no sinks, re-indexed positions, chunked prefill and a batch."""
    from attnkit.methods.streaming import Streaming
    from helpers import SMALL, assert_shortcut_is_exact
    model = attnkit.load_model(f"random:llama:{SMALL}")
    cases = [("streaming:budget_tokens=24", (90,), {}), ("streaming:budget_tokens=40,sinks=0", (30,), {}),
             ("streaming:budget_tokens=24,positions=reindex", (70,), {"chunk_size": 32}),
             ("streaming:budget_tokens=16,sinks=2", (50, 50, 61), {})]

    assert_shortcut_is_exact(model, cases, lambda: monkeypatch.setattr(Streaming, "victim_slot", lambda self, ctx: None))
