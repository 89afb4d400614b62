"""The folded attention kernel (attnkit.attention.folded_attention with folded_bias): query heads folded
into the query axis under an additive mask equal the reference attention by position."""

import pytest
import torch

from attnkit.attention import attend, folded_attention, folded_bias


@pytest.mark.parametrize("window", [None, 7])
def test_folded_verification_attention_equals_reference(window):
    """VerifyingFull's kernel call (query heads folded into the query axis, additive mask) is the
    reference attention by position, GQA and the model's own window included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 8, 16, generator=g).transpose(1, 2)  # [b, hq, n, d], not contiguous (as HF hands it)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    q_pos, k_pos = torch.arange(35, 40), torch.arange(40)
    ref = attend(q, k, v, 0.25, q_pos, k_pos, window)
    bias = folded_bias(q_pos, k_pos, q.shape[1] // k.shape[1], window, q.dtype)
    assert torch.allclose(folded_attention(q, k, v, 0.25, bias), ref, atol=1e-5)


def test_slot_order_mask_equals_reference_with_per_head_positions():
    """Several appended tokens over a compressed cache whose kv heads hold different earlier positions:
    the causal mask by slot index (what ``Method._attend_held`` uses) is the reference mask by position."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 4, 16, generator=g)
    k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    kept = torch.stack([torch.randperm(90, generator=g)[:26].sort().values for _ in range(2)])[None]  # [1, 2, 26]
    q_pos = torch.arange(100, 104)
    k_pos = torch.cat([kept, q_pos.expand(1, 2, 4)], dim=2)  # each head: its kept prompt, then the new tokens
    ref = attend(q, k, v, 0.25, q_pos, k_pos)
    slots = torch.arange(30)
    bias = folded_bias(slots[26:], slots, 4, None, q.dtype)
    assert torch.allclose(folded_attention(q, k, v, 0.25, bias), ref, atol=1e-5)


def test_rows_whose_heads_agree_but_differ_from_each_other_get_their_own_mask():
    """A decode query over a compressed batch where each row's kv heads hold the same positions but the rows hold
    different ones (a sliding window masks some): each row is attended with its own positions, as alone."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 12, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g)
    rows = [torch.randperm(60, generator=g)[:12].sort().values for _ in range(2)]
    k_pos = torch.stack([r.expand(2, 12) for r in rows])  # [2 rows, 2 heads, 12]
    q_pos = torch.tensor([70])
    batch = attend(q, k, v, 0.25, q_pos, k_pos, window=40)
    for r in range(2):
        alone = attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], 0.25, q_pos, k_pos[r:r + 1], window=40)
        assert torch.allclose(batch[r:r + 1], alone, atol=1e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])  # bf16: its own rounding
def test_a_chunk_after_its_prefix_takes_two_flash_calls(monkeypatch, dtype, atol):
    """A prompt chunk after the chunks before it (queries = the last positions of a contiguous run of keys): two
    flash calls merged by their log-sum-exps equal the masked reference, GQA included; a short step (decode,
    verification) and non-contiguous keys keep the masked kernel."""
    from attnkit import attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 50, 8, 16, generator=g).transpose(1, 2).mul(2).to(dtype)  # HF's layout: [b, hq, n, d], strided
    k, v = (torch.randn(2, 2, 170, 16, generator=g).mul(2).to(dtype) for _ in range(2))
    q_pos, k_pos = torch.arange(120, 170), torch.arange(170)
    mask = attention.position_mask(q_pos, k_pos)
    ref = attention.sdpa(q.float(), k.float(), v.float(), 0.25, mask=mask)
    calls = []
    split = attention.prefix_attention
    monkeypatch.setattr(attention, "_PREFIX_MIN_QUERIES", 16)
    monkeypatch.setattr(attention, "prefix_attention", lambda *a: calls.append(1) or split(*a))
    out = attention.attend(q, k, v, 0.25, q_pos, k_pos)
    assert calls and out.dtype == dtype and torch.allclose(out.float(), ref, atol=atol)
    attention.attend(q[:, :, -8:], k, v, 0.25, q_pos[-8:], k_pos)  # fewer queries than _PREFIX_MIN_QUERIES
    gap = torch.cat([torch.arange(100), torch.arange(110, 180)])  # keys not contiguous (an evicted run)
    attention.attend(q, k, v, 0.25, torch.arange(130, 180), gap)
    assert len(calls) == 1
