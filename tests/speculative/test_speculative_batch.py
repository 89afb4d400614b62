"""Speculative decoding on a batch of prompts (attnkit.speculative.generate with a list): greedy output is
the plain batch's token for token for every draft source, each sequence accepting its own number of
drafts per round while the target verifies all of them in one forward per round; sampled output has
the target's distribution (chi-square over the rows of one batch); stops, streaming and bad input."""

import pytest
import torch

import attnkit
import attnkit.speculative.generate as spec_generate
import attnkit.speculative.rows as spec_rows
from attnkit.errors import AttnkitError
from attnkit.recipe.core import Recipe
from attnkit.sampling import SamplingConfig
from attnkit.speculative import DraftSource, Proposal, SpeculativeStats, speculative_generate
from helpers import SIGNIFICANCE, SMALL, chi_square_p_value, random_ids, repetitive_prompt, sharpened, target_joint


@pytest.fixture(scope="module")
def near_draft():
    """The greedy target with a slightly perturbed head: it agrees with the target often, not always."""
    model = attnkit.load_model(f"random:llama:{SMALL}")
    with torch.no_grad():
        head = model.hf.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    return model


def batch_prompts() -> list[list[int]]:
    """Three prompts of different lengths that repeat themselves (prompt lookup finds its drafts)."""
    return [repetitive_prompt(120).tolist(), repetitive_prompt(90).tolist()[5:], random_ids(40, seed=2).tolist() * 2]


def recording(monkeypatch):
    """Record every target verification (the rows of each round, their lengths, each row's acceptance)
    and every draft-model forward of the batch (its rows)."""
    verify, drafts, accepted = [], [], []
    verify_each, draft_each, prefix = spec_generate.forward_each, spec_rows.forward_each, spec_generate.greedy_prefix

    def record_verify(model, feeds):
        verify.append([len(tokens) for _, tokens, _, _ in feeds])
        accepted.append([])
        return verify_each(model, feeds)

    def record_draft(model, feeds):
        drafts.append(len(feeds))
        return draft_each(model, feeds)

    def record_prefix(drafted, best):
        accepted[-1].append(prefix(drafted, best).accepted)
        return prefix(drafted, best)

    monkeypatch.setattr(spec_generate, "forward_each", record_verify)
    monkeypatch.setattr(spec_rows, "forward_each", record_draft)
    monkeypatch.setattr(spec_generate, "greedy_prefix", record_prefix)
    return verify, drafts, accepted


@pytest.mark.parametrize("source,spec,options", [
    ("prompt_lookup", None, {}),
    ("prompt_lookup", None, {"adaptive_gamma": True}),
    ("draft_model", "near", {}),
    ("draft_model", "near", {"draft_lookup": True}),
    ("self", "streaming:budget_tokens=24,sinks=4", {}),  # an evicting draft cache: one token per draft forward
    ("self", "snapkv:budget_tokens=24,window_size=4", {"draft_lookup": True}),
])
def test_batched_greedy_equals_plain_batch(greedy_models, near_draft, monkeypatch, source, spec, options):
    target, _ = greedy_models
    prompts = batch_prompts()
    plain = attnkit.generate(target, prompts, max_new_tokens=30, stop_at_eos=False)
    verify, drafts, accepted = recording(monkeypatch)
    out = speculative_generate(target, prompts, source, draft=near_draft if spec == "near" else spec, gamma=4,
                               max_new_tokens=30, stop_at_eos=False, **options)
    assert [g.token_ids for g in out] == [p.token_ids for p in plain]
    assert [g.text for g in out] == [p.text for p in plain]
    stats = [g.stats for g in out]
    assert all(isinstance(s, SpeculativeStats) and s.batch_size == 3 and s.new_tokens == 30 for s in stats)
    assert [s.prompt_tokens for s in stats] == [len(p) for p in prompts]
    # one target forward per round over every sequence still generating: the first rounds hold all three
    # rows, and each sequence took part in as many forwards as it had rounds
    assert len(verify) == max(s.rounds for s in stats)
    assert len(verify[0]) == 3
    assert sum(len(rows) for rows in verify) == sum(s.rounds for s in stats)
    assert any(len(set(lengths)) > 1 for lengths in verify)  # rows of different lengths, padded on the left
    # acceptance happened, and was ragged: rows of one round kept different numbers of drafts
    assert all(s.accepted_tokens > 0 for s in stats)
    assert any(len(set(round_)) > 1 for round_ in accepted)
    assert sum(map(sum, accepted)) == sum(s.accepted_tokens for s in stats)
    if source == "prompt_lookup":
        assert not drafts and all(s.draft_forwards == 0 for s in stats)
    else:  # the drafts fed together: forwards over several sequences' draft sessions
        assert max(drafts) == 3 and all(s.draft_forwards > 0 for s in stats)


