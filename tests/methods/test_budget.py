"""The cache budget of the eviction methods (attnkit.methods.budget): fractions and token counts, per-layer
budgets, and the errors found once the prompt and the model are known."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from helpers import SMALL, assert_equals_full, per_token_bytes, random_ids

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


@pytest.mark.parametrize("param", ["budget=[0.3,0.3,0.3]", "budget=0.3,0.3,0.3", "budget=0.3/0.3/0.3"])
def test_a_per_layer_list_of_the_wrong_length_names_the_layers(small_llama, param, capsys):
    """However a per-layer list is written on the command line, a wrong count says how many layers the model has."""
    from attnkit.cli import main
    assert main(["generate", "--model", f"random:llama:{SMALL}", "--method", "snapkv", "--param", param,
                 "--prompt", "def f(x):", "--max-new-tokens", "2"]) != 0
    assert "budget lists 3 values but the model has 2 layers" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("snapkv:budget=[0.3,0.3]", r"expected key=value, got '0.3\]' \(a per-layer list is written with '/'"),
    ("snapkv:budget=0.3/x", r"budget='0.3/x' is not a valid .*one value per layer separated by '/'")])
def test_a_per_layer_list_written_wrong_says_how_to_write_it(spec, message):
    with pytest.raises(AttnkitError, match=message):
        attnkit.parse_method_spec(spec)


def test_runtime_budget_errors(small_llama):
    ids = random_ids(100, seed=18)
    with pytest.raises(AttnkitError, match="recent window larger than the budget: recent_tokens=30"):
        attnkit.generate(small_llama, ids, "h2o", params={"budget": 0.2, "recent_tokens": 30}, max_new_tokens=2)
    with pytest.raises(AttnkitError, match="observation window.*does not fit"):
        attnkit.generate(small_llama, ids, "snapkv", params={"budget": 0.2}, max_new_tokens=2)


# ---- PyramidKV's layer budgets --------------------------------------------------------------------------------
def test_pyramid_shares_fall_linearly_and_keep_the_mean():
    from attnkit.methods.budget import pyramid_share
    for budget, floor, layers in ((512, 0, 32), (512, 32, 32), (200, 8, 6), (40, 4, 4)):
        shares = [pyramid_share(budget, floor, layer, layers) for layer in range(layers)]
        assert shares == sorted(shares, reverse=True) and min(shares) > floor
        assert abs(sum(shares) / layers - budget) <= 0.5  # the same total as uniform, up to rounding
        free = budget - floor
        assert abs(shares[-1] - (floor + free / 20)) <= 0.5 and abs(shares[0] - (floor + 2 * free - free / 20)) <= 0.5
    assert pyramid_share(100, 0, 0, 1) == 100  # one layer: nothing to spread


@pytest.mark.parametrize("spec,floor", [("h2o:budget_tokens=60", 0), ("streaming:budget_tokens=60,sinks=4", 4),
                                        ("snapkv:budget_tokens=60,window_size=8", 8),
                                        ("keyformer:score=shared,budget_tokens=60", 0)])
def test_pyramid_layers_hold_their_shares(spec, floor):
    from attnkit.forward import prefill
    from attnkit.methods.budget import pyramid_share
    from attnkit.session import new_session
    model = attnkit.load_model("random:llama:layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128")
    method = attnkit.parse_method_spec(spec + ",layer_budgets=pyramid")
    session = new_session(model, method, 200, 3)
    prefill(model, session, random_ids(200, seed=4))
    if "keyformer" in spec:  # the shared score compresses the prompt at the first decode step
        assert session.cache.lengths() == [200] * 4
        return
    assert session.cache.lengths() == [pyramid_share(60, floor, layer, 4) for layer in range(4)]
    uniform = attnkit.generate(model, random_ids(200, seed=4), spec, max_new_tokens=3, stop_at_eos=False)
    pyramid = attnkit.generate(model, random_ids(200, seed=4), method, max_new_tokens=3, stop_at_eos=False)
    assert abs(pyramid.stats.final_kv_bytes - uniform.stats.final_kv_bytes) <= 2 * per_token_bytes(model) // 4


@pytest.mark.parametrize("spec", ["h2o:budget_tokens=4000", "snapkv:budget_tokens=4000,window_size=8",
                                  "streaming:budget_tokens=4000", "keyformer:budget_tokens=4000"])
def test_pyramid_at_an_unlimited_budget_equals_full(small_llama, spec):
    """Every layer's share (the smallest is 1/20 of the budget) holds the whole sequence: exactly full."""
    ids = random_ids(150, seed=3)
    assert_equals_full(small_llama, ids, attnkit.parse_method_spec(spec + ",layer_budgets=pyramid"), 8,
                       same_bytes=False)


def test_pyramid_refuses_per_layer_lists_and_unknown_modes():
    with pytest.raises(AttnkitError, match="layer_budgets=pyramid spreads one budget over the layers"):
        attnkit.parse_method_spec("h2o:budget_tokens=40/30,layer_budgets=pyramid")
    with pytest.raises(AttnkitError, match="layer_budgets must be one of uniform, pyramid; got 'steep'"):
        attnkit.parse_method_spec("snapkv:budget=0.3,layer_budgets=steep")


def test_a_one_line_spec_is_a_method(small_llama):
    ids = random_ids(120, seed=9)
    by_spec = attnkit.generate(small_llama, ids, "h2o:budget_tokens=30", max_new_tokens=4, stop_at_eos=False)
    by_params = attnkit.generate(small_llama, ids, "h2o", params={"budget_tokens": 30}, max_new_tokens=4,
                                 stop_at_eos=False)
    assert by_spec.token_ids == by_params.token_ids and by_spec.stats.final_kv_bytes == by_params.stats.final_kv_bytes
    with pytest.raises(AttnkitError, match="params are given with the spec 'h2o:budget_tokens=30'"):
        attnkit.generate(small_llama, ids, "h2o:budget_tokens=30", params={"recent": 0.2}, max_new_tokens=2)
