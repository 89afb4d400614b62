"""head_budgets=adaptive (AdaKV, Feng et al. 2024, arXiv 2407.11550) on the prompt-time scorers: equal to full at an
unlimited budget and, with alpha_safeguard=1 (every head keeps its own B best), to uniform through the flat layout on
every architecture; the kept (head, position) pairs equal a plain recomputation from the method's rank, the heads
holding different counts that sum to kv x B; flat decode attention equals dense attention per head; a batch equals
its prompts alone; the bytes are uniform's; what the flat layout cannot honour is refused in one line."""

import pytest
import torch

import attnkit
import attnkit.methods.prompt_scorer as prompt_scorer
from attnkit import AttnkitError
from attnkit.cache import LayerKV
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.scoring import adaptive_keep, flat_attention
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Step, layer_contexts, new_session
from attnkit.speculative.generate import speculative_generate
from helpers import per_token_bytes, random_ids

torch.set_num_threads(1)

NEW = 8
SPECS = ["snapkv:budget_tokens=40,window_size=8", "knorm:budget_tokens=32", "keydiff:budget=0.3",
         "expected_attention:budget_tokens=32"]


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


def adaptive(spec: str, extra: str = "") -> str:
    return spec + ",head_budgets=adaptive" + ("," + extra if extra else "")


def generate(model, ids, spec):
    return attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)


def worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def unique_ids(n, seed):
    """A prompt with no repeated token: no two keys of a layer tie in a score (RoPE keeps a key's norm)."""
    return torch.randperm(256, generator=torch.Generator().manual_seed(seed))[:n] + 3


# ---- exactness ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["snapkv:window_size=8,budget_tokens=200", "knorm:budget_tokens=200",
                                  "keydiff:budget_tokens=200", "expected_attention:budget_tokens=200"])
def test_unlimited_budget_equals_full(models, arch, spec):
    model, ids = models[arch], random_ids(150, seed=3)
    full = generate(model, ids, "full")
    out = generate(model, ids, adaptive(spec))
    assert out.token_ids == full.token_ids and worst(out, full) < 1e-4
    assert out.stats.final_kv_bytes == full.stats.final_kv_bytes


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", SPECS)
def test_full_safeguard_equals_uniform_through_the_flat_layout(models, arch, spec):
    """alpha_safeguard=1 makes every head keep its own B best, uniform's choice; held flat and decoded by
    flat_attention (the model's own sliding window on mistral), the tokens and logits are uniform's."""
    model, ids = models[arch], random_ids(130, seed=5)
    uniform = generate(model, ids, spec)
    flat = generate(model, ids, adaptive(spec, "alpha_safeguard=1.0"))
    assert flat.token_ids == uniform.token_ids and worst(flat, uniform) < 1e-4


# ---- the kept entries ---------------------------------------------------------------------------------------
def reference_keep(rank, protect, budget, alpha):
    """AdaKV written plainly for one row: per head its protected entries and its int(alpha B) best (at least one),
    then the best of the rest across heads until kv x B are kept. A set of (head, slot)."""
    kv, n = rank.shape
    guaranteed, others = set(), []
    safe = max(1, int(budget * alpha)) if alpha > 0 else 0
    for h in range(kv):
        prot = [j for j in range(n) if protect is not None and protect[h, j]]
        best = sorted((j for j in range(n) if j not in prot), key=lambda j: -float(rank[h, j]))
        guaranteed |= {(h, j) for j in prot + best[:max(0, safe - len(prot))]}
    others = sorted(((h, j) for h in range(kv) for j in range(n) if (h, j) not in guaranteed),
                    key=lambda hj: -float(rank[hj]))
    return guaranteed | set(others[:kv * budget - len(guaranteed)])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", SPECS + ["knorm:budget_tokens=32,alpha_safeguard=0.9",
                                          "snapkv:budget_tokens=40,window_size=8,alpha_safeguard=0.9"])
