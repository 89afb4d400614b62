"""SpeculativeConfig (attnkit.speculative.config): every field documented and checked, a recipe's decode
mapping read and written back, the rules between fields, and the options speculative_generate takes."""

import dataclasses

import pytest

import attnkit
from attnkit.methods.spec import parse_method_spec
from attnkit.speculative import PromptLookupDraft, SpeculativeConfig, make_draft, speculative_config


def test_every_field_has_help_a_check_and_a_scope():
    for f in dataclasses.fields(SpeculativeConfig):
        assert f.metadata["help"] and callable(f.metadata["check"]), f.name
        assert f.metadata["scope"] in ("loop", "draft", "model"), f.name
    assert SpeculativeConfig.mapping_keys()[0] == "speculate"


def test_a_decode_mapping_round_trips():
    data = {"speculate": "self", "draft": "snapkv:budget_tokens=24,window_size=4", "draft_lookup": True,
            "draft_confidence": 0.4, "draft_weights": "int8", "gamma": 3, "max_gamma": 6}
    config = SpeculativeConfig.from_mapping(data, "r.yaml")
    assert config.source == "self" and config.gamma == 3 and config.draft_confidence == 0.4
    assert config.to_mapping() == data
    assert SpeculativeConfig.from_mapping(config.to_mapping()) == config
    assert SpeculativeConfig("prompt_lookup").to_mapping() == {"speculate": "prompt_lookup"}  # defaults left out


@pytest.mark.parametrize("data,match", [
    ([1], "'decode' must be a mapping"),
    ({"speculate": "guess"}, "r.yaml: unknown draft source 'guess'; decode.speculate must be one of"),
    ({"gamma": 3}, "decode.speculate must be one of"),
    ({"speculate": "self", "size": 3}, "decode has no key size; allowed: speculate, gamma"),
    ({"speculate": "self", "gamma": 0}, "decode.gamma must be a whole number >= 1, got 0"),
    ({"speculate": "self", "gamma": True}, "decode.gamma must be a whole number"),
    ({"speculate": "self", "adaptive_gamma": "yes"}, "decode.adaptive_gamma must be True or False"),
    ({"speculate": "self", "draft_lookup": "yes"}, "decode.draft_lookup must be true or false"),
    ({"speculate": "self", "draft_confidence": 1.2}, "decode.draft_confidence must be a probability"),
    ({"speculate": "self", "draft_weights": "int4"}, "decode.draft_weights must be one of same, int8"),
    ({"speculate": "self", "verify_cost": -1}, "decode.verify_cost must be a number >= 0"),
    ({"speculate": "self", "draft": 3}, "decode.draft must be a spec string"),
    ({"speculate": "self", "gamma": 4, "max_gamma": 2}, "r.yaml: decode: max_gamma must be a whole number >= gamma"),
    ({"speculate": "prompt_lookup", "draft_confidence": 0.3}, "model draft .* 'prompt_lookup' runs no model"),
    ({"speculate": "prompt_lookup", "draft": "size=3"}, "prompt_lookup has no option size"),
    ({"speculate": "self", "draft": "full"}, "compressed cache"),
    ({"speculate": "self", "draft": "streaming:budget_tokens=8,sinks=2", "draft_lookup": True},
     "only appends while decoding"),
])
def test_bad_decode_mappings_raise_naming_the_key(data, match):
    with pytest.raises(attnkit.AttnkitError, match=match):
        SpeculativeConfig.from_mapping(data, "r.yaml")


def test_options_are_field_names():
    config = speculative_config("self", gamma=3, draft_lookup=True)
    assert config == SpeculativeConfig("self", gamma=3, draft_lookup=True)
    assert speculative_config(config, gamma=5).gamma == 5 and speculative_config(config) is config
    spec = "snapkv:budget_tokens=8,window_size=2"
    assert speculative_config("self", draft=spec).draft == spec
    with pytest.raises(attnkit.AttnkitError, match="no speculative decoding option gama; options: gamma"):
        speculative_config("self", gama=3)
    with pytest.raises(attnkit.AttnkitError, match="draft_weights must be one of same, int8"):
        SpeculativeConfig("self", draft_weights="fp8")
    assert SpeculativeConfig("self", draft_weights=None).draft_weights == "same"


def test_a_draft_source_instance_takes_loop_options_only():
    source = PromptLookupDraft(max_ngram=2)
    config = SpeculativeConfig(source, gamma=2, adaptive_gamma=True)
    assert make_draft(config) is source
    with pytest.raises(attnkit.AttnkitError, match="draft_lookup given with a DraftSource instance"):
        SpeculativeConfig(source, draft_lookup=True)
    with pytest.raises(attnkit.AttnkitError, match="a decode mapping cannot hold"):
        config.to_mapping()
    built = SpeculativeConfig("self", gamma=3, draft_confidence=0.3).drafting_with(source)
    assert built.source is source and built.gamma == 3 and built.draft_confidence is None


def test_draft_specs_of_the_wrong_kind_are_refused():
    with pytest.raises(attnkit.AttnkitError, match="prompt_lookup takes a spec string"):
        SpeculativeConfig("prompt_lookup", draft=parse_method_spec("snapkv:budget_tokens=8,window_size=2"))
    with pytest.raises(attnkit.AttnkitError, match="draft_model drafts with a second model"):
        SpeculativeConfig("draft_model", draft=parse_method_spec("snapkv:budget_tokens=8,window_size=2"))
    assert make_draft("self", draft=parse_method_spec("snapkv:budget_tokens=8,window_size=2")).method.name == "snapkv"
    assert make_draft("prompt_lookup", draft="max_ngram=2").max_ngram == 2
    assert make_draft("self", draft_lookup="max_ngram=2").lookup.max_ngram == 2


def test_command_line_flags_come_from_the_fields():
    import argparse

    from attnkit.speculative.config import command_line_options, from_arguments

    parser = argparse.ArgumentParser()
    for flag, keywords in command_line_options():
        parser.add_argument(flag, **keywords)
    flags = [flag for flag, _ in command_line_options()]
    assert flags[:2] == ["--speculate", "--gamma"] and "--draft-weights" in flags
    assert from_arguments(parser.parse_args([])) is None
    args = parser.parse_args(["--speculate", "self", "--gamma", "3", "--draft-lookup", "--draft-confidence", "0.4"])
    assert from_arguments(args) == SpeculativeConfig("self", gamma=3, draft_lookup=True, draft_confidence=0.4)
    with pytest.raises(attnkit.AttnkitError, match="--draft-lookup, --draft-weights are options of speculative "
                                                   "decoding; add --speculate"):
        from_arguments(parser.parse_args(["--draft-lookup", "--draft-weights", "int8"]))
