"""score_threshold on prompt scorers (kvpress's DMSPress around a ScorerPress; the threshold rule of DMS, Łańcucki et
al. 2025, arXiv 2506.05345, without its trained evictors): ``score_threshold=-inf`` equals full on every architecture,
batched; the kept positions equal a plain recomputation of the rule (after the prompt: the entries scoring at least T
and the last w positions; while decoding with threshold_decode: the entry leaving the window dropped if below T, the
generated tokens scored alone), for knorm and keydiff; through transformers' generate (AttnkitCache) the same tokens;
kvzap's threshold runs on the same functions; bad parameters and vLLM refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Session, Step
from attnkit.vllm.plan import check_supported
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("scorer", ["knorm", "snapkv"])
def test_minus_infinity_equals_full_batched(arch_models, arch, scorer):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(f"{scorer}:score_threshold=-inf"), NEW)


def held(session):
    """Sorted positions each kv head holds (a flat layer split by the head owning each slot; dropped slots left out)."""
    layer = session.cache.layers[0]
    pos = layer.view()[2][0]
    if "head" not in layer.extras:
        return [sorted(row.tolist()) for row in pos]
    owner = layer.extras["head"][0, 0, :layer.length]
    return [sorted(pos[0][owner == h].tolist()) for h in range(2)]  # qkv: 2 kv heads


def drive(method, q, k, v, prompt_len):
    """helpers.drive, reading a flat layer by head: the held positions after the prompt and at every decode step."""
    n, scaling = q.shape[2], q.shape[-1] ** -0.5
    session = Session(method, KVCache(1), 1, prompt_len, n - prompt_len, rope=ROPE)
    p = slice(0, prompt_len)
    Step(session, "prefill", torch.arange(prompt_len)).attention(0, q[:, :, p], k[:, :, p], v[:, :, p], scaling, None)
    steps = [held(session)]
    for t in range(prompt_len, n):
        s = slice(t, t + 1)
        Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s], scaling, None)
        steps.append(held(session))
    return session, None, steps


def norm_score(k, h, p):
    return -math.sqrt(sum(x * x for x in k[0, h, p].double().tolist()))


def diff_scores(k, h, n):
    """KeyDiff's score of the first `n` keys of kv head `h`: minus the cosine to the mean of their unit vectors."""
    rows = [k[0, h, p].double().tolist() for p in range(n)]
    units = [[x / math.sqrt(sum(y * y for y in r)) for x in r] for r in rows]
    anchor = [sum(u[c] for u in units) / n for c in range(len(rows[0]))]
    a = math.sqrt(sum(x * x for x in anchor))
    return [-sum(x * y for x, y in zip(u, anchor)) / a for u in units]


def threshold_reference(k, n, total, t, w, scores, decode):
    """Per step (0: after the prompt; i: what the i-th decode query attends to) and kv head, the held positions:
    after the prompt those scoring >= t or among the last w; at the step of position q (decode), the entries older
    than q - w scoring below t are gone, q itself held."""
    steps, held = [], []
    for h in range(k.shape[1]):
        held.append([p for p in range(n) if scores[h][p] >= t or p >= n - w])
    steps.append([list(row) for row in held])
    for q in range(n, total):
        for h in range(k.shape[1]):
            if decode:
                held[h] = [p for p in held[h] if p >= q - w or scores[h][p] >= t]
            held[h].append(q)
        steps.append([sorted(row) for row in held])
    return steps


@pytest.mark.parametrize("decode", [False, True])
def test_knorm_keeps_what_scores_above_the_threshold(decode):
    q, k, v = qkv(70, seed=81)
    n, w = 50, 6
    scores = [[norm_score(k, h, p) for p in range(70)] for h in range(k.shape[1])]
    t = sorted(scores[0][:n])[n // 2]  # about half the prompt below it
    method = attnkit.make_method("knorm", score_threshold=t, threshold_window=w, threshold_decode=decode)
    _, _, got = drive(method, q, k, v, n)
    want = threshold_reference(k, n, 70, t, w, scores, decode)
    assert got == want
    assert len(got[0][0]) < n  # something was dropped at the prompt
    if decode:
        assert len(got[-1][0]) < len(got[0][0]) + 70 - n  # and while decoding


def test_keydiff_scores_the_prompt_and_appends():
    q, k, v = qkv(60, seed=82)
    n, w, t = 48, 5, -0.1
    scores = [diff_scores(k, h, n) for h in range(k.shape[1])]
    method = attnkit.make_method("keydiff", score_threshold=t, threshold_window=w)
    _, _, got = drive(method, q, k, v, n)
    assert got == threshold_reference(k, n, 60, t, w, scores, False)
    assert 0 < len(got[0][0]) < n and got[0][0] != got[0][1]  # counts per kv head differ


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    params = {"score_threshold": -0.5, "threshold_window": 16, "threshold_decode": True}
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=4), "knorm", params, 16)
    for layer in cache.session_of(0).cache.layers:
        alive = layer.extras["head"][0, 0, :layer.length]
        counts = [int((alive == h).sum()) for h in range(2)]
        assert 16 < min(counts) and max(counts) < 150 and counts[0] != counts[1], counts  # dropped, per kv head


def test_kvzap_threshold_is_the_same_rule():
    import attnkit.methods.kvzap as kvzap
    from attnkit.methods import threshold

    assert kvzap.keep_above is threshold.keep_above and kvzap.decode_step is threshold.decode_step


def test_vllm_refuses_a_threshold_in_one_line():
    check_supported(parse_method_spec("knorm:budget=0.3"), "test")
    with pytest.raises(AttnkitError, match="depends on the scores") as caught:
        check_supported(parse_method_spec("knorm:score_threshold=-2"), "test")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("knorm:score_threshold=-2,budget=0.5", "budget"),
                                       ("knorm:score_threshold=-2,decode_every=4", "decode_every"),
                                       ("knorm:score_threshold=-2,head_budgets=adaptive", "head_budgets"),
                                       ("knorm:score_threshold=-2,positions=reindexed", "positions"),
                                       ("knorm:score_threshold=nan", "score_threshold"),
                                       ("knorm:score_threshold=-2,threshold_window=-1", "threshold_window"),
                                       ("knorm:budget=0.5,threshold_window=8", "threshold_window"),
                                       ("snapkv:score_threshold=0.1,threshold_decode=true", "threshold_decode"),
                                       ("knorm", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("finch:score_threshold=0.1,positions=original", "votes"),
                                       ("compactor:score_threshold=0.1", "blending"),
                                       ("kvzip:score_threshold=0.1", "reconstruction"),
                                       ("kvgrad:score_threshold=0.1", "reconstruction")])
def test_scorers_whose_score_needs_a_budget_refuse_a_threshold(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
    if name == "blending":
        parse_method_spec("compactor:score_threshold=0.1,blending=0.5")


def test_a_sweep_budget_does_not_apply_to_a_threshold():
    from attnkit.recipe.core import as_recipe

    assert as_recipe("knorm", "test").takes_budget()
    assert not as_recipe("knorm:score_threshold=-2", "test").takes_budget()
