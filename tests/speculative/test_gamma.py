"""Choosing gamma, the drafted tokens per round (attnkit.speculative.gamma)."""

import pytest

import attnkit
from attnkit.speculative import best_gamma, speculative_generate
from helpers import SMALL


def test_best_gamma_counts_verification_cost():
    assert best_gamma(0.9, 0.05, 16, verify_cost=0.2) < best_gamma(0.9, 0.05, 16)
    with pytest.raises(attnkit.AttnkitError, match="verify_cost"):
        speculative_generate(attnkit.load_model(f"random:llama:{SMALL}"), "hi", "prompt_lookup", verify_cost=-1)


def test_bad_gamma_raises(greedy_models):
    with pytest.raises(attnkit.AttnkitError, match="gamma"):
        speculative_generate(greedy_models[0], "hi", "prompt_lookup", gamma=0)


def test_adaptive_gamma_follows_acceptance():
    assert best_gamma(0.05, 0.1, 16) == 1
    assert best_gamma(0.95, 0.05, 16) > best_gamma(0.6, 0.05, 16) >= 2
    assert best_gamma(0.999, 0.0, 16) == 16
