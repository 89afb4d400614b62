"""kvcompose (KVCompose, arXiv 2509.05165): equal to full at an unlimited budget on every architecture, batched; the
kept positions and the count per layer (per layer and kv head, unstructured) equal the paper's rule written plainly
from transformers' own eager attention of a second forward of the prompt over its cache (not attnkit's attention);
AttnkitCache and vLLM refuse it in one line; bad parameters refused in one line."""

import pytest
import torch
from transformers import DynamicCache

import attnkit
from attnkit import AttnkitError
from attnkit.forward import prefill
from attnkit.methods import kvcompose, scoring_native
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from attnkit.vllm.plan import check_supported
from helpers import assert_equals_full, random_ids

torch.set_num_threads(1)

NEW = 10


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (120, 97, 120)]
    for spec in ("kvcompose:budget=1.0", "kvcompose:budget_tokens=200,structured=false"):
        assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def eager_replay(model, ids):
    """Per layer, transformers' eager attention probabilities ``[hq, n, 2n]`` of the prompt read a second time over
    its own cache (at the positions after it), and the prompt's values ``[kv, n, d]``."""
    hf, n = model.hf, ids.shape[-1]
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        cache = DynamicCache()
        with torch.no_grad():
            hf.model(input_ids=ids[None], past_key_values=cache)
            out = hf.model(input_ids=ids[None], past_key_values=cache, output_attentions=True)
        return [a[0].double() for a in out.attentions], [layer.values[0, :, :n].double() for layer in cache.layers]
    finally:
        hf.set_attn_implementation(previous)


def reference(model, ids, method):
    """The paper's scores ``[layer][kv head][position]`` and the composite scores ``(value, cell)`` of every cell
    (a layer, or a layer and kv head) and rank, written with Python lists."""
    attentions, values = eager_replay(model, ids)
    n, kv = ids.shape[-1], values[0].shape[0]
    reduce = {"max": max, "mean": lambda xs: sum(xs) / len(xs)}
    scores = []
    for probs, vals in zip(attentions, values):
        hq = probs.shape[0]
        g = hq // kv
        per_head = [[reduce[method.agg_task](probs[h, :, j].tolist()) for j in range(n)] for h in range(hq)]
        layer = [[reduce[method.agg_group]([per_head[h][j] for h in range(k * g, (k + 1) * g)]) for j in range(n)]
                 for k in range(kv)]
        if method.add_v_norm:
            layer = [[s * float(vals[k, j].norm()) for j, s in enumerate(row)] for k, row in enumerate(layer)]
        if method.add_mean_across_heads:
            means = [sum(layer[k][j] for k in range(kv)) / kv for j in range(n)]
            layer = [[s + means[j] for j, s in enumerate(row)] for row in layer]
        scores.append(layer)
    ranked = [[sorted(row, reverse=True) for row in layer] for layer in scores]
    bound = method.keep_token_lower_bound
    if method.structured:
        composite = [[reduce[method.agg_head]([row[r] for row in layer]) + (1e9 if r < bound else 0.0)
                      for r in range(n)] for layer in ranked]
        composite[0] = [max(c[r] for c in composite) for r in range(n)]
        cells = [(v, layer) for layer, row in enumerate(composite) for v in row]
    else:
        cells = [(v + (1e9 if r < bound else 0.0), (layer, k)) for layer, rows in enumerate(ranked)
                 for k, row in enumerate(rows) for r, v in enumerate(row)]
    return scores, cells


def assert_counts_follow_the_budget(counts: dict, cells, kept: int, floor: int, tol=1e-9):
    """`counts` (per cell) are the `kept` composite tokens of highest score: every cell holds all of its tokens above
    the kept-th score and some of those within `tol` of it (equal scores may fall either way), at least `floor`."""
    values = sorted((v for v, _ in cells), reverse=True)
    edge = values[kept - 1]
    above = {cell: 0 for cell in counts}
    near = dict(above)
    for v, cell in cells:
        above[cell] += v > edge + tol
        near[cell] += abs(v - edge) <= tol
    assert sum(min(c, above[cell] + near[cell]) for cell, c in counts.items()) >= kept
    for cell, c in counts.items():
        assert max(floor, above[cell]) <= c <= max(floor, above[cell] + near[cell])


