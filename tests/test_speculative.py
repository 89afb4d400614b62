"""Speculative decoding: losslessness exactly (enumeration), statistically (chi-square) and
greedily (token for token), cache rollback, draft sources, errors, CLI."""

import dataclasses
import itertools
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnkit
from attnkit.attention import attend, folded_attention, folded_bias
from attnkit.bench.speculative import format_time_per_round, run_speculative_bench, time_per_round
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.base import resolve_method
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.session import Step, new_session
from attnkit.speculative import (
    DraftRun,
    DraftSource,
    ModelDraft,
    PromptLookupDraft,
    Proposal,
    acceptance_probabilities,
    best_gamma,
    greedy_accept,
    make_draft,
    outcome_probabilities,
    residual_distribution,
    speculative_accept,
    speculative_generate,
)
from attnkit.speculative.rollback import drop_newest, snapshot_session
from attnkit.speculative.target import VerifyingFull, prefill_sessions
from attnkit.tokenizer import build_byte_tokenizer
from helpers import SMALL, random_ids

SIGNIFICANCE = 0.001  # chi-square tests fail when P(statistic >= observed | lossless) < 0.1%


def chi_square_p_value(observed: dict, expected_probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    small_obs = small_exp = 0.0
    stat, cells = 0.0, 0
    for cell, prob in expected_probs.items():
        e, o = prob * n, observed.get(cell, 0)
        if e < 5:
            small_obs, small_exp = small_obs + o, small_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp if small_exp >= 1 else 0.0
        cells += 1 if small_exp >= 1 else 0
    assert sum(observed.values()) == n
    assert not set(observed) - set(expected_probs), "a sample fell outside the target's support"
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ---- toy "models": distributions that depend on the whole prefix --------------------------------------
def toy_logits(prefix: tuple, vocab: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (2 ** 31))
    return torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5


def toy_dist(prefix: tuple, vocab: int, salt: int, config: SamplingConfig) -> torch.Tensor:
    d = next_token_distribution(toy_logits(prefix, vocab, salt), config).double()  # float32 inside
    return d / d.sum()  # sums to 1 in float64, as the proof assumes


# ---- the rule itself, by hand ------------------------------------------------------------------------
def test_one_step_outcome_equals_target_by_hand():
    """Seed 003's proof, computed: sum over drafts x~ ~ p of P(accept) + P(reject) * residual == q."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0], dtype=torch.float64)
    # (A) min(1, q/p) and (B) max(0, q - p) normalised, as the seed writes them
    tokens = torch.arange(5)
    a = acceptance_probabilities(tokens[:3], p.expand(3, 5), q.expand(3, 5))
    assert torch.allclose(a, torch.tensor([0.2, 2 / 3, 1.0], dtype=torch.float64))
    r = residual_distribution(p, q)
    assert torch.allclose(r, torch.tensor([0, 0, 0.1, 0.4, 0], dtype=torch.float64) / 0.5)
    total = torch.zeros(5, dtype=torch.float64)
    for x in range(3):
        out = outcome_probabilities(torch.tensor([x]), p[None], torch.stack([q, q]))
        total += p[x] * out[0]  # the token emitted in place of the first draft
        total += p[x] * out[1].sum() * torch.nn.functional.one_hot(torch.tensor(x), 5).double()
    assert torch.allclose(total, q, atol=1e-15)


@pytest.mark.parametrize("p_kind", ["sampled", "point_mass"])
@pytest.mark.parametrize("config", [SamplingConfig(True), SamplingConfig(True, temperature=0.7, top_p=0.7),
                                    SamplingConfig(True, top_k=2)], ids=["t1", "top_p", "top_k"])
def test_exact_joint_distribution_by_enumeration(p_kind, config):
    """The exact distribution of the first 3 tokens of speculative decoding (gamma=2, drafts whose
    distribution depends on the prefix) equals the target's joint distribution."""
    V, N, gamma = 3, 3, 2

    def q_of(prefix):
        return toy_dist(prefix, V, 1, config)

    def p_of(prefix):
        return toy_dist(prefix, V, 2, config)

    def point_of(prefix):  # a deterministic draft (like prompt lookup): a fixed token per prefix
        return sum(prefix) % V

    result: dict[tuple, float] = {}

    def walk(prefix: tuple, mass: float):
        if len(prefix) >= N:
            result[prefix[:N]] = result.get(prefix[:N], 0.0) + mass
            return
        for drafts in itertools.product(range(V), repeat=gamma):
            if p_kind == "point_mass":
                if any(drafts[i] != point_of(prefix + drafts[:i]) for i in range(gamma)):
                    continue
                weight, probs = 1.0, None
            else:
                ps = [p_of(prefix + drafts[:i]) for i in range(gamma)]
                weight = math.prod(float(ps[i][drafts[i]]) for i in range(gamma))
                if weight == 0:
                    continue
                probs = torch.stack(ps)
            qs = torch.stack([q_of(prefix + drafts[:i]) for i in range(gamma + 1)])
            outcomes = outcome_probabilities(torch.tensor(drafts), probs, qs)
            for k in range(gamma + 1):
                for x in range(V):
                    if outcomes[k, x] > 0:
                        walk(prefix + drafts[:k] + (x,), mass * weight * float(outcomes[k, x]))

    walk((), 1.0)
    for seq in itertools.product(range(V), repeat=N):
        expected = math.prod(float(q_of(seq[:i])[seq[i]]) for i in range(N))
        assert result.get(seq, 0.0) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "list"])
