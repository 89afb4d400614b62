"""KV-cache eviction, the flow shared by streaming, h2o, keyformer and snapkv (attnkit.methods.eviction):
decode writes in place, big budgets equal `full`, chunked prefill, constant memory, native sliding windows,
parameter errors and method specs, TOVA's victim choice without a mask. Each method's own selection rule:
test_streaming.py, test_h2o.py, test_keyformer.py, test_snapkv.py; the budget: test_budget.py.
"""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.forward import forward, prefill
from attnkit.session import Session, Step, new_session
from helpers import ROPE, SMALL, assert_equals_full, assert_shortcut_is_exact, per_token_bytes, qkv, random_ids

torch.set_num_threads(1)


def test_decode_writes_in_place_no_reallocation():
    q, k, v = qkv(80, seed=71)
    for spec in ("h2o", "keyformer", "streaming"):
        method = attnkit.make_method(spec, budget_tokens=16)
        session = Session(method, KVCache(1), 1, 40, 40, rope=ROPE)
        Step(session, "prefill", torch.arange(40)).attention(0, q[:, :, :40], k[:, :, :40], v[:, :, :40], 0.3, None)
        layer = session.cache.layers[0]
        ptrs = (layer.keys.data_ptr(), layer.values.data_ptr())
        for t in range(40, 80):
            s = slice(t, t + 1)
            Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s], 0.3, None)
            assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs and layer.capacity == 16


BIG = ["streaming", "streaming:positions=reindex", "h2o", "h2o:gqa_reduce=max", "keyformer",
       "keyformer:noise=gaussian,positions=new", "keyformer:score=shared", "snapkv", "snapkv:decode_budget=30"]


@pytest.mark.parametrize("spec", BIG)
def test_budget_at_or_above_everything_equals_full(small_llama, spec):
    ids = random_ids(180, seed=12)
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=200")
    out, full = assert_equals_full(small_llama, ids, method, 20, same_bytes=False)
    assert out.stats.final_kv_bytes == full.stats.final_kv_bytes


