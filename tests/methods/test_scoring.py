"""The shared scoring pass of the eviction methods (attnkit.methods.scoring): pooling, attention statistics."""

import pytest
import torch

from attnkit.methods import scoring

torch.set_num_threads(1)

D = 8


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(n, hq=4, kv=2, d=D, seed=0):
    return randn(1, hq, n, d, seed=seed), randn(1, kv, n, d, seed=seed + 1), randn(1, kv, n, d, seed=seed + 2)


def test_pooling():
    x = torch.tensor([0.0, 0.0, 9.0, 0.0, 0.0, 3.0])
    assert scoring.avg_or_max_pool(x, 3, "max").tolist() == [0.0, 9.0, 9.0, 9.0, 3.0, 3.0]
    # edge: the zero padding counts
    assert scoring.avg_or_max_pool(x, 3, "avg").tolist() == pytest.approx([0.0, 3.0, 3.0, 3.0, 1.0, 1.0])
    assert torch.equal(scoring.avg_or_max_pool(x, 1, "avg"), x)


def test_attention_statistics_gqa_reduction():
    """Query head 0 looks only at key 0, head 1 spreads evenly: mean and max reduce them per query."""
    keys = torch.eye(4)[None, None] * 10  # [1, 1 kv head, 4 keys, d=4]
    q = torch.zeros(1, 2, 1, 4)
    q[0, 0, 0, 0] = 10.0
    for reduce, expected in (("mean", [0.625, 0.125, 0.125, 0.125]), ("max", [1.0, 0.25, 0.25, 0.25])):
        got = scoring.attention_statistics(q, keys, 1.0, torch.tensor([3]), torch.arange(4), reduce=reduce)
        assert got[0, 0].tolist() == pytest.approx(expected, abs=1e-6)


def test_attention_statistics_blocks_equal_dense_and_stay_small():
    n, hq, kv = 700, 4, 2
    q, k, _ = qkv(n, hq, kv, seed=61)
    x = q.view(1, kv, 2, n, D) @ k[:, :, None].transpose(-1, -2) * 0.3
    x = x.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.softmax(x, -1).mean(2).sum(2)
    sizes = []

    def spy(logits, q_pos, k_pos):
        sizes.append(logits.numel())
        return torch.softmax(logits, -1)

    limit = 20_000
    got = scoring.attention_statistics(q, k, 0.3, torch.arange(n), torch.arange(n), weights=spy,
                                       block_elements=limit)
    assert torch.allclose(got, dense, atol=1e-4)
    assert len(sizes) > 50 and max(sizes) <= limit  # never the whole n x n matrix


@pytest.mark.parametrize("block_elements", [None, 300])
def test_attention_statistics_per_head_positions_in_any_order_mask_only_later_keys(block_elements):
    """Per-head key positions, shuffled, some after the first queries (a decode-time layer: entries kept in any
    order, the recent ones last or not): each key is hidden from exactly the queries before it, and the keys wholly
    before the queries are seen by all of them."""
    hq, kv, n_q, n_k = 6, 2, 9, 40
    gen = torch.Generator().manual_seed(7)
    q, k = randn(1, hq, n_q, D, seed=71), randn(1, kv, n_k, D, seed=72)
    k_pos = torch.stack([torch.randperm(50, generator=gen)[:n_k] for _ in range(kv)])[None]
    q_pos = torch.arange(41, 50)
    x = (q.view(1, kv, 3, n_q, D) @ k[:, :, None].transpose(-1, -2)) * 0.3
    x = x.masked_fill(k_pos[:, :, None, None, :] > q_pos[:, None], float("-inf"))
    dense = torch.softmax(x, -1).mean(2).sum(2)
    got = scoring.attention_statistics(q, k, 0.3, q_pos, k_pos, block_elements=block_elements)
    assert bool((k_pos > q_pos[0]).any()) and bool((k_pos < q_pos[0]).any())
    assert torch.allclose(got, dense, atol=1e-5)


# ---- one pass: the prompt's attention output and the statistic from the same blocks ---------------
def sdpa_reference(q, k, v, scaling, window=None):
    n = q.shape[2]
    pos = torch.arange(n)
    allowed = pos[:, None] >= pos[None, :]
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling,
                                                            enable_gqa=True)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_one_pass_output_is_sdpa_and_statistic_is_attention_statistics(window, reduce):
    n, hq, kv = 300, 8, 2
    q, k, v = qkv(n, hq, kv, seed=3)
    q, k, v = (torch.cat([x, randn(*x.shape, seed=9)]) for x in (q, k, v))  # batch of 2
    pos = torch.arange(n)
    ref_out = sdpa_reference(q, k, v, 0.4, window)
    ref_stats = scoring.attention_statistics(q, k, 0.4, pos, pos, reduce=reduce, window=window)
    for block in (None, 1, 4000, 10 ** 9):  # 16-query blocks (the floor) up to one block
        out, stats = scoring.attention_with_statistics(q, k, v, 0.4, pos, pos, reduce=reduce, window=window,
                                                       block_elements=block)
        assert out.shape == q.shape
        assert torch.allclose(out, ref_out, atol=1e-5), block
        assert torch.allclose(stats, ref_stats, atol=1e-4), block
    if window is not None:  # the statistic really is windowed: keys far behind the last queries get less
        full_stats = scoring.attention_statistics(q, k, 0.4, pos, pos, reduce=reduce)
        assert not torch.allclose(stats, full_stats, atol=1e-2)


