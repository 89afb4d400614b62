"""compactor (Compactor, arXiv 2507.08143): equal to full at an unlimited budget on every architecture, batched; the
kept positions equal a plain recomputation (the sinks at both ends, then blending x z(leverage) + z(non-causal
attention) over the tokens between them, blending defaulting to the share of the prompt dropped); through
transformers' generate (AttnkitCache) the same tokens; a budget below the sinks, ``decode_every`` and bad parameters
refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, drive, randn, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("compactor:budget_tokens=200,chunk_size=32"),
                       NEW)


def z(rows):
    """Standardise a list of per-head lists together (mean and unbiased deviation over all their values)."""
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return [[(x - mean) / std for x in row] for row in rows]


def leverage(k_raw, middle, columns, seed):
    """Per kv head: x_i^T (X^T X + 0.01 I)^{-1} x_i over `middle`, X the keys before RoPE centred over `middle`,
    sketched by layer 0's draw of the seeded generator (float64)."""
    kv, d = k_raw.shape[1], k_raw.shape[-1]
    sketch = torch.randn(1, kv, d, columns, generator=torch.Generator().manual_seed(seed)).double() / math.sqrt(columns)
    out = []
    for h in range(kv):
        x = k_raw[0, h, middle].double()
        x = (x - x.mean(dim=0)) @ sketch[0, h]
        inverse = torch.linalg.inv(x.T @ x + 0.01 * torch.eye(columns, dtype=torch.float64))
        out.append([(x[i] @ inverse @ x[i]).item() for i in range(len(middle))])
    return out


def attention(q, k, v, middle, chunk):
    """Per kv head over `middle`: avgpool_3(a * ||v||), a the non-causal softmax weight each key gets from the
    queries of its tile (tiles of `chunk` from the middle's start, the last padded with zero queries and keys)."""
    kv, group = k.shape[1], q.shape[1] // k.shape[1]
    out = []
    for h in range(kv):
        s = []
        for t0 in range(0, len(middle), chunk):
            tile = middle[t0:t0 + chunk]
            pad = chunk - len(tile)
            qs = q[0, h * group:(h + 1) * group, tile].double()
            logits = torch.cat([qs @ k[0, h, tile].double().T, torch.zeros(group, len(tile), pad, dtype=torch.float64)],
                               dim=-1)
            weights = torch.softmax(logits, dim=-1)[..., :len(tile)].sum(dim=1) + pad / chunk  # padding queries
            s += (weights.mean(dim=0) * v[0, h, tile].double().norm(dim=-1)).tolist()
        out.append([(([0.0] + s)[i] + s[i] + (s[1:] + [0.0])[i]) / 3 for i in range(len(s))])
    return out


def compactor_kept(q, k_raw, k, v, n, budget, first, last, chunk, columns, seed, blending):
    middle = list(range(first, n - last))
    weight = 1 - budget / n if blending is None else blending
    lev, att = z(leverage(k_raw, middle, columns, seed)), z(attention(q, k, v, middle, chunk))
    kept = []
    for h in range(k.shape[1]):
        score = {p: weight * lev[h][i] + att[h][i] for i, p in enumerate(middle)}
        best = sorted(middle, key=lambda p: -score[p])[:budget - first - last]
        kept.append(sorted(list(range(first)) + best + list(range(n - last, n))))
    return kept


@pytest.mark.parametrize("budget,first,last,chunk,columns,blending", [
    (18, 8, 4, 16, 6, None), (18, 3, 2, 7, 12, None), (30, 0, 0, 64, 4, None), (18, 8, 4, 16, 6, 2.5),
    (18, 8, 4, 16, 6, 0.0), (12, 8, 4, 16, 6, None)])
def test_kept_positions_equal_a_plain_recomputation(budget, first, last, chunk, columns, blending):
    n, seed = 50, 4
    q, k_raw, v = randn(1, 4, n + 3, 8, seed=40), randn(1, 2, n + 3, 8, seed=41), randn(1, 2, n + 3, 8, seed=42)
    k = ROPE.rotate(k_raw, torch.arange(n + 3))
    method = attnkit.make_method("compactor", budget_tokens=budget, sink_size_start=first, sink_size_end=last,
                                 chunk_size=chunk, sketch_dimension=columns, sketch_seed=seed, blending=blending)
    _, _, held = drive(method, q, k, v, n)
    assert held[0] == compactor_kept(q, k_raw, k, v, n, budget, first, last, chunk, columns, seed, blending)
    assert held[-1] == [row + [n, n + 1, n + 2] for row in held[0]]  # decode appends


def test_the_default_blending_is_the_share_dropped():
    """Half the prompt kept: the default blending is 0.5, the same choice as blending=0.5, another as blending=3."""
    n = 48
    q, k, v = randn(1, 4, n + 1, 8, seed=1), randn(1, 2, n + 1, 8, seed=2), randn(1, 2, n + 1, 8, seed=3)
    kept = {b: drive(attnkit.make_method("compactor", budget=0.5, chunk_size=16, sketch_dimension=4, blending=b),
                     q, k, v, n)[2][0] for b in (None, 0.5, 3.0)}
    assert kept[None] == kept[0.5] != kept[3.0]


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["qwen3"], random_ids(150, seed=3), "compactor",
                                                 {"budget_tokens": 40, "chunk_size": 32}, 16)
    assert max(cache.kept_lengths()) <= 40 + 16


def test_a_budget_below_the_sinks_is_refused(arch_models):
    with pytest.raises(AttnkitError, match="sink_size_start.*10-entry budget") as caught:
        attnkit.generate(arch_models["llama"], random_ids(60, seed=1), "compactor", params={"budget_tokens": 10},
                         max_new_tokens=2)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("compactor:budget=0.5,sink_size_start=-1", "sink_size_start"),
                                       ("compactor:budget=0.5,sink_size_end=1.5", "sink_size_end"),
                                       ("compactor:budget=0.5,chunk_size=0", "chunk_size"),
                                       ("compactor:budget=0.5,sketch_dimension=-4", "sketch_dimension"),
                                       ("compactor:budget=0.5,sketch_seed=x", "sketch_seed"),
                                       ("compactor:budget=0.5,blending=-0.5", "blending"),
                                       ("compactor:budget=0.5,decode_every=2", "decode_every=2")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