def test_greedy_accept_rule(as_tensor):
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0], [9.0, 0.0, 0.0]])

    def drafts(ids):
        return torch.tensor(ids, dtype=torch.long) if as_tensor else list(ids)

    assert greedy_accept(drafts([1, 0, 2]), logits).tokens([1, 0, 2]) == [1, 0, 2, 0]
    assert greedy_accept(drafts([1, 2, 2]), logits).tokens([1, 2, 2]) == [1, 0]
    assert greedy_accept(drafts([0, 0, 2]), logits).tokens([0, 0, 2]) == [1]
    assert greedy_accept(drafts([]), logits[:1]).tokens([]) == [1]
    with pytest.raises(attnkit.AttnkitError, match=r"\[gamma \+ 1, vocab\] = \[3, V\]"):
        greedy_accept(drafts([1, 0]), logits)


# ---- the sampler, statistically --------------------------------------------------------------------------
@pytest.mark.parametrize("config", [SamplingConfig(True), SamplingConfig(True, top_p=0.75)], ids=["t1", "top_p"])
@pytest.mark.parametrize("p_kind", ["sampled", "point_mass"])
def test_sampled_joint_matches_target_chi_square(config, p_kind):
    """Run the acceptance sampler in a loop over 5-token toy models (prefix-dependent p and q, gamma=3)
    and compare the empirical joint of the first two tokens with the target's (25 cells)."""
    V, N, gamma, runs = 5, 2, 3, 6000
    gen = torch.Generator().manual_seed(1234)
    cache: dict = {}

    def dist(prefix, salt):
        key = (prefix, salt)
        if key not in cache:
            cache[key] = toy_dist(prefix, V, salt, config).float()
        return cache[key]

    counts: dict[tuple, int] = {}
    for _ in range(runs):
        out: tuple = ()
        while len(out) < N:
            drafts, probs = [], []
            for _ in range(gamma):
                p = dist(out + tuple(drafts), 2)
                if p_kind == "point_mass":
                    tok = int(p.argmax())
                else:
                    tok = int(torch.multinomial(p, 1, generator=gen))
                    probs.append(p)
                drafts.append(tok)
            qs = torch.stack([dist(out + tuple(drafts[:i]), 1) for i in range(gamma + 1)])
            res = speculative_accept(torch.tensor(drafts), torch.stack(probs) if probs else None, qs, gen)
            out = out + tuple(res.tokens(drafts))
        counts[out[:N]] = counts.get(out[:N], 0) + 1
    expected = {}
    for seq in itertools.product(range(V), repeat=N):
        prob = math.prod(float(dist(seq[:i], 1)[seq[i]]) for i in range(N))
        if prob > 0:
            expected[seq] = prob
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE


# ---- end to end with small random models -----------------------------------------------------------------
def sharpened(seed: int, scale: float = 40.0, noise: float = 0.0):
    """A small random llama whose LM head is scaled up, so its distributions are far from uniform;
    `noise` perturbs the head (a draft that agrees with the target only partly)."""
    model = attnkit.load_model(f"random:llama:{SMALL},seed={seed}")
    with torch.no_grad():
        model.hf.lm_head.weight.mul_(scale)
        if noise:
            g = torch.Generator().manual_seed(99)
            model.hf.lm_head.weight.add_(torch.randn(model.hf.lm_head.weight.shape, generator=g) * noise)
    return model


def target_joint(target, prompt: torch.Tensor, config: SamplingConfig, n: int) -> dict[tuple, float]:
    """Exact probability of every n-token continuation under plain sampling from the target."""
    out: dict[tuple, float] = {}

    def walk(prefix, mass):
        if len(prefix) == n:
            out[prefix] = mass
            return
        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
        q = next_token_distribution(attnkit.score_tokens(target, ids)[-1], config).double()
        for x in torch.nonzero(q).flatten().tolist():
            walk(prefix + (x,), mass * float(q[x]))

    walk((), 1.0)
    return out


@pytest.fixture(scope="module")
def target_and_draft():
    # the draft is the target with a perturbed head: about half of its drafts are accepted, so
    # rejections resample from a residual that differs from q
    return sharpened(0), sharpened(0, noise=0.3)


