"""Drafting with int8 weights (attnkit.speculative.int8_weights): the int8 layer computes what its
equation says, the view shares everything but the linear layers and leaves the model alone, and
speculative decoding with an int8 draft stays lossless (token for token greedily, the target's
distribution when sampling)."""

import json

import pytest
import torch
from torch import nn

import attnkit
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.base import resolve_method
from attnkit.recipe import as_recipe
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.session import Step, new_session
from attnkit.speculative import make_draft, speculative_generate
from attnkit.speculative.int8_weights import Int8WeightLinear, int8_bytes, int8_weight_view
from helpers import (
    SIGNIFICANCE,
    SMALL,
    chi_square_p_value,
    random_ids,
    repetitive_prompt,
    sampled_runs,
    sharpened,
    target_joint,
)


@pytest.mark.parametrize("in_features,bias", [(256, False), (100, True), (7, False), (200, True)])
def test_int8_linear_computes_its_equation(in_features, bias):
    """y = (x Q^T) s + b with s_j = max_i |W_ji| / 127 and Q = round(W / s): checked against that formula
    in float64, for input widths the kernel takes as they are (256) and ones it needs padded for (7, 100,
    200: crashed or wrong without the padding); 1-D, 2-D and 3-D inputs."""
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, in_features, generator=g) * 0.1)
        linear.weight[5] = 0.0  # an all-zero row: scale clamps, no division by zero
    layer = Int8WeightLinear(linear, torch.bfloat16)
    w = linear.weight.double()
    s = w.abs().amax(1) / 127
    q = torch.round(w / s.clamp_min(1e-300)[:, None]).clamp(-127, 127)
    assert torch.equal(layer.qweight[:, :in_features].double(), q)
    assert layer.qweight.shape[1] % 16 == 0 and not layer.qweight[:, in_features:].any()
    assert torch.allclose(layer.dequantized_weight().double(), q * s.to(torch.bfloat16).double()[:, None])
    for shape in [(in_features,), (3, in_features), (2, 5, in_features)]:
        x = torch.randn(shape, generator=g)
        ref = x.double() @ layer.dequantized_weight().double().t()
        if bias:
            ref = ref + linear.bias.double()
        y = layer(x)
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.float32
        # activations go through bfloat16 (8 significant bits): relative error well under 2 %
        assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
        # and the quantised layer stays close to the float one
        full = linear(x).double()
        assert (y.double() - full).abs().max() <= 0.03 * full.abs().max()


def test_int8_view_shares_all_but_the_linear_layers_and_leaves_the_model_alone():
    model = attnkit.load_model(f"random:llama:{SMALL}")
    before = {name: p.clone() for name, p in model.hf.named_parameters()}
    ids = random_ids(40, seed=2)
    logits = attnkit.score_tokens(model, ids)
    view = int8_weight_view(model)
    # the model itself: unchanged modules, parameters and outputs
    assert all(isinstance(m, nn.Linear) for name, m in model.hf.named_modules() if name.endswith("_proj"))
    assert all(torch.equal(p, before[name]) for name, p in model.hf.named_parameters())
    assert torch.equal(attnkit.score_tokens(model, ids), logits)
    # the view: every linear layer int8 (LM head included), the rest the very same tensors
    linears = [name for name, m in model.hf.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(view.hf.get_submodule(name), Int8WeightLinear) for name in linears)
    assert view.hf.model.embed_tokens.weight is model.hf.model.embed_tokens.weight
    assert view.hf.model.norm.weight is model.hf.model.norm.weight
    assert view.hf.model.layers[0].input_layernorm.weight is model.hf.model.layers[0].input_layernorm.weight
    linear_bytes = sum(model.hf.get_submodule(name).weight.nbytes for name in linears)
    assert linear_bytes / 4 <= int8_bytes(view) <= linear_bytes / 4 * 1.1  # int8 + small scales
    # and it computes nearly what the model does
    approx = attnkit.score_tokens(view, ids)
    assert (approx - logits).abs().max() < 0.05 * logits.abs().max()
    assert (approx.argmax(-1) == logits.argmax(-1)).float().mean() > 0.9


@pytest.fixture(scope="module")
def models():
    return attnkit.load_model(f"random:llama:{SMALL}"), attnkit.load_model(f"random:llama:{SMALL},seed=3")


@pytest.mark.parametrize("source,spec,lookup,confidence", [
    ("self", "streaming:budget_tokens=24,sinks=4", False, None),
    ("self", "snapkv:budget_tokens=24,window_size=4", True, 0.3),
    ("draft_model", "other", False, None),
    ("draft_model", "other", True, None),
])
def test_greedy_with_int8_draft_weights_equals_plain(models, source, spec, lookup, confidence):
    target, other = models
    spec = other if spec == "other" else spec
    prompt = repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=40, stop_at_eos=False)
    draft = make_draft(source, target, draft=spec, draft_lookup=lookup, draft_confidence=confidence, draft_weights="int8")
    for gamma in (1, 4):
        out = speculative_generate(target, prompt, draft, gamma=gamma, max_new_tokens=40, stop_at_eos=False)
        assert out.token_ids == plain.token_ids, gamma
        assert " int8" in out.stats.draft
    assert draft.drafter is not (target if source == "self" else other)  # it drafted with the int8 view
    assert isinstance(draft.drafter.hf.lm_head, Int8WeightLinear)
    own = 0 if source == "self" else sum(p.nbytes for p in other.hf.parameters())
    assert out.stats.draft_weight_bytes == own + int8_bytes(draft.drafter) > own
    view = draft.drafter
    speculative_generate(target, prompt, draft, gamma=4, max_new_tokens=4, stop_at_eos=False)
    assert draft.drafter is view  # made once per model, then kept


