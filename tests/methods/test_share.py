"""Share-Attention (Taniguchi et al., section 4.1): eq. 9, clustering, the config file, and the `share` method."""

import json

import pytest
import torch

import attnkit
from attnkit.calibrate.heads import (
    calibrate_heads,
    cluster_heads,
    eq9_distance,
    head_distances,
    resolve_thresholds,
    schedule_thresholds,
    write_config,
)
from attnkit.cli import main as cli_main
from attnkit.errors import AttnkitError
from attnkit.methods.share import LayerPlan, Share, shared_attention, shared_prefill_fused
from attnkit.methods.spec import make_method, parse_method_spec
from helpers import random_ids

SPEC4 = "random:llama:layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
NEW = 8


@pytest.fixture(scope="module")
def llama4():
    return attnkit.load_model(SPEC4)


def config_dict(model, share_to_per_layer):
    g = model.geometry
    layers = []
    for share_to in share_to_per_layer:
        essential = [h for h in range(g.n_q_heads) if h not in share_to]
        layers.append({"essential_heads": essential, "share_to": {str(h): e for h, e in share_to.items()}})
    return {"n_layers": g.n_layers, "n_heads": g.n_q_heads, "n_kv_heads": g.n_kv_heads, "layers": layers}


def gen(model, ids, method, **kw):
    return attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True, **kw)


def max_logit_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


# ---- eq. 9 ---------------------------------------------------------------------------------------------
def test_eq9_distance_by_hand():
    a = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    b = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.9, 0.0], [0.2, 0.3, 0.5]])
    # sum of squares = 0.4^2 + 0.4^2 = 0.32; / sqrt(N = 3)
    assert eq9_distance(a, b) == pytest.approx((0.32 ** 0.5) / 3 ** 0.5, abs=1e-7)
    assert eq9_distance(a, a) == 0.0


