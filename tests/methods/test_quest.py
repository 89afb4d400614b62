"""quest: the page summaries and bounds, the page choice, the kernels (C++ on the CPU, Triton in its interpreter)
against the torch reference, exactness at a covering budget on every architecture (batched, through AttnkitCache),
the bytes held and read, chunked prefill, sliding windows, and the refusals."""

import os

import pytest
import torch

import attnkit
from attnkit import AttnkitError, native
from attnkit.cache import KVCache, LayerKV
from attnkit.hf_cache import AttnkitCache
from attnkit.methods import quest_native
from attnkit.methods.quest_pages import PagedLayerKV, choose_pages, gathered_attention, page_bounds
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Session, Step
from attnkit.speculative import speculative_generate
from helpers import SMALL, randn, random_ids

torch.set_num_threads(1)
NEW = 12


@pytest.fixture(scope="module")
def models():
    return {"llama": attnkit.load_model(f"random:llama:{SMALL}"),
            "mistral": attnkit.load_model(f"random:mistral:{SMALL},sliding_window=64"),
            "qwen3": attnkit.load_model(f"random:qwen3:{SMALL}")}


def run(model, prompts, spec, **options):
    return attnkit.generate(model, prompts, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True, **options)


def worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


# ---- summaries, bounds, choice ------------------------------------------------------------------------
def paged(keys, page_size):
    b, kv, n, d = keys.shape
    layer = PagedLayerKV.around(LayerKV.allocate(b, kv, 8, d, keys.dtype, keys.device), page_size)
    return layer


@pytest.mark.parametrize("chunks", [[45], [7, 1, 1, 20, 16], [1] * 45])
def test_summaries_are_each_pages_min_and_max_however_the_keys_arrive(chunks):
    keys = randn(2, 3, 45, 8, seed=1)
    layer = paged(keys, 16)
    start = 0
    for n in chunks:  # appended in these pieces (growing the layer past its first capacity)
        layer.append(keys[:, :, start:start + n], keys[:, :, start:start + n], torch.arange(start, start + n))
        start += n
    assert layer.pages == 3
    for p in range(3):
        page = keys[:, :, 16 * p:16 * (p + 1)]
        assert torch.equal(layer.page_min[:, :, p], page.amin(2)) and torch.equal(layer.page_max[:, :, p], page.amax(2))
    assert layer.nbytes() == layer.keys.nbytes * 2 + layer.page_min.nbytes * 2


def test_the_bound_is_at_least_every_logit_of_its_page():
    keys, q = randn(2, 2, 64, 8, seed=2), randn(2, 4, 1, 8, seed=3)
    layer = paged(keys, 16)
    layer.append(keys, keys, torch.arange(64))
    bounds = page_bounds(q, layer.page_min[:, :, :4], layer.page_max[:, :, :4])  # [b, kv, g, pages]
    logits = (q.reshape(2, 2, 2, 1, 8) @ keys.unsqueeze(2).transpose(-1, -2)).squeeze(-2)  # [b, kv, g, 64]
    page_max = logits.unflatten(-1, (4, 16)).amax(-1)
    assert (bounds >= page_max - 1e-5).all()


def test_choice_keeps_the_last_page_and_the_highest_bounds_and_the_first_only_when_asked():
    bounds = torch.tensor([[[[0.0, 5.0, 1.0, 9.0, 2.0, -3.0]], [[7.0, 0.5, 0.1, 0.2, 8.0, 0.0]]]])  # [1, 2, 1, 6]
    assert choose_pages(bounds, 4, False).tolist() == [[[[1, 3, 4, 5]], [[0, 1, 4, 5]]]]
    assert choose_pages(bounds, 4, False, first=True).tolist() == [[[[0, 1, 3, 5]], [[0, 1, 4, 5]]]]
    # a sliding window hides slots below 40 (pages 0 and 1 of 16): never chosen over a visible page, never forced
    for first in (False, True):
        assert choose_pages(bounds, 3, False, visible_from=40, first=first).tolist() == [[[[3, 4, 5]], [[3, 4, 5]]]]
    two_heads = torch.cat([bounds, -bounds], dim=2)  # the group's second head ranks the other way
    assert choose_pages(two_heads, 3, True)[0, 0].tolist() == [[1, 3, 5], [0, 2, 5]]
    assert choose_pages(two_heads, 3, False)[0, 0].tolist() == [[1, 3, 5]]  # the group's maximum
    assert choose_pages(two_heads, 3, True, first=True)[0, 0].tolist() == [[0, 3, 5], [0, 2, 5]]
    assert choose_pages(two_heads, 3, False, first=True)[0, 0].tolist() == [[0, 3, 5]]


