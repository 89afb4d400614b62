"""The buffered form (``decode_every``) of the per-step eviction methods h2o, tova and keyformer
(attnkit.methods.buffered): the held count follows its fixed rule at every step, layer and kv head (prompts
shorter and longer than the budget, PyramidKV's budgets per layer); each compression keeps exactly the protected
entries and the best of the method's rank (against dense references on hand-made tensors, and against the rank
itself in a model); an unlimited budget gives full attention; a batch gives each prompt its tokens alone, in
attnkit.generate and in transformers' generate (AttnkitCache, padded); a speculative self-draft with it is lossless;
a multi-token step and bad values are refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.buffered import FILL_QUEUE
from attnkit.methods.eviction import EvictionMethod
from attnkit.methods.keyformer_noise import keyformer_noise
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Step, layer_contexts, new_session, planned_slots
from attnkit.speculative import speculative_generate
from helpers import assert_equals_full, drive, qkv, random_ids

torch.set_num_threads(1)

NEW = 12
METHODS = ["h2o", "tova", "keyformer", "keyformer:score=shared"]


def spec_with(spec: str, extra: str) -> str:
    return spec + ("," if ":" in spec else ":") + extra


def expected_held(n: int, budget: int, every: int, g: int, deferred: bool = False) -> int:
    """The rule a paged host plans by: after the prompt min(n, B) (n for a deferred prompt compression), after
    g = k N + r decode steps min(min(n, B) + k N, B) + r."""
    if g == 0:
        return n if deferred else min(n, budget)
    k, r = divmod(g, every)
    return min(min(n, budget) + k * every, budget) + r


def run_steps(model, spec: str, n: int, steps: int, seed: int = 0):
    """Prefill `n` random tokens, then `steps` greedy decode steps (max_new_tokens = steps + 1, as the runner's last
    token is never fed). Returns the method, the session, its budgets and planned slots per layer, and per step
    (0: after the prompt) the entries held per layer and kv head."""
    method = parse_method_spec(spec)
    session = new_session(model, method, n, steps + 1)
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    planned = planned_slots(session)

    def held():
        out = []
        for kv in session.cache.layers:
            pos = kv.view()[2][0]
            assert all(len(set(row.tolist())) == kv.length for row in pos)  # distinct positions per kv head
            out.append([kv.length] * pos.shape[0])
        return out

    counts = []
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=seed))).argmax())
        counts.append(held())
        for i in range(steps):
            hidden = forward(model, torch.tensor([token]), n + i, lambda p: Step(session, "decode", p))
            token = int(logits_of(model, hidden[-1:]).argmax())
            counts.append(held())
    return method, session, budgets, planned, counts


# ---- the held count, step by step ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", METHODS + ["h2o:layer_budgets=pyramid", "keyformer:score=shared,layer_budgets=pyramid"])
@pytest.mark.parametrize("every", [1, 4, 7])
@pytest.mark.parametrize("n", [9, 24, 41])
def test_the_held_count_follows_the_rule_at_every_step(small_llama, spec, every, n):
    steps, budget = 30, 24
    _, session, budgets, planned, counts = run_steps(
        small_llama, spec_with(spec, f"budget_tokens={budget},decode_every={every}"), n, steps)
    deferred = "shared" in spec  # the shared score compresses the prompt at its first decode step
    total = n + steps + 1
    if "pyramid" in spec:
        assert budgets[0] > budgets[-1]
    for layer, b in enumerate(budgets):
        want = [expected_held(n, b, every, g, deferred) for g in range(steps + 1)]
        assert [step[layer] for step in counts] == [[w] * 2 for w in want], (layer, b)
        assert max(want[1:]) <= b + every  # (a deferred prompt compression holds the prompt until the first step)
        assert planned[layer] == min(b + every, total)  # the memory the batch check reserves
        assert session.cache.layers[layer].capacity == min(b + every, total)


def test_a_compression_due_below_b_plus_n_of_the_whole_length_still_happens(small_llama):
    """B < n + new tokens <= B + N: the N-th step holds more than B, so it compresses (as the rule says), though
    the layer never needs more than B + N slots."""
    for spec in METHODS:
        _, _, budgets, _, counts = run_steps(small_llama, spec_with(spec, "budget_tokens=12,decode_every=8"), 10, 9)
        assert [step[0][0] for step in counts] == [expected_held(10, 12, 8, g) for g in range(10)]
        assert counts[8][0][0] == 12 and counts[7][0][0] == 17


def test_decode_every_zero_is_the_per_step_form(small_llama):
    """decode_every=0, the default, evicts one entry per step: at most B held, the incoming token included (the rule
    with N = 1, which a paged host plans by; the buffered form with N = 1 attends over B + 1 instead)."""
    for spec in METHODS:
        assert parse_method_spec(spec_with(spec, "budget_tokens=24")).decode_every == 0
        for n in (9, 41):
            _, session, _, planned, counts = run_steps(small_llama, spec_with(spec, "budget_tokens=24,decode_every=0"),
                                                       n, 20)
            assert planned == [24, 24] and [kv.capacity for kv in session.cache.layers] == [24, 24]
            want = [expected_held(n, 24, 1, g, deferred="shared" in spec) for g in range(21)]
            assert [step[layer] for step in counts for layer in range(2)] == [[w] * 2 for w in want for _ in range(2)]


# ---- what a compression keeps: dense references on hand-made tensors ------------------------------------------
def softmax_weights(x, head, q_pos, k_pos, t):
    return torch.softmax(x, dim=-1)


def keyformer_weights(noise, seed, kv, g, T, tau_init=1.0, tau_end=2.0):
    def weights(x, head, q_pos, k_pos, t):
        zeta = keyformer_noise(noise, seed, 0, kv, g, q_pos, k_pos)
        if isinstance(zeta, torch.Tensor):
            zeta = zeta[0, head]
        return torch.softmax((x + zeta) / (tau_init + t * (tau_end - tau_init) / T), dim=-1)  # eq. 9-10
    return weights


def accumulated_reference(q, k, prompt_len, budget, every, recent, weights, reduce="mean"):
    """H2O's and Keyformer's buffered rule written plainly, per kv head (full matrices, Python lists, no slots):
    every query adds its weights to the keys it sees; the prompt and every `every`-th step keep the recent window
    and the best accumulated scores. Held positions per step (0: after the prompt) and kv head."""
    _, hq, n, d = q.shape
    g = hq // k.shape[1]

    def one_head(h):
        score = torch.zeros(n, dtype=torch.float64)
        qh = q[0, h * g:(h + 1) * g]

        def add(x, q_pos, k_pos, t):
            w = weights(x, h, q_pos, k_pos, t)
            score[k_pos] += (w.mean(0) if reduce == "mean" else w.amax(0)).sum(0).double()

        def compress(held, next_pos):
            keep = [p for p in held if p >= next_pos - recent]
            rest = sorted((p for p in held if p not in keep), key=lambda p: -score[p])
            return sorted(keep + rest[:budget - len(keep)])

        x = qh[:, :prompt_len] @ k[0, h, :prompt_len].T * d ** -0.5
        x = x.masked_fill(torch.ones(prompt_len, prompt_len, dtype=torch.bool).triu(1), float("-inf"))
        add(x, torch.arange(prompt_len), torch.arange(prompt_len), 0)
        held = list(range(prompt_len))
        if prompt_len > budget:
            held = compress(held, prompt_len)
        steps = [held]
        for i, t in enumerate(range(prompt_len, n), 1):
            held = held + [t]
            add((qh[:, t] @ k[0, h, held].T * d ** -0.5)[:, None], torch.tensor([t]), torch.tensor(held), i)
            if i % every == 0 and len(held) > budget:
                held = compress(held, t + 1)
            steps.append(sorted(held))
        return steps

    per_head = [one_head(h) for h in range(k.shape[1])]
    return [[steps[s] for steps in per_head] for s in range(n - prompt_len + 1)]


def tova_reference(q, k, prompt_len, budget, every):
    """TOVA's buffered rule written plainly: a compression keeps the newest entry and the best of the newest query's
    attention averaged over every query head; one set for every kv head."""
    _, hq, n, d = q.shape
    g = hq // k.shape[1]

    def compress(held, t):
        probs = torch.stack([torch.softmax(q[0, h, t].double() @ k[0, h // g, held].double().T * d ** -0.5, -1)
                             for h in range(hq)]).mean(0)
        rest = sorted((p for p in held if p != t), key=lambda p: -probs[held.index(p)])
        return sorted([t] + rest[:budget - 1])

    held = list(range(prompt_len))
    if prompt_len > budget:
        held = compress(held, prompt_len - 1)
    steps = [held]
    for i, t in enumerate(range(prompt_len, n), 1):
        held = held + [t]
        if i % every == 0 and len(held) > budget:
            held = compress(held, t)
        steps.append(sorted(held))
    return [[s] * k.shape[1] for s in steps]


@pytest.mark.parametrize("every", [1, 3, 5])
@pytest.mark.parametrize("prompt_len", [8, 30])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_h2o_keeps_the_recent_window_and_the_heaviest_hitters(every, prompt_len, reduce):
    q, k, v = qkv(60, seed=11)
    method = attnkit.make_method("h2o", budget_tokens=12, recent_tokens=4, gqa_reduce=reduce, decode_every=every)
    session, _, held = drive(method, q, k, v, prompt_len=prompt_len)
    assert held == accumulated_reference(q, k, prompt_len, 12, every, 4, softmax_weights, reduce)
    assert session.cache.layers[0].capacity == 12 + every


@pytest.mark.parametrize("every", [2, 4])
@pytest.mark.parametrize("noise", ["gumbel", "none"])
def test_keyformer_keeps_the_recent_window_and_the_best_accumulated_score(every, noise):
    q, k, v = qkv(50, seed=21)
    method = attnkit.make_method("keyformer", budget_tokens=12, recent_tokens=3, noise=noise, seed=7,
                                 decode_every=every)
    _, _, held = drive(method, q, k, v, prompt_len=30)
    assert held == accumulated_reference(q, k, 30, 12, every, 3, keyformer_weights(noise, 7, 2, 2, 20))


def test_the_steps_between_compressions_only_append_and_queue_their_queries():
    """What a host may run as plain attention between two compressions (decode_queries_kept): H2O's and Keyformer's
    per-layer score queue their N steps' queries (taken at the N-th step, which the references above check), TOVA's
    keep nothing; their per-step forms queue the steps that fill the budget (FILL_QUEUE at a time); TOVA's per-step
    form and Keyformer's shared score run their hooks on every step."""
    assert attnkit.make_method("h2o", budget_tokens=12, decode_every=4).decode_queries_kept() == 4
    assert attnkit.make_method("keyformer", budget_tokens=12, decode_every=5).decode_queries_kept() == 5
    assert attnkit.make_method("tova", budget_tokens=12, decode_every=4).decode_queries_kept() == 0
    assert attnkit.make_method("h2o", budget_tokens=12).decode_queries_kept() == FILL_QUEUE
    assert attnkit.make_method("keyformer", budget_tokens=12).decode_queries_kept() == FILL_QUEUE
    for method in (attnkit.make_method("keyformer", budget_tokens=12, decode_every=4, score="shared"),
                   attnkit.make_method("tova", budget_tokens=12)):
        assert method.decode_queries_kept() is None
    q, k, v = qkv(40, seed=5)
    method = attnkit.make_method("h2o", budget_tokens=12, recent_tokens=4, decode_every=4)
    session, _, _ = drive(method, q, k, v, prompt_len=30)  # 10 decode steps: compressions after the 4th and 8th
    state = session.layer_state[0]
    assert state.decoded == 10 and state.queued_q.shape[2] == 2 and state.queued_pos.tolist() == [38, 39]