@pytest.mark.parametrize("source", ["draft_model", "self", "self+lookup", "draft_model+confidence"])
def test_end_to_end_sampling_matches_target_chi_square(target_and_draft, source, monkeypatch):
    """The first three of four tokens generated with speculation (top-k 3, gamma 3: the first round
    drafts 2) over 1000 seeds match the target's exact joint distribution (27 cells), computed from the
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
    for seed in range(runs):
        out = speculative_generate(target, prompt, source.split("+")[0], draft=spec, draft_lookup=lookup,
                                   draft_confidence=confidence, gamma=3, max_new_tokens=4, stop_at_eos=False,
                                   seed=seed, **kw)
        first = tuple(out.token_ids[:3])
        counts[first] = counts.get(first, 0) + 1
    assert (len(judged) > runs / 2) == lookup  # guesses were judged, and only with lookup
    assert (sum(stops) > runs / 2) == (confidence is not None)  # drafting stopped early, and only then
    expected = target_joint(target, prompt, config, 3)
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE


def test_judging_a_guess_draws_from_the_draft_distribution():
    """:meth:`ModelDraft._judge` (accept the guess with probability q(guess), else draw from q without
    it) gives tokens distributed as q itself, at temperature 1 and with top-p, for a likely and an
    unlikely guess (chi-square over 20000 draws)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    for config in (SamplingConfig(True), SamplingConfig(True, top_p=0.8)):
        d = ModelDraft(None, "snapkv:budget_tokens=8,window_size=2")
        d.sampling, d.generator = config, torch.Generator().manual_seed(3)
        q = next_token_distribution(logits, config).double()
        for guess in (0, 4):
            n, counts = 20000, {}
            for _ in range(n):
                _, tok, dist = d._judge(logits, guess)
                counts[tok] = counts.get(tok, 0) + 1
            assert torch.allclose(dist.double(), q)
            expected = {i: float(q[i]) for i in range(len(q)) if q[i] > 0}
            assert chi_square_p_value(counts, expected, n) > SIGNIFICANCE


class ArgmaxDraft(DraftSource):
    """A deterministic draft through the public interface: the target's own greedy continuation
    (point masses on its most likely tokens, so acceptance is partial and the residual matters)."""

    kind = "argmax"

    def __init__(self, model):
        self.model, self.proposals = model, 0

    def propose(self, context, gamma):
        tokens = []
        for _ in range(gamma):
            tokens.append(int(attnkit.score_tokens(self.model, context + tokens)[-1].argmax()))
        self.proposals += 1
        return Proposal(tokens)


@pytest.mark.parametrize("source", ["prompt_lookup", "argmax"])
def test_end_to_end_point_mass_draft_matches_target_chi_square(target_and_draft, source):
    """Deterministic drafts (point-mass p) with sampling. For prompt lookup the prompt holds every token
    once, so the lookup always finds the last token and proposes what followed it."""
    target, _ = target_and_draft
    prompt = torch.randperm(256, generator=torch.Generator().manual_seed(9)) + 3
    kw = dict(do_sample=True, top_k=3)
    config = SamplingConfig(**kw)
    draft = "prompt_lookup" if source == "prompt_lookup" else ArgmaxDraft(target)
    runs, counts, drafted = 600, {}, 0
    for seed in range(runs):
        out = speculative_generate(target, prompt, draft, gamma=2, max_new_tokens=3, stop_at_eos=False,
                                   seed=seed, **kw)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        drafted += out.stats.drafted_tokens
    assert drafted > runs / 2  # the source did propose
    assert chi_square_p_value(counts, target_joint(target, prompt, config, 3), runs) > SIGNIFICANCE


# ---- greedy: token for token the plain output ------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_models():
    return attnkit.load_model(f"random:llama:{SMALL}"), attnkit.load_model(f"random:llama:{SMALL},seed=3")


