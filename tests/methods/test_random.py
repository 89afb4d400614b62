"""random (kvpress's RandomPress): equal to full at an unlimited budget on every architecture, batched; the kept
positions are the top-B of ``torch.rand(kv, L)`` from the seeded generator in every layer, for every row of a batch
and however the prompt is chunked; ``decode_every`` re-draws over what is held; through transformers' generate
(AttnkitCache) the same tokens; bad seeds refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids, recompress_dense

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec("random:budget_tokens=200,seed=3"), NEW)


def expected_kept(n: int, kv: int, budget: int, seed: int) -> list[list[int]]:
    draws = torch.rand(kv, n, generator=torch.Generator().manual_seed(seed))
    return [sorted(row.tolist()) for row in draws.topk(budget, dim=-1).indices]


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize("chunk", [None, 37])
def test_kept_positions_are_the_top_of_the_seeded_draws_in_every_layer_and_row(arch_models, seed, chunk):
    model = arch_models["llama"]
    n, budget, kv = 120, 30, model.geometry.n_kv_heads
    method = parse_method_spec(f"random:budget_tokens={budget},seed={seed}")
    ids = torch.stack([random_ids(n, seed=1), random_ids(n, seed=2)])
    session = new_session(model, method, n, 1, rows=2)
    with torch.inference_mode():
        prefill(model, session, ids, chunk_size=chunk)
    want = expected_kept(n, kv, budget, seed)
    for layer in session.cache.layers:
        for row in layer.view()[2]:
            assert [sorted(h.tolist()) for h in row] == want
    other = expected_kept(n, kv, budget, seed + 1)
    assert other != want  # the seed matters


@pytest.mark.parametrize("every", [1, 4])
def test_decode_every_draws_again_over_what_is_held(every):
    q, k, v = qkv(50, seed=5)
    budget, prompt_len, seed = 12, 30, 4
    method = attnkit.make_method("random", budget_tokens=budget, decode_every=every, seed=seed)
    _, _, got = drive(method, q, k, v, prompt_len)

    def choose(h, held, next_pos):
        draws = torch.rand(k.shape[1], len(held), generator=torch.Generator().manual_seed(seed))[h]
        return [held[i] for i in draws.topk(budget).indices.tolist()]

    assert got == recompress_dense(q, k, prompt_len, budget, every, choose)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(150, seed=3), "random",
                                                 {"budget_tokens": 40, "decode_every": 8, "seed": 2}, 16)
    assert max(cache.kept_lengths()) <= 48


@pytest.mark.parametrize("spec", ["random:budget=0.5,seed=-1", "random:budget=0.5,seed=1.5"])
def test_a_bad_seed_is_refused_in_one_line(spec):
    with pytest.raises(AttnkitError, match="seed") as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
