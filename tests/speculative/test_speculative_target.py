"""The target's side of speculation (attnkit.speculative.target): VerifyingFull's multi-token verification
forwards and the draft cache filled inside the target's prompt pass (prefill_sessions)."""

import pytest
import torch

import attnkit
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.base import resolve_method
from attnkit.sampling import SamplingConfig
from attnkit.session import Step, new_session
from attnkit.speculative import DraftRun, ModelDraft
from attnkit.speculative.rollback import drop_newest
from attnkit.speculative.target import VerifyingFull, prefill_sessions
from helpers import SMALL, _filled, random_ids


@pytest.mark.parametrize("model_spec", [
    f"random:llama:{SMALL}",
    "random:mistral:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128,sliding_window=20",
])
def test_verifying_full_steps_equal_one_token_decoding(greedy_models, model_spec):
    """VerifyingFull's verification forwards (mask built once per forward and shared by the layers, for
    a single query too) give the logits of plain one-token decoding with ``full``, forward after
    forward, across rollbacks."""
    model = greedy_models[0] if model_spec == f"random:llama:{SMALL}" else attnkit.load_model(model_spec)
    ids = random_ids(40, seed=5)
    with torch.inference_mode():
        a = new_session(model, VerifyingFull(), 40, 20)
        prefill(model, a, ids)
        b = new_session(model, resolve_method("full"), 40, 20)
        prefill(model, b, ids)
        pos = 40
        for extra in ([5, 77, 130], [9], [200, 3, 4, 5, 6], [11, 12]):
            multi = logits_of(model, forward(model, torch.tensor(extra), pos,
                                             lambda p: Step(a, "prefill", p, False), all_positions=True))
            single = []
            for i, t in enumerate(extra):
                single.append(logits_of(model, forward(model, torch.tensor([t]), pos + i,
                                                       lambda p: Step(b, "decode", p)))[-1])
            assert torch.allclose(multi, torch.stack(single), atol=1e-5)
            dropped = min(1, len(extra) - 1)  # roll back the last token (when there are several)
            drop_newest(a, dropped)
            drop_newest(b, dropped)
            pos += len(extra) - dropped


@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=12,window_size=4", "keyformer:budget_tokens=12,score=shared",
                                  "streaming:budget_tokens=12,sinks=2"])
def test_shared_prompt_pass_builds_the_same_draft_cache(greedy_models, spec):
    """The self-draft's cache filled inside the target's prompt pass (no attention output of its own)
    is the cache its own prompt pass builds. (For the eviction methods, which attend in full over the
    prompt; a sparse-prefill draft such as ``window`` gets the target's exact keys instead of its own.)"""
    model, _ = greedy_models
    prompt = random_ids(40, seed=6)
    run = DraftRun(model, prompt, 10, SamplingConfig(), None, chunk_size=16)
    shared, alone = (ModelDraft(None, spec, share_prefill=flag) for flag in (True, False))
    target = new_session(model, resolve_method("full"), 40, 10)
    with torch.inference_mode():
        prefill_sessions(model, [target, shared.start(run)], prompt, 16)
    assert alone.start(run) is None
    assert type(shared.session.method) is type(alone.session.method)  # the wrapper is gone after the pass
    for (ka, va, pa, ea), (kb, vb, pb, eb) in zip(_filled(shared.session), _filled(alone.session)):
        assert torch.equal(pa, pb) and torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
        assert all(torch.allclose(ea[k], eb[k], atol=1e-4) for k in ea)
