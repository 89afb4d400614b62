"""MInference sparse prefill (MInference 1.0, Jiang et al. 2024, arXiv 2407.02490): patterns, index building,
kernels, the pattern search, the methods and their composition with a cache method.

Kernels are held to the dense-mask reference built from the same layout; the layouts to the plain
definitions of the three patterns; the methods to `full` where the pattern keeps everything.
"""

import json

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit import sparse as sa
from attnkit.calibrate import pattern_stats as search
from attnkit.cli import main
from attnkit.methods.spec import parse_method_spec, split_spec_list
from attnkit.recipe import recipe_from_dict, recipe_to_dict
from attnkit.runner import generate
from attnkit.sparse.patterns import HeadPattern as HP
from helpers import SMALL, random_ids

torch.set_num_threads(1)

B = 16
MIXED = [HP("a_shape", n_init=5, n_local=37), HP("vertical_slash", k_v=9, k_s=6), HP("block_sparse", k_b=3),
         HP("vertical_slash", k_v=3, k_s=30)]


def qkv(n, nq=None, hq=4, kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nq = n if nq is None else nq
    return (torch.randn(1, hq, nq, d, generator=g), torch.randn(1, kv, n, d, generator=g),
            torch.randn(1, kv, n, d, generator=g))


# ---- kernels == dense-mask reference ------------------------------------------------------------------
@pytest.fixture
def flex(monkeypatch):
    """FlexAttention where the C++ kernel would run (a CPU in float32; the kernel has tests of its own,
    tests/sparse/test_sparse_native.py): the path of a GPU, and of a CPU without a compiler."""
    monkeypatch.setattr(sa.kernels, "native_pays", lambda *a: False)


@pytest.mark.parametrize("n,nq", [(208, 208), (203, 203), (203, 70)])
def test_flex_kernel_equals_reference(flex, n, nq):
    """Compiled FlexAttention, mixed patterns, GQA (4 query / 2 kv heads), lengths that are and are not
    multiples of the block, a whole prompt and its last chunk. 208 and 203 are padded to the same size, so
    they run one compiled graph (a compilation takes seconds on a CPU: two for the three cases)."""
    q, k, v = qkv(n, nq)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=B, last_q=16)
    assert not layout.dense and layout.columns is not None
    out = sa.sparse_attention(q, k, v, layout, 0.25, compiled=True)
    ref = sa.reference_attention(q, k, v, layout, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_one_compiled_kernel_serves_every_prompt_length_of_a_padded_size(flex):
    """Prompts of 203 and 197 tokens are padded to the same 208: the second runs the kernel compiled for the
    first (dynamo compiles no new graph) and still equals the reference."""
    import torch._dynamo.utils as dynamo_utils

    graphs = []
    for n in (203, 197):
        assert sa.padded_length(n, B) == 208
        q, k, v = qkv(n, seed=n)
        layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=B, last_q=16, width=16)  # as the method fixes it
        assert layout.columns is not None
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        out = sa.sparse_attention(q, k, v, layout, 0.25, compiled=True)
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"] - before)
        torch.testing.assert_close(out, sa.reference_attention(q, k, v, layout, 0.25), atol=1e-5, rtol=1e-5)
    assert graphs[1] == 0, graphs


def test_eager_kernel_equals_reference():
    for n, nq, pats in [(150, 150, MIXED), (150, 33, MIXED), (100, 100, [HP("block_sparse", k_b=2)] * 4)]:
        q, k, v = qkv(n, nq, seed=n + nq)
        layout = sa.layout_for_patterns(pats, q, k, 0.3, block=B, last_q=8)
        out = sa.sparse_attention(q, k, v, layout, 0.3, compiled=False)
        torch.testing.assert_close(out, sa.reference_attention(q, k, v, layout, 0.3), atol=1e-5, rtol=1e-5)


def test_flops_count_the_tiles_the_kernel_runs():
    q, k, v = qkv(203)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=B)
    mask = sa.block_mask(layout, 2, sa.padded_length(203, B), sa.padded_length(203, B))
    listed = (mask.kv_num_blocks + mask.full_kv_num_blocks).sum((0, 2))
    assert torch.equal(listed.long(), layout.tiles)
    assert torch.equal(sa.kernel_flops(layout, 16), layout.tiles.double() * B * B * 4 * 16)
    dense = sa.build_layout(["block_sparse"] * 4, 203, 0, B, tiles=torch.ones(4, 13, 13, dtype=torch.bool))
    assert dense.dense and torch.allclose(dense.density, torch.full((4,), 13 * 14 / 2 * B * B / (203 * 204 / 2),
                                                                    dtype=torch.float64))


