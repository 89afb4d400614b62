"""The speculative decoding loop (attnkit.speculative.generate) end to end on small random models: sampling
matches the target's distribution (chi-square), greedy decoding is token for token the plain output,
for every draft source; stop strings, EOS, streaming and seeds behave as in plain generation."""

import dataclasses

import pytest
import torch

import attnkit
from attnkit.sampling import SamplingConfig
from attnkit.speculative import DraftSource, ModelDraft, PromptLookupDraft, Proposal, speculative_generate
from helpers import (
    SIGNIFICANCE,
    chi_square_p_value,
    random_ids,
    repetitive_prompt,
    sampled_runs,
    sharpened,
    target_joint,
)


@pytest.fixture(scope="module")
def target_and_draft():
    # the draft is the target with a perturbed head: a quarter to a half of its drafts are accepted, so
    # rejections resample from a residual that differs from q
    return sharpened(0), sharpened(0, noise=0.3)


@pytest.mark.parametrize("source", ["draft_model", "self", "self+lookup", "draft_model+confidence"])
def test_end_to_end_sampling_matches_target_chi_square(target_and_draft, source, monkeypatch):
    """The first three of four tokens generated with speculation (top-k 3, gamma 3: the first round
    drafts 2) over 1000 seeds (drawn side by side as one batch, the first rows checked against single-prompt
    calls: helpers.sampled_runs) match the target's exact joint distribution (27 cells), computed from the
    target's logits. ``self+lookup``: the draft judges prompt-lookup guesses (a prompt of all-distinct
    tokens: every lookup succeeds). ``draft_model+confidence``: drafting stops after a token the draft
    gave less than probability 0.6 (which happens in most rounds here)."""
    target, draft = target_and_draft
    prompt = random_ids(24, seed=5)
    kw = dict(do_sample=True, top_k=3, temperature=1.0)
    config = SamplingConfig(**kw)
    spec = {"draft_model": draft, "self": "streaming:budget_tokens=8,sinks=2",
            "self+lookup": "snapkv:budget_tokens=8,window_size=2", "draft_model+confidence": draft}[source]
    lookup = source == "self+lookup"
    confidence = 0.6 if source.endswith("+confidence") else None
    stops = []
    original_unsure = ModelDraft._unsure

    def recording_unsure(self, *args):
        stops.append(original_unsure(self, *args))
        return stops[-1]

    monkeypatch.setattr(ModelDraft, "_unsure", recording_unsure)
    if lookup:
        prompt = torch.randperm(256, generator=torch.Generator().manual_seed(9)) + 3
    judged = []
    original = ModelDraft._judge
    monkeypatch.setattr(ModelDraft, "_judge", lambda self, *a: judged.append(1) or original(self, *a))
    runs, counts = 1000, {}
    out = sampled_runs(target, prompt, source.split("+")[0], runs, draft=spec, draft_lookup=lookup,
                       draft_confidence=confidence, gamma=3, max_new_tokens=4, stop_at_eos=False, **kw)
    for g in out:
        counts[tuple(g.token_ids[:3])] = counts.get(tuple(g.token_ids[:3]), 0) + 1
    assert (len(judged) > runs / 2) == lookup  # guesses were judged, and only with lookup
    assert (sum(stops) > runs / 2) == (confidence is not None)  # drafting stopped early, and only then
    expected = target_joint(target, prompt, config, 3)
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE


class ArgmaxDraft(DraftSource):
    """A deterministic draft through the public interface: the target's own greedy continuation
    (point masses on its most likely tokens, so acceptance is partial and the residual matters). The
    argmax after a context is computed once (`memo`, shared with the copies :meth:`fork` makes)."""

    kind = "argmax"

    def __init__(self, model, memo=None):
        self.model, self.memo = model, {} if memo is None else memo

    def fork(self):
        return ArgmaxDraft(self.model, self.memo)

    def propose(self, context, gamma):
        tokens = []
        for _ in range(gamma):
            key = tuple(context + tokens)
            if key not in self.memo:
                self.memo[key] = int(attnkit.score_tokens(self.model, list(key))[-1].argmax())
            tokens.append(self.memo[key])
        return Proposal(tokens)


@pytest.mark.parametrize("source", ["prompt_lookup", "argmax"])
def test_end_to_end_point_mass_draft_matches_target_chi_square(target_and_draft, source):
    """Deterministic drafts (point-mass p) with sampling, 600 seeds (helpers.sampled_runs). For prompt lookup the
    prompt holds every token once, so the lookup always finds the last token and proposes what followed it."""
    target, _ = target_and_draft
    prompt = torch.randperm(256, generator=torch.Generator().manual_seed(9)) + 3
    kw = dict(do_sample=True, top_k=3)
    config = SamplingConfig(**kw)
    draft = "prompt_lookup" if source == "prompt_lookup" else ArgmaxDraft(target)
    runs, counts = 600, {}
    out = sampled_runs(target, prompt, draft, runs, gamma=2, max_new_tokens=3, stop_at_eos=False, **kw)
    for g in out:
        counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
    assert sum(g.stats.drafted_tokens for g in out) > runs / 2  # the source did propose
    assert chi_square_p_value(counts, target_joint(target, prompt, config, 3), runs) > SIGNIFICANCE


