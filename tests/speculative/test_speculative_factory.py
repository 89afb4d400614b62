"""Building a draft source from its spec (attnkit.speculative.factory.make_draft): defaults and errors."""

import pytest

import attnkit
from attnkit.speculative import make_draft


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