@pytest.mark.parametrize("spec", ["h2o", "keyformer", "keyformer:score=shared", "snapkv:window_size=16"])
def test_chunked_prefill_keeps_the_same_tokens(small_llama, spec):
    ids = random_ids(300, seed=13)
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=64")
    one = attnkit.generate(small_llama, ids, method, max_new_tokens=15, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(small_llama, ids, method, max_new_tokens=15, stop_at_eos=False, keep_logits=True,
                               chunk_size=70)
    assert chunked.token_ids == one.token_ids
    assert (chunked.logits[-1] - one.logits[-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("spec", ["streaming", "h2o", "keyformer", "snapkv:window_size=8,decode_budget=16"])
def test_cache_bytes_constant_over_500_decode_steps(small_llama, spec):
    method = attnkit.parse_method_spec(spec + ("," if ":" in spec else ":") + "budget_tokens=32")
    ids = random_ids(100, seed=14)
    session = new_session(small_llama, method, 100, 501)
    sizes = []
    with torch.inference_mode():
        token = int(prefill(small_llama, session, ids).argmax())
        for i in range(500):
            token = int(forward(small_llama, torch.tensor([token]), 100 + i,
                                lambda p: Step(session, "decode", p))[-1].argmax())
            sizes.append(session.cache.nbytes())
    slots = 32 + (16 if spec.startswith("snapkv") else 0)
    assert set(sizes) == {slots * per_token_bytes(small_llama)}
    assert session.cache.lengths() == [slots] * small_llama.geometry.n_layers


def test_native_sliding_window_model():
    """A model with its own sliding window (Mistral): big budgets equal full, small ones run."""
    model = attnkit.load_model(f"random:mistral:{SMALL},sliding_window=48")
    ids = random_ids(160, seed=17)
    full = attnkit.generate(model, ids, "full", max_new_tokens=12, stop_at_eos=False)
    for name in ("h2o", "keyformer", "streaming", "snapkv"):
        out = attnkit.generate(model, ids, name, params={"budget_tokens": 200}, max_new_tokens=12, stop_at_eos=False)
        assert out.token_ids == full.token_ids
        small = attnkit.generate(model, ids, name, params={"budget_tokens": 40}, max_new_tokens=12,
                                 stop_at_eos=False)
        assert small.stats.final_kv_bytes == 40 * per_token_bytes(model) or name == "snapkv"


@pytest.mark.parametrize("name,params,pattern", [
    ("h2o", {"budget": 0}, r"0 < budget <= 1, got 0"),
    ("h2o", {"budget": 1.5}, r"got 1.5"),
    ("keyformer", {"budget": "-0.2"}, r"got -0.2"),
    ("snapkv", {"budget": 0.5, "budget_tokens": 100}, r"not both.*budget=0.5.*budget_tokens=100"),
    ("streaming", {}, r"needs a cache budget"),
    ("h2o", {"budget_tokens": 0}, r"budget_tokens.*got 0"),
    ("h2o", {"budget_tokens": 32, "recent_tokens": 40}, r"recent window larger than the budget.*recent_tokens=40"),
    ("keyformer", {"budget_tokens": 32, "recent_tokens": 32}, r"recent window larger than the budget"),
    ("keyformer", {"budget": 0.5, "recent": 1.5}, r"recent window larger than the budget.*1.5"),
    ("keyformer", {"budget": 0.5, "noise": "uniform"}, r"noise must be one of gumbel, gaussian, constant, none; "
                                                        r"got 'uniform'"),
    ("keyformer", {"budget": 0.5, "score": "global"}, r"score.*'global'"),
    ("keyformer", {"budget": 0.5, "positions": "reindex"}, r"positions.*'reindex'"),
    ("keyformer", {"budget": 0.5, "tau_init": 0}, r"tau_init.*got 0"),
    ("h2o", {"budget": 0.5, "gqa_reduce": "sum"}, r"gqa_reduce.*'sum'"),
    ("streaming", {"budget_tokens": 4, "sinks": 4}, r"sinks=4.*budget"),
    ("snapkv", {"budget_tokens": 16, "window_size": 32}, r"window_size=32.*budget_tokens=16"),
    ("snapkv", {"budget": 0.5, "kernel_size": 4}, r"kernel_size must be odd.*4"),
    ("snapkv", {"budget": 0.5, "pooling": "median"}, r"pooling.*'median'"),
])
def test_bad_parameters(name, params, pattern):
    with pytest.raises(AttnkitError, match=pattern):
        attnkit.make_method(name, **params)


def test_cli_specs_parse():
    m = attnkit.parse_method_spec("keyformer:budget_tokens=2048,noise=gaussian,score=shared,recent=0.3")
    assert (m.budget_tokens, m.noise, m.score, m.recent) == (2048, "gaussian", "shared", 0.3)
    assert attnkit.parse_method_spec("h2o:budget=0.25/0.5").budget == [0.25, 0.5]
    from attnkit.methods.spec import split_spec_list

    specs = split_spec_list("full,h2o:budget_tokens=2048,keyformer:budget_tokens=2048,noise=none,streaming:"
                           "budget_tokens=2048,sinks=4,snapkv:budget_tokens=2048")
    assert [attnkit.parse_method_spec(s).name for s in specs] == ["full", "h2o", "keyformer", "streaming", "snapkv"]
    assert math.isclose(attnkit.parse_method_spec(specs[2]).tau_end, 2.0)


def test_tova_argmin_of_its_buffer_is_the_masked_rule(monkeypatch):
    """TOVA stores its newest entry's score as +inf and evicts the buffer's plain argmin (victim_slots); the
    generic rule (the lowest rank outside `protect`, per head) must pick the very same entries: same tokens,
    logits bit for bit and bytes, for prompts longer and shorter than the budget, chunked prefill, pyramid
    budgets and a batch of two lengths."""
    from attnkit.methods.eviction import EvictionMethod
    from attnkit.methods.tova import TOVA
    model = attnkit.load_model(f"random:llama:{SMALL}")
    cases = [("tova:budget_tokens=24", (90,), {}), ("tova:budget_tokens=40", (30,), {}),
             ("tova:budget_tokens=24", (70,), {"chunk_size": 32}),
             ("tova:budget_tokens=20,layer_budgets=pyramid", (50, 50, 61), {})]

    generic = EvictionMethod.victim_slots
    assert_shortcut_is_exact(model, cases, lambda: monkeypatch.setattr(TOVA, "victim_slots", generic))