@pytest.mark.parametrize("every", [1, 3, 6])
@pytest.mark.parametrize("prompt_len", [6, 30])
def test_tova_keeps_what_the_latest_query_attends_to_most(every, prompt_len):
    q, k, v = qkv(50, seed=31)
    _, _, held = drive(attnkit.make_method("tova", budget_tokens=10, decode_every=every), q, k, v, prompt_len)
    assert held == tova_reference(q, k, prompt_len, 10, every)


@pytest.mark.parametrize("spec", METHODS + ["h2o:layer_budgets=pyramid,recent=0.25"])
def test_a_compression_in_a_model_keeps_the_protected_entries_and_the_best_ranked(small_llama, monkeypatch, spec):
    """Every compression while decoding, checked against the method's own rank and protected entries read just before
    it (Keyformer's shared score included): the protected ones, then the highest-ranked others, B in all."""
    seen = []
    compact = EvictionMethod.compact

    def checked(self, ctx, count, spare, next_pos):
        rank, protect = self.rank(ctx)[0].double(), self.protect(ctx, next_pos)
        before = ctx.kv.view()[2][0].clone()
        compact(self, ctx, count, spare, next_pos)
        if ctx.step.phase != "decode" or not self.decode_every:
            return
        assert count == self.layer_budget(ctx) and ctx.kv.capacity == count + self.decode_every
        for h, kept in enumerate(ctx.kv.view()[2][0].tolist()):
            forced = set() if protect is None else set(before[h][protect[0, h]].tolist())
            others = sorted((i for i, p in enumerate(before[h].tolist()) if p not in forced), key=lambda i: -rank[h, i])
            want = forced | {int(before[h, i]) for i in others[:count - len(forced)]}
            assert set(kept) == want and kept == sorted(kept)  # slot order kept: positions ascending
        seen.append((ctx.index, int(next_pos)))

    monkeypatch.setattr(EvictionMethod, "compact", checked)
    every = 5
    _, session, budgets, _, counts = run_steps(small_llama, spec_with(spec, f"budget_tokens=30,decode_every={every}"),
                                               70, 26)
    deferred = [(layer, 70) for layer in range(2)] if "shared" in spec else []  # the prompt, at the first step
    assert sorted(seen) == sorted(deferred + [(layer, 70 + g) for layer in range(2) for g in range(every, 27, every)])
    if "shared" in spec:  # one score for the whole model: every layer and kv head keeps the same entries
        held = [session.cache.layers[i].view()[2][0].tolist() for i in range(2)]
        assert all(row == held[0][0] for layer in held for row in layer)


