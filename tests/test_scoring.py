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
