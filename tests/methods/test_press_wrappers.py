"""kvpress's wrapper presses as prompt-scorer parameters (:mod:`attnkit.methods.wrappers`): ``segment_length``
(ChunkPress), ``block_size`` (BlockPress) and ``decode_fraction`` (CompressionRatioDecodingPress). Each: equal to full
at an unlimited budget on every architecture, batched; the kept positions (and, for blocks, the prompt's outputs) equal
a plain recomputation of the rule; through transformers' generate (AttnkitCache) the same tokens; bad parameters
refused in one line; vLLM's plan counts what decode_fraction holds, and vLLM refuses block_size in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.methods.wrappers import keep_segments
from helpers import (
    assert_attnkit_cache_equals_generate,
    assert_equals_full,
    drive,
    per_token_bytes,
    qkv,
    randn,
    random_ids,
)

torch.set_num_threads(1)

NEW = 10
KV = 2


def norm_scores(k, head):
    return [-float(x) for x in k[0, head].double().norm(dim=-1)]


# ---- segment_length (ChunkPress) ------------------------------------------------------------------------------------
def segment_choice(score, protected, positions, budget, length):
    """Each segment's share of the unprotected budget by largest remainders (ties to the earlier segment), its best
    entries by `score`, plus the protected entries: written out with Python integers."""
    free = [p for p in positions if p not in protected]
    slots = budget - len(protected)
    segments = sorted({p // length for p in positions})
    members = {j: [p for p in free if p // length == j] for j in segments}
    quota = {j: len(members[j]) * slots // len(free) for j in segments}
    remainder = {j: len(members[j]) * slots % len(free) for j in segments}
    for j in sorted(segments, key=lambda j: (-remainder[j], j))[:slots - sum(quota.values())]:
        quota[j] += 1
    kept = set(protected)
    for j in segments:
        kept |= set(sorted(members[j], key=lambda p: -score[p])[:quota[j]])
    return sorted(kept)


@pytest.mark.parametrize("length,budget", [(10, 14), (16, 9), (7, 30), (50, 12)])
def test_segments_keep_their_share_by_largest_remainders(length, budget):
    n = 47
    rank = randn(1, KV, n, seed=length + budget)
    protect = torch.zeros(1, KV, n, dtype=torch.bool)
    protect[:, :, -3:] = True  # an observation window
    protect[:, 1, 5] = True
    positions = torch.arange(n).expand(1, KV, n)
    got = keep_segments(rank, protect, positions, budget, length)
    for h in range(KV):
        protected = set(torch.nonzero(protect[0, h]).flatten().tolist())
        want = segment_choice(rank[0, h].tolist(), protected, list(range(n)), budget, length)
        assert got[0, h].tolist() == want


def test_knorm_segments_equal_a_plain_recomputation_and_differ_from_plain_knorm():
    q, k, v = qkv(56, seed=41)
    budget, prompt_len, length = 15, 50, 12
    _, _, got = drive(attnkit.make_method("knorm", budget_tokens=budget, segment_length=length), q, k, v, prompt_len)
    want = [segment_choice(norm_scores(k, h), set(), list(range(prompt_len)), budget, length) for h in range(KV)]
    assert got[0] == want
    assert got[-1] == [row + list(range(prompt_len, 56)) for row in want]  # generated tokens are appended
    plain = drive(attnkit.make_method("knorm", budget_tokens=budget), q, k, v, prompt_len)[2]
    assert plain[0] != got[0]


# ---- block_size (BlockPress) -----------------------------------------------------------------------------------------
def blockwise_reference(q, k, v, n, budget, size):
    """The prompt in blocks (the first `budget` positions, then `size` each): every query attends densely over the
    entries held and its block's tokens up to itself; after a block (but the prompt's last) each kv head keeps its
    `budget` keys of lowest norm; after the last, too. Outputs [hq, n, d] and the held positions per kv head."""
    hq, d = q.shape[1], q.shape[-1]
    g = hq // KV
    held = [[] for _ in range(KV)]
    out = torch.zeros(hq, n, d, dtype=torch.float64)
    bounds = [0, min(budget, n)]
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + size))
    for start, end in zip(bounds, bounds[1:]):
        for t in range(start, end):
            for h in range(hq):
                keys = held[h // g] + list(range(start, t + 1))
                logits = torch.stack([q[0, h, t].double() @ k[0, h // g, p].double() for p in keys]) * d ** -0.5
                w = torch.softmax(logits, dim=0)
                out[h, t] = sum(w[i] * v[0, h // g, p].double() for i, p in enumerate(keys))
        for kv in range(KV):
            score = norm_scores(k, kv)
            candidates = held[kv] + list(range(start, end))
            held[kv] = sorted(sorted(candidates, key=lambda p: -score[p])[:budget])
    return out, held


@pytest.mark.parametrize("budget,size", [(12, 5), (10, 16), (20, 3)])
def test_blocks_attend_over_what_is_held_and_compress_after_each(budget, size):
    q, k, v = qkv(47, seed=43)
    n = 47
    method = attnkit.make_method("knorm", budget_tokens=budget, block_size=size)
    session, _, got = drive(method, q, k, v, n)
    want_out, want_held = blockwise_reference(q, k, v, n, budget, size)
    assert got[0] == want_held
    # the prompt's outputs: driven again to read them (drive returns the decode outputs only)
    from attnkit.cache import KVCache
    from attnkit.session import Session, Step
    again = Session(method, KVCache(1), 1, n, 0)
    out = Step(again, "prefill", torch.arange(n)).attention(0, q, k, v, q.shape[-1] ** -0.5, None)
    assert torch.allclose(out[0].double(), want_out, atol=1e-5)
    whole = Session(attnkit.make_method("knorm", budget_tokens=budget), KVCache(1), 1, n, 0)
    dense = Step(whole, "prefill", torch.arange(n)).attention(0, q, k, v, q.shape[-1] ** -0.5, None)
    assert not torch.allclose(dense, out, atol=1e-3)  # later blocks saw a compressed cache


def test_blocks_do_not_depend_on_the_hosts_chunks_and_bound_the_prefills_peak(arch_models):
    model = arch_models["llama"]
    ids = random_ids(150, seed=8)
    spec = "snapkv:budget_tokens=40,window_size=8,block_size=24"
    runs = [attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, chunk_size=c)
            for c in (None, 7, 64)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    plain = attnkit.generate(model, ids, "snapkv:budget_tokens=40,window_size=8", max_new_tokens=NEW,
                             stop_at_eos=False)
    layers = model.geometry.n_layers
    per_layer = per_token_bytes(model) // layers
    assert runs[0].stats.peak_kv_bytes <= layers * (40 + 24) * per_layer < plain.stats.peak_kv_bytes


# ---- decode_fraction (CompressionRatioDecodingPress) ----------------------------------------------------------------
@pytest.mark.parametrize("every,share", [(3, 0.3), (1, 0.25), (5, 0.5)])
def test_recompressions_keep_a_share_of_the_tokens_seen(every, share):
    from attnkit.vllm.plan import plan_for
    q, k, v = qkv(70, seed=44)
    budget, prompt_len = 20, 45
    method = attnkit.make_method("knorm", budget_tokens=budget, decode_every=every, decode_fraction=share)
    _, _, got = drive(method, q, k, v, prompt_len)
    held = [sorted(sorted(range(prompt_len), key=lambda p, h=h: -norm_scores(k, h)[p])[:budget]) for h in range(KV)]
    want = [held]
    for i, t in enumerate(range(prompt_len, 70), 1):
        held = [row + [t] for row in held]
        target = max(1, int(share * (t + 1)))
        if i % every == 0 and len(held[0]) > target:
            held = [sorted(sorted(row, key=lambda p, h=h: -norm_scores(k, h)[p])[:target]) for h, row in
                    enumerate(held)]
        want.append(held)
    assert got == want
    assert {len(step[0]) for step in want[1:]} - set(range(budget, budget + every))  # the share, not back to B
    plan = plan_for(method, prompt_len, 70 - prompt_len, 1)
    assert [plan.held(prompt_len + g) for g in range(70 - prompt_len)] == [len(step[0]) for step in want[:-1]]


# ---- every host, every architecture ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["knorm:budget_tokens=200,segment_length=32",
                                  "snapkv:budget_tokens=200,window_size=8,block_size=16",
                                  "keydiff:budget=1.0,decode_every=4,decode_fraction=1.0"])
def test_unlimited_budget_equals_full_batched(arch_models, arch, spec):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


@pytest.mark.parametrize("name,params", [
    ("knorm", {"budget_tokens": 40, "segment_length": 30}),
    ("snapkv", {"budget_tokens": 40, "window_size": 8, "block_size": 20}),
    ("keydiff", {"budget_tokens": 40, "decode_every": 3, "decode_fraction": 0.3}),
])
def test_through_transformers_generate(arch_models, name, params):
    assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(120, seed=6), name, params, 10)


@pytest.mark.parametrize("spec,match", [
    ("knorm:budget_tokens=16,segment_length=-1", "segment_length must be"),
    ("knorm:budget_tokens=16,segment_length=8,decode_every=4", "decode_every=4"),
    ("knorm:budget_tokens=16,segment_length=8,chunk_length=4", "chunk_length=4"),
    ("knorm:budget_tokens=16,segment_length=8,head_budgets=adaptive", "head_budgets='adaptive'"),
    ("knorm:budget_tokens=16,block_size=8,head_budgets=adaptive", "head_budgets=adaptive"),
    ("observed_attention:budget_tokens=16,block_size=8", "whole prompt"),
    ("knorm:budget_tokens=16,decode_fraction=0.5", "give decode_every"),
    ("knorm:budget_tokens=16,decode_every=4,decode_fraction=0", "decode_fraction must be"),
    ("knorm:budget_tokens=16,decode_every=4,decode_fraction=1.5", "decode_fraction must be"),
])
def test_bad_parameters_are_refused_in_one_line(spec, match):
    with pytest.raises(AttnkitError, match=match) as err:
        parse_method_spec(spec)
    assert "\n" not in str(err.value)


def test_vllm_refuses_blocks_in_one_line_and_plans_the_others():
    from attnkit.vllm.plan import check_supported, plan_for
    with pytest.raises(AttnkitError, match="block_size=64") as err:
        check_supported(parse_method_spec("knorm:budget=0.3,block_size=64"), "vllm")
    assert "\n" not in str(err.value)
    check_supported(parse_method_spec("knorm:budget=0.3,segment_length=64"), "vllm")
    plan = plan_for(parse_method_spec("knorm:budget_tokens=40,decode_every=4,decode_fraction=0.25"), 80, 40, 2)
    assert plan.live and [plan.held(c) for c in (80, 83, 84, 87, 88, 119)] == [40, 43, 21, 24, 22, 32]