# ---- an unlimited budget is full attention; a batch is its prompts alone ----------------------------------------
@pytest.fixture(scope="module")
def models(arch_models):
    return {**arch_models, "tiny": attnkit.load_model("tiny")}


@pytest.mark.parametrize("arch", ["tiny", "llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", METHODS)
def test_unlimited_budget_equals_full(models, arch, spec):
    model, ids = models[arch], random_ids(150, seed=3, vocab=min(259, models[arch].geometry.vocab_size))
    assert_equals_full(model, ids, parse_method_spec(spec_with(spec, "budget_tokens=300,decode_every=3")), NEW)
    # B = n + new - 1: the buffered path runs (append, attend, score) and the N-th steps never hold more than B
    assert_equals_full(model, ids, parse_method_spec(spec_with(spec, f"budget_tokens={150 + NEW - 1},decode_every=4")),
                       NEW)


@pytest.mark.parametrize("spec", METHODS + ["h2o:budget=0.3,layer_budgets=pyramid"])
def test_a_batch_gives_each_prompt_its_tokens_alone(models, spec):
    model = models["mistral"]  # its own sliding window (48) shorter than the prompts
    prompts = [random_ids(n, seed=60 + i).tolist() for i, n in enumerate((90, 61, 90))]
    method = parse_method_spec(spec_with(spec, "decode_every=4" if "budget" in spec else "budget_tokens=32,decode_every=4"))
    batch = attnkit.generate(model, prompts, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    for prompt, out in zip(prompts, batch):
        alone = attnkit.generate(model, prompt, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
        assert out.token_ids == alone.token_ids
        assert max((a - b).abs().max().item() for a, b in zip(out.logits, alone.logits)) < 1e-4
        assert (out.stats.final_kv_bytes, out.stats.peak_kv_bytes) == (alone.stats.final_kv_bytes,
                                                                       alone.stats.peak_kv_bytes)


def left_padded(prompts, pad=2):
    width = max(p.shape[0] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[0],), pad), p]) for p in prompts])
    return ids, torch.stack([(torch.arange(width) >= width - p.shape[0]).long() for p in prompts])


