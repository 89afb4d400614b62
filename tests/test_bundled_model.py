"""The bundled model loads offline and retrieves from distant context in general: a pass key, and a needle whose
phrasing and filler training never showed (held-out templates), which a small sliding window loses; it says how
to build it when it is missing (src/attnkit/assets/tiny/training.json records how it was trained)."""

import os

import pytest

import attnkit
import attnkit.model
from attnkit.bench.speculative import code_prompt
from attnkit.eval.data.task_registry import TASKS
from attnkit.speculative import make_draft, speculative_generate

# needles in the first half of a 1024-token prompt: at least 400 tokens before the question
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5)


@pytest.fixture(scope="module")
def tiny():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    return attnkit.load_model("tiny")


def test_tiny_geometry(tiny):
    g = tiny.geometry
    assert (g.architecture, g.n_layers, g.n_q_heads, g.n_kv_heads, g.head_dim) == ("llama", 6, 8, 2, 32)
    assert g.max_positions == 4096


def scores(model, task, method, params=None):
    """One batch of the task's samples at DEPTHS, 1024 tokens, greedy."""
    samples = [TASKS[task].make(model.tokenizer, 1024, depth=depth, seed=500 + i) for i, depth in enumerate(DEPTHS)]
    outs = attnkit.generate(model, [s.prompt for s in samples], method, params=params,
                            max_new_tokens=max(s.max_new_tokens for s in samples), stop="\n")
    return [TASKS[task].score(out.text, s) for out, s in zip(outs, samples)]


@pytest.mark.parametrize("task", ["passkey", "needle_heldout"])
def test_full_attention_finds_distant_needles_a_small_window_does_not(tiny, task):
    full = scores(tiny, task, "full")
    window = scores(tiny, task, "window", {"window": 256})
    assert sum(full) >= 4, full
    assert sum(window) == 0, window


def test_a_missing_bundled_model_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(attnkit.model, "bundled_path", lambda name: tmp_path / name)
    with pytest.raises(attnkit.AttnkitError, match="'tiny' is missing at .*training/bundle_v2.py"):
        attnkit.load_model("tiny")


def test_yarn_extends_tiny_beyond_its_trained_positions():
    """``tiny:yarn=2`` runs past tiny's 4096 positions (where plain ``tiny`` refuses the prompt), and
    greedy self-speculation with a compressed draft cache (drafting token by token, or verifying
    prompt-lookup guesses) is still token for token plain greedy there."""

    extended = attnkit.load_model("tiny:yarn=2")
    assert extended.geometry.max_positions == 8192
    assert extended.hf.config.rope_parameters["rope_type"] == "yarn"
    ids = code_prompt(extended, 4300, seed=0)
    with pytest.raises(attnkit.AttnkitError, match="4096"):
        attnkit.generate(attnkit.load_model("tiny"), ids, max_new_tokens=8)
    plain = attnkit.generate(extended, ids, max_new_tokens=12, stop_at_eos=False)
    for lookup in (False, True):
        draft = make_draft("self", extended, draft="snapkv:budget_tokens=256", draft_lookup=lookup)
        spec = speculative_generate(extended, ids, draft, gamma=4, max_new_tokens=12, stop_at_eos=False)
        assert spec.token_ids == plain.token_ids, lookup


@pytest.mark.parametrize("spec", ["tiny:yarn=1", "tiny:yarn=x", ":yarn=4"])
def test_bad_yarn_factor_is_refused(spec):
    with pytest.raises(attnkit.AttnkitError, match="factor F > 1"):
        attnkit.load_model(spec)
