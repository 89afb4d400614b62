"""cam (CaM, Zhang et al., ICML 2024; kvpress's CAMPress): equal to full at an unlimited budget on every architecture,
batched; the kept positions and the merged values equal a plain recomputation of the rule (decode attention summed per
entry, every N tokens back to B entries by the mean score over kv heads, the best-scored evicted entries' values
added to the next kept entries with Bernoulli probability min(1, own attention / window mean)); an entry is merged
shared out whole; through transformers' generate (AttnkitCache) the same tokens; bad parameters
refused in one line; vLLM refuses it in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm.plan import check_supported
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("cam:budget_tokens=200,decode_every=3"), NEW)


def cam_plainly(q, k, v, prompt_len, budget, every, m, seed, scorer):
    """The rule written with Python lists: per step, which positions are held and each held entry's value per kv
    head. Scores: ``scorer(key)`` per head, averaged over the kv heads."""
    hq, kv, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    g = hq // kv
    key = {(h, p): k[0, h, p].double().tolist() for h in range(kv) for p in range(n)}
    val = {(h, p): v[0, h, p].double().tolist() for h in range(kv) for p in range(n)}
    held = list(range(prompt_len))
    attn = {(h, p): 0.0 for h in range(kv) for p in range(n)}
    gen = torch.Generator().manual_seed(seed)
    since, steps = 0, [list(held)]
    for t in range(prompt_len, n):
        held.append(t)
        for hh in range(hq):  # the query's attention over the held entries, averaged over its kv group
            h = hh // g
            logits = [sum(a * b for a, b in zip(q[0, hh, t].double().tolist(), key[h, p])) / math.sqrt(d) for p in held]
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            for p, x in zip(held, w):
                attn[h, p] += x / sum(w) / g
        steps.append(list(held))  # what the step attended to
        since += 1
        if since < every or len(held) <= budget:
            continue
        score = {p: sum(scorer(key[h, p]) for h in range(kv)) / kv for p in held}
        kept = sorted(sorted(held, key=lambda p: -score[p])[:budget])
        gone = [p for p in held if p not in kept]
        merging = sorted(sorted(gone, key=lambda p: (-score[p], -p))[:since])
        windows = [[j for j in kept if j > p][:m] for p in merging]
        probs = []
        for h in range(kv):
            row = []
            for p, win in zip(merging, windows):
                mean = sum(attn[h, j] for j in win) / max(1, len(win))
                r = attn[h, p] / mean if mean > 0 else (1.0 if attn[h, p] > 0 else 0.0)
                row.append(min(1.0, max(0.0, r)))
            probs.append(row)
        draws = torch.bernoulli(torch.tensor([probs], dtype=torch.float32), generator=gen)[0].tolist()
        for h in range(kv):
            added = {j: [0.0] * d for j in kept}
            for i, (p, win) in enumerate(zip(merging, windows)):
                for j in win:
                    added[j] = [a + draws[h][i] * x / len(win) for a, x in zip(added[j], val[h, p])]
            for j in kept:
                val[h, j] = [x + a for x, a in zip(val[h, j], added[j])]
        held, since = kept, 0
        steps[-1] = list(held)
    return steps, {(h, p): val[h, p] for h in range(kv) for p in held}


def minus_norm(x):
    return -math.sqrt(sum(a * a for a in x))


@pytest.mark.parametrize("every,m,seed", [(1, 3, 0), (4, 5, 1), (6, 32, 2)])
def test_kept_positions_and_values_equal_a_plain_recomputation(every, m, seed):
    q, k, v = qkv(64, seed=71)
    q = q * 3  # sharper attention: the probabilities spread over (0, 1]
    budget, prompt_len = 18, 30
    method = attnkit.make_method("cam", budget_tokens=budget, decode_every=every, merge_budget=m, seed=seed)
    session, _, got = drive(method, q, k, v, prompt_len)
    steps, values = cam_plainly(q, k, v, prompt_len, budget, every, m, seed, minus_norm)
    assert got == [[s] * k.shape[1] for s in steps]
    _, held_values, positions = session.cache.layers[0].view()
    changed = 0
    for h in range(k.shape[1]):
        for slot, p in enumerate(positions[0, h].tolist()):
            want = torch.tensor(values[h, p], dtype=torch.float64)
            assert torch.allclose(held_values[0, h, slot].double(), want, atol=1e-5), (h, p)
            changed += not torch.allclose(want, v[0, h, p].double())
    assert changed  # some values were merged


def test_a_merged_value_is_shared_out_whole(monkeypatch):
    """Every value (1, 0, ...): each candidate drawn 1 hands exactly its value, split over its window, so the kept
    entries' first channel sums to their count plus the draws of 1 (candidates with an empty window hand nothing)."""
    import attnkit.methods.cam as cam

    drawn = []

    def recording(run, p, seed):
        out = original(run, p, seed)
        drawn.append(out)
        return out

    original = cam.draw
    monkeypatch.setattr(cam, "draw", recording)
    q, k, v = qkv(34, seed=72)
    v = torch.zeros_like(v)
    v[..., 0] = 1.0
    method = attnkit.make_method("cam", budget_tokens=12, decode_every=4, merge_budget=40, seed=3)
    session, _, held = drive(method, q * 3, k, v, 30)  # one compression, after the 4th token
    extra = session.cache.layers[0].view()[1][0, :, :, 0].sum(dim=-1) - len(held[-1][0])
    assert len(drawn) == 1 and drawn[0].shape[-1] == 4
    assert torch.allclose(extra, extra.round(), atol=1e-5)  # whole values, split over their windows
    assert bool((extra >= 1).any()) and torch.all(extra <= drawn[0][0].sum(dim=-1) + 1e-5)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "cam",
                                                 {"budget_tokens": 48, "decode_every": 4, "merge_budget": 8}, 16)
    assert max(cache.kept_lengths()) <= 48 + 4


@pytest.mark.parametrize("spec,name", [("cam:budget=0.5,scorer=snapkv", "scorer"),
                                       ("cam:budget=0.5,decode_every=0", "decode_every"),
                                       ("cam:budget=0.5,merge_budget=0", "merge_budget"),
                                       ("cam:budget=0.5,seed=-1", "seed"),
                                       ("cam:decode_every=4", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


def test_vllm_refuses_it_in_one_line():
    with pytest.raises(AttnkitError, match="merges evicted values into kept entries while decoding") as caught:
        check_supported(parse_method_spec("cam:budget=0.3,decode_every=8"), "recipe")
    assert "\n" not in str(caught.value)
