"""A stacked decode step (several generations' steps as one, each row at its own position: ``Step.per_row``, what
the vLLM host runs for requests of a per-step method) equals each generation's own step: the same outputs, the same
entries kept in the same order, the same per-entry statistics and method states afterwards."""

import pytest
import torch

from attnkit.cache import KVCache, LayerKV
from attnkit.methods.base import resolve_method
from attnkit.session import Session, Step, stack_states

HEADS, KV, D, SCALE = 4, 2, 16, 0.25
PROMPTS = (20, 31, 26)  # each generation its own prompt length, generation length and position
NEW = (40, 50, 60)


def _tokens(gen, n):
    return (torch.randn(1, HEADS, n, D, generator=gen), torch.randn(1, KV, n, D, generator=gen),
            torch.randn(1, KV, n, D, generator=gen))


def _generation(method, prompt_len, new, seed, steps):
    """A one-layer session of `method` after a random prompt and `steps` decode steps."""
    gen = torch.Generator().manual_seed(seed)
    session = Session(method, KVCache(1, 1), 1, prompt_len, new)
    Step(session, "prefill", torch.arange(prompt_len)).attention(0, *_tokens(gen, prompt_len), SCALE, None)
    for t in range(steps):
        Step(session, "decode", torch.tensor([prompt_len + t])).attention(0, *_tokens(gen, 1), SCALE, None)
    return session, gen


def _stacked_step(sessions, inputs, positions):
    """One stacked step of `sessions` (their states and caches stacked, then put back, as the vLLM host does)."""
    method = sessions[0].method
    stacked = method.stack_states([s.layer_state[0] for s in sessions], [s.state for s in sessions])
    assert stacked is not None
    layers = [s.cache.layers[0] for s in sessions]
    kv = LayerKV(*(torch.cat([getattr(layer, name) for layer in layers]) for name in ("keys", "values", "positions")),
                 layers[0].length, extras={n: torch.cat([layer.extras[n] for layer in layers]) for n in layers[0].extras})
    session = Session(method, KVCache(1, len(sessions)), 1, torch.tensor([s.prompt_len for s in sessions]),
                      torch.tensor([s.max_new_tokens for s in sessions]))
    session.layer_state[0], session.state = stacked
    session.cache.layers[0] = kv
    q, k, v = (torch.cat([x[i] for x in inputs]) for i in range(3))
    out = Step(session, "decode", torch.tensor(positions).view(-1, 1, 1), per_row=True).attention(0, q, k, v, SCALE,
                                                                                                    None)
    method.unstack_states(stacked, [s.layer_state[0] for s in sessions], [s.state for s in sessions])
    for r, s in enumerate(sessions):
        s.cache.layers[0] = LayerKV(kv.keys[r:r + 1], kv.values[r:r + 1], kv.positions[r:r + 1], kv.length,
                                    extras={n: t[r:r + 1] for n, t in kv.extras.items()})
    return out


@pytest.mark.parametrize("spec", ["h2o:budget_tokens=16", "keyformer:budget_tokens=16", "tova:budget_tokens=16",
                                  "keyformer:budget_tokens=12,noise=gaussian,recent=0.5,tau_end=3",
                                  "a_shape:n_init=4,n_local=8+h2o:budget_tokens=16"])
def test_a_stacked_step_equals_each_generations_own(spec):
    method = resolve_method(spec)
    assert method.stacks_decode
    mine = [_generation(method, n, new, seed, 3 + seed) for seed, (n, new) in enumerate(zip(PROMPTS, NEW))]
    theirs = [_generation(method, n, new, seed, 3 + seed) for seed, (n, new) in enumerate(zip(PROMPTS, NEW))]
    steps = [3 + seed for seed in range(len(PROMPTS))]
    for _ in range(4):  # stacked steps in a row, then each generation's own step: the states carry over
        positions = [n + t for n, t in zip(PROMPTS, steps)]
        inputs = [_tokens(gen, 1) for _, gen in mine]
        own = [Step(s, "decode", torch.tensor([p])).attention(0, *x, SCALE, None)
               for (s, _), p, x in zip(theirs, positions, inputs)]
        together = _stacked_step([s for s, _ in mine], inputs, positions)
        assert torch.equal(together, torch.cat(own))
        for (a, _), (b, _) in zip(mine, theirs):
            ka, kb = a.cache.layers[0], b.cache.layers[0]
            assert ka.length == kb.length
            assert torch.equal(ka.view()[2], kb.view()[2]) and torch.equal(ka.view()[0], kb.view()[0])
            for name in kb.extras:
                assert torch.equal(ka.extras[name][:, :, :ka.length], kb.extras[name][:, :, :kb.length]), name
        steps = [t + 1 for t in steps]
    for (a, gen), (b, _), n, t in zip(mine, theirs, PROMPTS, steps):  # then an own step each: the states put back
        x, p = _tokens(gen, 1), n + t  # go on alike
        assert torch.equal(Step(a, "decode", torch.tensor([p])).attention(0, *x, SCALE, None),
                           Step(b, "decode", torch.tensor([p])).attention(0, *x, SCALE, None))


@pytest.mark.parametrize("spec", ["h2o:budget_tokens=16,decode_every=4", "keyformer:budget_tokens=16,score=shared",
                                  "snapkv:budget_tokens=16,window_size=4"])
def test_methods_whose_steps_differ_per_generation_do_not_stack(spec):
    method = resolve_method(spec)
    assert not method.stacks_decode
    sessions = [_generation(method, n, new, seed, 2)[0] for seed, (n, new) in enumerate(zip(PROMPTS, NEW))]
    assert method.stack_states([s.layer_state[0] for s in sessions], [s.state for s in sessions]) is None


def test_states_that_differ_beyond_their_rows_do_not_stack():
    method = resolve_method("h2o:budget_tokens=16")
    a, b = (_generation(method, n, 40, seed, 2)[0] for seed, n in enumerate((20, 31)))
    assert method.stack_states([a.layer_state[0], b.layer_state[0]], [a.state, b.state]) is not None
    b.layer_state[0].recent = 3  # another recent window: the same step would not be each one's own
    assert method.stack_states([a.layer_state[0], b.layer_state[0]], [a.state, b.state]) is None
    assert stack_states([torch.zeros(1, 2), torch.zeros(2, 2)]) == (False, None)  # a tensor of two rows

