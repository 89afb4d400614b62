"""``low_entropy_chunk_length`` (kvpress's EntropyGatedChunkKVPress: ChunkKV, arXiv 2502.00299, with an entropy
gate) on the prompt scorers: exactly full at an unlimited budget on every architecture, batched; the kept positions
equal a plain recomputation of the gated rule (chunk means and entropies, lower medians, spiky chunks cut to their
best members, the budget topped up by score) at the prompt and at every ``decode_every`` re-compression; protected
entries stay; it changes ChunkKV's choice; through transformers' generate (AttnkitCache) the same tokens; bad values
refused in one line."""

import math

import pytest
import torch

from attnkit import AttnkitError
from attnkit.methods.entropy_chunks import keep_entropy_gated_chunks
from attnkit.methods.spec import parse_method_spec
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 8


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["knorm:budget_tokens=200,chunk_length=8,low_entropy_chunk_length=2",
                                  "snapkv:budget_tokens=200,window_size=8,chunk_length=10,low_entropy_chunk_length=4"])
def test_unlimited_budget_equals_full_batched(arch_models, arch, spec):
    prompts = [random_ids(n, seed=n).tolist() for n in (120, 77, 120)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def entropy(values):
    """A chunk's normalised entropy: scores shifted to be non-negative, normalised to sum to one (+1e-8)."""
    if len(values) == 1:
        return 0.0
    low = min(min(values), 0.0)
    shifted = [x - low for x in values]
    total = sum(shifted) + 1e-8
    h = -sum(x / total * math.log(x / total + 1e-8) for x in shifted)
    return min(1.0, max(0.0, h / math.log(len(values))))


def gated_reference(scores: dict, protected: set, budget: int, c: int, k: int) -> list[int]:
    """The protected positions, then chunks (positions // c; those holding a protected position first, then by mean
    score, ties to the earlier chunk) giving their members by score, a spiky chunk (mean at or above the lower median
    of the means, entropy below the lower median of the entropies; never one holding a protected position) at most
    `k` of them, until `budget`; then the best-scored positions left."""
    chunks = {}
    for p in sorted(scores):
        chunks.setdefault(p // c, []).append(p)
    guarded = {j for j, m in chunks.items() if protected & set(m)}
    mean = {j: sum(scores[p] for p in m) / len(m) for j, m in chunks.items()}
    ent = {j: entropy([scores[p] for p in m]) for j, m in chunks.items()}

    def median(xs):
        return sorted(xs)[(len(xs) - 1) // 2]

    # a chunk holding a protected position counts as the highest mean and an entropy of 1 in the medians
    mean_median = median([math.inf if j in guarded else x for j, x in mean.items()])
    ent_median = median([1.0 if j in guarded else x for j, x in ent.items()])
    kept = list(protected)
    for j in sorted(chunks, key=lambda j: (j not in guarded, -mean[j], j)):
        spiky = j not in guarded and mean[j] >= mean_median and ent[j] < ent_median
        for p in sorted(chunks[j], key=lambda p: -scores[p])[:k if spiky else len(chunks[j])]:
            if len(kept) < budget and p not in kept:
                kept.append(p)
    for p in sorted(scores, key=lambda p: -scores[p]):
        if len(kept) < budget and p not in kept:
            kept.append(p)
    return sorted(kept)


@pytest.mark.parametrize("c,k,every", [(4, 1, 0), (7, 2, 0), (6, 3, 4), (5, 1, 3)])
def test_prompt_and_recompressions_equal_a_plain_recomputation(c, k, every):
    """knorm (score ``-||k||``, all negative: the entropy's shift is exercised) on hand-made keys: after the prompt
    and after every re-compression each kv head holds what :func:`gated_reference` keeps from what it held."""
    prompt, budget, new = 60, 22, 12
    q, keys, v = qkv(prompt + new, seed=91)
    spec = f"knorm:budget_tokens={budget},chunk_length={c},low_entropy_chunk_length={k},decode_every={every}"
    _, _, held = drive(parse_method_spec(spec), q, keys, v, prompt)
    for h in range(keys.shape[1]):
        score = {p: -keys[0, h, p].double().norm().item() for p in range(prompt + new)}
        before = list(range(prompt))
        for step, now in enumerate(held):
            compressed = step == 0 or (every and step % every == 0)
            want = gated_reference({p: score[p] for p in before}, set(), budget, c, k) if compressed else before
            assert now[h] == want, (step, h)
            before = now[h] + [prompt + step]


@pytest.mark.parametrize("c,k,protected", [(6, 2, set(range(60, 66))), (5, 1, {0, 1, 2, 62, 63, 64, 65}),
                                           (8, 3, set())])
def test_the_rule_with_protected_entries_equals_a_plain_recomputation(c, k, protected):
    """The selection alone on random scores (some negative) with protected positions: the chunks holding them first
    and whole, counted at the top of the medians, the rest gated."""
    rank = torch.randn(1, 2, 66, generator=torch.Generator().manual_seed(93)) + 0.5
    protect = torch.zeros(1, 2, 66, dtype=torch.bool)
    protect[..., sorted(protected)] = True
    got = keep_entropy_gated_chunks(rank, protect if protected else None, torch.arange(66).expand(1, 2, 66), 25, c, k)
    for h in range(2):
        scores = {p: rank[0, h, p].item() for p in range(66)}
        assert got[0, h].tolist() == gated_reference(scores, protected, 25, c, k)


def test_the_gate_changes_chunkkvs_choice_and_keeps_the_protected_entries():
    prompt, budget, c, k = 64, 24, 8, 2
    q, keys, v = qkv(prompt + 2, seed=92)
    chunked = drive(parse_method_spec(f"knorm:budget_tokens={budget},chunk_length={c}"), q, keys, v, prompt)[2][0]
    gated = drive(parse_method_spec(f"knorm:budget_tokens={budget},chunk_length={c},low_entropy_chunk_length={k}"),
                  q, keys, v, prompt)[2][0]
    assert gated != chunked and all(len(row) == budget for row in gated)
    snap = drive(parse_method_spec(f"snapkv:budget_tokens={budget},window_size=6,chunk_length={c},"
                                   f"low_entropy_chunk_length={k}"), q, keys, v, prompt)[2][0]
    for row in snap:  # the window (58-63) and the rest of its chunk (56-63) stay
        assert len(row) == budget and set(range(56, prompt)) <= set(row)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "keydiff",
                                                 {"budget_tokens": 40, "chunk_length": 8,
                                                  "low_entropy_chunk_length": 3, "decode_every": 5}, 16)
    assert max(cache.kept_lengths()) <= 45


@pytest.mark.parametrize("spec,match", [
    ("knorm:budget=0.5,low_entropy_chunk_length=2", "give chunk_length too"),
    ("knorm:budget=0.5,chunk_length=4,low_entropy_chunk_length=4", "must be smaller than chunk_length=4"),
    ("knorm:budget=0.5,chunk_length=4,low_entropy_chunk_length=-1", "low_entropy_chunk_length must be"),
    ("snapkv:budget=0.5,chunk_length=8,low_entropy_chunk_length=2.5", "low_entropy_chunk_length")])
def test_bad_values_are_refused_in_one_line(spec, match):
    with pytest.raises(AttnkitError, match=match) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
