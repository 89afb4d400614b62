"""The bundled model loads offline and really uses distant context (a partly trained checkpoint: see
src/attnkit/assets/tiny/training.json; the bar rises as training continues)."""

import os

import pytest

import attnkit
from attnkit.bench.speculative import code_prompt
from attnkit.eval.tasks import TASKS
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


def passkey_scores(model, method, params=None):
    scores = []
    for i, depth in enumerate(DEPTHS):
        sample = TASKS["passkey"].make(model.tokenizer, 1024, depth=depth, seed=500 + i)
        out = attnkit.generate(model, sample.prompt, method, params=params, max_new_tokens=8, stop="\n")
        scores.append(TASKS["passkey"].score(out.text, sample))
    return scores


def test_full_attention_finds_distant_passkeys_a_small_window_does_not(tiny):
    full = passkey_scores(tiny, "full")
    window = passkey_scores(tiny, "window", {"window": 256})
    assert sum(full) >= 3, full
    assert sum(window) == 0, window


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