def test_kept_pairs_equal_a_recomputation_from_the_rank(models, arch, spec, monkeypatch):
    model, n = models[arch], 130
    method = parse_method_spec(adaptive(spec))
    ids = torch.stack([unique_ids(n, seed=s) for s in (1, 2)])
    seen = []
    real = prompt_scorer.adaptive_keep

    def spy(rank, protect, count, alpha):
        seen.append((rank.clone(), None if protect is None else protect.clone(), count, alpha))
        return real(rank, protect, count, alpha)

    monkeypatch.setattr(prompt_scorer, "adaptive_keep", spy)
    session = new_session(model, method, n, NEW, rows=2)
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    with torch.inference_mode():
        prefill(model, session, ids)
    assert len(seen) == len(budgets) and all(b < n for b in budgets)
    kv = model.geometry.n_kv_heads
    differ = binds = False
    for layer, (rank, protect, count, alpha) in enumerate(seen):
        assert (count, alpha) == (budgets[layer], method.alpha_safeguard)
        flat = session.cache.layers[layer]
        assert flat.keys.shape[1] == 1 and flat.length == kv * count
        for row in range(2):
            heads = flat.extras["head"][row, 0, :flat.length].tolist()
            pos = flat.view()[2][row, 0].tolist()  # the prompt's slot j holds position j
            assert set(zip(heads, pos)) == reference_keep(rank[row], None if protect is None else protect[row],
                                                          count, alpha)
            counts = [heads.count(h) for h in range(kv)]
            assert sum(counts) == kv * count and min(counts) >= max(1, int(alpha * count))
            differ |= len(set(counts)) > 1
            binds |= min(counts) == max(1, int(alpha * count))
    assert differ  # the heads really hold different numbers of entries
    if method.name == "knorm" and method.alpha_safeguard == 0.9:
        assert binds  # some head holds no more than the safeguard gives it


def test_the_safeguard_and_protected_entries_hold_when_one_head_ranks_low():
    """Head 1 ranks below every entry of head 0: it keeps only its protected entries and its best ones up to
    int(alpha B) entries in all (protected entries count toward the safeguard, as kvpress's window scores do)."""
    g = torch.Generator().manual_seed(1)
    rank = torch.rand(1, 2, 30, generator=g)
    rank[:, 1] -= 2
    protect = torch.zeros(1, 2, 30, dtype=torch.bool)
    protect[:, :, -3:] = True  # e.g. an observation window
    heads, slots = adaptive_keep(rank, protect, 10, 0.5)
    kept = set(zip(heads[0].tolist(), slots[0].tolist()))
    best_low = rank[0, 1, :27].topk(2).indices.tolist()  # int(0.5 x 10) = 5, 3 of them protected
    assert kept == ({(1, j) for j in best_low + [27, 28, 29]}
                    | {(0, j) for j in range(27, 30)} | {(0, j) for j in rank[0, 0, :27].topk(12).indices.tolist()})
    heads, slots = adaptive_keep(rank, protect, 10, 0.2)  # int(0.2 x 10) = 2 < 3: the protected entries only
    assert heads[0].tolist().count(1) == 3
    heads, slots = adaptive_keep(rank, None, 10, 0.0)  # no safeguard: head 1 keeps nothing
    assert heads.tolist() == [[0] * 20]


# ---- flat decode attention ----------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 20])
def test_flat_attention_equals_dense_attention_per_head(window):
    """A dense layer compacted flat (per-head kept sets of different sizes), one token appended per head: the
    flat attention of every query head equals softmax attention over its kv head's entries (float64)."""
    g = torch.Generator().manual_seed(0)
    b, hq, kv, n, d = 2, 6, 3, 40, 16
    keys, values = torch.randn(b, kv, n, d, generator=g), torch.randn(b, kv, n, d, generator=g)
    layer = LayerKV.allocate(b, kv, n, d, torch.float32, "cpu")
    layer.append(keys, values, torch.arange(n))
    kept = [[sorted(torch.randperm(n, generator=g)[:c].tolist()) for c in counts]
            for counts in ((5, 12, 7), (20, 2, 2))]  # 24 entries per row, different splits
    heads = torch.tensor([[h for h in range(kv) for _ in kept[r][h]] for r in range(b)])
    slots = torch.tensor([[j for h in range(kv) for j in kept[r][h]] for r in range(b)])
    layer.keep_flat(heads, slots, spare=1)
    assert layer.keys.shape == (b, 1, 24 + kv, d)
    k_new, v_new = torch.randn(b, kv, 1, d, generator=g), torch.randn(b, kv, 1, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g)
    layer.append_flat(k_new, v_new, torch.tensor([n]))
    flat_k, flat_v, pos = layer.view()
    allowed = None if window is None else (n - pos < window).unsqueeze(2)
    out = flat_attention(q, flat_k, flat_v, layer.extras["head"][:, :, :layer.length], kv, d ** -0.5, allowed)
    for r in range(b):
        for h in range(hq):
            group = h // (hq // kv)
            idx = [j for j in kept[r][group] if window is None or n - j < window]
            ks = torch.cat([keys[r, group, idx], k_new[r, group]]).double()
            vs = torch.cat([values[r, group, idx], v_new[r, group]]).double()
            want = torch.softmax(q[r, h, 0].double() @ ks.T * d ** -0.5, -1) @ vs
            assert (out[r, h, 0].double() - want).abs().max() < 1e-5