@pytest.mark.parametrize("spec", METHODS)
def test_attnkit_cache_in_transformers_generate(small_llama, spec):
    """One prompt and a left-padded batch through ``model.hf.generate`` with AttnkitCache: attnkit.generate's tokens,
    logits and bytes for each prompt alone."""
    model = small_llama
    name, _, rest = spec.partition(":")
    params = {"budget_tokens": 16, "decode_every": 3, **dict(p.split("=") for p in rest.split(",") if p)}
    prompts = [random_ids(n, seed=30 + i) for i, n in enumerate((37, 20, 37))]
    alone = [attnkit.generate(model, p, name, params=params, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
             for p in prompts]
    for batch in ([prompts[0]], prompts):
        ids, mask = left_padded(batch)
        cache = AttnkitCache(model, name, params=params, max_new_tokens=NEW)
        out = model.hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
        for row, ours in enumerate(alone[:len(batch)]):
            assert out.sequences[row, ids.shape[1]:].tolist() == ours.token_ids, row
            assert max((a[row] - b).abs().max().item() for a, b in zip(out.logits, ours.logits)) < 1e-4
            assert cache.row_nbytes(row) == ours.stats.final_kv_bytes
            # NEW - 1 = 11 decode steps: 3 compressions, then 2 more tokens
            assert cache.kept_lengths(row) == [16 + 2] * 2


@pytest.mark.parametrize("spec", ["h2o", "keyformer:score=shared"])
def test_a_self_draft_with_the_buffered_form_is_lossless(small_llama, spec):
    """A speculative self-draft evicting with decode_every (its cache rolled back to a snapshot when drafts are
    rejected): greedy output exactly the target's own; lookup guessing, which cuts the draft cache back, is refused."""
    prompt = random_ids(60, seed=8)
    draft = spec_with(spec, "budget_tokens=24,decode_every=4")
    plain = attnkit.generate(small_llama, prompt, max_new_tokens=20, stop_at_eos=False)
    out = speculative_generate(small_llama, prompt, "self", draft=draft, gamma=3, max_new_tokens=20, stop_at_eos=False)
    assert out.token_ids == plain.token_ids
    with pytest.raises(AttnkitError, match="evicts while decoding") as err:
        speculative_generate(small_llama, prompt, "self", draft=draft, draft_lookup=True, max_new_tokens=4)
    assert "\n" not in str(err.value)


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", METHODS)
def test_a_multi_token_decode_step_is_refused(spec):
    q, k, v = qkv(24, seed=1)
    method = parse_method_spec(spec_with(spec, "budget_tokens=8,decode_every=4"))
    session, _, _ = drive(method, q[:, :, :20], k[:, :, :20], v[:, :, :20], prompt_len=16)
    s = slice(20, 22)
    with pytest.raises(AttnkitError, match=r"decodes one token per step, got 2 at once") as err:
        Step(session, "decode", torch.arange(20, 22)).attention(0, q[:, :, s], k[:, :, s], v[:, :, s], 0.3, None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name,params,pattern", [
    ("h2o", {"decode_every": -1}, r"decode_every must be a whole number >= 0 .*got -1"),
    ("tova", {"decode_every": 1.5}, r"decode_every must be a whole number >= 0 .*got 1.5"),
    ("keyformer", {"decode_every": None}, r"decode_every must be a whole number >= 0 .*got None"),
    ("streaming", {"decode_every": 2}, r"method 'streaming' has no parameter decode_every"),
])
def test_bad_values_are_refused_in_one_line(name, params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method(name, budget=0.5, **params)
    assert "\n" not in str(err.value)
    if name != "streaming":
        with pytest.raises(AttnkitError, match=r"decode_every=.x. is not a valid"):
            parse_method_spec(f"{name}:budget=0.5,decode_every=x")


def test_specs_parse_and_describe():
    m = parse_method_spec("h2o:budget_tokens=64,decode_every=8")
    assert (m.decode_every, m.decode_only_appends()) == (8, False)
    assert parse_method_spec("tova:budget=0.3").describe() == \
        "tova(budget=0.3, budget_tokens=None, layer_budgets=uniform, decode_every=0)"
    assert "decode_every=2" in parse_method_spec("keyformer:budget=0.3,decode_every=2,score=shared").describe()