def test_int8_self_draft_proposes_from_its_int8_view(models):
    """The self-draft's first proposal is drawn from the int8 view's distribution over the target's
    prompt cache (the prompt pass is the target's own), not from the target's: recomputed here by
    feeding the view the token after the prompt over a cache the target's prefill filled."""
    target, _ = models
    prompt = random_ids(60, seed=4)
    draft = make_draft("self", target, draft="snapkv:budget_tokens=1000,window_size=4", draft_weights="int8")
    proposals = []
    propose = draft.propose
    draft.propose = lambda context, gamma: proposals.append((list(context), propose(context, gamma))) or proposals[-1][1]
    config = SamplingConfig(True)
    speculative_generate(target, prompt, draft, gamma=3, max_new_tokens=6, do_sample=True, seed=0, stop_at_eos=False)
    context, proposal = proposals[0]
    assert len(context) == 61  # the prompt and the token the prompt pass chose
    with torch.inference_mode():
        session = new_session(target, resolve_method("full"), 60, 8)
        prefill(target, session, prompt)
        view = draft.drafter
        hidden = forward(view, torch.tensor(context[60:]), 60, lambda pos: Step(session, "decode", pos))
        expected = next_token_distribution(logits_of(view, hidden)[-1], config)
        hidden = forward(target, torch.tensor(context[60:]), 60, lambda pos: Step(session, "decode", pos))
        targets = next_token_distribution(logits_of(target, hidden)[-1], config)
    assert torch.allclose(proposal.probs[0].log(), expected.log(), atol=1e-5)
    # measurably not the target's own distribution (in log-probabilities: 1 % apart somewhere)
    assert (proposal.probs[0].log() - targets.log()).abs().max() > 1e-2


def test_sampling_with_an_int8_draft_matches_target_chi_square():
    """The first three tokens over 1000 seeds (top-k 3, gamma 3) match the target's exact joint
    distribution: the int8 draft's proposals are judged with the distribution they were drawn from. Two layers:
    the int8 self-draft of one agrees with it so often that a wrong acceptance rule would hardly show."""
    target = sharpened(0, layers=2)
    prompt = random_ids(24, seed=5)
    kw = dict(do_sample=True, top_k=3, temperature=1.0)
    draft = make_draft("self", target, draft="snapkv:budget_tokens=8,window_size=2", draft_weights="int8")
    runs, counts = 1000, {}
    out = sampled_runs(target, prompt, draft, runs, gamma=3, max_new_tokens=4, stop_at_eos=False, **kw)
    for g in out:
        counts[tuple(g.token_ids[:3])] = counts.get(tuple(g.token_ids[:3]), 0) + 1
    assert sum(g.stats.drafted_tokens for g in out) > runs
    assert all(" int8" in g.stats.draft for g in out)  # every row drafted with the int8 view
    expected = target_joint(target, prompt, SamplingConfig(**kw), 3)
    assert chi_square_p_value(counts, expected, runs) > SIGNIFICANCE


@pytest.mark.parametrize("kind,weights,match", [
    ("self", "int4", "draft_weights must be one of same, int8"),
    ("draft_model", "fp8", "draft_weights must be one of same, int8"),
    ("prompt_lookup", "int8", "runs no model"),
])
def test_bad_draft_weights_raise(kind, weights, match):
    with pytest.raises(attnkit.AttnkitError, match=match):
        make_draft(kind, draft_weights=weights)


def test_draft_weights_in_recipe_and_cli(models, capsys):
    target, _ = models
    recipe = as_recipe({"decode": {"speculate": "self", "draft": "snapkv:budget_tokens=24,window_size=4",
                                   "draft_weights": "int8", "gamma": 3}})
    assert as_recipe(recipe.to_dict()).decode.draft_weights == "int8"
    prompt = repetitive_prompt()
    out = recipe.generate(target, prompt, max_new_tokens=12, stop_at_eos=False)
    assert out.token_ids == attnkit.generate(target, prompt, max_new_tokens=12, stop_at_eos=False).token_ids
    assert " int8" in out.stats.draft
    with pytest.raises(attnkit.AttnkitError, match="decode.draft_weights must be one of same, int8"):
        as_recipe({"decode": {"speculate": "self", "draft_weights": "int4"}})
    model = f"random:llama:{SMALL}"
    text = "abcabcabcabcabcabc"
    assert main(["generate", "--model", model, "--prompt", text, "--max-new-tokens", "8", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", model, "--prompt", text, "--max-new-tokens", "8", "--json", "--speculate",
                 "self", "--draft", "snapkv:budget_tokens=8,window_size=2", "--draft-weights", "int8"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["draft_weight_bytes"] > 0