def test_chunked_head_distances_match_dense_maps():
    torch.manual_seed(0)
    hq, kv, n, d = 4, 2, 11, 8
    q, k = torch.randn(1, hq, n, d), torch.randn(1, kv, n, d)
    pos = torch.arange(n)
    scale = d ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    maps = []
    for h in range(hq):
        logits = (q[0, h] @ k[0, h // (hq // kv)].T * scale).masked_fill(~causal, float("-inf"))
        maps.append(torch.softmax(logits, -1))
    expected = torch.tensor([[eq9_distance(maps[i], maps[j]) for j in range(hq)] for i in range(hq)])
    got = head_distances(q, k, scale, pos, pos, block_elements=3 * hq * n)  # chunks of 3 queries
    assert torch.allclose(got.float(), expected.float(), atol=1e-6)
    assert got[0, 1] > 0.01  # not trivially zero


# ---- clustering -----------------------------------------------------------------------------------------
def hand_distances():
    d = torch.full((5, 5), 0.9)
    d.fill_diagonal_(0.0)
    for i, j, v in [(0, 1, 0.10), (0, 2, 0.15), (1, 2, 0.12), (3, 4, 0.05)]:
        d[i, j] = d[j, i] = v
    return d


def test_clustering_hand_made_distances():
    d = hand_distances()
    # head 1 reaches {0, 1, 2} with the smallest summed distance (0.22); then {3, 4}: tie, lower index
    assert cluster_heads(d, 0.18) == ([1, 3], {0: 1, 2: 1, 4: 3})
    # at 0.11 only 0-1 and 3-4 are close: head 0 leads (tie with 1, lower index), head 2 alone
    assert cluster_heads(d, 0.11) == ([0, 2, 3], {1: 0, 4: 3})
    assert cluster_heads(d, 0.0) == ([0, 1, 2, 3, 4], {})
    # everything within 1.0: the medoid (smallest summed distance, head 1: 2.02) leads
    assert cluster_heads(d, 1.0) == ([1], {0: 1, 2: 1, 3: 1, 4: 1})


def test_clustering_never_chains_beyond_the_threshold():
    d = torch.tensor([[0.0, 0.1, 0.5], [0.1, 0.0, 0.1], [0.5, 0.1, 0.0]])
    essential, share_to = cluster_heads(d, 0.18)
    assert essential == [1] and share_to == {0: 1, 2: 1}
    for h, e in share_to.items():
        assert d[h, e] <= 0.18


def test_threshold_schedules():
    assert schedule_thresholds("0.1,0.5", 32) == [0.5 if 15 <= i < 29 else 0.1 for i in range(32)]
    assert schedule_thresholds("0.1,0.5,1:3", 4) == [0.1, 0.5, 0.5, 0.1]
    with pytest.raises(AttnkitError, match="0 <= A < B <= 4"):
        schedule_thresholds("0.1,0.5,3:9", 4)
    assert resolve_thresholds(3) == ([0.18] * 3, "uniform 0.18")
    with pytest.raises(AttnkitError, match="2 thresholds given but the model has 3 layers"):
        resolve_thresholds(3, thresholds=[0.1, 0.2])


# ---- the shared attention -----------------------------------------------------------------------------------
def dense_shared_reference(q, k, v, scale, share_to):
    """Per-head softmax of every head, then head h takes ITS essential head's probabilities x its own V."""
    hq, kv, n = q.shape[1], k.shape[1], q.shape[2]
    g = hq // kv
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = [torch.softmax((q[0, h] @ k[0, h // g].T * scale).masked_fill(~causal, float("-inf")), -1)
             for h in range(hq)]
    return torch.stack([probs[share_to.get(h, h)] @ v[0, h // g] for h in range(hq)])[None]


def test_shared_attention_reuses_essential_probabilities_across_kv_groups():
    torch.manual_seed(1)
    hq, kv, n, d = 4, 2, 13, 8
    q, k, v = torch.randn(1, hq, n, d), torch.randn(1, kv, n, d), torch.randn(1, kv, n, d)
    pos = torch.arange(n)
    share_to = {1: 2, 3: 0}  # head 1 (kv 0) uses head 2's (kv 1) softmax and vice versa for head 3
    plan = LayerPlan.build(hq, kv, share_to)
    assert plan.essential == (0, 2) and plan.shares
    out = shared_attention(q, k, v, d ** -0.5, pos, pos, None, plan, block_elements=4 * hq * n)
    ref = dense_shared_reference(q, k, v, d ** -0.5, share_to)
    assert torch.allclose(out, ref, atol=1e-6)
    fused = shared_prefill_fused(q, k, v, d ** -0.5, plan)  # one SDPA call per (keys' kv, values' kv) pair
    assert torch.allclose(fused, ref, atol=1e-5)
    plain = dense_shared_reference(q, k, v, d ** -0.5, {})
    assert (out[0, 1] - plain[0, 1]).abs().max() > 1e-3  # head 1 really changed
    assert torch.allclose(out[0, 0], plain[0, 0], atol=1e-6)  # an essential head did not


def twin_head_model():
    """A model where, in every layer, q-head 1 equals q-head 0 (same kv group) and q-head 3 equals q-head 0 with
    kv head 1's keys equal to kv head 0's (values differ): sharing 1->0 and 3->0 is exact."""
    model = attnkit.load_model(SPEC4.replace("layers=4", "layers=3"))
    d = model.geometry.head_dim
    with torch.no_grad():
        for layer in model.hf.model.layers:
            attn = layer.self_attn
            w = attn.q_proj.weight
            w[d:2 * d] = w[:d]
            w[3 * d:4 * d] = w[:d]
            attn.k_proj.weight[d:2 * d] = attn.k_proj.weight[:d]
    return model


def test_share_with_exact_twins_equals_full_and_really_shares():
    model = twin_head_model()
    ids = random_ids(200, seed=4)
    ref = gen(model, ids, "full")
    cfg = config_dict(model, [{1: 0, 3: 0}] * 3)
    method = Share(config=cfg)
    assert method.skipped_fraction() == pytest.approx(0.5)
    # fused prefill: head 1 (same kv group as head 0) is free, head 3 (other group) recomputes its softmax
    assert method.skipped_fraction(n_kv=2) == pytest.approx(0.25)
    out = gen(model, ids, method)
    assert out.token_ids == ref.token_ids
    assert max_logit_diff(out, ref) < 1e-4
    # sharing to a head that is NOT a twin changes the output: the shared probabilities are really used
    wrong = gen(model, ids, Share(config=config_dict(model, [{2: 1}] * 3)))
    assert max_logit_diff(wrong, ref) > 1e-3


@pytest.mark.parametrize("spec", [SPEC4, "random:qwen3:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,"
                                          "intermediate=128"])
def test_no_sharing_equals_full(spec, tmp_path):
    model = attnkit.load_model(spec)
    ids = random_ids(150, seed=2)
    ref = gen(model, ids, "full")
    zero = write_config(calibrate_heads(model, length=200, tasks=["passkey"], threshold=0.0), tmp_path / "zero.json")
    for method in (parse_method_spec("share:config=none"), make_method("share", config=str(zero))):
        out = gen(model, ids, method)
        assert out.token_ids == ref.token_ids
        assert max_logit_diff(out, ref) < 1e-4
        assert out.stats.final_kv_bytes == ref.stats.final_kv_bytes  # sharing saves compute, not memory


def test_share_chunked_prefill_matches_dense_reference(llama4):
    ids = random_ids(90, seed=5)
    cfg = config_dict(llama4, [{1: 2}, {}, {3: 0, 2: 0}, {1: 0}])
    one = gen(llama4, ids, Share(config=cfg))  # fused prefill
    chunked = gen(llama4, ids, Share(config=cfg), chunk_size=32)  # explicit, chunked
    explicit = gen(llama4, ids, Share(config=cfg, fused_prefill=False))
    for other in (chunked, explicit):
        assert other.token_ids == one.token_ids
        assert max_logit_diff(other, one) < 1e-4


# ---- the config file ---------------------------------------------------------------------------------------
def test_config_for_another_geometry_is_refused(tmp_path):
    small = attnkit.load_model("random:llama:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128")
    other = attnkit.load_model("random:llama:layers=2,hidden=64,heads=8,kv_heads=2,head_dim=8,intermediate=128")
    path = write_config(calibrate_heads(small, length=200, tasks=["passkey"], threshold=0.5), tmp_path / "s.json")
    ids = random_ids(40)
    with pytest.raises(AttnkitError, match=r"2 layers x 4 query heads \(2 kv heads\) but .* 2 layers x 8 query heads"):
        attnkit.generate(other, ids, "share", params={"config": str(path)}, max_new_tokens=2)
    four = attnkit.load_model(SPEC4)
    with pytest.raises(AttnkitError, match=r"calibrated for 2 layers .* has 4 layers"):
        attnkit.generate(four, ids, "share", params={"config": str(path)}, max_new_tokens=2)


def test_malformed_configs_are_refused(tmp_path):
    with pytest.raises(AttnkitError, match="does not exist"):
        make_method("share", config=str(tmp_path / "missing.json"))
    bad = {"n_layers": 1, "n_heads": 4, "layers": [{"essential_heads": [0, 1], "share_to": {"2": 0}}]}
    with pytest.raises(AttnkitError, match="each of its 4 heads once"):
        make_method("share", config=bad)
    bad["layers"][0] = {"essential_heads": [0, 1, 2], "share_to": {"3": 5}}
    with pytest.raises(AttnkitError, match="non-essential"):
        make_method("share", config=bad)


def test_calibrate_heads_same_seed_same_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    model = attnkit.load_model(SPEC4)
    args = dict(length=256, tasks=["passkey", "kv_retrieval"], seed=3, threshold=0.004)
    a = write_config(calibrate_heads(model, **args), tmp_path / "a.json").read_bytes()
    b = write_config(calibrate_heads(model, **args), tmp_path / "b.json").read_bytes()
    assert a == b
    data = json.loads(a)
    assert data["date"] == "2023-11-14" and data["n_layers"] == 4 and data["thresholds"] == [0.004] * 4
    assert all(p["seed"] >= 1_000_000 for p in data["prompts"])  # never an evaluation seed
    for layer in data["layers"]:
        d = torch.tensor(layer["distances"])
        for h, e in layer["share_to"].items():
            assert d[int(h), e] <= 0.004
        assert layer["retention_rate"] == len(layer["essential_heads"]) / 4
    other = write_config(calibrate_heads(model, **dict(args, seed=4)), tmp_path / "c.json").read_bytes()
    assert other != a


def test_cli_calibrate_heads_smoke(tmp_path, capsys):
    out = tmp_path / "heads.json"
    rc = cli_main(["calibrate", "heads", "--model", SPEC4, "--out", str(out), "--length", "200", "--tasks", "passkey",
                   "--threshold-schedule", "0,1,1:3"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["thresholds"] == [0.0, 1.0, 1.0, 0.0]
    assert [len(x["essential_heads"]) for x in data["layers"]] == [4, 1, 1, 4]
    assert "retention" in capsys.readouterr().out
    thresholds = tmp_path / "th.txt"
    thresholds.write_text("0\n0\n0\n")
    assert cli_main(["calibrate", "heads", "--model", SPEC4, "--out", str(out), "--length", "200",
                     "--tasks", "passkey", "--thresholds", str(thresholds)]) == 2
    assert "lists 3 thresholds but the model has 4 layers" in capsys.readouterr().err


def test_compose_refuses_model_level_methods():
    with pytest.raises(AttnkitError, match="cannot be composed"):
        parse_method_spec("select:filter_layer=1+snapkv:budget=0.5")