# ---- the patterns as defined ---------------------------------------------------------------------------
def _causal_forced(n, q_start=0):
    i = torch.arange(q_start, n)[:, None]
    j = torch.arange(n)[None, :]
    return j <= i, (j < B) | (j // B == i // B)


def test_a_shape_mask_is_the_token_rule():
    n = 203
    layout = sa.build_layout(["a_shape"] * 2, n, 0, B, init=torch.tensor([5, 40]), local=torch.tensor([37, 3]))
    causal, forced = _causal_forced(n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for h, (n_init, n_local) in enumerate([(5, 37), (40, 3)]):
        want = causal & ((j < n_init) | (i - j < n_local) | forced)
        assert torch.equal(sa.dense_mask(layout)[h], want)


def test_vertical_slash_estimate_and_mask():
    n, last_q = 203, 16
    q, k, _ = qkv(n)
    vertical, slash = sa.estimate_vertical_slash(q, k, 0.25, last_q)
    # Alg. 2 by hand: softmax of the last queries, summed down columns and along diagonals
    kk = k[0].repeat_interleave(2, 0)
    logits = q[0, :, -last_q:] @ kk.transpose(-1, -2) * 0.25
    pos = torch.arange(n - last_q, n)[:, None]
    probs = torch.softmax(logits.masked_fill(torch.arange(n)[None] > pos, float("-inf")), -1)
    torch.testing.assert_close(vertical, probs.sum(1))
    want = torch.zeros(4, n)
    for r in range(last_q):
        for j in range(int(pos[r]) + 1):
            want[:, int(pos[r]) - j] += probs[:, r, j]
    torch.testing.assert_close(slash, want)

    pats = [HP("vertical_slash", k_v=5, k_s=4)] * 4
    layout = sa.layout_for_patterns(pats, q, k, 0.25, block=B, last_q=last_q)
    mask = sa.dense_mask(layout)
    causal, forced = _causal_forced(n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for h in range(4):
        v_scores = vertical[h].clone()
        v_scores[:B] = float("-inf")
        cols = v_scores.topk(5).indices
        lines = slash[h].topk(4).indices
        exact = (torch.isin(j, cols) | torch.isin(i - j, lines) | forced) & causal
        assert bool((mask[h] >= exact).all()), "every chosen column and line is computed"
        # and nothing else than: the chosen columns, the tiles the lines cross, the forced tiles
        crossed = torch.zeros(n, n, dtype=torch.bool)
        for s in lines.tolist():
            for d in {s // B, -(-s // B)}:
                crossed |= (i // B - j // B) == d
        assert bool((mask[h] <= ((crossed | torch.isin(j, cols) | forced) & causal)).all())


def test_block_sparse_estimate_and_mask():
    n = 203
    q, k, _ = qkv(n)
    probs = sa.estimate_block_sparse(q, k, 0.25, B)
    nb = -(-n // B)
    qm = torch.stack([q[0, :, s:s + B].mean(1) for s in range(0, n, B)], 1)
    km = torch.stack([k[0, :, s:s + B].mean(1) for s in range(0, n, B)], 1).repeat_interleave(2, 0)
    logits = (qm @ km.transpose(-1, -2)) * 0.25
    want = torch.softmax(logits.masked_fill(torch.ones(nb, nb, dtype=torch.bool).triu(1), float("-inf")), -1)
    torch.testing.assert_close(probs, want)

    layout = sa.layout_for_patterns([HP("block_sparse", k_b=2)] * 4, q, k, 0.25, block=B)
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    for h in range(4):
        top = torch.zeros(nb, nb, dtype=torch.bool).scatter_(1, probs[h].topk(2).indices, True)
        assert torch.equal(layout.main[h], (top | (j == 0) | (j == i)) & (j <= i))


def test_every_pattern_is_causal_and_keeps_first_and_diagonal_blocks():
    n = 203
    q, k, _ = qkv(n)
    pats = [HP("a_shape", n_init=0, n_local=0), HP("vertical_slash", k_v=0, k_s=0), HP("block_sparse", k_b=0),
            HP("vertical_slash", k_v=50, k_s=50)]
    mask = sa.dense_mask(sa.layout_for_patterns(pats, q, k, 0.25, block=B))
    causal, forced = _causal_forced(n)
    assert bool((mask <= causal).all())
    assert bool((mask >= (forced & causal)).all())


def test_static_patterns_use_the_stored_indices():
    vs = HP("vertical_slash", k_v=3, k_s=2, vertical=(5, 40, 77), slash=(0, 20))
    bs = HP("block_sparse", k_b=1, blocks=((0,), (0,), (1,), (0, 2)))
    layouts = [sa.layout_for_patterns([vs, vs, bs, bs], *qkv(100, seed=s)[:2], 0.25, block=B) for s in (1, 2)]
    assert torch.equal(layouts[0].main, layouts[1].main) and torch.equal(layouts[0].columns, layouts[1].columns)
    lay = layouts[0]
    assert lay.columns[0, :2].tolist() == [40, 77]  # key 5 lies in tile 0, which is always kept
    i, j = lay.grid()
    want_vs = (j <= i) & ((j == 0) | (i - j <= 2))  # offsets 0 and 20 cross block diagonals 0, 1 and 2
    assert torch.equal(lay.main[0], want_vs)
    stored = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    rows = torch.cat([stored, stored[-1:].expand(3, 3)])  # later rows reuse the last stored row
    want_bs = (j <= i) & ((j == 0) | (j == i) | torch.nn.functional.pad(rows, (0, 4)))
    assert torch.equal(lay.main[2], want_bs)


# ---- methods ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    return attnkit.load_model(f"random:llama:{SMALL}")


def _same(a, b):
    return a.token_ids == b.token_ids and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_keeping_everything_equals_full_exactly(small, tmp_path):
    ids = random_ids(150, seed=3)
    full = generate(small, ids, "full", max_new_tokens=4, keep_logits=True)
    for spec in ["minference:k_v=0,k_s=150", "minference:pattern=block_sparse,k_b=10,block_size=16",
                 "a_shape:n_init=100,n_local=50,block_size=16"]:
        out = generate(small, ids, parse_method_spec(spec), max_new_tokens=4, keep_logits=True)
        assert _same(out, full), spec
    config = _write_config(tmp_path / "all.json", [[{"pattern": "vertical_slash", "k_v": 0, "k_s": 999}] * 4] * 2)
    assert _same(generate(small, ids, "minference", params={"config": config}, max_new_tokens=4, keep_logits=True), full)
    with sa.profile() as prof:
        generate(small, ids, "minference", params={"k_v": 0, "k_s": 150}, max_new_tokens=1)
    assert prof.dense_calls == 2 and prof.sparse_calls == 0
    chunked = generate(small, ids, "full", max_new_tokens=4, keep_logits=True, chunk_size=64)
    assert _same(generate(small, ids, "minference", params={"k_v": 0, "k_s": 150}, max_new_tokens=4,
                          keep_logits=True, chunk_size=64), chunked)


def test_sparse_method_uses_the_kernel_and_decodes_densely(small):
    ids = random_ids(200, seed=4)
    with sa.profile() as prof:
        out = generate(small, ids, "minference", params={"pattern": "block_sparse", "k_b": 2, "block_size": 16, "compile": False},
                       max_new_tokens=3, keep_logits=True)
    assert prof.sparse_calls == 2 and 0 < prof.as_dict()["mean_density"] < 1
    full = generate(small, ids, "full", max_new_tokens=3, keep_logits=True)
    assert out.stats.final_kv_bytes == full.stats.final_kv_bytes  # the cache keeps every prompt token
    assert not torch.equal(out.logits[0], full.logits[0])
    # a multi-token step after the prompt (a speculative verification) is not prefill: dense
    from attnkit.forward import forward, prefill
    from attnkit.session import Step, new_session
    session = new_session(small, parse_method_spec("minference:pattern=block_sparse,k_b=2,block_size=16"), 200, 8)
    with sa.profile() as prof, torch.inference_mode():
        prefill(small, session, ids)
        forward(small, random_ids(5), 200, lambda pos: Step(session, "prefill", pos, False))
    assert (prof.sparse_calls, prof.dense_calls) == (2, 2)


def test_heads_denser_than_dense_above_run_dense_attention(tmp_path):
    """A layer with two heads whose layouts compute more than 0.9 of their causal pairs and two that compute
    less: the dense ones give dense causal attention, the others their layout's attention (the reference),
    all from one call; dense_above=1 keeps every head on its layout, a tiny one makes the layer dense."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from attnkit.cache import KVCache
    from attnkit.methods.minference import MInferenceRun
    from attnkit.session import Session

    n = 203
    q, k, v = qkv(n, seed=5)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=B, last_q=16)
    over = layout.density > 0.9
    assert over.tolist() == [False, True, False, True]
    config = _write_config(tmp_path / "mixed.json", [[p.to_dict() for p in MIXED]])
    session = Session(parse_method_spec("full"), KVCache(1), 1, n, 0)  # a one-layer prompt of n tokens
    ctx = SimpleNamespace(native_window=None, q_pos=torch.arange(n), scaling=0.25, index=0, session=session,
                          session_state=MInferenceRun())
    positions = torch.arange(n).expand(1, 2, n)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.25,
                                           is_causal=True)
    sparse = sa.reference_attention(q, k, v, layout, 0.25)
    for limit, want in ((0.9, torch.where(over[None, :, None, None], dense, sparse)), (1.0, sparse), (0.01, dense)):
        method = parse_method_spec(f"minference:config={config},dense_above={limit}")
        with sa.profile() as prof:
            out = method.prefill_output(ctx, q, k, v, positions)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        if limit == 0.9:  # the dense heads count as density 1
            assert prof.sparse_calls == 1
            assert prof.density_sum == pytest.approx(float(torch.where(over, 1.0, layout.density).mean()))
        assert prof.dense_calls == (limit == 0.01)
    for bad in ("0", "1.5", "x"):
        with pytest.raises(AttnkitError, match="dense_above"):
            parse_method_spec(f"minference:dense_above={bad}")
        with pytest.raises(AttnkitError, match="dense_above"):
            parse_method_spec(f"a_shape:dense_above={bad}")


def _write_config(path, layers, **meta):
    data = {"format": "attnkit.minference-patterns/1", "block_size": 16, "last_q": 16, **meta, "layers": layers}
    path.write_text(json.dumps(data))
    return str(path)


def test_config_checks(small, tmp_path):
    ids = random_ids(100)
    three = _write_config(tmp_path / "three.json", [[{"pattern": "block_sparse", "k_b": 2}] * 4] * 3)
    with pytest.raises(AttnkitError, match=r"3 layers x 4 heads, but the model has 2 layers x 4 query heads"):
        generate(small, ids, "minference", params={"config": three}, max_new_tokens=1)
    five = _write_config(tmp_path / "five.json", [[{"pattern": "block_sparse", "k_b": 2}] * 5] * 2)
    with pytest.raises(AttnkitError, match=r"2 layers x 5 heads, but the model has 2 layers x 4"):
        generate(small, ids, "minference", params={"config": five}, max_new_tokens=1)
    bad = _write_config(tmp_path / "bad.json", [[{"pattern": "vertical_slash", "k_v": 3}] * 4] * 2)
    with pytest.raises(AttnkitError, match="needs k_v, k_s; missing k_s"):
        parse_method_spec(f"minference:config={bad}")
    with pytest.raises(AttnkitError, match="does not exist"):
        parse_method_spec(f"minference:config={tmp_path / 'nope.json'}")
    with pytest.raises(AttnkitError, match="config fixes the pattern"):
        parse_method_spec(f"minference:config={three},k_b=3")
    with pytest.raises(AttnkitError, match="no static indices"):
        parse_method_spec(f"minference_static:config={three}")
    with pytest.raises(AttnkitError, match="k_b is not a parameter of pattern vertical_slash"):
        parse_method_spec("minference:k_b=3")
    with pytest.raises(AttnkitError, match="block size must be one of"):
        parse_method_spec("a_shape:block_size=48")


# ---- the search ------------------------------------------------------------------------------------------
def test_recall_is_the_dense_mass_inside_the_layout():
    n = 150
    q, k, _ = qkv(n)
    logits = q[0] @ k[0].repeat_interleave(2, 0).transpose(-1, -2) * 0.25
    probs = torch.softmax(logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1)
    a = sa.build_layout(["a_shape"] * 4, n, 0, B, init=torch.full((4,), 7), local=torch.full((4,), 20))
    stats = search.dense_stats(q, k, 0.25, B, a)
    torch.testing.assert_close(stats.a_shape.float() / n, (probs * sa.dense_mask(a)).sum((1, 2)) / n)
    for pats in ([HP("vertical_slash", k_v=11, k_s=5)] * 4, [HP("block_sparse", k_b=3)] * 4):
        layout = sa.layout_for_patterns(pats, q, k, 0.25, block=B, last_q=16)
        torch.testing.assert_close(search.layout_recall(layout, stats),
                                   (probs * sa.dense_mask(layout)).sum((1, 2)) / n)


def test_search_writes_a_valid_config_reproducibly(small, tmp_path):
    spec = f"random:llama:{SMALL}"
    args = ["calibrate", "patterns", "--model", spec, "--length", "256", "--flops-budget", "0.5", "--block-size", "16",
            "--tasks", "passkey,kv_retrieval", "--seed", "3", "--static"]
    assert main(args + ["--out", str(tmp_path / "a.json")]) == 0
    assert main(args + ["--out", str(tmp_path / "b.json")]) == 0
    text = (tmp_path / "a.json").read_text()
    assert text == (tmp_path / "b.json").read_text()
    data = json.loads(text)
    assert (data["model"], data["length"], data["flops_budget"]) == (spec, 256, 0.5)
    assert len(data["layers"]) == 2 and all(len(layer) == 4 for layer in data["layers"])
    for layer in data["layers"]:
        for head in layer:
            assert head["pattern"] in sa.PATTERNS and 0 < head["recall"] <= 1
            assert head["density"] <= 0.5 + 1e-9
    ids = random_ids(256, seed=9)
    for name in ("minference", "minference_static"):
        with sa.profile() as prof:
            generate(small, ids, name, params={"config": str(tmp_path / "a.json"), "compile": False}, max_new_tokens=2)
        assert prof.sparse_calls == 2


def test_fit_to_budget_scales_each_candidate():
    n = 256
    q, k, _ = qkv(n)
    ranks = [search.estimate_ranks(q, k, 0.25, B, 16)]
    for cand in search.candidates():
        params = search.fit_to_budget(cand, ranks, 0.3, B, 4)
        density = search.candidate_layout(cand.pattern, params, ranks[0], B).density
        assert bool((density <= 0.3).all())
        bigger = search.candidate_layout(cand.pattern, params + 2, ranks[0], B).density
        assert bool((bigger > density - 1e-12).all())


# ---- composition -------------------------------------------------------------------------------------------
def test_compose_prefill_outputs_with_a_cache_method(small):
    ids = random_ids(200, seed=5)

    def run(spec):
        return generate(small, ids, parse_method_spec(spec), max_new_tokens=4, keep_logits=True)

    sparse = "minference:k_v=4,k_s=8,block_size=16,compile=false"
    assert _same(run(sparse + "+full"), run(sparse))
    snap = run("snapkv:budget=0.3")
    assert _same(run("minference:k_v=0,k_s=400+snapkv:budget=0.3"), snap)
    both = run(sparse + "+snapkv:budget=0.3")
    assert both.stats.peak_kv_bytes == snap.stats.peak_kv_bytes
    assert both.stats.final_kv_bytes == snap.stats.final_kv_bytes
    assert torch.equal(both.logits[0], run(sparse).logits[0])  # first token: the sparse prefill's output
    with pytest.raises(AttnkitError, match="computes its own prefill attention"):
        run("minference:k_v=4,k_s=8+window:window=64")
    with pytest.raises(AttnkitError, match="computes its prefill outputs inside prefill_attention"):
        parse_method_spec("window:window=64+snapkv:budget=0.3")


def test_compose_specs_and_recipes(tmp_path):
    assert split_spec_list("full,minference:k_v=4,k_s=8+snapkv:budget=0.3,window_size=8,window:window=64") == [
        "full", "minference:k_v=4,k_s=8+snapkv:budget=0.3,window_size=8", "window:window=64"]
    m = parse_method_spec("minference:k_v=4,k_s=8+snapkv:budget=0.3,window_size=8")
    assert m.name == "compose" and m.prefill_method.k_s == 8 and m.cache_method.window_size == 8
    again = recipe_from_dict(json.loads(json.dumps(recipe_to_dict(m))))
    assert again.params() == m.params()
    from attnkit.methods.compose import Compose
    from attnkit.methods.snapkv import SnapKV
    inst = Compose(prefill={"method": "a_shape", "params": {"n_init": 64}}, cache=SnapKV(budget=0.5))
    assert inst.params()["cache"] == {"method": "snapkv", "params": SnapKV(budget=0.5).params()}
    with pytest.raises(AttnkitError, match="exactly two"):
        parse_method_spec("full+full+full")
