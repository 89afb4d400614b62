"""The cache budget of the eviction methods (attnkit.methods.budget): fractions and token counts, per-layer
budgets, and the errors found once the prompt and the model are known."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from helpers import per_token_bytes, random_ids

torch.set_num_threads(1)


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


def test_runtime_budget_errors(small_llama):
    ids = random_ids(100, seed=18)
    with pytest.raises(AttnkitError, match="recent window larger than the budget: recent_tokens=30"):
        attnkit.generate(small_llama, ids, "h2o", params={"budget": 0.2, "recent_tokens": 30}, max_new_tokens=2)
    with pytest.raises(AttnkitError, match="observation window.*does not fit"):
        attnkit.generate(small_llama, ids, "snapkv", params={"budget": 0.2}, max_new_tokens=2)
