"""The acceptance rule of speculative sampling (attnkit.speculative.acceptance): losslessness exactly
(enumeration over toy models whose distributions depend on the prefix), statistically (chi-square) and
greedily."""

import itertools
import math
import random

import pytest
import torch

import attnkit
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.speculative import (
    acceptance_probabilities,
    greedy_accept,
    outcome_probabilities,
    residual_distribution,
    speculative_accept,
)
from helpers import SIGNIFICANCE, chi_square_p_value


def toy_logits(prefix: tuple, vocab: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((salt,) + prefix) % (2 ** 31))
    return torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5


def toy_dist(prefix: tuple, vocab: int, salt: int, config: SamplingConfig) -> torch.Tensor:
    d = next_token_distribution(toy_logits(prefix, vocab, salt), config).double()  # float32 inside
    return d / d.sum()  # sums to 1 in float64, as the proof assumes


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


@pytest.mark.parametrize("config", [SamplingConfig(True), SamplingConfig(True, top_p=0.75)], ids=["t1", "top_p"])
@pytest.mark.parametrize("p_kind", ["sampled", "point_mass"])
def test_sampled_joint_matches_target_chi_square(config, p_kind):
    """Run the acceptance sampler in a loop over 5-token toy models (prefix-dependent p and q, gamma=3)
    and compare the empirical joint of the first two tokens with the target's (25 cells). The drafts are
    drawn from p in Python (``random``, its own seed), and a round's stacked p and q rows are built once per
    (prefix, drafts): the loop's time is the sampler's."""
    V, N, gamma, runs = 5, 2, 3, 6000
    gen = torch.Generator().manual_seed(1234)
    draw = random.Random(1234)
    cache: dict = {}

    def dist(prefix, salt):
        key = (prefix, salt)
        if key not in cache:
            cache[key] = toy_dist(prefix, V, salt, config).float()
        return cache[key]

    def draft_token(prefix):  # a draw from p, or p's argmax for a point mass
        key = (prefix, "token")
        if key not in cache:
            p = dist(prefix, 2)
            cache[key] = int(p.argmax()) if p_kind == "point_mass" else list(itertools.accumulate(p.tolist()))
        weights = cache[key]
        return weights if p_kind == "point_mass" else draw.choices(range(V), cum_weights=weights)[0]

    def round_inputs(prefix, drafts):  # the sampler's arguments for these drafts after `prefix`
        key = (prefix, drafts)
        if key not in cache:
            probs = None if p_kind == "point_mass" else torch.stack([dist(prefix + drafts[:i], 2) for i in range(gamma)])
            qs = torch.stack([dist(prefix + drafts[:i], 1) for i in range(gamma + 1)])
            cache[key] = torch.tensor(drafts), probs, qs
        return cache[key]

    counts: dict[tuple, int] = {}
    for _ in range(runs):
        out: tuple = ()
        while len(out) < N:
            drafts: tuple = ()
            for _ in range(gamma):
                drafts += (draft_token(out + drafts),)
            res = speculative_accept(*round_inputs(out, drafts), gen)
            out = out + tuple(res.tokens(list(drafts)))
        counts[out[:N]] = counts.get(out[:N], 0) + 1
    expected = {}
    for seq in itertools.product(range(V), repeat=N):
        prob = math.prod(float(dist(seq[:i], 1)[seq[i]]) for i in range(N))
        if prob > 0:
            expected[seq] = prob
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE
