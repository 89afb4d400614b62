"""The speculative benchmark (attnkit.bench.speculative): argument checks and the per-round time split."""

import pytest
import torch

import attnkit
from attnkit.bench.speculative import format_time_per_round, run_speculative_bench, time_per_round


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
