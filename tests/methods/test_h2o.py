"""H2O (attnkit.methods.h2o): heavy hitters plus the recent window, against a dense reference."""

import pytest
import torch

import attnkit
from helpers import dense_reference, drive, heavy_hitter_tensors, qkv

torch.set_num_threads(1)


def test_h2o_keeps_heavy_hitters_and_recent_window():
    q, k, v = heavy_hitter_tensors(30)
    method = attnkit.make_method("h2o", budget_tokens=5, recent_tokens=2)
    _, _, held = drive(method, q, k, v, prompt_len=16)
    for head in held[0]:
        assert {3, 9, 14, 15} <= set(head) and len(head) == 5
    for i, step in enumerate(held[1:]):
        t = 16 + i
        assert step == [[3, 9, t - 2, t - 1, t]] * 2  # B - 1 - w heavy hitters, w recent, the incoming token


def softmax_weights(x, head, q_pos, k_pos, t):
    return torch.softmax(x, dim=-1)


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_h2o_matches_dense_reference(reduce):
    q, k, v = qkv(60, seed=11)
    method = attnkit.make_method("h2o", budget_tokens=14, recent_tokens=4, gqa_reduce=reduce)
    _, _, held = drive(method, q, k, v, prompt_len=40)
    assert held == dense_reference(q, k, 40, 14, 4, softmax_weights, reduce)
