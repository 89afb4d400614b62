"""``then=`` (kvpress's ComposedPress): a prompt scorer followed by a second one on what the first kept. Equal to
full at unlimited budgets on every architecture, batched; the kept positions equal a plain recomputation of the
two rules in a row (KNorm then KeyDiff, the second's fraction applying to what it receives); SnapKV then KNorm
keeps KNorm's best among what SnapKV alone keeps; through transformers' generate (AttnkitCache) the same tokens;
the vLLM plan holds the final count; bad compositions refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm.plan import check_supported, plan_for
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budgets_equal_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    method = parse_method_spec("snapkv:budget=1.0,window_size=8,then=knorm:budget=1.0")
    assert_equals_full(arch_models[arch], prompts, method, NEW)


def plain_knorm(k, h, held, count):
    norms = {p: math.sqrt(sum(x * x for x in k[0, h, p].double().tolist())) for p in held}
    return sorted(sorted(held, key=lambda p: norms[p])[:count])


def plain_keydiff(k, h, held, count):
    keys = {p: k[0, h, p].double().tolist() for p in held}
    units = {p: [x / math.sqrt(sum(y * y for y in v)) for x in v] for p, v in keys.items()}
    anchor = [sum(units[p][c] for p in held) / len(held) for c in range(len(keys[held[0]]))]
    a_norm = math.sqrt(sum(x * x for x in anchor))
    cos = {p: sum(x * y for x, y in zip(keys[p], anchor)) / (math.sqrt(sum(x * x for x in keys[p])) * a_norm)
           for p in held}
    return sorted(sorted(held, key=lambda p: cos[p])[:count])


@pytest.mark.parametrize("first,second", [(0.5, 0.5), (0.7, 0.3), (0.4, 1.0)])
def test_knorm_then_keydiff_equals_a_plain_recomputation(first, second):
    q, k, v = qkv(60, seed=71)
    prompt_len = 50
    method = parse_method_spec(f"knorm:budget={first},then=keydiff:budget={second}")
    _, _, got = drive(method, q, k, v, prompt_len)
    b1 = math.floor(first * prompt_len + 0.5)
    b2 = min(b1, math.floor(second * b1 + 0.5))  # the second fraction applies to what the first kept
    for h in range(k.shape[1]):
        held = plain_knorm(k, h, list(range(prompt_len)), b1)
        held = plain_keydiff(k, h, held, b2) if b2 < b1 else held
        assert got[0][h] == held
        for step, t in enumerate(range(prompt_len, 60), 1):  # generated tokens are appended
            assert got[step][h] == held + list(range(prompt_len, t + 1))


def test_snapkv_then_knorm_keeps_knorms_best_of_what_snapkv_keeps():
    q, k, v = qkv(56, seed=72)
    prompt_len = 48
    _, _, alone = drive(parse_method_spec("snapkv:budget_tokens=30,window_size=8"), q, k, v, prompt_len)
    _, _, got = drive(parse_method_spec("snapkv:budget_tokens=30,window_size=8,then=knorm:budget_tokens=12"),
                      q, k, v, prompt_len)
    for h in range(k.shape[1]):
        assert got[0][h] == plain_knorm(k, h, alone[0][h], 12)
    assert got[0] != [list(range(prompt_len - 12, prompt_len))] * k.shape[1]  # not only the window survived


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=4), "snapkv",
                                                 {"budget": 0.5, "window_size": 8, "then": "keydiff:budget=0.4"}, 16)
    assert max(cache.kept_lengths()) <= 30 + 16  # round(0.4 x 75) = 30 entries of the prompt per kv head


def test_the_vllm_plan_holds_the_final_count():
    method = parse_method_spec("snapkv:budget=0.5,then=knorm:budget=0.5")
    check_supported(method, "test")
    assert plan_for(method, 1000, 16, 4).kept == 250
    assert plan_for(parse_method_spec("knorm:budget_tokens=300,then=keydiff:budget_tokens=500"), 1000, 16, 4).kept == 300
    assert plan_for(parse_method_spec("knorm:budget=1.0,then=keydiff:budget=1.0"), 1000, 16, 4).kept is None


def test_a_recipe_dict_and_a_method_give_the_same_composition():
    q, k, v = qkv(50, seed=73)
    by_spec = drive(parse_method_spec("knorm:budget_tokens=30,then=keydiff:budget_tokens=10"), q, k, v, 50)[2]
    by_dict = drive(attnkit.make_method("knorm", budget_tokens=30, then={"method": "keydiff",
                                                                          "params": {"budget_tokens": 10}}),
                    q, k, v, 50)[2]
    by_method = drive(attnkit.make_method("knorm", budget_tokens=30,
                                          then=attnkit.make_method("keydiff", budget_tokens=10)), q, k, v, 50)[2]
    assert by_spec == by_dict == by_method
    assert len(by_spec[0][0]) == 10


@pytest.mark.parametrize("spec,words", [
    ("snapkv:budget=0.5,then=snapkv:budget=0.5", "then='snapkv' ranks by statistics"),
    ("knorm:budget=0.5,then=h2o:budget=0.5", "not a prompt scorer"),
    ("knorm:budget=0.5,then=knorm", "needs a cache budget"),
    ("knorm:budget=0.5,decode_every=4,then=knorm:budget=0.5", "decode_every=4"),
    ("knorm:budget=0.5,head_budgets=adaptive,then=knorm:budget=0.5", "head_budgets=adaptive"),
    ("kvzip:budget=0.5,then=knorm:budget=0.5", "shared compaction"),
    ("knorm:budget=0.5,then=nothing", "unknown method 'nothing'"),
])
def test_bad_compositions_are_refused_in_one_line(spec, words):
    with pytest.raises(AttnkitError, match=words) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


def test_a_nested_then_is_refused():
    inner = attnkit.make_method("knorm", budget=0.5, then="keydiff:budget=0.5")
    with pytest.raises(AttnkitError, match="then of its own"):
        attnkit.make_method("snapkv", budget=0.5, then=inner)


def test_ties_of_equal_norms_keep_the_lowest_norms_whichever_tied_entry_stays():
    """kvpress's SnapKV leaves its kept entries in score order, so its KNorm breaks ties of equal norms (repeated tokens
    in the first layer: RoPE keeps a key's norm) by another order than attnkit's position order; either way the kept
    norms are the lowest ones of what SnapKV kept."""
    q, k, v = qkv(56, seed=74)
    k[:, :, 20:40] = k[:, :, 0:20]  # every key of 0..19 repeated: ties of equal norms
    prompt_len = 48
    _, _, alone = drive(parse_method_spec("snapkv:budget_tokens=30,window_size=8"), q, k, v, prompt_len)
    _, _, got = drive(parse_method_spec("snapkv:budget_tokens=30,window_size=8,then=knorm:budget_tokens=12"),
                      q, k, v, prompt_len)
    for h in range(k.shape[1]):
        norms = {p: float(k[0, h, p].norm()) for p in alone[0][h]}
        assert set(got[0][h]) <= set(alone[0][h]) and len(got[0][h]) == 12
        assert sorted(norms[p] for p in got[0][h]) == pytest.approx(sorted(norms.values())[:12])
