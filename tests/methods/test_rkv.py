"""rkv (R-KV, arXiv 2505.24133): equal to full at an unlimited budget on every architecture, in a batch and inside
transformers' generate (AttnkitCache); at a small budget the cache holds at most B + decode_every entries per kv
head, is compressed back to B every decode_every tokens and keeps the observation window; the kept positions
equal a plain float64 recomputation of the paper's score step by step; the redundancy term penalises the older
copies of a repeated key; vLLM and prompt lookup refuse it, self-speculation drafts with it; bad parameters are
refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.rkv import RKV, redundancy, rkv_score
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Step, layer_contexts, new_session
from attnkit.speculative import speculative_generate
from attnkit.speculative.model_draft import check_lookup_cache
from attnkit.vllm.config import EngineConfig
from helpers import assert_equals_full, drive, per_token_bytes, qkv, random_ids, recompress_dense, repetitive_prompt

torch.set_num_threads(1)

NEW = 12


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


# ---- unlimited budget: exactly full -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["rkv:budget_tokens=200", "rkv:budget_tokens=162,decode_every=3,window_size=4"])
def test_unlimited_budget_equals_full(models, arch, spec):
    assert_equals_full(models[arch], random_ids(150, seed=3), parse_method_spec(spec), NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unlimited_budget_equals_full_in_a_batch(models, arch):
    prompts = [random_ids(n, seed=7 + n).tolist() for n in (120, 95, 120)]
    assert_equals_full(models[arch], prompts, parse_method_spec("rkv:budget_tokens=300,decode_every=2"), NEW)


@pytest.mark.parametrize("params", [{"budget_tokens": 400, "decode_every": 2}, {"budget_tokens": 40, "decode_every": 5},
                                    {"budget": 0.3, "window_size": 4}])
def test_model_generate_through_attnkit_cache_equals_attnkit_generate(models, params):
    model, ids, n = models["llama"], random_ids(150, seed=3), 20
    ours = attnkit.generate(model, ids, "rkv", params=params, max_new_tokens=n, stop_at_eos=False, keep_logits=True)
    cache = AttnkitCache(model, "rkv", params=params, max_new_tokens=n)
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=n, do_sample=False, eos_token_id=None,
                            pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    assert out.sequences[0, 150:].tolist() == ours.token_ids
    assert max((a[0] - b).abs().max().item() for a, b in zip(out.logits, ours.logits)) < 1e-4
    assert cache.nbytes() == ours.stats.final_kv_bytes
    if params.get("budget_tokens", 0) < 150:
        assert max(cache.kept_lengths()) < 150
    else:  # never compressed: full's tokens
        full = attnkit.generate(model, ids, "full", max_new_tokens=n, stop_at_eos=False)
        assert ours.token_ids == full.token_ids


# ---- small budget: the cache's size and the recent window ---------------------------------------------------
@pytest.mark.parametrize("every", [1, 4])
def test_the_cache_holds_at_most_budget_plus_interval_and_keeps_the_window(models, every):
    model, n, budget, window, steps = models["llama"], 100, 32, 8, 30
    method = parse_method_spec(f"rkv:budget_tokens={budget},decode_every={every},window_size={window}")
    session = new_session(model, method, n, steps)
    assert [method.planned_slots(ctx) for ctx in layer_contexts(session)] == [budget + every] * 2
    lengths = []
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=5))).argmax())
        for i in range(steps):
            hidden = forward(model, torch.tensor([token]), n + i, lambda p: Step(session, "decode", p))
            token = int(logits_of(model, hidden[-1:]).argmax())
            lengths.append(session.cache.lengths())
            assert session.cache.nbytes() == (budget + every) * per_token_bytes(model)
            if (i + 1) % every == 0:  # just compressed: B entries, the last `window` tokens among them
                for kv in session.cache.layers:
                    held = kv.view()[2][0]
                    recent = torch.arange(n + i + 1 - window, n + i + 1)
                    assert held.shape[-1] == budget
                    assert all(set(recent.tolist()) <= set(row.tolist()) for row in held)
    assert all(length <= budget + every for step in lengths for length in step)
    if every == 1:
        assert lengths == [[budget] * 2] * steps
    else:
        assert [step[0] for step in lengths[:8]] == [33, 34, 35, 32, 33, 34, 35, 32]
    assert session.cache.peak_bytes <= n * per_token_bytes(model)


def test_a_small_budget_runs_on_every_architecture_and_frees_memory(models):
    ids = random_ids(160, seed=9)
    for arch, model in models.items():
        out = attnkit.generate(model, ids, "rkv", params={"budget_tokens": 40, "decode_every": 8}, max_new_tokens=30,
                               stop_at_eos=False)
        full = attnkit.generate(model, ids, "full", max_new_tokens=30, stop_at_eos=False)
        assert len(out.token_ids) == 30, arch
        assert out.stats.final_kv_bytes == 48 * per_token_bytes(model) < full.stats.final_kv_bytes


# ---- the score, step by step against a plain recomputation ---------------------------------------------------
def dense_rkv_choose(q, k, budget, window_size, kernel_size, mix_lambda, threshold=0.5):
    """R-KV's selection written plainly in float64 for kv head `h` holding positions `held`, the next token at
    `next_pos`: importance (the window's logits maxed over the group, softmaxed over the entries before the window,
    averaged over the window, max-pooled), redundancy (full cosine matrix, each row's latest similar entry zeroed,
    column means, softmax), the window kept plus the best of ``lambda I - (1 - lambda) R``."""
    g, d = q.shape[1] // k.shape[1], q.shape[-1]

    def choose(h, held, next_pos):
        window = list(range(next_pos - window_size, next_pos))
        prefix = [p for p in held if p < window[0]]
        imp = torch.zeros(len(prefix), dtype=torch.float64)
        for t in window:
            logits = q[0, h * g:(h + 1) * g, t].double() @ k[0, h, prefix].double().T * d ** -0.5
            imp += torch.softmax(logits.amax(0), -1)
        imp /= window_size
        r = kernel_size // 2
        pooled = torch.tensor([max(float(imp[j]) for j in range(max(0, i - r), min(len(prefix), i + r + 1)))
                               for i in range(len(prefix))])
        keys = k[0, h, held].double()
        unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.T
        sim.fill_diagonal_(0)
        for i in range(len(held)):
            similar = [j for j in range(len(held)) if sim[i, j] > threshold]
            if similar:
                sim[i, max(similar)] = 0
        red = torch.softmax(sim.mean(0), -1)[:len(prefix)]
        score = mix_lambda * pooled - (1 - mix_lambda) * red
        best = [prefix[i] for i in score.argsort(descending=True)[:budget - window_size].tolist()]
        return best + window
    return choose


# max pooling gives neighbours equal importance: with lambda = 1 only kernel 1 leaves no exact ties to break
@pytest.mark.parametrize("every,mix_lambda,kernel", [(1, 0.1, 3), (3, 0.1, 3), (4, 0.5, 5), (3, 1.0, 1)])
def test_kept_positions_equal_a_plain_recomputation(every, mix_lambda, kernel):
    q, k, v = qkv(56, seed=43)
    # a stretch repeated with a little noise (cosine above the threshold, no exact ties), and later generated
    # tokens that repeat it again, so the redundancy term has something to find
    k[:, :, 20:26] = k[:, :, 10:16] + 0.2 * torch.randn(1, 2, 6, k.shape[-1], generator=torch.Generator().manual_seed(1))
    k[:, :, 40:46] = k[:, :, 10:16] + 0.2 * torch.randn(1, 2, 6, k.shape[-1], generator=torch.Generator().manual_seed(2))
    budget, prompt_len, window = 14, 30, 4
    method = attnkit.make_method("rkv", budget_tokens=budget, decode_every=every, window_size=window,
                                 kernel_size=kernel, mix_lambda=mix_lambda)
    session, _, got = drive(method, q, k, v, prompt_len)
    want = recompress_dense(q, k, prompt_len, budget, every, dense_rkv_choose(q, k, budget, window, kernel, mix_lambda))
    assert got == want
    assert session.cache.layers[0].capacity == budget + every


def one_hot_keys(rows):
    """Keys ``[1, 1, len(rows), 16]``: row i is the unit vector e_{rows[i]} (distinct rows orthogonal)."""
    return torch.eye(16)[rows][None, None]


def test_redundancy_penalises_the_older_copies_of_a_key():
    # e1 at slots 1, 3, 5: the newest copy is every other copy's latest similar entry, so it is not penalised;
    # the middle one is penalised by the oldest only (the newest's latest similar entry is the middle one)
    r = redundancy(one_hot_keys([0, 1, 2, 1, 3, 1]), threshold=0.5)[0, 0]
    assert torch.allclose(r, torch.softmax(torch.tensor([0, 2, 0, 1, 0, 0]) / 6, -1))
    assert r[1] > r[3] > r[5] == r[0]
    # two copies alone are each other's latest similar entry: neither is penalised (the authors' rule)
    r = redundancy(one_hot_keys([0, 1, 2, 1]), threshold=0.5)[0, 0]
    assert torch.allclose(r, torch.full((4,), 0.25))
    # in blocks of rows: the same numbers
    keys = torch.randn(2, 3, 40, 16)
    keys[:, :, 30:] = keys[:, :, 5:15]
    assert torch.allclose(redundancy(keys, block_elements=2 * 3 * 40 * 7), redundancy(keys, block_elements=1 << 20))
    assert torch.allclose(rkv_score(torch.tensor([0.5]), torch.tensor([0.25]), 0.1), torch.tensor([0.05 - 0.225]))


def test_of_identical_keys_with_equal_attention_the_oldest_copy_is_dropped_first():
    # zero queries attend uniformly, so every entry before the window has the same importance; only the
    # redundancy tells them apart
    rows = [0, 1, 2, 1, 3, 4, 1, 5, 6, 7, 8, 9]
    n = len(rows)
    k = one_hot_keys(rows).expand(1, 2, n, 16).clone()
    q, v = torch.zeros(1, 4, n + 1, 16), torch.randn(1, 2, n + 1, 16)
    k = torch.cat([k, torch.eye(16)[10].expand(1, 2, 1, 16)], dim=2)
    method = attnkit.make_method("rkv", budget_tokens=n - 1, decode_every=1, window_size=2)
    _, _, held = drive(method, q, k, v, n)
    dropped = [set(range(n)) - set(row) for row in held[0]]
    assert dropped == [{1}, {1}]  # the oldest of the copies at 1, 3, 6 (both kv heads)


# ---- other hosts -------------------------------------------------------------------------------------------
def test_vllm_serves_it_and_prompt_lookup_refuses_it_in_one_line():
    for spec in ("rkv:budget=0.3", "rkv:budget_tokens=256,decode_every=1", "minference+rkv:budget=0.3"):
        assert EngineConfig.parse({"attnkit": {"recipe": spec}}) is not None  # served while decoding (vllm/live.py)
    method = parse_method_spec("rkv:budget_tokens=24")
    assert not method.decode_only_appends()
    with pytest.raises(AttnkitError, match="evicts while decoding") as info:
        check_lookup_cache(method)
    assert "\n" not in str(info.value)


def test_self_speculation_with_an_rkv_draft_equals_plain_greedy(models):
    target, prompt = models["llama"], repetitive_prompt()
    plain = attnkit.generate(target, prompt, max_new_tokens=30, stop_at_eos=False)
    for gamma in (1, 4):
        out = speculative_generate(target, prompt, "self", draft="rkv:budget_tokens=24,window_size=4,decode_every=3",
                                   gamma=gamma, max_new_tokens=30, stop_at_eos=False)
        assert out.token_ids == plain.token_ids


# ---- parameters -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,pattern", [
    ({}, r"rkv needs a cache budget"),
    ({"budget": 0.3, "decode_every": 0}, r"decode_every must be a whole number >= 1 \(R-KV compresses while decoding"),
    ({"budget": 0.3, "window_size": 0}, r"window_size must be a whole number >= 1"),
    ({"budget": 0.3, "kernel_size": 4}, r"kernel_size must be odd"),
    ({"budget": 0.3, "pooling": "min"}, r"pooling must be one of"),
    ({"budget": 0.3, "gqa_reduce": "sum"}, r"gqa_reduce must be one of"),
    ({"budget": 0.3, "mix_lambda": 1.5}, r"mix_lambda must be a number with 0.0 <= x <= 1.0"),
    ({"budget": 0.3, "threshold": 2}, r"threshold must be a number with -1.0 <= x <= 1.0"),
    ({"budget": 0.3, "head_budgets": "adaptive"}, r"head_budgets=adaptive compresses the prompt only"),
])
def test_bad_parameters_are_refused_in_one_line(params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method("rkv", **params)
    assert "\n" not in str(err.value)


def test_a_window_larger_than_the_budget_is_refused(models):
    with pytest.raises(AttnkitError, match=r"observation window \(8 tokens\) does not fit in the 6-slot budget"):
        attnkit.generate(models["llama"], random_ids(40, seed=2), "rkv", params={"budget_tokens": 6}, max_new_tokens=4)


def test_defaults_are_the_papers():
    m = parse_method_spec("rkv:budget_tokens=128")
    assert isinstance(m, RKV) and attnkit.methods.RKV is RKV
    assert (m.decode_every, m.window_size, m.kernel_size, m.pooling, m.gqa_reduce, m.mix_lambda, m.threshold) == \
        (128, 8, 7, "max", "max", 0.1, 0.5)