# ---- batches and bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_batch_equals_each_prompt_alone(models, spec):
    model = models["mistral"]
    prompts = [random_ids(n, seed=10 + i).tolist() for i, n in enumerate((120, 95, 120))]
    batch = attnkit.generate(model, prompts, adaptive(spec), max_new_tokens=NEW, stop_at_eos=False,
                             keep_logits=True)
    for prompt, out in zip(prompts, batch):
        alone = generate(model, prompt, adaptive(spec))
        assert out.token_ids == alone.token_ids and worst(out, alone) < 1e-4
        assert out.stats.final_kv_bytes == alone.stats.final_kv_bytes


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_equal_uniform_at_the_same_budget(models, spec):
    model, n = models["llama"], 130
    ids = random_ids(n, seed=8)
    uniform, flat = generate(model, ids, spec), generate(model, ids, adaptive(spec))
    assert (flat.stats.final_kv_bytes, flat.stats.peak_kv_bytes) == (uniform.stats.final_kv_bytes,
                                                                     uniform.stats.peak_kv_bytes)
    method = parse_method_spec(adaptive(spec))
    session = new_session(model, method, n, NEW)
    budget = method.layer_budget(layer_contexts(session)[0])
    assert flat.stats.final_kv_bytes == per_token_bytes(model) * (budget + NEW)  # kv x (B + generated) entries
    same = new_session(model, parse_method_spec(spec), n, NEW)  # the batch memory check counts what uniform holds
    assert ([method.planned_slots(ctx) for ctx in layer_contexts(session)]
            == [same.method.planned_slots(ctx) for ctx in layer_contexts(same)])


# ---- refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,pattern", [
    ("knorm:budget_tokens=32,head_budgets=adaptive,decode_every=2", r"decode_every=2 is not supported"),
    ("snapkv:budget_tokens=40,window_size=8,head_budgets=adaptive,decode_budget=4", r"decode_budget=4 evicts"),
    ("keydiff:budget_tokens=32,head_budgets=per_head", r"head_budgets must be one of uniform, adaptive"),
    ("knorm:budget_tokens=32,alpha_safeguard=0.5", r"alpha_safeguard=0.5 applies to head_budgets=adaptive only"),
    ("knorm:budget_tokens=32,head_budgets=adaptive,alpha_safeguard=1.5", r"alpha_safeguard"),
    ("h2o:budget_tokens=32,head_budgets=adaptive", r"head_budgets"),
    ("tova:budget_tokens=32,head_budgets=adaptive", r"head_budgets"),
])
def test_refusals_are_one_line(spec, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        parse_method_spec(spec)
    assert "\n" not in str(err.value)


def test_multi_token_decode_steps_are_refused(models):
    model, n = models["llama"], 100
    method = parse_method_spec(adaptive("knorm:budget_tokens=32"))
    assert not method.decode_only_appends()
    session = new_session(model, method, n, 4)
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=4))).argmax())
        with pytest.raises(AttnkitError, match=r"head_budgets=adaptive decodes one token per step, got 2") as err:
            forward(model, torch.tensor([token, token]), n, lambda p: Step(session, "decode", p))
    assert "\n" not in str(err.value)


# ---- where else the flat layer goes -------------------------------------------------------------------------
def test_speculative_draft_with_adaptive_budgets_is_fed_token_by_token_and_lossless(models):
    """A self-speculation draft cache with head_budgets=adaptive (one token per draft forward, rolled back by
    snapshot): greedy output equals plain generation."""
    model, ids = models["llama"], random_ids(100, seed=2)
    plain = attnkit.generate(model, ids, "full", max_new_tokens=12, stop_at_eos=False)
    out = speculative_generate(model, ids, "self", draft=adaptive("snapkv:budget_tokens=24,window_size=4"),
                               gamma=3, max_new_tokens=12, stop_at_eos=False)
    assert out.token_ids == plain.token_ids and out.stats.drafted_tokens > 0


def test_model_generate_with_an_attnkit_cache_equals_attnkit_generate(models):
    model, ids = models["qwen3"], random_ids(120, seed=6)
    spec = adaptive("expected_attention:budget_tokens=32")
    ours = generate(model, ids, spec)
    cache = AttnkitCache(model, spec, max_new_tokens=NEW)
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=2)
    assert out[0, ids.shape[0]:].tolist() == ours.token_ids
    assert cache.nbytes() == ours.stats.final_kv_bytes


def test_composed_with_a_sparse_prefill(models):
    spec = "a_shape:n_init=16,n_local=32,block_size=16+" + adaptive("snapkv:budget_tokens=40,window_size=8")
    model = models["llama"]
    prompts = [random_ids(n, seed=20 + i).tolist() for i, n in enumerate((110, 110))]
    batch = attnkit.generate(model, prompts, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    for prompt, out in zip(prompts, batch):
        alone = generate(model, prompt, spec)
        assert out.token_ids == alone.token_ids and worst(out, alone) < 1e-4