def repetitive_prompt(n: int = 120) -> torch.Tensor:
    base = random_ids(17, seed=11)
    return torch.cat([base] * (n // 17 + 1))[:n]


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
def test_greedy_equals_plain(greedy_models, source, spec):
    target, other = greedy_models
    if spec == "other":
        spec = other
    elif spec == "same":
        spec = target
    prompt = repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=40, stop_at_eos=False)
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
def test_greedy_with_a_lookup_guessing_draft_equals_plain(greedy_models, source, spec, monkeypatch):
    """The draft verifies prompt-lookup guesses several per forward (TriForce's hierarchy): still the
    plain greedy tokens, and the draft did take several tokens in one forward."""
    target, other = greedy_models
    spec = {"other": other, "same": target}.get(spec, spec)
    prompt = repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=40, stop_at_eos=False)
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
def test_greedy_with_a_confidence_stop_equals_plain(greedy_models, source, spec, lookup):
    """Drafting stops after a token the draft is unsure of: still the plain greedy tokens, with rounds
    shorter than gamma (the threshold is high enough that random weights stop most rounds)."""
    target, other = greedy_models
    spec = other if spec == "other" else spec
    prompt = repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=40, stop_at_eos=False)
    for gamma, adaptive in ((4, False), (6, True)):
        out = speculative_generate(target, prompt, source, draft=spec, draft_lookup=lookup,
                                   draft_confidence=0.5, gamma=gamma, adaptive_gamma=adaptive,
                                   max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.token_ids, (gamma, adaptive)
        assert out.stats.mean_gamma < gamma - 0.5
        assert "stop<0.5" in out.stats.draft


def test_a_confidence_stop_ends_the_proposal_at_the_first_unsure_token(greedy_models):
    """Every proposed token but the last has draft probability >= the threshold, and a proposal shorter
    than gamma ends with one below it (probabilities recomputed from the draft model's own logits)."""
    target, other = greedy_models
    draft = make_draft("draft_model", target, draft=other, draft_confidence=0.3)
    context = repetitive_prompt(60).tolist()
    draft.start(DraftRun(target, torch.tensor(context[:-1]), 60, SamplingConfig(), None))  # the last: not fed
    lengths = []
    for _ in range(8):
        with torch.inference_mode():
            tokens = draft.propose(context, 5).tokens
        probs = attnkit.score_tokens(other, context + tokens)[len(context) - 1:].softmax(-1)
        mine = [float(probs[i, tok]) for i, tok in enumerate(tokens)]
        assert all(p >= 0.3 for p in mine[:-1])
        assert len(tokens) == 5 or mine[-1] < 0.3
        lengths.append(len(tokens))
        draft.feedback(len(tokens) - 1)
        context = context + tokens
    assert min(lengths) < 5  # some proposals did stop early


@pytest.mark.parametrize("kind,confidence,match", [
    ("self", 0.0, "between 0 and 1"),
    ("self", 1.0, "between 0 and 1"),
    ("draft_model", 1.5, "between 0 and 1"),
    ("self", True, "between 0 and 1"),
    ("prompt_lookup", 0.3, "model draft"),
])
def test_bad_draft_confidence_raises(kind, confidence, match):
    with pytest.raises(attnkit.AttnkitError, match=match):
        make_draft(kind, draft_confidence=confidence)


def test_snapkv_decodes_several_tokens_in_one_step(greedy_models):
    """After its prompt compression SnapKV only appends, so one decoding step over several tokens gives
    the logits and the cache of one step per token, and dropping the newest slots undoes the last."""
    model, _ = greedy_models
    prompt = random_ids(30, seed=4)
    run = DraftRun(model, prompt, 20, SamplingConfig(), None)
    together, one_by_one = (ModelDraft(None, "snapkv:budget_tokens=12,window_size=4", share_prefill=False)
                            for _ in range(2))
    together.start(run)
    one_by_one.start(run)
    new = [5, 9, 13, 21]
    with torch.inference_mode():
        rows = together._feed(new, 30)
        ref = torch.stack([one_by_one._feed([tok], 30 + i)[-1] for i, tok in enumerate(new)])
        assert rows.shape == ref.shape and torch.allclose(rows, ref, atol=1e-5)
        for (ka, va, pa, _), (kb, vb, pb, _) in zip(_filled(together.session), _filled(one_by_one.session)):
            assert torch.equal(pa, pb) and torch.allclose(ka, kb, atol=1e-6) and torch.allclose(va, vb, atol=1e-6)
        drop_newest(together.session, 2)
        again = together._feed([13, 21], 32)
    assert torch.allclose(again, ref[2:], atol=1e-5)


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


# ---- rollback of the caches ----------------------------------------------------------------------------
def test_target_rollback_is_exact(greedy_models):
    """A multi-token verification forward (prefill step after the prompt) gives the logits of feeding
    the tokens one by one, and dropping the newest entries (LayerKV.length) leaves the cache of the
    accepted prefix."""
    model, _ = greedy_models
    ids = random_ids(40, seed=2)
    extra = [5, 77, 130, 9]
    full = resolve_method("full")
    with torch.inference_mode():
        a = new_session(model, full, 40, 10)
        prefill(model, a, ids)
        multi = logits_of(model, forward(model, torch.tensor(extra), 40, lambda pos: Step(a, "prefill", pos, False),
                                         all_positions=True))
        b = new_session(model, full, 40, 10)
        prefill(model, b, ids)
        single = []
        for i, t in enumerate(extra[:2]):
            single.append(logits_of(model, forward(model, torch.tensor([t]), 40 + i,
                                                   lambda pos: Step(b, "decode", pos)))[-1])
        assert torch.allclose(multi[:2], torch.stack(single), atol=1e-5)
        drop_newest(a, len(extra) - 2)  # accept extra[:2]
        for la, lb in zip(a.cache.layers, b.cache.layers):
            ka, va, pa = la.view()
            kb, vb, pb = lb.view()
            assert torch.equal(pa, pb) and torch.allclose(ka, kb, atol=1e-6) and torch.allclose(va, vb, atol=1e-6)
        # continuing after the rollback overwrites the stale slots
        nxt = [logits_of(model, forward(model, torch.tensor([200]), 42,
                                        lambda pos, s=s: Step(s, "decode", pos)))[-1] for s in (a, b)]
        assert torch.allclose(nxt[0], nxt[1], atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_folded_verification_attention_equals_reference(window):
    """VerifyingFull's kernel call (query heads folded into the query axis, additive mask) is the
    reference attention by position, GQA and the model's own window included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 8, 16, generator=g).transpose(1, 2)  # [b, hq, n, d], not contiguous (as HF hands it)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    q_pos, k_pos = torch.arange(35, 40), torch.arange(40)
    ref = attend(q, k, v, 0.25, q_pos, k_pos, window)
    bias = folded_bias(q_pos, k_pos, q.shape[1] // k.shape[1], window, q.dtype)
    assert torch.allclose(folded_attention(q, k, v, 0.25, bias), ref, atol=1e-5)


def test_slot_order_mask_equals_reference_with_per_head_positions():
    """Several appended tokens over a compressed cache whose kv heads hold different earlier positions:
    the causal mask by slot index (what ``Method._attend_held`` uses) is the reference mask by position."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 4, 16, generator=g)
    k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    kept = torch.stack([torch.randperm(90, generator=g)[:26].sort().values for _ in range(2)])[None]  # [1, 2, 26]
    q_pos = torch.arange(100, 104)
    k_pos = torch.cat([kept, q_pos.expand(1, 2, 4)], dim=2)  # each head: its kept prompt, then the new tokens
    ref = attend(q, k, v, 0.25, q_pos, k_pos)
    slots = torch.arange(30)
    bias = folded_bias(slots[26:], slots, 4, None, q.dtype)
    assert torch.allclose(folded_attention(q, k, v, 0.25, bias), ref, atol=1e-5)


@pytest.mark.parametrize("model_spec", [
    f"random:llama:{SMALL}",
    "random:mistral:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128,sliding_window=20",
])
def test_verifying_full_steps_equal_one_token_decoding(greedy_models, model_spec):
    """VerifyingFull's verification forwards (mask built once per forward and shared by the layers, for
    a single query too) give the logits of plain one-token decoding with ``full``, forward after
    forward, across rollbacks."""
    model = greedy_models[0] if model_spec == f"random:llama:{SMALL}" else attnkit.load_model(model_spec)
    ids = random_ids(40, seed=5)
    with torch.inference_mode():
        a = new_session(model, VerifyingFull(), 40, 20)
        prefill(model, a, ids)
        b = new_session(model, resolve_method("full"), 40, 20)
        prefill(model, b, ids)
        pos = 40
        for extra in ([5, 77, 130], [9], [200, 3, 4, 5, 6], [11, 12]):
            multi = logits_of(model, forward(model, torch.tensor(extra), pos,
                                             lambda p: Step(a, "prefill", p, False), all_positions=True))
            single = []
            for i, t in enumerate(extra):
                single.append(logits_of(model, forward(model, torch.tensor([t]), pos + i,
                                                       lambda p: Step(b, "decode", p)))[-1])
            assert torch.allclose(multi, torch.stack(single), atol=1e-5)
            dropped = min(1, len(extra) - 1)  # roll back the last token (when there are several)
            drop_newest(a, dropped)
            drop_newest(b, dropped)
            pos += len(extra) - dropped


def _state_equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, Step):
        return True  # the step a method remembers is compared by behaviour below
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x) is type(y) and all(_state_equal(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    if isinstance(x, (bool, int, float, str, type(None))):
        return x == y
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_state_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_state_equal(a, b) for a, b in zip(x, y))
    return True  # other objects (the Step a method remembers) are compared by behaviour below


def _filled(session):
    out = []
    for kv in session.cache.layers:
        k, v, p = kv.view()
        out.append((k, v, p, {name: s[:, :, :kv.length] for name, s in kv.extras.items()}))
    return out


def test_rollback_refuses_what_it_cannot_undo(greedy_models):
    """drop_newest: a count outside 0..length, or a ring cache (its dropped slots overwrote older
    entries), is a clear error naming the value."""
    model, _ = greedy_models
    ids = random_ids(40, seed=2)
    with torch.inference_mode():
        full = new_session(model, resolve_method("full"), 40, 10)
        prefill(model, full, ids)
        for bad in (41, -1):
            with pytest.raises(attnkit.AttnkitError, match=f"cannot drop the newest {bad} of 40 entries"):
                drop_newest(full, bad)
        drop_newest(full, 0)
        drop_newest(full, 3)
        assert all(kv.length == 37 for kv in full.cache.layers)
        ring = new_session(model, resolve_method("window", {"window": 16}), 40, 10)
        prefill(model, ring, ids)
        with pytest.raises(attnkit.AttnkitError, match="ring-buffer cache"):
            drop_newest(ring, 1)


@pytest.mark.parametrize("spec", ["streaming:budget_tokens=12,sinks=2", "h2o:budget_tokens=12,recent_tokens=4",
                                  "keyformer:budget_tokens=12,score=shared", "full",
                                  "snapkv:budget_tokens=12,window_size=4"])
def test_draft_rollback_equals_feeding_only_accepted_tokens(greedy_models, spec):
    """After propose(gamma) + feedback(n), the draft's session (slots, positions, score buffers, layer
    and shared state) is what feeding only the accepted tokens produces, for every n."""
    model, _ = greedy_models
    prompt = random_ids(30, seed=4)
    run = DraftRun(model, prompt, 20, SamplingConfig(), None)
    gamma = 5
    for accepted in range(gamma + 1):
        d = ModelDraft(model if spec == "full" else None, spec, share_prefill=False)
        d.start(run)
        context = prompt.tolist() + [3]
        drafted = d.propose(context, gamma).tokens
        d.feedback(accepted)
        ref = ModelDraft(model if spec == "full" else None, spec, share_prefill=False)
        ref.start(run)
        # the reference feeds the context and the accepted drafts (all but the last when every draft
        # passed: the draft never feeds its last token) through the same one-token steps
        fed = context + drafted[:min(accepted, gamma - 1)]
        for i in range(ref.cached, len(fed)):
            ref._feed(fed[i:i + 1], i)
        ref.cached = len(fed)
        assert d.cached == ref.cached == len(context) + min(accepted, gamma - 1)
        fa, fb = _filled(d.session), _filled(ref.session)
        for (ka, va, pa, ea), (kb, vb, pb, eb) in zip(fa, fb):
            assert torch.equal(pa, pb)
            assert torch.allclose(ka, kb, atol=1e-6) and torch.allclose(va, vb, atol=1e-6)
            assert ea.keys() == eb.keys() and all(torch.allclose(ea[k], eb[k], atol=1e-5) for k in ea)
        assert _state_equal(d.session.layer_state, ref.session.layer_state)
        assert _state_equal(d.session.state, ref.session.state)
        # and both continue identically
        nxt = context + drafted[:accepted] + [42]
        assert d.propose(nxt, 3).tokens == ref.propose(nxt, 3).tokens


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=12,window_size=4", "keyformer:budget_tokens=12,score=shared",
                                  "streaming:budget_tokens=12,sinks=2"])