def test_a_finished_sequence_leaves_the_batch_with_its_own_stop(greedy_models, monkeypatch):
    """Stop strings, EOS and max_new_tokens end each sequence on its own, as in the plain batch; the
    rounds after that verify only the others, and streaming names each token's prompt."""
    target, _ = greedy_models
    prompts = batch_prompts()
    free = attnkit.generate(target, prompts, max_new_tokens=30, stop_at_eos=False)
    stop = free[1].text[8:10]
    plain = attnkit.generate(target, prompts, max_new_tokens=30, stop_at_eos=False, stop=[stop])
    verify, _, _ = recording(monkeypatch)
    pieces = {i: [] for i in range(3)}
    out = speculative_generate(target, prompts, "prompt_lookup", gamma=4, max_new_tokens=30, stop_at_eos=False,
                               stop=[stop], on_token=lambda i, t, d: pieces[i].append(d))
    assert [(g.text, g.token_ids, g.stats.finish_reason) for g in out] == \
        [(p.text, p.token_ids, p.stats.finish_reason) for p in plain]
    assert out[1].stats.finish_reason == "stop"
    assert ["".join(pieces[i]) for i in range(3)] == [g.text for g in out]
    assert len(verify[-1]) < 3  # the stopped sequence no longer takes part
    assert len(verify) == max(g.stats.rounds for g in out) > out[1].stats.rounds


@pytest.fixture(scope="module")
def sampling_models():
    # the draft is the target with a perturbed head: about half of its drafts are accepted, so
    # rejections resample from a residual that differs from q
    return sharpened(0), sharpened(0, noise=0.3)


@pytest.mark.parametrize("source", ["draft_model", "self", "prompt_lookup"])
def test_batched_sampling_matches_target_chi_square(sampling_models, source, monkeypatch):
    """600 rows of one prompt in one batch (row i samples with seed i; top-k 3, gamma 3): the first three
    of four tokens match the target's exact joint distribution (27 cells). For prompt lookup the prompt
    holds every token once, so every lookup finds the last token and proposes what followed it. Row 0
    is the single-prompt run with the same seed."""
    target, draft = sampling_models
    prompt = torch.randperm(256, generator=torch.Generator().manual_seed(9))[:24] + 3
    if source == "prompt_lookup":
        prompt = torch.randperm(256, generator=torch.Generator().manual_seed(9)) + 3
    spec = {"draft_model": draft, "self": "streaming:budget_tokens=8,sinks=2", "prompt_lookup": None}[source]
    kw = dict(do_sample=True, top_k=3, gamma=3, max_new_tokens=4, stop_at_eos=False, seed=0)
    runs = 600
    verify, _, _ = recording(monkeypatch)
    out = speculative_generate(target, prompt[None].expand(runs, -1), source, draft=spec, **kw)
    assert len(out) == runs and len(verify[0]) == runs
    assert sum(g.stats.drafted_tokens for g in out) > runs  # the source did propose
    accepted, drafted = sum(g.stats.accepted_tokens for g in out), sum(g.stats.drafted_tokens for g in out)
    # rejections resample from the residual; a model draft's proposals are accepted too (what follows a
    # token in this prompt is almost never among the target's top 3, so the lookup's are rejected)
    assert (0 < accepted < drafted) if source != "prompt_lookup" else accepted < drafted
    counts = {}
    for g in out:
        counts[tuple(g.token_ids[:3])] = counts.get(tuple(g.token_ids[:3]), 0) + 1
    expected = target_joint(target, prompt, SamplingConfig(do_sample=True, top_k=3), 3)
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE
    alone = speculative_generate(target, prompt, source, draft=spec, **kw)
    assert alone.token_ids == out[0].token_ids
    assert len({tuple(g.token_ids) for g in out}) > 1  # the rows did not share one random stream


def test_bad_batches_are_refused_in_one_line(greedy_models):
    target, _ = greedy_models
    for prompt, message in (([], "the batch of prompts is empty"),
                            (["hello", [5, 6, 7]], "mixes texts and token ids"),
                            (torch.zeros(0, 4, dtype=torch.long), "the batch of prompts is empty")):
        with pytest.raises(AttnkitError, match=message) as err:
            speculative_generate(target, prompt, "prompt_lookup", max_new_tokens=4)
        assert "\n" not in str(err.value)


class OwnDraft(DraftSource):
    """A caller's source that does not say how to copy itself."""

    kind = "own"

    def propose(self, context, gamma):
        return Proposal(context[-gamma:])


def test_a_source_without_fork_drafts_for_one_prompt_only(greedy_models):
    target, _ = greedy_models
    prompt = repetitive_prompt(60).tolist()
    one = speculative_generate(target, [prompt], OwnDraft(), gamma=2, max_new_tokens=6, stop_at_eos=False)
    assert len(one) == 1 and one[0].token_ids == attnkit.generate(target, prompt, max_new_tokens=6,
                                                                 stop_at_eos=False).token_ids
    with pytest.raises(AttnkitError, match="one draft source per prompt.*OwnDraft.*fork") as err:
        speculative_generate(target, [prompt, prompt[3:]], OwnDraft(), gamma=2, max_new_tokens=6)
    assert "\n" not in str(err.value)


def test_a_recipe_with_a_decode_strategy_takes_a_batch(greedy_models):
    """A recipe's ``decode`` (speculative decoding) generates for a batch like the plain method does."""
    target, _ = greedy_models
    prompts = batch_prompts()
    recipe = Recipe.from_dict({"decode": {"speculate": "prompt_lookup", "gamma": 3}})
    out = recipe.generate(target, prompts, max_new_tokens=12, stop_at_eos=False)
    plain = attnkit.generate(target, prompts, max_new_tokens=12, stop_at_eos=False)
    assert [g.token_ids for g in out] == [p.token_ids for p in plain]
    assert all(isinstance(g.stats, SpeculativeStats) and g.stats.batch_size == 3 for g in out)
