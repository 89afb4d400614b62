"""The mask vocabulary: the boolean mask, the additive SDPA bias and FlexAttention's mask_mod built from one
rule agree with each other and with the plain definitions (Mistral 7B's ``triu(1) + tril(-window)``,
StreamingLLM's sinks plus window, MInference's A-shape), for keys shared by every head and per kv head."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from attnkit import masks
from attnkit.attention import folded_bias, position_mask
from attnkit.errors import AttnkitError

N = 40


def mistral_masked(n: int, window: int) -> torch.Tensor:
    """Mistral's construction over positions 0..n-1: masked where triu(1) (future) or tril(-window) (too far)."""
    ones = torch.ones(n, n)
    return (ones.triu(1) + ones.tril(-window)) > 0


def plain(name, q, k):
    """The definitions written out over position grids."""
    d = q - k
    return {"causal": d >= 0, "window": (d >= 0) & (d < 7), "streaming": (d >= 0) & ((k < 3) | (d < 5)),
            "a_shape": (d >= 0) & ((k < 4) | (d < 9))}[name]


RULES = {"causal": masks.causal, "window": masks.sliding_window(7), "streaming": masks.a_shape(3, 5),
         "a_shape": masks.and_(masks.causal, masks.or_(masks.sinks(4), masks.window(9)))}


def flex_grid(rule, q_pos, k_pos, heads=1, groups=1, batch=1, q_len=None, k_len=None):
    """The mask_mod evaluated by FlexAttention's own create_mask -> [batch, heads, q, L]."""
    mod = masks.flex_mask_mod(rule, q_pos, k_pos, groups)
    q_len = q_pos.shape[0] if q_len is None else q_len
    k_len = k_pos.shape[-1] if k_len is None else k_len
    return create_mask(mod, batch, heads, q_len, k_len, device="cpu")


def test_sliding_window_is_mistrals_mask():
    pos = torch.arange(N)
    for window in (1, 4, 16, N + 3):
        allowed = masks.boolean_mask(masks.sliding_window(window), pos, pos)
        assert torch.equal(~allowed, mistral_masked(N, window))
        assert torch.equal(position_mask(pos, pos, window), allowed)
        bias = masks.additive_bias(masks.sliding_window(window), pos, pos, torch.float32)
        assert torch.equal(bias, torch.zeros(N, N).masked_fill(mistral_masked(N, window), float("-inf")))
        assert torch.equal(flex_grid(masks.sliding_window(window), pos, pos)[0, 0], allowed)
    assert torch.equal(position_mask(pos, pos), masks.boolean_mask(masks.causal, pos, pos))


@pytest.mark.parametrize("name", sorted(RULES))
def test_three_outputs_agree_on_shared_keys(name):
    rule = RULES[name]
    q_pos = torch.arange(25, N)  # the last queries of a prompt
    k_pos = torch.randperm(N, generator=torch.Generator().manual_seed(1))  # keys in any slot order
    want = plain(name, q_pos[:, None], k_pos[None, :])
    allowed = masks.boolean_mask(rule, q_pos, k_pos)
    assert torch.equal(allowed, want)
    bias = masks.additive_bias(rule, q_pos, k_pos, torch.float16)
    assert bias.dtype == torch.float16 and torch.equal(bias == 0, want) and bool(torch.isinf(bias[~want]).all())
    assert torch.equal(flex_grid(rule, q_pos, k_pos)[0, 0], want)
    offsets = flex_grid(rule, 25, 0, q_len=N - 25, k_len=N)[0, 0]  # positions as index + offset
    assert torch.equal(offsets, masks.boolean_mask(rule, q_pos, torch.arange(N)))


@pytest.mark.parametrize("name", sorted(RULES))
def test_three_outputs_agree_on_per_kv_head_keys(name):
    rule = RULES[name]
    g = torch.Generator().manual_seed(2)
    batch, kv, groups, length = 2, 3, 2, 30
    k_pos = torch.stack([torch.stack([torch.randperm(N, generator=g)[:length] for _ in range(kv)])
                         for _ in range(batch)])  # [b, kv, L]: each head kept other tokens
    q_pos = torch.arange(N - 6, N)
    want = plain(name, q_pos[None, None, :, None], k_pos[:, :, None, :])
    allowed = masks.boolean_mask(rule, q_pos, k_pos)
    assert allowed.shape == (batch, kv, 6, length) and torch.equal(allowed, want)
    assert torch.equal(masks.additive_bias(rule, q_pos, k_pos, torch.float32) == 0, want)
    flex = flex_grid(rule, q_pos, k_pos, heads=kv * groups, groups=groups, batch=batch)
    assert torch.equal(flex, want.repeat_interleave(groups, dim=1))
    if name == "window":
        assert torch.equal(position_mask(q_pos, k_pos, 7), want)


def test_per_head_parameters():
    pos = torch.arange(N)
    n_init, n_local = torch.tensor([0, 3, 10]), torch.tensor([2, 5, 1])
    rule = masks.a_shape(n_init, n_local)
    allowed = masks.boolean_mask(rule, pos, pos, heads=3)
    flex = flex_grid(rule, pos, pos, heads=3)[0]
    for h in range(3):
        want = plain("causal", pos[:, None], pos[None, :]) & (
            (pos[None, :] < n_init[h]) | (pos[:, None] - pos[None, :] < n_local[h]))
        assert torch.equal(allowed[h], want) and torch.equal(flex[h], want)
        assert torch.equal(masks.boolean_mask(masks.a_shape(int(n_init[h]), int(n_local[h])), pos, pos), want)
    with pytest.raises(AttnkitError, match="per-head parameters"):
        masks.boolean_mask(rule, pos, pos)


def test_same_block_and_key_sets():
    pos = torch.arange(N)
    i, j = pos[:, None], pos[None, :]
    assert torch.equal(masks.boolean_mask(masks.same_block(8), pos, pos), i // 8 == j // 8)
    member = torch.zeros(2, N, dtype=torch.bool)
    member[0, [3, 17]] = True
    member[1, 30] = True
    got = masks.boolean_mask(masks.and_(masks.causal, masks.key_in(member)), pos, pos, heads=2)
    assert torch.equal(got[0], (j <= i) & ((j == 3) | (j == 17))) and torch.equal(got[1], (j <= i) & (j == 30))


def test_folded_bias_tiles_the_window_mask_over_the_groups():
    q_pos, k_pos = torch.arange(30, 34), torch.arange(34)
    bias = folded_bias(q_pos, k_pos, 3, 6, torch.float32)
    one = masks.additive_bias(masks.sliding_window(6), q_pos, k_pos, torch.float32)
    assert torch.equal(bias, one.repeat(3, 1)) and torch.equal(one == 0, position_mask(q_pos, k_pos, 6))