def test_shared_prompt_pass_builds_the_same_draft_cache(greedy_models, spec):
    """The self-draft's cache filled inside the target's prompt pass (no attention output of its own)
    is the cache its own prompt pass builds. (For the eviction methods, which attend in full over the
    prompt; a sparse-prefill draft such as ``window`` gets the target's exact keys instead of its own.)"""
    model, _ = greedy_models
    prompt = random_ids(40, seed=6)
    run = DraftRun(model, prompt, 10, SamplingConfig(), None, chunk_size=16)
    shared, alone = (ModelDraft(None, spec, share_prefill=flag) for flag in (True, False))
    target = new_session(model, resolve_method("full"), 40, 10)
    with torch.inference_mode():
        prefill_sessions(model, [target, shared.start(run)], prompt, 16)
    assert alone.start(run) is None
    assert type(shared.session.method) is type(alone.session.method)  # the wrapper is gone after the pass
    for (ka, va, pa, ea), (kb, vb, pb, eb) in zip(_filled(shared.session), _filled(alone.session)):
        assert torch.equal(pa, pb) and torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
        assert all(torch.allclose(ea[k], eb[k], atol=1e-4) for k in ea)


def test_snapshots_are_independent_copies(greedy_models):
    model, _ = greedy_models
    d = ModelDraft(None, "h2o:budget_tokens=10,recent_tokens=3", share_prefill=False)
    d.start(DraftRun(model, random_ids(20), 10, SamplingConfig(), None))
    d.propose(random_ids(20).tolist() + [4], 1)
    snap = snapshot_session(d.session)
    before = [kv.extras["score"].clone() for kv in snap.layers]
    d.propose(random_ids(20).tolist() + [4, 6], 2)
    assert all(torch.equal(b, kv.extras["score"]) for b, kv in zip(before, snap.layers))


