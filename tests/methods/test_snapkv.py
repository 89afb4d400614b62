"""SnapKV (attnkit.methods.snapkv): the pooled observation-window vote and the decode budget."""

import pytest
import torch

import attnkit
from helpers import drive, heavy_hitter_tensors

torch.set_num_threads(1)


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


def test_a_prompt_no_longer_than_the_window_keeps_its_best_voted_entries():
    """A 12-token prompt under a 16-token window is all window: every query votes (no pooling, nothing
    protected) and the best-voted 4 entries stay, the heavy keys among them; the window is not kept whole."""
    q, k, v = heavy_hitter_tensors(16, heavy=(2, 6))
    method = attnkit.make_method("snapkv", budget=0.34, window_size=16)
    _, _, held = drive(method, q, k, v, prompt_len=12)
    kept = held[0][0]
    assert len(kept) == 4 and {2, 6} <= set(kept) and kept != list(range(8, 12))
    assert held[-1][0] == kept + list(range(12, 16))  # decode appends
    # inside a longer prompt a window larger than the budget is still refused (the window is always kept)
    with pytest.raises(attnkit.AttnkitError, match=r"observation window \(16 tokens\) does not fit in the 6-slot"):
        drive(attnkit.make_method("snapkv", budget=0.3, window_size=16), *heavy_hitter_tensors(24), prompt_len=20)
