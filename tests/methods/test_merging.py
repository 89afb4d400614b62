"""merge=true on the prompt scorers (kvpress's MergingPress, after Token Merging arXiv 2210.09461 and D2O arXiv
2406.13035): equal to full at an unlimited budget on every architecture, batched; the kept positions are the scorer's
own and the kept values equal a plain recomputation of the rule (each evicted value folded into the kept entry of most
similar key, weighted by similarity and value norms, gated by the threshold and the fraction), at the prompt and at
each decode_every re-compression; through transformers' generate (AttnkitCache) the same tokens; bad parameters refused
in one line; vLLM refuses merging while decoding in one line."""

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
    for spec in ("knorm:budget_tokens=200,merge=true", "keydiff:budget_tokens=200,decode_every=3,merge=true,"
                 "similarity_threshold=0.1,merge_fraction=0.5"):
        assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def quantile(xs, q):
    """Linear interpolation between the order statistics (numpy's default, torch.quantile's)."""
    xs = sorted(xs)
    at = q * (len(xs) - 1)
    lo, hi = math.floor(at), math.ceil(at)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def merge_plainly(held, keep, threshold, frac):
    """`held`: {position: (key, value)} of one kv head (lists); `keep`: the kept positions. The kept values after the
    rule, written from its description with Python floats."""
    def norm(x):
        return math.sqrt(sum(a * a for a in x))

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / (max(norm(a), 1e-6) * max(norm(b), 1e-6))

    kept = sorted(keep)
    gone = sorted(set(held) - set(keep))
    best = {}
    for e in gone:
        sims = [cos(held[e][0], held[j][0]) for j in kept]
        top = max(sims)
        best[e] = (top, kept[sims.index(top)])
    ok = {e for e in gone if best[e][0] >= threshold}
    if frac < 1 and ok:
        cut = quantile([best[e][0] if e in ok else -math.inf for e in gone], 1 - frac)
        assert math.isfinite(cut)  # the cases below keep the quantile among similarities that passed
        ok = {e for e in ok if best[e][0] >= cut}
    out = {j: list(held[j][1]) for j in kept}
    weight_sum = dict.fromkeys(kept, 0.0)
    added = {j: [0.0] * len(held[j][1]) for j in kept}
    for e in sorted(ok):
        s, j = best[e]
        ve, vj = held[e][1], held[j][1]
        w = max(s, 0.0) * norm(ve) / (norm(ve) + norm(vj) + 1e-6)
        weight_sum[j] += w
        added[j] = [a + w * x for a, x in zip(added[j], ve)]
    for j in kept:
        if weight_sum[j] > 0:
            out[j] = [(v + a) / (1 + weight_sum[j]) for v, a in zip(held[j][1], added[j])]
    return out


@pytest.mark.parametrize("every,threshold,frac", [(0, 0.0, 1.0), (0, 0.3, 1.0), (0, 0.0, 0.6), (4, 0.1, 0.75)])
def test_kept_positions_and_values_equal_a_plain_recomputation(every, threshold, frac):
    q, k, v = qkv(62, seed=61)
    budget, prompt_len = 16, 40
    spec = dict(budget_tokens=budget, decode_every=every)
    plain_session, _, plain_held = drive(attnkit.make_method("knorm", **spec), q, k, v, prompt_len)
    session, _, got = drive(attnkit.make_method("knorm", merge=True, similarity_threshold=threshold,
                                                merge_fraction=frac, **spec), q, k, v, prompt_len)
    assert got == plain_held  # merging never changes which entries the scorer keeps
    # the plain rule: per kv head, positions -> (key, value), compressed by the lowest key norms, values merged
    kv = k.shape[1]
    held = [{p: (k[0, h, p].double().tolist(), v[0, h, p].double().tolist()) for p in range(prompt_len)}
            for h in range(kv)]

    def compress(h):
        keep = sorted(held[h], key=lambda p: math.sqrt(sum(x * x for x in held[h][p][0])))[:budget]
        merged = merge_plainly(held[h], keep, threshold, frac)
        held[h] = {p: (held[h][p][0], merged[p]) for p in keep}

    for h in range(kv):
        compress(h)
    for i, t in enumerate(range(prompt_len, q.shape[2]), 1):
        for h in range(kv):
            held[h][t] = (k[0, h, t].double().tolist(), v[0, h, t].double().tolist())
            if every and i % every == 0 and len(held[h]) > budget:
                compress(h)
    layer = session.cache.layers[0]
    _, values, positions = layer.view()
    merged_any = False
    for h in range(kv):
        for slot, p in enumerate(positions[0, h].tolist()):
            want = torch.tensor(held[h][p][1], dtype=torch.float64)
            assert torch.allclose(values[0, h, slot].double(), want, atol=1e-5), (h, p)
            merged_any |= not torch.allclose(want, v[0, h, p].double())
    assert merged_any  # the case merged something


def test_merging_changes_the_outputs_only_after_an_eviction(arch_models):
    model = arch_models["llama"]
    ids = random_ids(120, seed=5)
    plain = attnkit.generate(model, ids, "knorm", params={"budget_tokens": 40}, max_new_tokens=4, stop_at_eos=False,
                             keep_logits=True)
    merged = attnkit.generate(model, ids, "knorm", params={"budget_tokens": 40, "merge": True}, max_new_tokens=4,
                              stop_at_eos=False, keep_logits=True)
    assert torch.equal(plain.logits[0], merged.logits[0])  # the prompt's own outputs: nothing merged yet
    assert not torch.equal(plain.logits[1], merged.logits[1])  # the first decode step reads the merged values


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "snapkv",
                                                 {"budget_tokens": 48, "window_size": 8, "decode_every": 8,
                                                  "merge": True, "merge_fraction": 0.5}, 16)
    assert max(cache.kept_lengths()) <= 56


@pytest.mark.parametrize("spec,name", [("knorm:budget=0.5,merge=2", "merge"),
                                       ("knorm:budget=0.5,merge=true,similarity_threshold=1.5", "similarity_threshold"),
                                       ("knorm:budget=0.5,merge=true,merge_fraction=0", "merge_fraction"),
                                       ("knorm:budget=0.5,merge_fraction=0.5", "merge=true only"),
                                       ("knorm:budget=0.5,merge=true,head_budgets=adaptive", "head_budgets"),
                                       ("kvzap:config={kvzap},threshold=-3,merge=true", "threshold")])
def test_bad_parameters_are_refused_in_one_line(spec, name, kvzap_configs):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec.format(kvzap=kvzap_configs["llama"]))
    assert "\n" not in str(caught.value)


def test_vllm_refuses_merging_while_decoding_in_one_line():
    check_supported(parse_method_spec("knorm:budget=0.3,merge=true"), "recipe")  # the prompt's merge: written back
    with pytest.raises(AttnkitError, match="merge=true with decode_every") as caught:
        check_supported(parse_method_spec("knorm:budget=0.3,merge=true,decode_every=4"), "recipe")
    assert "\n" not in str(caught.value)
