"""positions=reindexed on prompt scorers (kvpress's KeyRerotationPress around any ScorerPress): at an unlimited budget
equal to full on every architecture, batched; the kept entries are those of positions=original, relabelled to the
prompt's last B positions, and every decode step attends exactly as over a cache whose kept keys are rotated from
before RoPE to 0..B-1 with the query at B + i (kvpress's re-rotated cache), for knorm and snapkv; through transformers'
generate (AttnkitCache) the same tokens; bad combinations, a model without RoPE and vLLM refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm.plan import check_supported
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("scorer", ["knorm", "snapkv"])
def test_unlimited_budget_equals_full_batched(arch_models, arch, scorer):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    spec = f"{scorer}:budget_tokens=200,positions=reindexed"
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


def norm_choose(k, n, budget):
    """KNorm by hand: per kv head the `budget` keys of lowest L2 norm."""
    return [sorted(sorted(range(n), key=lambda p: float(k[0, h, p].double().norm()))[:budget])
            for h in range(k.shape[1])]


@pytest.mark.parametrize("scorer", ["knorm", "snapkv"])
def test_reindexed_attends_as_kvpress_rerotated_cache(scorer):
    """The kept entries are positions=original's (knorm: the lowest norms, by hand); every decode output equals
    attention over the kept keys rotated from before RoPE to 0..B-1 and the generated ones after them, the query at
    B + i."""
    q_raw, k_raw, v = qkv(60, seed=91)
    n, budget = 44, 16
    at = torch.arange(q_raw.shape[2])
    q, k = ROPE.rotate(q_raw, at), ROPE.rotate(k_raw, at)
    params = {"budget_tokens": budget, **({"window_size": 4, "kernel_size": 1} if scorer == "snapkv" else {})}
    kept = drive(attnkit.make_method(scorer, **params), q, k, v, n)[2][0]
    if scorer == "knorm":
        assert kept == norm_choose(k, n, budget)
    _, outs, held = drive(attnkit.make_method(scorer, positions="reindexed", **params), q, k, v, n)
    assert held[0] == [list(range(n - budget, n))] * k.shape[1]  # relabelled: the prompt's last B positions
    g, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    for i, out in enumerate(outs):
        for head in range(q.shape[1]):
            entries = torch.tensor(kept[head // g] + list(range(n, n + i + 1)))
            keys = ROPE.rotate(k_raw[0, head // g, entries], torch.arange(len(entries)))
            query = ROPE.rotate(q_raw[0, head, n + i:n + i + 1], budget + i)
            want = torch.softmax(query @ keys.T * scale, dim=-1) @ v[0, head // g, entries]
            torch.testing.assert_close(out[0, head], want, atol=1e-5, rtol=1e-5)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models):
    ids = random_ids(150, seed=5)
    params = {"budget_tokens": 40, "positions": "reindexed"}
    cache = assert_attnkit_cache_equals_generate(arch_models["llama"], ids, "keydiff", params, 16)
    assert max(cache.kept_lengths()) <= 40 + 16
    original = attnkit.generate(arch_models["llama"], ids, "keydiff", params={"budget_tokens": 40}, max_new_tokens=16,
                                stop_at_eos=False, keep_logits=True)
    reindexed = attnkit.generate(arch_models["llama"], ids, "keydiff", params=params, max_new_tokens=16,
                                 stop_at_eos=False, keep_logits=True)
    assert max((a - b).abs().max().item() for a, b in zip(original.logits[1:], reindexed.logits[1:])) > 1e-4


def test_vllm_refuses_reindexed_in_one_line():
    check_supported(parse_method_spec("knorm:budget=0.3"), "test")
    with pytest.raises(AttnkitError, match="rewrites keys") as caught:
        check_supported(parse_method_spec("knorm:budget=0.3,positions=reindexed"), "test")
    assert "\n" not in str(caught.value)


def test_a_model_without_rope_is_refused():
    q, k, v = qkv(30, seed=92)
    with pytest.raises(AttnkitError, match="rotary embedding"):
        drive(attnkit.make_method("knorm", budget_tokens=8, positions="reindexed"), q, k, v, 24, rope=None)


@pytest.mark.parametrize("spec,name", [("knorm:budget=0.5,positions=new", "positions"),
                                       ("knorm:budget=0.5,positions=reindexed,decode_every=4", "decode_every"),
                                       ("knorm:budget=0.5,positions=reindexed,head_budgets=adaptive", "head_budgets"),
                                       ("snapkv:budget=0.5,positions=reindexed,block_size=16", "block_size"),
                                       ("kvzip:budget=0.5,positions=reindexed", "reconstruction"),
                                       ("kvgrad:budget=0.5,positions=reindexed", "reconstruction")])
def test_bad_combinations_are_refused_in_one_line(spec, name):
    with pytest.raises(AttnkitError, match=name) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)
