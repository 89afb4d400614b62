"""leverage (Compactor's leverage term, arXiv 2507.08143): equal to full at an unlimited budget on every architecture,
batched; the kept positions equal a plain recomputation of the ridge leverage of the centred keys before RoPE
(sketched or not, the prompt and every ``decode_every`` re-compression); each layer's sketch is the draw kvpress
makes from torch's global generator after ``torch.manual_seed(sketch_seed)``; in the first layer, where a key before
RoPE depends on its token alone, repeated tokens tie up to rounding; through transformers' generate (AttnkitCache)
the same tokens; bad parameters refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.leverage import layer_sketch
from attnkit.methods.spec import parse_method_spec
from attnkit.session import LayerContext, Step, new_session
from helpers import (
    ROPE,
    assert_attnkit_cache_equals_generate,
    assert_equals_full,
    drive,
    randn,
    random_ids,
    recompress_dense,
)

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("leverage:budget_tokens=200"), NEW)
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("leverage:budget_tokens=200,decode_every=3"), NEW)


def raw_and_rotated(n, kv=2, d=8, seed=0):
    """Queries, keys before RoPE, the same keys after RoPE at positions 0..n-1, and values."""
    k_raw = randn(1, kv, n, d, seed=seed + 1)
    return randn(1, 2 * kv, n, d, seed=seed), k_raw, ROPE.rotate(k_raw, torch.arange(n)), randn(1, kv, n, d,
                                                                                                  seed=seed + 2)


def leverage_choose(k_raw, budget, columns, seed):
    """Per kv head: the `budget` held entries of highest x_i^T (X^T X + 0.01 I)^{-1} x_i, X the held keys before RoPE
    minus their mean, times the seeded sketch (layer 0: the first draw), in float64."""
    kv, d = k_raw.shape[1], k_raw.shape[-1]
    sketch = None
    if columns:
        g = torch.Generator().manual_seed(seed)
        sketch = torch.randn(1, kv, d, columns, generator=g).double() / math.sqrt(columns)

    def choose(h, held, next_pos):
        x = k_raw[0, h, held].double()
        x = x - x.mean(dim=0)
        if sketch is not None:
            x = x @ sketch[0, h]
        inverse = torch.linalg.inv(x.T @ x + 0.01 * torch.eye(x.shape[1], dtype=torch.float64))
        score = [(x[i] @ inverse @ x[i]).item() for i in range(len(held))]
        order = sorted(range(len(held)), key=lambda i: -score[i])
        return [held[i] for i in order[:budget]]
    return choose


@pytest.mark.parametrize("columns,every", [(0, 0), (6, 0), (12, 0), (0, 3), (5, 4)])
def test_kept_positions_equal_a_plain_recomputation(columns, every):
    q, k_raw, k, v = raw_and_rotated(64, seed=31)
    budget, prompt_len, seed = 18, 45, 7
    method = attnkit.make_method("leverage", budget_tokens=budget, decode_every=every, sketch_dimension=columns,
                                 sketch_seed=seed)
    _, _, got = drive(method, q, k, v, prompt_len)
    assert got == recompress_dense(q, k, prompt_len, budget, every, leverage_choose(k_raw, budget, columns, seed))


def test_the_seed_and_the_sketch_change_the_choice():
    q, _, k, v = raw_and_rotated(64, seed=3)
    kept = {(c, s): drive(attnkit.make_method("leverage", budget_tokens=16, sketch_dimension=c, sketch_seed=s),
                          q, k, v, 48)[2][0] for c, s in ((3, 0), (3, 1), (0, 0))}
    assert len({str(v) for v in kept.values()}) == 3


def test_each_layers_sketch_is_kvpress_draw_after_manual_seed():
    """kvpress draws ``randn(batch, kv, d, k) / sqrt(k)`` per layer, in layer order, from torch's global generator:
    seeded right before the prompt, layer l's is the (l + 1)-th draw, which is what attnkit takes."""
    kv, d, k, seed = 2, 16, 48, 11
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        draws = [torch.randn(1, kv, d, k, dtype=torch.float32) * (1 / math.sqrt(k)) for _ in range(3)]
    for layer, want in enumerate(draws):
        assert torch.equal(layer_sketch(seed, layer, kv, d, k, torch.float32, "cpu"), want)
    assert not torch.equal(layer_sketch(seed + 1, 0, kv, d, k, torch.float32, "cpu"), draws[0])


def test_first_layer_repeated_tokens_tie_up_to_rounding(arch_models):
    """In the first layer a key before RoPE depends on its token alone, so the entries of one token have the same
    leverage in exact arithmetic; attnkit turns the cached keys back from RoPE, so their scores agree only up to
    rounding and the tie is broken by it (kvpress's keys, projected again from the hidden states, tie exactly and
    torch.topk picks among them: docs/methods.md, the one way the two kept sets may differ)."""
    model = arch_models["llama"]
    ids = torch.tensor([5, 9, 5, 7, 5, 9, 11, 13] * 12)
    method = attnkit.make_method("leverage", budget_tokens=1000)
    session = new_session(model, method, ids.shape[-1], 1)
    with torch.inference_mode():
        prefill(model, session, ids)
    ctx = LayerContext(Step(session, "prefill", torch.arange(ids.shape[-1])), 0, 1.0, None)
    scores = method.rank(ctx)[0]
    for token in (5, 9):
        where = (ids == token).nonzero().flatten()
        same = scores[:, where]
        torch.testing.assert_close(same, same[:, :1].expand_as(same), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(scores[:, 0], scores[:, 1], rtol=1e-2)  # other tokens: other scores


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "leverage",
                                                 {"budget_tokens": 40, "decode_every": 8}, 16)
    assert max(cache.kept_lengths()) <= 48


def test_a_model_without_rotary_embedding_is_refused():
    q, _, k, v = raw_and_rotated(40)
    with pytest.raises(AttnkitError, match="before RoPE") as caught:
        drive(attnkit.make_method("leverage", budget_tokens=10), q, k, v, 30, rope=None)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,name", [("leverage:budget=0.5,sketch_dimension=-1", "sketch_dimension"),
                                       ("leverage:budget=0.5,sketch_dimension=2.5", "sketch_dimension"),
                                       ("leverage:budget=0.5,sketch_seed=-3", "sketch_seed"),
                                       ("leverage:sketch_dimension=8", "budget")])
def test_bad_parameters_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
