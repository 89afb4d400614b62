"""finch (FINCH, Corallo and Papotti 2024; kvpress's FinchPress): equal to full at an unlimited budget on every
architecture, batched; the kept positions equal a plain recomputation of the question's (position-weighted)
attention, with and without the normalisation; with positions=reindexed the kept keys are the same entries, and a
decode step attends exactly as over a cache whose kept keys sit at 0..B-1 and whose query continues at B (kvpress's
re-rotated cache), recomputed from the keys before RoPE; through transformers' generate (AttnkitCache) the same
tokens; bad parameters refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm.plan import check_supported
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_unlimited_budget_equals_full_batched(arch_models, arch, positions):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    spec = f"finch:budget_tokens=200,question_tokens=8,positions={positions}"
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def finch_choose(q, k, prompt_len, budget, question, normalize):
    """Per kv head, the question's positions and the `budget - question` context positions of highest score: each
    question query's causal softmax row over the prompt (times its position with `normalize`), averaged over the
    question's queries and the kv group's query heads."""
    g = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    context = prompt_len - question
    kept = []
    for h in range(k.shape[1]):
        score = [0.0] * context
        for head in range(h * g, (h + 1) * g):
            for i in range(context, prompt_len):
                logits = [float(q[0, head, i].double() @ k[0, h, j].double()) * scale for j in range(i + 1)]
                top = max(logits)
                e = [pow(2.718281828459045, x - top) for x in logits]
                for j in range(context):
                    score[j] += e[j] / sum(e) * (i if normalize else 1) / question / g
        best = sorted(range(context), key=lambda j: -score[j])[:budget - question]
        kept.append(sorted(best) + list(range(context, prompt_len)))
    return kept


@pytest.mark.parametrize("normalize", [True, False])
def test_kept_positions_equal_a_plain_recomputation(normalize):
    q, k, v = qkv(56, seed=71)
    budget, prompt_len, question = 20, 48, 6
    method = attnkit.make_method("finch", budget_tokens=budget, question_tokens=question, normalize=normalize,
                                 positions="original")
    _, _, got = drive(method, q, k, v, prompt_len)
    want = finch_choose(q, k, prompt_len, budget, question, normalize)
    assert got[0] == want
    for t, step in enumerate(got[1:], prompt_len):  # generated tokens are appended
        assert step == [row + list(range(prompt_len, t + 1)) for row in want]


def test_the_normalisation_changes_the_choice():
    q, k, _ = qkv(48, seed=71)
    assert finch_choose(q, k, 48, 20, 6, True) != finch_choose(q, k, 48, 20, 6, False)


def test_reindexed_attends_as_kvpress_rerotated_cache():
    """positions=reindexed keeps the entries of positions=original; every decode output equals attention over the
    kept keys rotated from before RoPE to 0..B-1 and the generated ones after them, the query at B + i."""
    q_raw, k_raw, v = qkv(58, seed=72)
    n, budget, question = 46, 18, 5
    at = torch.arange(q_raw.shape[2])
    q, k = ROPE.rotate(q_raw, at), ROPE.rotate(k_raw, at)
    original = attnkit.make_method("finch", budget_tokens=budget, question_tokens=question, positions="original")
    kept = drive(original, q, k, v, n)[2][0]
    reindexed = attnkit.make_method("finch", budget_tokens=budget, question_tokens=question)
    session, outs, held = drive(reindexed, q, k, v, n)
    assert held[0] == [list(range(n - budget, n))] * k.shape[1]  # relabelled: the prompt's last B positions
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    for i, out in enumerate(outs):
        for head in range(q.shape[1]):
            entries = torch.tensor(kept[head // g] + list(range(n, n + i + 1)))
            keys = ROPE.rotate(k_raw[0, head // g, entries], torch.arange(len(entries)))
            query = ROPE.rotate(q_raw[0, head, n + i:n + i + 1], budget + i)
            want = torch.softmax(query @ keys.T * scale, dim=-1) @ v[0, head // g, entries]
            torch.testing.assert_close(out[0, head], want, atol=1e-5, rtol=1e-5)


def test_a_prompt_no_longer_than_the_question_is_kept_or_refused():
    q, k, v = qkv(30, seed=73)
    method = attnkit.make_method("finch", budget_tokens=24, question_tokens=24)
    assert drive(method, q, k, v, 20)[2][0] == [list(range(20))] * 2  # all question, within the budget
    with pytest.raises(AttnkitError, match="does not fit"):
        drive(attnkit.make_method("finch", budget=0.5, question_tokens=24), q, k, v, 20)


@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models, positions):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "finch",
                                                 {"budget_tokens": 40, "question_tokens": 12,
                                                  "positions": positions}, 16)
    assert max(cache.kept_lengths()) <= 40 + 16


def test_the_vllm_host_runs_original_positions_and_refuses_reindexed_in_one_line():
    check_supported(parse_method_spec("finch:budget=0.3,positions=original"), "test")
    with pytest.raises(AttnkitError, match="rewrites keys") as caught:
        check_supported(parse_method_spec("finch:budget=0.3"), "test")
    assert "\n" not in str(caught.value)


def test_reindexed_is_refused_with_kivi():
    with pytest.raises(AttnkitError, match="positions=original"):
        parse_method_spec("finch:budget=0.5+kivi")
    parse_method_spec("finch:budget=0.5,positions=original+kivi")


@pytest.mark.parametrize("spec,name", [("finch:budget=0.5,question_tokens=0", "question_tokens"),
                                       ("finch:budget=0.5,normalize=2", "normalize"),
                                       ("finch:budget=0.5,positions=new", "positions"),
                                       ("finch:budget=0.5,decode_every=4", "decode_every"),
                                       ("finch:budget_tokens=16,question_tokens=32", "question_tokens"),
                                       ("finch:budget=0.5,head_budgets=adaptive", "head_budgets")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
