"""The long-output tasks' samples (attnkit.eval.data.long_output): continuation windows of the held-out text, recall
items (needle prompt, stretch, question), their settings, and the protocols and recipes they refuse."""

from __future__ import annotations

import pytest

from attnkit import AttnkitError, load_model
from attnkit.eval.data import long_output as lo
from attnkit.eval.data.corpus import heldout_ids
from attnkit.eval.data.items import score_prediction, task_items
from attnkit.eval.data.protocols import PROTOCOLS, QUERY_AWARE, refusal
from attnkit.eval.data.task_registry import ALL_TASKS, higher_is_better
from attnkit.recipe import Recipe, as_recipe


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def test_tasks_are_registered():
    assert {lo.CONTINUATION, lo.RECALL} <= set(ALL_TASKS)
    assert not higher_is_better(lo.CONTINUATION) and not higher_is_better("perplexity")
    assert higher_is_better(lo.RECALL)


def test_continuation_windows_follow_the_prompt_in_the_heldout_text(model):
    settings = lo.LongOutput(continuation_tokens=48)
    items = task_items(model, lo.CONTINUATION, 256, 5, 3, [0.5] * 3, long_output=settings)
    assert items == task_items(model, lo.CONTINUATION, 256, 5, 3, [0.5] * 3, long_output=settings)  # seeded
    hay = heldout_ids(model.tokenizer)
    bos = list(model.tokenizer("").input_ids)
    for item in items:
        assert len(item.prompt) == 256 and len(item.continuation) == 48 and list(item.prompt[:len(bos)]) == bos
        text = list(item.prompt[len(bos):]) + list(item.continuation)
        start = next(i for i in range(len(hay)) if hay[i:i + len(text)] == text)  # one unbroken window
        assert start >= 0
    assert len({item.prompt for item in items}) == 3


def test_recall_items_hold_the_needle_then_stretch_and_question(model):
    items = task_items(model, lo.RECALL, 256, 0, 2, [0.25, 0.75], long_output=lo.LongOutput(stretch_tokens=100))
    for item, depth in zip(items, [0.25, 0.75]):
        assert abs(len(item.prompt) - 256) <= 4 and len(item.stretch) == 100 and item.depth == depth
        assert model.tokenizer.decode(list(item.question)).strip().startswith("What is the pass key?")
        assert item.answers[0] in model.tokenizer.decode(list(item.prompt))  # the needle is in the prompt
        assert item.answers[0] not in model.tokenizer.decode(list(item.stretch))
        assert score_prediction(lo.RECALL, f" {item.answers[0]}.", item) == 1.0
        assert score_prediction(lo.RECALL, " 12.", item) == 0.0
    assert not task_items(model, lo.RECALL, 256, 0, 1, [0.5], long_output=lo.LongOutput(stretch_tokens=0))[0].stretch


@pytest.mark.parametrize("settings,message", [
    (dict(continuation_tokens=0), "continuation_tokens"), (dict(stretch_tokens=-1), "stretch_tokens"),
    (dict(continuation_tokens=1.5), "continuation_tokens")])
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(AttnkitError, match=message) as err:
        lo.LongOutput(**settings)
    assert "\n" not in str(err.value)


def test_beyond_the_model_positions_is_one_line(model):
    with pytest.raises(AttnkitError, match="positions") as err:
        task_items(model, lo.CONTINUATION, 4000, 0, 1, [0.5], long_output=lo.LongOutput(continuation_tokens=200))
    assert "\n" not in str(err.value)


def test_options_name_what_each_task_decodes():
    settings = lo.LongOutput(64, 32)
    assert settings.options(lo.CONTINUATION) == {"continuation_tokens": 64}
    assert settings.options(lo.RECALL) == {"stretch_tokens": 32}
    assert settings.options("passkey") == {}


@pytest.mark.parametrize("task", lo.LONG_OUTPUT_TASKS)
def test_query_aware_only_and_attnkit_decoding_only(task):
    full = as_recipe("full")
    assert refusal(full, QUERY_AWARE, task) is None
    for protocol in set(PROTOCOLS) - {QUERY_AWARE}:
        why = refusal(full, protocol, task)
        assert "query-aware" in why and "\n" not in why
    peer = Recipe(peer=("SnapKVPress", {}), name="kvpress:SnapKVPress")
    assert "kvpress" in refusal(peer, QUERY_AWARE, task)
    speculative = as_recipe({"name": "pl", "decode": {"speculate": "prompt_lookup"}})
    assert "speculative" in refusal(speculative, QUERY_AWARE, task)
