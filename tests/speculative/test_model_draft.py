"""The model draft (attnkit.speculative.model_draft): judging lookup guesses, the confidence stop, feeding
several tokens in one step, and the vocabulary check against the target."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import attnkit
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.speculative import DraftRun, ModelDraft, make_draft, speculative_generate
from attnkit.speculative.rollback import drop_newest
from attnkit.tokenizer import build_byte_tokenizer
from helpers import SIGNIFICANCE, _filled, chi_square_p_value, random_ids, repetitive_prompt


def test_judging_a_guess_draws_from_the_draft_distribution():
    """:meth:`ModelDraft._judge` (accept the guess with probability q(guess), else draw from q without
    it) gives tokens distributed as q itself, at temperature 1 and with top-p, for a likely and an
    unlikely guess (chi-square over 5000 draws: a rejection that draws from q with the guess left in, the
    subtle mistake, fails it with probability ~1 for the unlikely guess at temperature 1 too)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    for config in (SamplingConfig(True), SamplingConfig(True, top_p=0.8)):
        d = ModelDraft(None, "snapkv:budget_tokens=8,window_size=2")
        d.sampling, d.generator = config, torch.Generator().manual_seed(3)
        q = next_token_distribution(logits, config).double()
        for guess in (0, 4):
            n, counts = 5000, {}
            for _ in range(n):
                _, tok, dist = d._judge(logits, guess)
                counts[tok] = counts.get(tok, 0) + 1
            assert torch.allclose(dist.double(), q)
            expected = {i: float(q[i]) for i in range(len(q)) if q[i] > 0}
            assert chi_square_p_value(counts, expected, n) > SIGNIFICANCE


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
