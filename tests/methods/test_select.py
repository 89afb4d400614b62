"""Select-Attention (Taniguchi et al., section 4.2), the GemFilter baseline, and the filter-layer sweep."""

import json

import pytest
import torch

import attnkit
from attnkit.calibrate.filter_layer import select_bytes_per_token
from attnkit.cli import main as cli_main
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.select import HIDDEN, Select, kept_fraction, top_p
from attnkit.methods.spec import make_method, parse_method_spec
from attnkit.session import new_session
from helpers import random_ids

SPEC4 = "random:llama:layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
NEW = 8


@pytest.fixture(scope="module")
def llama4():
    return attnkit.load_model(SPEC4)


def gen(model, ids, method, **kw):
    if isinstance(method, str):
        method = parse_method_spec(method)
    return attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True, **kw)


def max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def assert_same(out, ref):
    assert out.token_ids == ref.token_ids
    assert max_logit_diff(out, ref) < 1e-4


# ---- equal to full at the limits --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [SPEC4, "random:mistral:layers=3,hidden=64,heads=4,kv_heads=2,head_dim=16,"
                                          "intermediate=128"])
def test_select_keeping_everything_equals_full(spec):
    model = attnkit.load_model(spec)
    n_layers = model.geometry.n_layers
    ids = random_ids(180, seed=3)
    ref = gen(model, ids, "full")
    # the last layer as filter: nothing after it to filter
    assert_same(gen(model, ids, f"select:filter_layer={n_layers - 1},p_decode=0.5"), ref)
    # p = 1 at an early filter layer: the later layers recompute every token from the stored hidden states
    assert_same(gen(model, ids, "select:filter_layer=1,p_decode=1.0"), ref)
    assert_same(gen(model, ids, "select:filter_layer=0,p_decode=1.0,p_prefill=1.0,prefill_select=true"), ref)
    assert_same(gen(model, ids, "select:filter_layer=1,p_decode=1.0", chunk_size=64), ref)


def test_select_with_small_p_filters_and_changes_the_output(llama4):
    ids = random_ids(300, seed=8)
    ref = gen(llama4, ids, "full")
    method = Select(filter_layer=1, p_decode=0.5)
    out = gen(llama4, ids, method)
    kept = kept_fraction(out.stats.method_stats)
    assert kept is not None and kept < 0.7  # the later layers saw a subset of the context
    assert out.stats.method_stats["selection_steps"] == NEW - 1
    assert max_logit_diff(out, ref) > 1e-3
    # the first token comes from an unfiltered prefill (prefill_select=false): same as full
    assert (out.logits[0] - ref.logits[0]).abs().max() < 1e-4
    filtered = gen(llama4, ids, "select:filter_layer=1,p_decode=0.5,prefill_select=true,p_prefill=0.5")
    assert (filtered.logits[0] - ref.logits[0]).abs().max() > 1e-3
    weighted = Select(filter_layer=1, p_decode=0.5, value_weighted=True)
    assert kept_fraction(gen(llama4, ids, weighted).stats.method_stats) != kept


def test_top_p_by_hand():
    scores = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])
    assert top_p(scores, 0.5).tolist() == [1]
    assert top_p(scores, 0.6).tolist() == [1, 3]       # 0.5 < 0.6 <= 0.75
    assert top_p(scores, 0.75).tolist() == [1, 3]
    assert top_p(scores, 0.76).tolist() == [0, 1, 3]
    assert top_p(scores, 1.0).tolist() == [0, 1, 2, 3, 4]
    assert top_p(scores * 3, 0.6).tolist() == [1, 3]   # the mass is relative (value-weighted scores)


def test_select_score_tokens_equals_full_without_prefill_selection(llama4):
    ids = random_ids(120, seed=6)
    ref = attnkit.score_tokens(llama4, ids)
    ours = attnkit.score_tokens(llama4, ids, "select", params={"filter_layer": "1", "p_decode": "0.5"})
    assert (ours - ref).abs().max() < 1e-4
    with pytest.raises(AttnkitError, match="only the last prompt position"):
        attnkit.score_tokens(llama4, ids, "select", params={"filter_layer": "1", "prefill_select": "true"})