# ---- sources, errors ------------------------------------------------------------------------------------
def test_prompt_lookup_finds_most_recent_continuation():
    d = PromptLookupDraft(max_ngram=3, min_ngram=1)
    ctx = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert d.lookup(ctx, 3) == [5, 6, 7]  # the latest earlier "1 2 3" was followed by 5 6 7
    # "2 3 5" -> up to the end of the context, then on through the proposal itself (period 7)
    assert d.lookup(ctx + [5], 10) == [6, 7, 1, 2, 3, 5, 6, 7, 1, 2]
    assert d.lookup([4, 7, 7, 7], 3) == [7, 7, 7]  # a run continues
    assert d.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert d.lookup([8, 8, 8, 42], 4) == []
    assert PromptLookupDraft(2, 2).lookup([1, 7, 3, 0, 7], 2) == []  # only a 1-gram match


def test_prompt_lookup_sizes_proposals_by_match_length():
    """Adaptive prompt lookup: a long match earns a longer proposal than a short one, a match whose
    drafts the target keeps rejecting earns none (at a CPU-like verification cost), and a free
    verification drafts up to the cap."""
    d = PromptLookupDraft()
    d.adaptive, d.verify_cost = True, 0.1
    assert d.planned_length(30, 16) > d.planned_length(4, 16) > d.planned_length(1, 16) >= 1
    for _ in range(20):  # 1-token matches whose first draft is always rejected
        d._last = (1, 3)
        d.feedback(0)
    assert d.planned_length(1, 16) == 0
    assert d.planned_length(30, 16) <= 16
    d.verify_cost = 0.0  # a free verification (memory-bound GPU): draft all the way
    assert d.planned_length(30, 16) == 16
    d.verify_cost = 0.1
    base = b"def f(x):\n    return x + 1\n\n"
    ctx = list(base * 3) + list(b"def f(x):\n    re")
    m, e = d.match(ctx)
    assert m >= 16 and ctx[e + 1] == ord("t")
    before = d.next_accept_probability(m)
    out = d.lookup(ctx, 16)
    assert out and out[0] == ord("t")
    d.feedback(0)  # the target rejected the first draft
    assert d.next_accept_probability(m) < before
    # without adaptive gamma the proposal is the fixed length
    fixed = PromptLookupDraft()
    assert len(fixed.lookup(ctx, 5)) == 5


