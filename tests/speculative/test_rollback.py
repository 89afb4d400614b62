"""Rolling caches back after a verification (attnkit.speculative.rollback): dropping the newest entries of
the target's cache, snapshots of an evicting draft's session, and what cannot be undone."""

import dataclasses

import pytest
import torch

import attnkit
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.base import resolve_method
from attnkit.sampling import SamplingConfig
from attnkit.session import Step, new_session
from attnkit.speculative import DraftRun, ModelDraft
from attnkit.speculative.rollback import drop_newest, snapshot_session
from helpers import _filled, random_ids


def test_target_rollback_is_exact(greedy_models):
    """A multi-token verification forward (prefill step after the prompt) gives the logits of feeding
    the tokens one by one, and dropping the newest entries (LayerKV.length) leaves the cache of the
    accepted prefix."""
    model, _ = greedy_models
    ids = random_ids(40, seed=2)
    extra = [5, 77, 130, 9]
    full = resolve_method("full")
    with torch.inference_mode():
        a = new_session(model, full, 40, 10)
        prefill(model, a, ids)
        multi = logits_of(model, forward(model, torch.tensor(extra), 40, lambda pos: Step(a, "prefill", pos, False),
                                         all_positions=True))
        b = new_session(model, full, 40, 10)
        prefill(model, b, ids)
        single = []
        for i, t in enumerate(extra[:2]):
            single.append(logits_of(model, forward(model, torch.tensor([t]), 40 + i,
                                                   lambda pos: Step(b, "decode", pos)))[-1])
        assert torch.allclose(multi[:2], torch.stack(single), atol=1e-5)
        drop_newest(a, len(extra) - 2)  # accept extra[:2]
        for la, lb in zip(a.cache.layers, b.cache.layers):
            ka, va, pa = la.view()
            kb, vb, pb = lb.view()
            assert torch.equal(pa, pb) and torch.allclose(ka, kb, atol=1e-6) and torch.allclose(va, vb, atol=1e-6)
        # continuing after the rollback overwrites the stale slots
        nxt = [logits_of(model, forward(model, torch.tensor([200]), 42,
                                        lambda pos, s=s: Step(s, "decode", pos)))[-1] for s in (a, b)]
        assert torch.allclose(nxt[0], nxt[1], atol=1e-5)


def _state_equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, Step):
        return True  # the step a method remembers is compared by behaviour below
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x) is type(y) and all(_state_equal(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    if isinstance(x, (bool, int, float, str, type(None))):
        return x == y
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_state_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_state_equal(a, b) for a, b in zip(x, y))
    return True  # other objects (the Step a method remembers) are compared by behaviour below


def test_rollback_refuses_what_it_cannot_undo(greedy_models):
    """drop_newest: a count outside 0..length, or a ring cache (its dropped slots overwrote older
    entries), is a clear error naming the value."""
    model, _ = greedy_models
    ids = random_ids(40, seed=2)
    with torch.inference_mode():
        full = new_session(model, resolve_method("full"), 40, 10)
        prefill(model, full, ids)
        for bad in (41, -1):
            with pytest.raises(attnkit.AttnkitError, match=f"cannot drop the newest {bad} of 40 entries"):
                drop_newest(full, bad)
        drop_newest(full, 0)
        drop_newest(full, 3)
        assert all(kv.length == 37 for kv in full.cache.layers)
        ring = new_session(model, resolve_method("window", {"window": 16}), 40, 10)
        prefill(model, ring, ids)
        with pytest.raises(attnkit.AttnkitError, match="ring-buffer cache"):
            drop_newest(ring, 1)


@pytest.mark.parametrize("spec", ["streaming:budget_tokens=12,sinks=2", "h2o:budget_tokens=12,recent_tokens=4",
                                  "keyformer:budget_tokens=12,score=shared", "full",
                                  "snapkv:budget_tokens=12,window_size=4",
                                  "rkv:budget_tokens=12,window_size=4,decode_every=3"])
def test_draft_rollback_equals_feeding_only_accepted_tokens(greedy_models, spec):
    """After propose(gamma) + feedback(n), the draft's session (slots, positions, score buffers, layer
    and shared state) is what feeding only the accepted tokens produces, for every n."""
    model, _ = greedy_models
    prompt = random_ids(30, seed=4)
    run = DraftRun(model, prompt, 20, SamplingConfig(), None)
    gamma = 5
    for accepted in range(gamma + 1):
        d = ModelDraft(model if spec == "full" else None, spec, share_prefill=False)
        d.start(run)
        context = prompt.tolist() + [3]
        drafted = d.propose(context, gamma).tokens
        d.feedback(accepted)
        ref = ModelDraft(model if spec == "full" else None, spec, share_prefill=False)
        ref.start(run)
        # the reference feeds the context and the accepted drafts (all but the last when every draft
        # passed: the draft never feeds its last token) through the same one-token steps
        fed = context + drafted[:min(accepted, gamma - 1)]
        for i in range(ref.cached, len(fed)):
            ref._feed(fed[i:i + 1], i)
        ref.cached = len(fed)
        assert d.cached == ref.cached == len(context) + min(accepted, gamma - 1)
        fa, fb = _filled(d.session), _filled(ref.session)
        for (ka, va, pa, ea), (kb, vb, pb, eb) in zip(fa, fb):
            assert torch.equal(pa, pb)
            assert torch.allclose(ka, kb, atol=1e-6) and torch.allclose(va, vb, atol=1e-6)
            assert ea.keys() == eb.keys() and all(torch.allclose(ea[k], eb[k], atol=1e-5) for k in ea)
        assert _state_equal(d.session.layer_state, ref.session.layer_state)
        assert _state_equal(d.session.state, ref.session.state)
        # and both continue identically
        nxt = context + drafted[:accepted] + [42]
        assert d.propose(nxt, 3).tokens == ref.propose(nxt, 3).tokens


def test_snapshots_are_independent_copies(greedy_models):
    model, _ = greedy_models
    d = ModelDraft(None, "h2o:budget_tokens=10,recent_tokens=3", share_prefill=False)
    d.start(DraftRun(model, random_ids(20), 10, SamplingConfig(), None))
    d.propose(random_ids(20).tolist() + [4], 1)
    snap = snapshot_session(d.session)
    before = [kv.extras["score"].clone() for kv in snap.layers]
    d.propose(random_ids(20).tolist() + [4, 6], 2)
    assert all(torch.equal(b, kv.extras["score"]) for b, kv in zip(before, snap.layers))