# ---- memory -----------------------------------------------------------------------------------------------
def test_select_keeps_no_kv_after_the_filter_layer(llama4):
    g = llama4.geometry
    n, new, L = 100, 5, 1
    ids = random_ids(n, seed=1)
    session = new_session(llama4, make_method("select", filter_layer=L), n, new)
    with torch.inference_mode():
        prefill(llama4, session, ids)
    cache = session.cache
    assert all(layer is None for layer in cache.layers[L + 1:])
    assert all(layer is not None for layer in cache.layers[:L + 1])
    slots = n + new
    kv_layer = 2 * g.n_kv_heads * g.head_dim * 4 * slots
    assert cache.kv_nbytes() == (L + 1) * kv_layer
    assert cache.extra_bytes() == cache.extra[HIDDEN].nbytes == slots * 64 * 4
    assert cache.nbytes() == cache.kv_nbytes() + cache.extra_bytes()

    out = attnkit.generate(llama4, ids, "select", params={"filter_layer": str(L)}, max_new_tokens=new,
                           stop_at_eos=False)
    full = attnkit.generate(llama4, ids, "full", max_new_tokens=new, stop_at_eos=False)
    per_token_full = 2 * 4 * 2 * 16 * 4  # 4 layers, 2 kv heads, head_dim 16, float32: 1024 B
    per_token_select = 2 * 2 * 2 * 16 * 4 + 64 * 4  # layers 0..1 (512 B) + one 64-float hidden state (256 B)
    assert full.stats.final_kv_bytes == slots * per_token_full
    assert out.stats.final_kv_bytes == out.stats.peak_kv_bytes == slots * per_token_select
    assert per_token_select == select_bytes_per_token(llama4, L) and per_token_full == select_bytes_per_token(llama4, 3)
    # filter layer 0 on this geometry: 256 + 256 = 512 B per token, half of full
    out0 = attnkit.generate(llama4, ids, "select", params={"filter_layer": "0"}, max_new_tokens=new, stop_at_eos=False)
    assert out0.stats.final_kv_bytes == slots * per_token_full // 2


# ---- parameters ---------------------------------------------------------------------------------------------
def test_bad_parameters_name_value_and_range(llama4):
    for p in ("1.5", "0", "-0.2"):
        with pytest.raises(AttnkitError, match=rf"p_decode={float(p)!r} is outside the allowed range 0 < p <= 1"):
            make_method("select", p_decode=p)
    with pytest.raises(AttnkitError, match=r"p_prefill=2.0 is outside the allowed range 0 < p <= 1"):
        parse_method_spec("select:p_prefill=2")
    with pytest.raises(AttnkitError, match=r"filter_layer=7 is out of range; the model has 4 layers, allowed 0..3"):
        attnkit.generate(llama4, random_ids(30), "select", params={"filter_layer": "7"}, max_new_tokens=2)
    with pytest.raises(AttnkitError, match=r"filter_layer=4 is out of range; the model has 4 layers, allowed 0..3"):
        attnkit.generate(llama4, random_ids(30), "gemfilter", params={"filter_layer": "4"}, max_new_tokens=2)
    with pytest.raises(AttnkitError, match="k=0 must be a token count"):
        make_method("gemfilter", k="0")
    with pytest.raises(AttnkitError, match="model.generate"):
        attnkit.AttnkitCache(llama4, "select", max_new_tokens=4)


# ---- select + share (Fig. 8 of the paper) ------------------------------------------------------------------
def test_select_composes_with_share(llama4):
    ids = random_ids(150, seed=9)
    ref = gen(llama4, ids, "full")
    assert_same(gen(llama4, ids, "select:filter_layer=1,p_decode=1.0,share_config=none"), ref)
    g = llama4.geometry
    cfg = {"n_layers": g.n_layers, "n_heads": 4, "n_kv_heads": 2,
           "layers": [{"essential_heads": [0, 2], "share_to": {"1": 0, "3": 2}}] * g.n_layers}
    both = gen(llama4, ids, Select(filter_layer=1, p_decode=1.0, share_config=cfg))
    shared = gen(llama4, ids, make_method("share", config=cfg))
    assert_same(both, shared)  # p = 1: select adds nothing to share
    assert max_logit_diff(shared, ref) > 1e-3  # and the sharing is really applied in the uncached layers too