def held(session):
    return [[sorted(row.tolist()) for row in layer.view()[2][0]] for layer in session.cache.layers]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", [
    "kvcompose:budget=0.3", "kvcompose:budget=0.25,structured=false",
    "kvcompose:budget_tokens=30,agg_task=mean,agg_group=max,agg_head=max,add_v_norm=true",
    "kvcompose:budget=0.2,add_mean_across_heads=false,keep_token_lower_bound=12",
])
def test_kept_positions_equal_the_rule_from_transformers_eager_attention(arch_models, arch, spec):
    model, n = arch_models[arch], 96
    ids = random_ids(n, seed=31)
    method = parse_method_spec(spec)
    scores, cells = reference(model, ids, method)
    session = new_session(model, method, n, 4)
    with torch.inference_mode():
        prefill(model, session, ids)
    kv = model.geometry.n_kv_heads
    layers = session.cache.layers
    if method.structured:
        got = held(session)
        counts = {layer: len(rows[0]) for layer, rows in enumerate(got)}
        assert all(len(row) == counts[layer] for layer, rows in enumerate(got) for row in rows)
        total = int(n * len(layers) * method.budget) if method.budget else method.budget_tokens * len(layers)
    else:
        got = []
        for layer in layers:
            positions, heads = layer.view()[2][0, 0], layer.extras["head"][0, 0, :layer.length]
            got.append([sorted(positions[heads == k].tolist()) for k in range(kv)])
        counts = {(layer, k): len(got[layer][k]) for layer in range(len(layers)) for k in range(kv)}
        total = int(n * len(layers) * kv * method.budget)
    floor = max(1, method.keep_token_lower_bound) if method.structured else 0
    assert_counts_follow_the_budget(counts, cells, total, floor)
    for layer, rows in enumerate(got):
        for k, row in enumerate(rows):
            order = sorted(range(n), key=lambda j: -scores[layer][k][j])
            assert row == sorted(order[:len(row)])
    if method.structured:
        assert counts[0] == max(counts.values())  # layer 0 never keeps fewer than another layer
    else:
        assert len(set(counts.values())) > 1  # the budget is shared unevenly by the kv heads


def test_generated_tokens_follow_the_compressed_cache(arch_models):
    model, ids = arch_models["llama"], random_ids(120, seed=4)
    full = attnkit.generate(model, ids, "full", max_new_tokens=NEW, stop_at_eos=False)
    out = attnkit.generate(model, ids, "kvcompose:budget=0.2", max_new_tokens=NEW, stop_at_eos=False)
    flat = attnkit.generate(model, ids, "kvcompose:budget=0.2,structured=false", max_new_tokens=NEW,
                            stop_at_eos=False)
    assert out.token_ids[0] == full.token_ids[0] == flat.token_ids[0]  # the prompt's own logits
    assert out.stats.final_kv_bytes < full.stats.final_kv_bytes / 3
    assert flat.stats.final_kv_bytes < full.stats.final_kv_bytes / 3


@pytest.mark.skipif(scoring_native.library() is None, reason="no C++ compiler")  # CI has one
@pytest.mark.parametrize("task", ["max", "mean"])
@pytest.mark.parametrize("group", ["max", "mean"])
def test_the_replay_through_the_cpu_kernel_equals_the_torch_path(monkeypatch, task, group):
    n, m, hq, kv, d = 300, 300, 8, 2, 32
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, m, hq, d, generator=gen).transpose(1, 2)  # the layout the projections give
    keys, values = torch.randn(2, 1, kv, n + m, d, generator=gen)
    ran = []
    original = kvcompose._replay_native
    monkeypatch.setattr(kvcompose, "_replay_native", lambda *a: ran.append(original(*a)) or ran[-1])
    native = [kvcompose.replay_attention(q, keys, values, d ** -0.5, n, task, group, output=o) for o in (True, False)]
    assert len(ran) == 2 and None not in ran and native[1][0] is None  # the kernel ran both times
    monkeypatch.setattr(kvcompose, "_replay_native", lambda *a: None)
    out, score = kvcompose.replay_attention(q, keys, values, d ** -0.5, n, task, group)
    torch.testing.assert_close(native[0][0], out, rtol=1e-5, atol=1e-6)
    for _, got in native:
        assert got.shape == (1, kv, n)
        torch.testing.assert_close(got, score, rtol=1e-5, atol=1e-7)


def test_attnkit_cache_refuses_it_in_one_line(arch_models):
    from attnkit.hf_cache import AttnkitCache

    with pytest.raises(AttnkitError, match="kvcompose") as caught:
        AttnkitCache(arch_models["llama"], "kvcompose", params={"budget": 0.3}, max_new_tokens=4)
    assert "\n" not in str(caught.value)


def test_vllm_refuses_it_in_one_line():
    with pytest.raises(AttnkitError, match="depends on its scores") as caught:
        check_supported(parse_method_spec("kvcompose:budget=0.3"), "--method")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("kvcompose", "budget"), ("kvcompose:budget=0", "budget"),
                                       ("kvcompose:budget=0.5,agg_task=sum", "agg_task"),
                                       ("kvcompose:budget=0.5,agg_head=min", "agg_head"),
                                       ("kvcompose:budget=0.5,structured=2", "structured"),
                                       ("kvcompose:budget=0.5,keep_token_lower_bound=-1", "keep_token_lower_bound"),
                                       ("kvcompose:budget=0.5/0.4", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