def test_best_gamma_counts_verification_cost():
    assert best_gamma(0.9, 0.05, 16, verify_cost=0.2) < best_gamma(0.9, 0.05, 16)
    with pytest.raises(attnkit.AttnkitError, match="verify_cost"):
        speculative_generate(attnkit.load_model(f"random:llama:{SMALL}"), "hi", "prompt_lookup", verify_cost=-1)


def test_mismatched_vocabularies_raise(greedy_models):
    target, _ = greedy_models
    config = LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64)
    other = attnkit.prepare(LlamaForCausalLM(config), build_byte_tokenizer(), "vocab300")
    with pytest.raises(attnkit.AttnkitError, match="vocabulary of 300 tokens but the target .* has 259"):
        speculative_generate(target, "hi", "draft_model", draft=other, max_new_tokens=4)

    class Shuffled:
        def __init__(self, inner):
            self.inner = inner

        def get_vocab(self):
            v = dict(self.inner.get_vocab())
            a, b = list(v)[10:12]
            v[a], v[b] = v[b], v[a]
            return v

    same_size = dataclasses.replace(greedy_models[1], tokenizer=Shuffled(target.tokenizer))
    with pytest.raises(attnkit.AttnkitError, match="different ids"):
        speculative_generate(target, "hi", "draft_model", draft=same_size, max_new_tokens=4)


@pytest.mark.parametrize("kind,spec,match", [
    ("nope", None, "unknown draft source"),
    ("self", "full", "compressed cache"),
    ("prompt_lookup", "max_ngram=0", "max_ngram"),
    ("prompt_lookup", "min_ngram=4,max_ngram=2", "larger than"),
    ("prompt_lookup", "size=3", "no option size"),
    ("self", "streaming:budget=2", "budget"),
])
def test_bad_draft_specs_raise(kind, spec, match):
    with pytest.raises(attnkit.AttnkitError, match=match):
        make_draft(kind, draft=spec)


@pytest.mark.parametrize("kind,spec,match", [
    ("self", "streaming:budget_tokens=12,sinks=2", "only appends while decoding"),
    ("self", "snapkv:budget_tokens=12,window_size=4,decode_budget=4", "only appends while decoding"),
    ("prompt_lookup", None, "model draft"),
])
def test_lookup_guessing_needs_a_model_draft_whose_cache_only_appends(kind, spec, match):
    with pytest.raises(attnkit.AttnkitError, match=match):
        make_draft(kind, draft=spec, draft_lookup=True)