@pytest.fixture(scope="module")
def plain(greedy_models):
    """Plain greedy decoding of the repetitive prompt (40 tokens): what every greedy speculation must give."""
    return attnkit.generate(greedy_models[0], repetitive_prompt(), max_new_tokens=40, stop_at_eos=False)


@pytest.mark.parametrize("source,spec", [
    ("prompt_lookup", None),
    ("prompt_lookup", "max_ngram=1,min_ngram=1"),
    ("draft_model", "other"),
    ("draft_model", "same"),
    ("self", "streaming:budget_tokens=24,sinks=4"),
    ("self", "streaming:budget_tokens=24,sinks=4,positions=reindex"),
    ("self", "h2o:budget_tokens=24,recent_tokens=8"),
    ("self", "keyformer:budget_tokens=24,recent_tokens=8"),
    ("self", "keyformer:budget_tokens=24,score=shared"),
    ("self", "snapkv:budget_tokens=24,window_size=4"),
    ("self", "window:window=16"),
])
def test_greedy_equals_plain(greedy_models, plain, source, spec):
    target, other = greedy_models
    if spec == "other":
        spec = other
    elif spec == "same":
        spec = target
    prompt = repetitive_prompt()
    for gamma, adaptive in ((1, False), (4, False), (3, True)):
        out = speculative_generate(target, prompt, source, draft=spec, gamma=gamma, adaptive_gamma=adaptive,
                                   max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.token_ids, (gamma, adaptive)
        assert out.text == plain.text
        s = out.stats
        assert s.new_tokens == 40 and s.rounds >= 1
        assert 0.0 <= s.acceptance_rate <= 1.0
        assert s.tokens_per_target_forward == pytest.approx((s.accepted_tokens + s.rounds) / s.rounds)
        # a draft model runs one forward per drafted token: the first takes the tokens the target
        # emitted last round, each later one the token just drafted; an evicting cache takes a round's
        # first tokens one forward each
        if source == "prompt_lookup":
            assert s.draft_forwards == 0
        elif source == "draft_model" or spec.startswith("snapkv"):
            assert s.draft_forwards == s.drafted_tokens
        else:
            assert s.drafted_tokens <= s.draft_forwards <= s.drafted_tokens + s.rounds
    if spec is target:  # the target drafting for itself is always right
        assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("source,spec", [("self", "snapkv:budget_tokens=24,window_size=4"),
                                         ("draft_model", "other"), ("draft_model", "same")])
def test_greedy_with_a_lookup_guessing_draft_equals_plain(greedy_models, plain, source, spec, monkeypatch):
    """The draft verifies prompt-lookup guesses several per forward (TriForce's hierarchy): still the
    plain greedy tokens, and the draft did take several tokens in one forward."""
    target, other = greedy_models
    spec = {"other": other, "same": target}.get(spec, spec)
    prompt = repetitive_prompt()
    fed = []
    original = ModelDraft._feed
    monkeypatch.setattr(ModelDraft, "_feed", lambda self, tokens, start: fed.append(len(tokens)) or
                        original(self, tokens, start))
    several = False
    for gamma, adaptive in ((1, False), (4, False), (6, True)):
        fed.clear()
        out = speculative_generate(target, prompt, source, draft=spec, draft_lookup=True, gamma=gamma,
                                   adaptive_gamma=adaptive, max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.token_ids, (gamma, adaptive)
        several |= max(fed) > 1
        assert out.stats.draft_forwards == len(fed)  # the draft's cache only appends: one forward per feed
    assert "prompt_lookup" in out.stats.draft
    assert several
    if spec is target:
        assert out.stats.acceptance_rate == 1.0


def test_lookup_guesses_ride_along_with_the_drafts_catch_up(greedy_models, monkeypatch):
    """Every draft forward takes the tokens the draft has not seen followed by the guesses the lookup
    just made; a round's first forward starts with the end of the context (the target's last tokens),
    so its guesses need no forward of their own. The guesses run to the round's cap (the tokens still to
    draft), whatever the match length: they are not sized by the target's verification cost."""
    target, _ = greedy_models
    calls, caps = [], []
    lookup_after, feed = PromptLookupDraft.lookup_after, ModelDraft._feed

    def recording_lookup(self, context, drafted, gamma):
        calls.append(("guesses", lookup_after(self, context, drafted, gamma), len(context), len(drafted)))
        caps.append((len(calls[-1][1]), gamma, self._last[0]))
        return calls[-1][1]

    monkeypatch.setattr(PromptLookupDraft, "lookup_after", recording_lookup)
    monkeypatch.setattr(ModelDraft, "_feed", lambda self, tokens, start: calls.append(("feed", tokens, start))
                        or feed(self, tokens, start))
    prompt = repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=30, stop_at_eos=False)
    out = speculative_generate(target, prompt, "self", draft="snapkv:budget_tokens=24,window_size=4",
                               draft_lookup=True, gamma=6, max_new_tokens=30, stop_at_eos=False)
    assert out.token_ids == plain.token_ids
    ride_along = 0
    for before, call in zip(calls, calls[1:]):
        if call[0] != "feed":
            continue
        assert before[0] == "guesses"
        (_, guesses, context_len, drafted), (_, tokens, start) = before, call
        unseen = tokens[:len(tokens) - len(guesses)]
        assert tokens[len(unseen):] == guesses and len(unseen) >= 1
        if drafted == 0:  # the round's first forward: the context's end the draft has not seen
            assert start + len(unseen) == context_len
            ride_along += bool(guesses)
        else:  # later: the token just drafted
            assert len(unseen) == 1 and start == context_len + drafted - 1
    assert ride_along > 0
    assert all(n in (0, cap) for n, cap, _ in caps)
    # short matches too (a 1-2 token match predicts badly: sizing would have proposed less than the cap)
    assert any(n == cap > 1 and match <= 2 for n, cap, match in caps)


@pytest.mark.parametrize("source,spec,lookup", [
    ("self", "snapkv:budget_tokens=24,window_size=4", True),
    ("self", "streaming:budget_tokens=24,sinks=4", False),  # an evicting cache: snapshots roll it back
    ("draft_model", "other", False),
    ("draft_model", "other", True),
])
def test_greedy_with_a_confidence_stop_equals_plain(greedy_models, plain, source, spec, lookup):
    """Drafting stops after a token the draft is unsure of: still the plain greedy tokens, with rounds
    shorter than gamma (the threshold is high enough that random weights stop most rounds)."""
    target, other = greedy_models
    spec = other if spec == "other" else spec
    prompt = repetitive_prompt()
    for gamma, adaptive in ((4, False), (6, True)):
        out = speculative_generate(target, prompt, source, draft=spec, draft_lookup=lookup,
                                   draft_confidence=0.5, gamma=gamma, adaptive_gamma=adaptive,
                                   max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.token_ids, (gamma, adaptive)
        assert out.stats.mean_gamma < gamma - 0.5
        assert "stop<0.5" in out.stats.draft


def test_greedy_equals_plain_sliding_window_model_and_chunked_prefill():
    target = attnkit.load_model("random:mistral:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,"
                                "intermediate=128,sliding_window=20")
    prompt = repetitive_prompt(90)
    plain = attnkit.generate(target, prompt, max_new_tokens=30, stop_at_eos=False, chunk_size=32)
    for source, spec in (("prompt_lookup", None), ("self", "streaming:budget_tokens=24,sinks=2")):
        out = speculative_generate(target, prompt, source, draft=spec, gamma=5, max_new_tokens=30,
                                   stop_at_eos=False, chunk_size=32)
        assert out.token_ids == plain.token_ids


def test_stop_strings_eos_and_streaming_match_plain(greedy_models):
    target, _ = greedy_models
    prompt = repetitive_prompt()
    free = attnkit.generate(target, prompt, max_new_tokens=30, stop_at_eos=False)
    stop = free.text[12:14]
    pieces_a, pieces_b = [], []
    a = attnkit.generate(target, prompt, max_new_tokens=30, stop_at_eos=False, stop=[stop],
                         on_token=lambda t, d: pieces_a.append(d))
    b = speculative_generate(target, prompt, "prompt_lookup", gamma=4, max_new_tokens=30, stop_at_eos=False,
                             stop=[stop], on_token=lambda t, d: pieces_b.append(d))
    assert (b.text, b.token_ids, b.stats.finish_reason) == (a.text, a.token_ids, a.stats.finish_reason)
    assert "".join(pieces_b) == b.text

    eos_at = free.token_ids[7]

    class Tok:
        def __init__(self, inner):
            self.inner, self.eos_token_id = inner, eos_at

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    model = dataclasses.replace(target, tokenizer=Tok(target.tokenizer))
    a = attnkit.generate(model, prompt, max_new_tokens=30)
    b = speculative_generate(model, prompt, "prompt_lookup", gamma=4, max_new_tokens=30)
    assert b.token_ids == a.token_ids and b.stats.finish_reason == a.stats.finish_reason == "eos"


def test_seeded_sampling_is_reproducible(greedy_models):
    target, other = greedy_models
    kw = dict(draft=other, gamma=3, max_new_tokens=20, do_sample=True, temperature=1.3, seed=7,
              stop_at_eos=False, adaptive_gamma=True)
    a = speculative_generate(target, "hello there", "draft_model", **kw)
    b = speculative_generate(target, "hello there", "draft_model", **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