@pytest.mark.parametrize("first_page", [False, True])
@pytest.mark.parametrize("per_query_head", [False, True])
def test_a_step_is_dense_attention_over_a_mask_of_the_pages_of_highest_bound(first_page, per_query_head):
    """An independent reference in plain torch (no page summaries, no gather): each page's bound taken from its keys,
    the pages ranked by it (a kv group by its heads' maximum, or each query head its own), the current page forced
    (the first too with ``first_page``), then softmax over the logits with every other slot masked. At
    ``token_budget=64`` over 200 entries the step reads 4 pages of 16 of 13, three or four of them by bound."""
    method = parse_method_spec(f"quest:token_budget=64,dense_layers=0,first_page={str(first_page).lower()},"
                               f"per_query_head={str(per_query_head).lower()}")
    n, d, scale = 200, 16, 0.25
    q, k, v = randn(2, 4, n + 1, d, seed=21), randn(2, 2, n + 1, d, seed=22), randn(2, 2, n + 1, d, seed=23)
    k[:, :, :16] *= 0.1  # a first page of low bounds: chosen only when forced
    session = Session(method, KVCache(1, 2), 1, n, 2)
    Step(session, "prefill", torch.arange(n)).attention(0, q[:, :, :n], k[:, :, :n], v[:, :, :n], scale, None)
    out = Step(session, "decode", torch.tensor([n])).attention(0, q[:, :, n:], k[:, :, n:], v[:, :, n:], scale, None)

    keys, values, query = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), q[:, :, n]  # [2, 4, n+1, d]
    pages = -(-(n + 1) // 16)
    bound = torch.stack([(torch.maximum(query[:, :, None] * keys[:, :, s:s + 16].amin(2)[:, :, None],
                                        query[:, :, None] * keys[:, :, s:s + 16].amax(2)[:, :, None])).sum(-1)[:, :, 0]
                         for s in range(0, n + 1, 16)], dim=-1)  # [2, 4, pages]
    if not per_query_head:
        bound = bound.view(2, 2, 2, pages).amax(2, keepdim=True).expand(2, 2, 2, pages).reshape(2, 4, pages)
    bound[..., -1] = float("inf")
    if first_page:
        bound[..., 0] = float("inf")
    chosen = bound.topk(4, dim=-1).indices  # [2, 4, 4]
    mask = torch.zeros(2, 4, pages, dtype=torch.bool).scatter_(-1, chosen, True).repeat_interleave(16, -1)[..., :n + 1]
    logits = (query[:, :, None] @ keys.transpose(-1, -2))[:, :, 0] * scale
    expected = logits.masked_fill(~mask, float("-inf")).softmax(-1)[:, :, None] @ values  # [2, 4, 1, d]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert bool(mask[..., 0].all()) == first_page  # the low first page: read only when forced


# ---- kernels --------------------------------------------------------------------------------------------
BUILDS = [i for i in native.runnable() if i != "native"] or ["native"]  # every instruction set this CPU runs
CASES = [(32, 1, 0, 200), (32, 2, 0, 200), (24, 1, 0, 197), (16, 2, 37, 181)]  # d (= dv), choices, lo, length


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("d,c,lo,length", CASES)
def test_the_cpu_kernel_equals_the_gathered_reference(monkeypatch, build, d, c, lo, length):
    """The kernel built for each instruction set this CPU runs (AVX2 and AVX-512 on an x86-64 CPU with both)."""
    monkeypatch.setenv(native.ENV_ISA, build)
    if quest_native.library() is None:
        pytest.skip("no C++ compiler on this machine")
    q, keys, values = randn(3, 4, 1, d, seed=4), randn(3, 2, 256, d, seed=5), randn(3, 2, 256, d, seed=6)
    pages = torch.stack([torch.randperm(-(-length // 16), generator=torch.Generator().manual_seed(i))[:5]
                         for i in range(3 * 2 * c)]).reshape(3, 2, c, 5).sort(-1).values
    pages[..., -1] = (length - 1) // 16
    ref = gathered_attention(q, keys, values, pages, 16, length, 0.3, lo)
    out = quest_native.paged_decode(q, keys[:, :, :length], values[:, :, :length], pages, 16, length, 0.3, lo)
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("d,per_head,visible_from", [(32, False, 0), (32, True, 0), (24, False, 70), (16, True, 70)])
def test_the_cpu_page_choice_equals_torchs(monkeypatch, build, d, per_head, visible_from, first):
    monkeypatch.setenv(native.ENV_ISA, build)
    if quest_native.library() is None:
        pytest.skip("no C++ compiler on this machine")
    keys, q = randn(3, 2, 200, d, seed=10), randn(3, 4, 1, d, seed=11)
    layer = paged(keys, 16)
    layer.append(keys, keys, torch.arange(200))
    pages = layer.pages
    summaries = layer.page_min[:, :, :pages], layer.page_max[:, :, :pages]
    ref = choose_pages(page_bounds(q, *summaries), 5, per_head, visible_from, 16, first)
    assert torch.equal(quest_native.choose_pages(q, *summaries, 5, per_head, visible_from, 16, first), ref)


def test_the_triton_kernel_equals_the_gathered_reference():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from attnkit.methods import quest_triton
    q, keys, values = randn(2, 4, 1, 24, seed=7), randn(2, 2, 100, 24, seed=8), randn(2, 2, 100, 16, seed=9)
    for c, lo in ((1, 0), (2, 30)):
        pages = torch.tensor([0, 2, 4, 6])[None, None, None].expand(2, 2, c, 4).contiguous()
        ref = gathered_attention(q, keys, values, pages, 16, 100, 0.25, lo)
        out = quest_triton.paged_decode(q, keys, values, pages, 16, 100, 0.25, lo)
        assert torch.allclose(out, ref, atol=1e-5)


# ---- in a generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["quest:token_budget=2000,dense_layers=0", "quest:budget=1.0,page_size=8,dense_layers=0",
                                  "quest:budget=1.0,dense_layers=1,per_query_head=true"])
def test_a_covering_budget_gives_full_attention_batched(models, arch, spec):
    model = models[arch]
    prompts = [random_ids(n, seed=i).tolist() for i, n in enumerate((150, 150, 97))]
    full, out = run(model, prompts, "full"), run(model, prompts, spec)
    for f, o in zip(full, out):
        assert o.token_ids == f.token_ids and worst(o, f) == 0.0
        assert o.stats.method_stats["quest_read_fraction"] == 1.0


def test_a_small_budget_reads_less_and_holds_full_plus_the_summaries(models):
    model = models["llama"]
    prompt = random_ids(300, seed=1).tolist()
    full, out = run(model, prompt, "full"), run(model, prompt, "quest:token_budget=64,dense_layers=0")
    stats = out.stats.method_stats
    pages = -(-(300 + NEW) // 16)
    # held: full's keys and values, plus two summaries of d floats per page and kv head in each layer
    assert out.stats.peak_kv_bytes == full.stats.peak_kv_bytes + 2 * 2 * 2 * pages * 16 * 4
    # read: 4 pages per kv head (the last partial) and the summaries, of the ~310 entries full reads
    assert 0.15 < stats["quest_read_fraction"] < 0.35
    assert stats["quest_bytes_read_per_step"] < stats["quest_full_bytes_per_step"]
    assert out.token_ids != full.token_ids or worst(out, full) > 1e-3  # it did attend over less


def test_the_cpu_kernel_and_torch_give_the_same_tokens(models, monkeypatch):
    if quest_native.library() is None:
        pytest.skip("no C++ compiler on this machine")
    prompts = [random_ids(200, seed=i).tolist() for i in range(2)]
    spec = "quest:token_budget=48,page_size=8,dense_layers=0,per_query_head=true"
    kernel = run(models["qwen3"], prompts, spec)
    monkeypatch.setattr(quest_native, "kernel_pays", lambda q, k: False)
    torch_path = run(models["qwen3"], prompts, spec)
    for a, b in zip(kernel, torch_path):
        assert a.token_ids == b.token_ids and worst(a, b) < 1e-4


def test_batched_rows_choose_their_own_pages(models):
    prompts = [random_ids(180, seed=i).tolist() for i in range(3)]
    spec = "quest:token_budget=48,dense_layers=0"
    batch = run(models["llama"], prompts, spec)
    for prompt, out in zip(prompts, batch):
        alone = run(models["llama"], prompt, spec)
        assert out.token_ids == alone.token_ids and worst(out, alone) < 1e-4


def test_chunked_prefill_changes_nothing(models):
    prompt = random_ids(230, seed=5).tolist()
    spec = "quest:token_budget=48,dense_layers=0"
    whole, chunked = run(models["llama"], prompt, spec), run(models["llama"], prompt, spec, chunk_size=37)
    assert chunked.token_ids == whole.token_ids and worst(chunked, whole) < 1e-4
    assert chunked.stats.method_stats == whole.stats.method_stats


def test_a_sliding_window_layer_is_never_read_outside_its_window(models):
    """Mistral with a 64-token window: every visible page fits a 96-token budget, so a step reads exactly what full
    attention sees (the pages before the window are never chosen, and the part of a page outside it is masked)."""
    model = models["mistral"]
    prompt = random_ids(260, seed=6).tolist()
    full, out = run(model, prompt, "full"), run(model, prompt, "quest:token_budget=96,dense_layers=0")
    assert out.token_ids == full.token_ids and worst(out, full) < 1e-4
    assert out.stats.method_stats["quest_read_fraction"] < 0.5


def test_through_attnkit_cache(models):
    model = models["llama"]
    ids = random_ids(170, seed=8)
    spec = "quest:token_budget=48,dense_layers=0"
    cache = AttnkitCache(model, parse_method_spec(spec), max_new_tokens=NEW)
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=2)
    assert out[0, 170:].tolist() == run(model, ids.tolist(), spec).token_ids


@pytest.mark.parametrize("spec,message", [
    ("quest", "token_budget"),
    ("quest:token_budget=10", "token_budget"),
    ("quest:token_budget=20,first_page=true", "token_budget"),
    ("quest:token_budget=64,first_page=2", "first_page"),
    ("quest:token_budget=64,budget=0.5", "not both"),
    ("quest:budget=1.5", "budget"),
    ("quest:token_budget=64,per_query_head=2", "per_query_head"),
])
def test_bad_parameters_are_refused_in_one_line(spec, message):
    with pytest.raises(AttnkitError, match=message) as caught:
        parse_method_spec(spec)
    assert "\n" not in str(caught.value)


def test_a_model_with_no_sparse_layer_and_a_multi_token_step_are_refused(models):
    with pytest.raises(AttnkitError, match="dense_layers=2 leaves none of the model's 2 layers"):
        run(models["llama"], random_ids(100).tolist(), "quest:token_budget=64")
    method = parse_method_spec("quest:token_budget=32,dense_layers=0")
    q, k, v = randn(1, 4, 66, 16, seed=1), randn(1, 2, 66, 16, seed=2), randn(1, 2, 66, 16, seed=3)
    session = Session(method, KVCache(1), 1, 64, 2)
    Step(session, "prefill", torch.arange(64)).attention(0, q[:, :, :64], k[:, :, :64], v[:, :, :64], 0.25, None)
    with pytest.raises(AttnkitError, match="one token per step"):
        Step(session, "decode", torch.arange(64, 66)).attention(0, q[:, :, 64:], k[:, :, 64:], v[:, :, 64:], 0.25,
                                                                None)


def test_a_quest_draft_speculates_losslessly(models):
    """Self-speculation with a quest draft (one token per draft step; the target verifies): full's tokens."""
    prompt = random_ids(200, seed=1).tolist()
    out = speculative_generate(models["llama"], prompt, "self", draft="quest:token_budget=32,dense_layers=0", gamma=3,
                               max_new_tokens=NEW, stop_at_eos=False)
    assert out.token_ids == run(models["llama"], prompt, "full").token_ids


def test_after_a_sparse_prefill_and_refused_where_it_cannot_run(models):
    """a_shape's prefill then Quest's decoding (its stats reported through compose); a prompt compression before it
    (compose's first part supplies prefill outputs only, so snapkv's policy would be dropped) and a quantized cache
    (Quest keeps its own storage) are refused in one line."""
    prompt = random_ids(200, seed=2).tolist()
    out = run(models["llama"], prompt, "a_shape:n_init=16,n_local=64,block_size=16+quest:token_budget=32,dense_layers=0")
    assert 0 < out.stats.method_stats["quest_read_fraction"] < 0.5
    for spec, message in (("snapkv:budget=0.5+quest:token_budget=64", "cache policy would be dropped"),
                          ("quest:token_budget=64+kivi", "keeps its own cache storage")):
        with pytest.raises(AttnkitError, match=message) as caught:
            parse_method_spec(spec)
        assert "\n" not in str(caught.value)


def test_a_sweep_budget_is_the_fraction_or_the_tokens_a_step_reads():
    from attnkit.recipe.core import as_recipe
    assert as_recipe("quest", "test").takes_budget() and not as_recipe("quest:token_budget=64", "test").takes_budget()
    fraction, tokens = (as_recipe("quest:dense_layers=0", "test").with_budget(b).method() for b in (0.25, 128))
    assert (fraction.budget, fraction.token_budget, tokens.budget, tokens.token_budget) == (0.25, None, None, 128)