def test_one_pass_rows_of_a_batch_are_independent():
    n = 90
    q, k, v = qkv(n, 4, 2, seed=5)
    q2, k2, v2 = qkv(n, 4, 2, seed=50)
    pos = torch.arange(n)
    alone = scoring.attention_with_statistics(q2, k2, v2, 0.3, pos, pos, block_elements=1)
    out, stats = scoring.attention_with_statistics(torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2]),
                                                   0.3, pos, pos, block_elements=1)
    assert torch.allclose(out[1:], alone[0], atol=1e-6) and torch.allclose(stats[1:], alone[1], atol=1e-6)


@pytest.mark.parametrize("window", [None, 20])
def test_one_pass_chunked_prompt_gives_the_same_output_and_statistic(window):
    """A prompt fed in chunks (each chunk's queries over the keys stored so far) gives the same outputs and,
    summed over the chunks, the same statistic as in one piece."""
    n = 130
    q, k, v = qkv(n, 4, 2, seed=7)
    pos = torch.arange(n)
    whole_out, whole_stats = scoring.attention_with_statistics(q, k, v, 0.5, pos, pos, window=window)
    outs, stats = [], torch.zeros_like(whole_stats)
    for s, e in ((0, 33), (33, 34), (34, 101), (101, n)):
        out, st = scoring.attention_with_statistics(q[:, :, s:e], k[:, :, :e], v[:, :, :e], 0.5, pos[s:e], pos[:e],
                                                    window=window, block_elements=1)
        outs.append(out)
        stats[:, :, :e] += st
    assert torch.allclose(torch.cat(outs, dim=2), whole_out, atol=1e-6)
    assert torch.allclose(stats, whole_stats, atol=1e-5)


def test_one_pass_weights_see_the_logits_and_probabilities_of_visible_keys_only():
    n = 60
    q, k, v = qkv(n, 4, 2, seed=11)
    pos = torch.arange(n)
    seen = []

    def tempered(logits, probs, q_pos, k_pos):  # softmax(x / 2): a Keyformer-like function of the logits
        assert torch.allclose(probs, torch.softmax(logits, dim=-1))
        assert int(k_pos[-1]) == int(q_pos[-1]) and int(k_pos[0]) == max(0, int(q_pos[0]) - 9)
        seen.append(logits.shape[-1])
        return torch.softmax(logits / 2, dim=-1)

    _, stats = scoring.attention_with_statistics(q, k, v, 0.5, pos, pos, weights=tempered, window=10,
                                                 block_elements=1)
    ref = scoring.attention_statistics(q, k, 0.5, pos, pos, window=10,
                                       weights=lambda x, qp, kp: torch.softmax(x / 2, dim=-1))
    assert torch.allclose(stats, ref, atol=1e-5)
    assert max(seen) <= 16 + 9  # a block of 16 queries reads its band of keys, not the whole prompt


def test_one_pass_refuses_per_head_positions():
    q, k, v = qkv(8, 4, 2)
    with pytest.raises(ValueError, match="shared"):
        scoring.attention_with_statistics(q, k, v, 1.0, torch.arange(8), torch.arange(8).expand(1, 2, 8))


@pytest.mark.parametrize("dtype,atol,out_atol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-3, 5e-2)])
def test_fused_pass_equals_the_blocked_pass(dtype, atol, out_atol):
    """Two flash calls (the second with queries and keys swapped, -lse in an extra dimension) give the
    prompt's output and H2O's statistic of the blocked pass, in half precision to about 1e-4 of each key's
    statistic (the remainder dimension); here through torch's CPU flash kernel."""
    n, hq, kv = 300, 8, 2
    q, k, v = qkv(n, hq, kv, seed=7)
    q, k, v = (torch.cat([x, randn(*x.shape, seed=11)]).mul(3).to(dtype) for x in (q, k, v))  # batch of 2
    pos = torch.arange(n)
    out, stats = scoring.fused_attention_with_statistics(q, k, v, 0.4)
    ref_out, ref_stats = scoring.attention_with_statistics(q.float(), k.float(), v.float(), 0.4, pos, pos)
    assert out.dtype == dtype and stats.shape == (2, kv, n)
    assert torch.allclose(out.float(), ref_out, atol=out_atol)  # bf16: the output's own rounding
    assert ((stats - ref_stats).abs() / ref_stats).max() < atol
    assert torch.allclose(stats.sum(-1), torch.full((2, kv), float(n)), rtol=atol)  # each query gives 1 in all


def test_fused_pass_is_only_chosen_where_flash_kernels_run():
    q = torch.zeros(1, 8, 4, 32, dtype=torch.bfloat16)
    assert not scoring.fused_pays(q)  # a CPU: the blocked pass is faster there
