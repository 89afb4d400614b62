"""`window` (Mistral 7B's sliding window): its mask in prefill, decode over the last `window` entries, rolling cache."""

import pytest
import torch

import attnkit
from helpers import SMALL, random_ids


def seed_mask(n: int, window: int) -> torch.Tensor:
    """The sliding-window mask: masked where triu(1) (future) or tril(-window) (too far back)."""
    ones = torch.ones(n, n)
    masked = (ones.triu(1) + ones.tril(-window)) > 0
    return torch.zeros(n, n).masked_fill(masked, float("-inf"))[None, None]


def dense_reference(model, ids, window, new_tokens):
    """Greedy decoding recomputing the whole sequence each step under the sliding-window mask (no cache)."""
    seq = ids.tolist()
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            x = torch.tensor([seq])
            out = model.hf(x, attention_mask=seed_mask(len(seq), window), use_cache=False).logits[0, -1].float()
            tok = int(out.argmax())
            tokens.append(tok)
            logits.append(out)
            seq.append(tok)
    return tokens, logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("window,n", [(8, 50), (32, 200), (100, 150)])
def test_window_equals_dense_seed_mask_reference(arch, window, n):
    model = attnkit.load_model(f"random:{arch}:{SMALL}")
    ids = random_ids(n, seed=window)
    ref_tokens, ref_logits = dense_reference(model, ids, window, 30)
    out = attnkit.generate(model, ids, "window", params={"window": window}, max_new_tokens=30,
                           stop_at_eos=False, keep_logits=True)
    assert out.token_ids == ref_tokens
    for ours, theirs in zip(out.logits, ref_logits):
        assert (ours - theirs).abs().max().item() < 1e-4


def test_window_prefill_long_prompt_banded(small_llama):
    """A prompt long enough for the banded block path gives the dense-mask result."""
    ids = random_ids(2600, seed=5)
    ref_tokens, _ = dense_reference(small_llama, ids, 300, 3)
    out = attnkit.generate(small_llama, ids, "window", params={"window": 300}, max_new_tokens=3, stop_at_eos=False)
    assert out.token_ids == ref_tokens


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_window_chunked_prefill_equals_one_shot(small_llama, chunk):
    ids = random_ids(1500, seed=2)
    one = attnkit.generate(small_llama, ids, "window", params={"window": 128}, max_new_tokens=10,
                           stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(small_llama, ids, "window", params={"window": 128}, max_new_tokens=10,
                               stop_at_eos=False, keep_logits=True, chunk_size=chunk)
    assert chunked.token_ids == one.token_ids
    assert (chunked.logits[-1] - one.logits[-1]).abs().max().item() < 1e-4


def test_large_window_equals_full(small_llama):
    ids = random_ids(400, seed=9)
    full = attnkit.generate(small_llama, ids, "full", max_new_tokens=40, stop_at_eos=False, keep_logits=True)
    win = attnkit.generate(small_llama, ids, "window", params={"window": 440}, max_new_tokens=40,
                           stop_at_eos=False, keep_logits=True)
    assert win.token_ids == full.token_ids
    assert (win.logits[-1] - full.logits[-1]).abs().max().item() < 1e-5


def test_window_cache_constant_over_500_steps(small_llama):
    window = 64
    out = attnkit.generate(small_llama, random_ids(100, seed=4), "window", params={"window": window},
                           max_new_tokens=600, stop_at_eos=False)
    g = small_llama.geometry
    expected = 2 * g.n_layers * g.n_kv_heads * window * g.head_dim * 4
    assert out.stats.new_tokens == 600
    assert out.stats.peak_kv_bytes == out.stats.final_kv_bytes == expected


@pytest.mark.parametrize("window", [16, 64])
def test_window_matches_mistral_native_sliding_window(window):
    model = attnkit.load_model(f"random:mistral:{SMALL},sliding_window={window}")
    assert model.geometry.sliding_window == window
    ids = random_ids(300, seed=window)
    ref = model.hf.generate(ids[None], max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=2)
    out = attnkit.generate(model, ids, "window", params={"window": window}, max_new_tokens=30, stop_at_eos=False)
    assert out.token_ids == ref[0, 300:].tolist()
    # `full` on that model honours the model's own window too
    full = attnkit.generate(model, ids, "full", max_new_tokens=30, stop_at_eos=False)
    assert full.token_ids == out.token_ids