# ---- gemfilter -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_gemfilter_keeping_the_whole_prompt_equals_full(llama4, positions):
    ids = random_ids(160, seed=2)
    ref = gen(llama4, ids, "full")
    assert_same(gen(llama4, ids, f"gemfilter:filter_layer=1,k=160,positions={positions}"), ref)
    assert_same(gen(llama4, ids, f"gemfilter:filter_layer=2,k=5000,positions={positions}", chunk_size=50), ref)


def test_gemfilter_compresses_the_prompt(llama4):
    n, k = 200, 40
    ids = random_ids(n, seed=5)
    out = gen(llama4, ids, f"gemfilter:filter_layer=1,k={k}")
    per_token = 2 * 4 * 2 * 16 * 4
    assert out.stats.final_kv_bytes == (k + NEW) * per_token
    assert out.stats.peak_kv_bytes == 2 * n * per_token // 4  # the filter pass: layers 0..1 over the prompt
    frac = gen(llama4, ids, "gemfilter:filter_layer=1,k=0.2")
    assert frac.stats.final_kv_bytes == out.stats.final_kv_bytes  # 0.2 x 200 = 40 tokens
    ref = gen(llama4, ids, "full")
    assert max_logit_diff(out, ref) > 1e-3
    with pytest.raises(AttnkitError, match="cannot score every prompt position"):
        attnkit.score_tokens(llama4, ids, "gemfilter", params={"k": "10"})


@pytest.mark.parametrize("pool", [1, 5])
def test_gemfilter_scores_are_pooled_as_the_reference_code_does(llama4, monkeypatch, pool):
    """The chosen tokens are the top-k of the last query's logits summed over heads and averaged over `pool`
    neighbours (F.avg_pool1d, zero padding counted: GemFilter's reference), the last prompt token forced in."""
    from attnkit.methods.gemfilter import GemFilter

    n, k = 120, 20
    seen, own = {}, GemFilter._choose

    def spy(self, ctx, q):
        seen["q"], seen["keys"] = q.clone(), ctx.kv.view()[0].clone()
        seen["chosen"] = own(self, ctx, q)
        return seen["chosen"]

    monkeypatch.setattr(GemFilter, "_choose", spy)
    gen(llama4, random_ids(n, seed=7), f"gemfilter:filter_layer=1,k={k},pool={pool}")
    q, keys = seen["q"].double(), seen["keys"].double()  # [1, 4, 1, 16], [1, 2, n, 16]
    logits = torch.matmul(q, keys.repeat_interleave(2, dim=1).transpose(-1, -2))[:, :, 0]  # [1, heads, n]
    scores = torch.nn.functional.avg_pool1d(logits.sum(1, keepdim=True), pool, 1, pool // 2)[0, 0]
    scores[-1] = float("inf")
    assert seen["chosen"].tolist() == sorted(scores.topk(k).indices.tolist())
    if pool == 5:
        unpooled = logits.sum(1)[0]
        unpooled[-1] = float("inf")
        assert seen["chosen"].tolist() != sorted(unpooled.topk(k).indices.tolist())  # pooling changes the choice


def test_gemfilter_pool_must_be_odd_and_positive():
    with pytest.raises(AttnkitError, match="pool=4 must be odd"):
        make_method("gemfilter", pool=4)
    with pytest.raises(AttnkitError, match="pool must be a whole number >= 1"):
        make_method("gemfilter", pool=0)


# ---- the filter-layer sweep --------------------------------------------------------------------------------
def test_cli_calibrate_filter_layer_smoke(tmp_path, capsys):
    out = tmp_path / "filter.json"
    rc = cli_main(["calibrate", "filter-layer", "--model", SPEC4, "--tasks", "passkey", "--length", "200",
                   "--samples", "1", "--p", "0.9", "--layers", "0,2", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["filter_layer"] for r in result["rows"]] == [0, 2]
    assert result["best_filter_layer"] in (0, 2)
    assert result["rows"][0]["bytes_per_token"] == 512 and result["full_bytes_per_token"] == 1024
    assert "<- best" in capsys.readouterr().out
    assert cli_main(["calibrate", "filter-layer", "--model", SPEC4, "--tasks", "passkey", "--length", "200",
                     "--layers", "9"]) == 2
    assert "allowed 0..3" in capsys.readouterr().err
    assert cli_main(["calibrate", "filter-layer", "--model", SPEC4, "--p", "1.2"]) == 2
    assert "p=1.2 is outside the allowed range 0 < p <= 1" in capsys.readouterr().err