def test_self_with_lookup_guessing_defaults_to_a_snapkv_cache():
    assert make_draft("self", draft_lookup=True).method.name == "snapkv"
    assert make_draft("self").method.name == "streaming"


def test_bad_gamma_raises(greedy_models):
    with pytest.raises(attnkit.AttnkitError, match="gamma"):
        speculative_generate(greedy_models[0], "hi", "prompt_lookup", gamma=0)


def test_adaptive_gamma_follows_acceptance():
    assert best_gamma(0.05, 0.1, 16) == 1
    assert best_gamma(0.95, 0.05, 16) > best_gamma(0.6, 0.05, 16) >= 2
    assert best_gamma(0.999, 0.0, 16) == 16


# ---- CLI ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("flags,named", [(["--draft-lookup"], "--draft-lookup"),
                                         (["--draft-confidence", "0.3"], "--draft-confidence"),
                                         (["--draft-weights", "int8"], "--draft-weights"),
                                         (["--draft", "tiny-draft"], "--draft")])
def test_cli_refuses_draft_options_without_speculate(command, flags, named, capsys):
    args = [command, "--model", f"random:llama:{SMALL}", *flags]
    if command == "generate":
        args += ["--prompt", "abc"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "add --speculate" in err


def test_cli_generate_speculate_matches_plain(capsys):
    model = f"random:llama:{SMALL}"
    prompt = "abcabcabcabcabcabc"
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "12", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "12", "--json",
                 "--speculate", "prompt_lookup", "--gamma", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert "acceptance_rate" in spec["stats"] and spec["stats"]["draft_forwards"] == 0
    assert main(["generate", "--model", model, "--prompt", prompt, "--max-new-tokens", "6",
                 "--speculate", "self", "--draft", "streaming:budget_tokens=8,sinks=2"]) == 0
    err = capsys.readouterr().err
    assert "acceptance" in err and "draft forwards per round" in err
    assert main(["generate", "--model", model, "--prompt", prompt, "--speculate", "self", "--method", "window",
                 "--param", "window=8"]) == 2


def test_cli_bench_speculate(capsys):
    assert main(["bench", "--model", f"random:llama:{SMALL}", "--context", "200", "--new-tokens", "8",
                 "--repeats", "1", "--threads", "1", "--speculate", "prompt_lookup", "--gamma", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["decoder"].split()[0] for r in rows] == ["plain", "speculative"]
    assert rows[1]["same_output_as_plain"] is True and rows[0]["decode_speedup"] == 1.0
    split = rows[1]["per_round"]  # one run: its own figures
    assert split["draft_forwards"] == 0 and split["tokens"] == pytest.approx(rows[1]["tokens_per_target_forward"])
    assert split["verify_steps"] > 0


def test_library_benches_refuse_fewer_than_two_new_tokens(small_llama):
    """Called from Python (not the CLI), both benches refuse a token count they cannot time decoding over
    (it divided by zero) before they generate anything."""
    from attnkit.bench.speed import run_bench

    prompt = torch.arange(3, 40)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(attnkit.AttnkitError, match=f"new_tokens must be a whole number >= 2.*got {bad!r}"):
            run_speculative_bench(small_llama, prompt, bad, "prompt_lookup", repeats=1)
        with pytest.raises(attnkit.AttnkitError, match=f"new_tokens must be a whole number >= 2.*got {bad!r}"):
            run_bench(small_llama, 40, bad, ["full"], repeats=1)


def test_time_per_round_pools_runs_in_plain_steps():
    """Two runs with different plain steps: each run's times are divided by its own plain step, then
    everything is summed over all rounds."""
    a = dict(rounds=2, tokens_per_target_forward=3.0, drafted_tokens=6, draft_forwards=4, draft_s=0.4,
             verify_s=0.2, decode_s=0.7)
    b = dict(rounds=3, tokens_per_target_forward=2.0, drafted_tokens=3, draft_forwards=3, draft_s=0.3,
             verify_s=0.6, decode_s=0.9)
    idle = dict(a, rounds=0)  # a run without rounds (the prompt filled max_new_tokens) adds nothing
    split = time_per_round([(a, 10.0), (b, 5.0), (idle, 2.0), (a, 0.0)])  # plain tok/s; 0: plain not timed
    assert split == pytest.approx({"tokens": (6 + 6) / 5, "drafted": 9 / 5, "draft_forwards": 7 / 5,
                                   "draft_steps": (4 + 1.5) / 5, "verify_steps": (2 + 3) / 5,
                                   "other_steps": (1 + 0) / 5})
    assert time_per_round([(idle, 10.0)]) is None and time_per_round([(a, 0.0)]) is None
    assert "= 1.10 steps (0.79 each)" in format_time_per_round(split)
