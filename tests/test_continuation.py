"""attnkit.continuation.generate_after: questions fed through a compressed context. Every method at an unlimited
budget gives full attention's tokens (the question continues the cache exactly); a context is prefilled once
however many questions it answers (counted); each question starts from the same compressed state."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError, continuation, forward, runner
from attnkit.continuation import generate_after
from attnkit.session import RowsStep
from helpers import SMALL, random_ids
from test_batch import UNLIMITED

torch.set_num_threads(1)

NEW = 8
CONTEXT = random_ids(110, seed=1).tolist()
QUESTIONS = [random_ids(7, seed=2).tolist(), random_ids(5, seed=3).tolist(), random_ids(7, seed=4).tolist()]


@pytest.fixture(scope="module")
def model():
    return attnkit.load_model(f"random:llama:{SMALL}")


@pytest.fixture(scope="module")
def full_answers(model):
    return [attnkit.generate(model, CONTEXT + q, "full", max_new_tokens=NEW, stop_at_eos=False).token_ids
            for q in QUESTIONS]


@pytest.mark.parametrize("spec", UNLIMITED)
def test_unlimited_budget_equals_full(model, full_answers, spec):
    got = generate_after(model, CONTEXT, QUESTIONS, spec, max_new_tokens=NEW, stop_at_eos=False)
    assert [g.token_ids for g in got] == full_answers, spec
    assert [g.stats.prompt_tokens for g in got] == [len(CONTEXT) + len(q) for q in QUESTIONS]


class Forwards:
    """Tokens through every forward, by phase (a RowsStep's parts counted by their own tokens)."""

    def __init__(self, monkeypatch):
        self.tokens = {"prefill": 0, "decode": 0}
        real = forward.forward_rows

        def counting(model, ids, positions, step, all_positions=False):
            parts = step.parts if isinstance(step, RowsStep) else [(0, ids.shape[0], ids.shape[1], step)]
            for start, end, tokens, s in parts:
                self.tokens[s.phase] += (end - start) * tokens
            return real(model, ids, positions, step, all_positions)

        monkeypatch.setattr(forward, "forward_rows", counting)
        monkeypatch.setattr(runner, "forward_rows", counting)  # the decoding loop's own reference


@pytest.mark.parametrize("spec", ["full", "snapkv:budget=0.3,window_size=8", "h2o:budget=0.3"])
def test_one_context_prefill_for_k_questions(model, monkeypatch, spec):
    counted = Forwards(monkeypatch)
    gens = generate_after(model, CONTEXT, QUESTIONS, spec, max_new_tokens=NEW, stop_at_eos=False)
    assert counted.tokens["prefill"] == len(CONTEXT)  # one context prefill, not one per question
    generated = sum(len(g.token_ids) - 1 for g in gens)  # the last token of each is never fed back
    assert counted.tokens["decode"] == sum(map(len, QUESTIONS)) + generated
    alone = Forwards(monkeypatch)
    for q in QUESTIONS:
        generate_after(model, CONTEXT, [q], spec, max_new_tokens=NEW, stop_at_eos=False)
    assert alone.tokens["prefill"] == len(QUESTIONS) * len(CONTEXT)


@pytest.mark.parametrize("spec", ["snapkv:budget=0.3,window_size=8", "h2o:budget=0.3", "keyformer:budget=0.3",
                                  "streaming:budget=0.3", "snapkv:budget=0.3,window_size=8,head_budgets=adaptive",
                                  "select:filter_layer=0,p_decode=0.5", "gemfilter:filter_layer=0,k=24"])
def test_each_question_starts_from_the_same_compressed_state(model, spec):
    together = generate_after(model, CONTEXT, QUESTIONS, spec, max_new_tokens=NEW, stop_at_eos=False)
    for q, got in zip(QUESTIONS, together):
        alone = generate_after(model, CONTEXT, [q], spec, max_new_tokens=NEW, stop_at_eos=False)[0]
        assert got.token_ids == alone.token_ids, spec
        if len(q) == max(map(len, QUESTIONS)):  # (shorter questions share the capacity reserved for the longest)
            assert (got.stats.peak_kv_bytes, got.stats.final_kv_bytes) == (alone.stats.peak_kv_bytes,
                                                                           alone.stats.final_kv_bytes)


def kept_context(session, n: int) -> list:
    """Per layer and kv head, the sorted positions before `n` the session's cache holds."""
    return [[sorted(p for p in kv.view()[2][0, h].tolist() if p < n) for h in range(kv.view()[2].shape[1])]
            for kv in session.cache.layers]


def test_the_question_is_hidden_from_the_compression(model, monkeypatch):
    """Query-agnostic SnapKV keeps the same context entries whatever the question, exactly those it keeps of the
    context alone; query-aware SnapKV's observation window is the question, so what it keeps depends on it."""
    spec, n = "snapkv:budget_tokens=40,window_size=4", len(CONTEXT)
    agnostic, aware = [], []
    real_feed, real_decode = continuation.feed, runner.decode_groups

    def spy_feed(m, session, ids, start, *more):
        agnostic.append(kept_context(session, n))
        return real_feed(m, session, ids, start, *more)

    def spy_decode(m, method, groups, sampling, max_new):
        aware.append(kept_context(groups[0].session, n))
        return real_decode(m, method, groups, sampling, max_new)

    monkeypatch.setattr(continuation, "feed", spy_feed)
    monkeypatch.setattr(runner, "decode_groups", spy_decode)
    for q in QUESTIONS:
        generate_after(model, CONTEXT, [q], spec, max_new_tokens=2)
        attnkit.generate(model, CONTEXT + q, spec, max_new_tokens=2)
    attnkit.generate(model, CONTEXT, spec, max_new_tokens=2)  # the context alone, no question
    alone = aware.pop()
    assert agnostic == [alone] * len(QUESTIONS)
    assert aware[0] != aware[1] != aware[2] and alone not in aware


def test_batch_of_contexts_equals_each_alone(model):
    other = random_ids(90, seed=9).tolist()
    spec = "h2o:budget=0.4"
    batch = generate_after(model, [CONTEXT, other, CONTEXT], [QUESTIONS, QUESTIONS[:1], QUESTIONS[1:]], spec,
                           max_new_tokens=NEW, stop_at_eos=False)
    for ctx, qs, got in zip([CONTEXT, other, CONTEXT], [QUESTIONS, QUESTIONS[:1], QUESTIONS[1:]], batch):
        alone = generate_after(model, ctx, qs, spec, max_new_tokens=NEW, stop_at_eos=False)
        assert [g.token_ids for g in got] == [g.token_ids for g in alone]


def test_text_and_empty_questions(model):
    context = "def add(a, b):\n    return a + b\n" * 3
    got = generate_after(model, context, ["", "add(1, 2) =="], "full", max_new_tokens=4, stop_at_eos=False)
    plain = attnkit.generate(model, context, "full", max_new_tokens=4, stop_at_eos=False)
    assert got[0].token_ids == plain.token_ids  # an empty question asks nothing: the answer follows the context
    ids = model.tokenizer(context).input_ids + model.tokenizer("add(1, 2) ==", add_special_tokens=False).input_ids
    assert got[1].token_ids == attnkit.generate(model, ids, "full", max_new_tokens=4, stop_at_eos=False).token_ids


@pytest.mark.parametrize("call, message", [
    (lambda m: generate_after(m, [CONTEXT, CONTEXT], [QUESTIONS], "full"), "one list of questions per context"),
    (lambda m: generate_after(m, CONTEXT, [], "full"), "at least one question"),
    (lambda m: generate_after(m, CONTEXT, [[10**6]], "full"), "outside the vocabulary"),
    (lambda m: generate_after(m, CONTEXT * 37, QUESTIONS, "full", max_new_tokens=90), "exceeds the 4096 positions"),
])
def test_bad_input_is_one_line(model, call, message):
    with pytest.raises(AttnkitError, match=message) as err:
        call(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec", UNLIMITED)
def test_teacher_force_at_an_unlimited_budget_equals_full(model, spec):
    """A reference continuation fed one token per decoding step (continuation.teacher_force) gets full attention's
    likelihoods under every method whose budget holds it all; a batch of two prompts as rows."""
    prompts = [CONTEXT, random_ids(len(CONTEXT), seed=5).tolist()]
    conts = [random_ids(24, seed=6).tolist(), random_ids(24, seed=7).tolist()]
    full = continuation.teacher_force(model, prompts, conts, "full")
    got = continuation.teacher_force(model, prompts, conts, spec)
    for g, f in zip(got, full):
        assert torch.allclose(g.nll, f.nll, atol=1e-5), spec
        assert g.stats.new_tokens == 24 and g.stats.prompt_tokens == len(CONTEXT)


def test_teacher_force_takes_the_chunks_a_serving_engine_chose(model):
    """The prompt fed in given chunk lengths (a serving engine's scheduler's) is the prompt fed in those chunks:
    equal chunks match chunk_size; a greedy continuation has a margin of 0 at every token, any other token a negative
    one; chunk lengths that do not sum to the prompt are one line."""
    n = len(CONTEXT)
    cont = attnkit.generate(model, CONTEXT, "snapkv:budget_tokens=64", max_new_tokens=8, stop_at_eos=False,
                            chunk_size=100).token_ids
    by_size = continuation.teacher_force(model, [CONTEXT], [cont], "snapkv:budget_tokens=64", chunk_size=100)[0]
    lengths = [100] * (n // 100) + ([n % 100] if n % 100 else [])
    by_list = continuation.teacher_force(model, [CONTEXT], [cont], "snapkv:budget_tokens=64", chunk_size=lengths)[0]
    assert torch.equal(by_size.nll, by_list.nll) and not by_list.margin.any()
    other = list(cont)
    other[3] = (other[3] + 1) % 4096
    assert float(continuation.teacher_force(model, [CONTEXT], [other], "snapkv:budget_tokens=64")[0].margin[3]) < 0
    with pytest.raises(AttnkitError, match=f"summing to the prompt's {n} tokens") as err:
        continuation.teacher_force(model, [CONTEXT], [cont], "full", chunk_size=[100, n])
    assert "\n" not in str(err.value)
