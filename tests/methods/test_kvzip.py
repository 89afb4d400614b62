"""kvzip: equal to full at an unlimited budget on every architecture and in batches; the score of every prompt entry
equals the paper's formula written plainly in float64 from the queries and keys of the reconstruction pass (caught
by hooks on the projections, rotated here), in one chunk and in several; the reconstruction input is the repeat
prompt and the context (a plain forward over that token sequence gives the same queries); the kept positions are
the sinks and the top-scored ones; nothing of the reconstruction stays in the cache; under a budget the bytes held
drop; what it cannot do is refused in one line."""

from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods import kvzip as kvzip_module
from attnkit.methods import scoring_native
from attnkit.methods.full import Full
from attnkit.methods.kvzip import (
    ANSWER_PREFIX,
    CONTINUE_PROMPT,
    OVERLAP,
    REPEAT_PROMPT,
    KVzip,
    reconstruction_attention,
)
from attnkit.methods.spec import parse_method_spec
from attnkit.sampling import SamplingConfig
from attnkit.session import layer_contexts, new_session
from attnkit.speculative import DraftRun, ModelDraft, speculative_generate
from helpers import assert_equals_full, per_token_bytes, random_ids

torch.set_num_threads(1)

NEW = 10


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


# ---- unlimited budget: exactly full -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("extra", ["", ",head_budgets=adaptive", ",chunk_size=40,n_sink=0"])
def test_unlimited_budget_equals_full(models, arch, extra):
    model, ids = models[arch], random_ids(150, seed=3)
    assert_equals_full(model, ids, parse_method_spec("kvzip:budget_tokens=200" + extra), NEW)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_unlimited_budget_batch_equals_full(models, arch):
    model = models[arch]
    prompts = [random_ids(n, seed=s).tolist() for s, n in enumerate((120, 120, 90))]
    assert_equals_full(model, prompts, parse_method_spec("kvzip:budget=1.0"), NEW)


# ---- the score: the paper's formula from the reconstruction pass's own queries and keys ---------------------
SCORES: dict = {}


@dataclass(frozen=True)
class ScoreRecorder(KVzip):
    """kvzip that records each layer's scores when it compresses the layer."""

    def rank(self, ctx):
        SCORES[ctx.index] = ctx.state.score[0].clone()
        return super().rank(ctx)


def projection_hooks(model, calls):
    """Forward hooks collecting, per layer, the queries and keys before RoPE ``[heads, tokens, d]`` of every forward
    (the output of q_proj/k_proj, or of Qwen3's q_norm/k_norm), in call order."""
    g, hooks = model.geometry, []
    for i, layer in enumerate(model.hf.model.layers):
        attn = layer.self_attn
        for kind, module in (("q", getattr(attn, "q_norm", None) or attn.q_proj),
                             ("k", getattr(attn, "k_norm", None) or attn.k_proj)):
            def hook(mod, args, out, i=i, kind=kind):
                heads = g.n_q_heads if kind == "q" else g.n_kv_heads
                calls.setdefault((i, kind), []).append(
                    out.detach().reshape(out.shape[0], -1, heads, g.head_dim)[0].transpose(0, 1).double().clone())
            hooks.append(module.register_forward_hook(hook))
    return hooks


def recorded_prefill(model, method, ids):
    """Prefill `ids` with `method` (a :class:`ScoreRecorder`: SCORES is refilled) in a fresh session, with the
    projection hooks on; the session and the queries and keys of every forward."""
    SCORES.clear()
    calls = {}
    hooks = projection_hooks(model, calls)
    try:
        session = new_session(model, method, ids.shape[-1], 4)
        with torch.inference_mode():
            prefill(model, session, ids)
    finally:
        for h in hooks:
            h.remove()
    return session, calls


def rope(x, positions, inv_freq):
    """RoPE in float64 at `positions` (the half-split form of the Llama family), ``x`` ``[heads, tokens, d]``."""
    angles = positions.double()[:, None] * inv_freq.double()
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_scores(q, k_ctx, k_own, start, end, n_sink, window, scaling):
    """The score of prompt positions ``start..end-1`` per kv head (float64): the softmax of the scaled logits of the
    reconstruction queries `q` ``[hq, m, d]`` (positions n..) over the sinks, the chunk and their own keys
    (causal, within `window`), its maximum over each kv group's query heads and the queries."""
    n, m = k_ctx.shape[1], q.shape[1]
    sink = min(n_sink, start)
    keys = torch.cat([k_ctx[:, :sink], k_ctx[:, start:end], k_own], 1)
    k_pos = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + m)])
    q_pos = torch.arange(n, n + m)
    allowed = k_pos[None] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None] > q_pos[:, None] - window
    kv = keys.shape[0]
    g = q.shape[0] // kv
    out = []
    for h in range(kv):
        logits = torch.einsum("gid,jd->gij", q[h * g:(h + 1) * g], keys[h]) * scaling
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        out.append(probs[..., sink:sink + end - start].amax(dim=(0, 1)))
    return torch.stack(out)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("outlier", [0.0, 400.0])
def test_reconstruction_attention_on_hand_made_tensors(window, outlier, one_pass):
    """One layer's reconstruction attention against dense float64: the output over every visible key, and the score
    of the chunk over the sinks, the chunk and the own keys; a key outside the scored ones with a logit far above
    theirs (`outlier`: their float32 exponentials shifted by the row's maximum would vanish) changes nothing."""
    n, m, start, end, sink, d = 70, 37, 32, 64, 4, 8
    g = torch.Generator().manual_seed(7)
    q, keys, values = (torch.randn(1, 4, m, d, generator=g), torch.randn(1, 2, n + m, d, generator=g),
                       torch.randn(1, 2, n + m, d, generator=g))
    common = torch.randn(d, generator=g)
    q += 2 * common  # the queries share a direction, which key 10 (neither a sink nor in the chunk) may point along
    keys[:, :, 10] = common * outlier / common.norm() ** 2
    out, score = reconstruction_attention(q, keys, values, d ** -0.5, start, end, sink, window, one_pass)
    q_pos, k_pos = torch.arange(n, n + m), torch.arange(n + m)
    allowed = k_pos[None] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None] > q_pos[:, None] - window
    scored = torch.zeros(n + m, dtype=torch.bool)
    scored[:sink] = scored[start:end] = scored[n:] = True
    for h in range(2):
        kh, vh = keys[0, h].double(), values[0, h].double()
        logits = torch.einsum("gid,jd->gij", q[0, 2 * h:2 * h + 2].double(), kh) * d ** -0.5
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        assert torch.allclose(out[0, 2 * h:2 * h + 2].double(), probs @ vh, atol=1e-5)
        sub = torch.softmax(logits.masked_fill(~(allowed & scored), float("-inf")), -1)
        want = sub[..., start:end].amax(dim=(0, 1))
        assert torch.allclose(score[0, h].double(), want, rtol=1e-5, atol=1e-7), (score[0, h] - want).abs().max()
    if outlier and window is None:
        assert float(probs[..., 10].min()) > 0.99  # the outlier takes nearly all the output's attention


def held(session, layer):
    return [sorted(row.tolist()) for row in session.cache.layers[layer].view()[2][0]]


def kept_entries(session, layer):
    """The (kv head, position) pairs row 0 of `layer` holds (a head-adaptive layer is flat: its heads in extras)."""
    kv = session.cache.layers[layer]
    positions = kv.view()[2][0]
    if "head" in kv.extras:
        return set(zip(kv.extras["head"][0, 0, :kv.length].tolist(), positions[0].tolist()))
    return {(h, p) for h, row in enumerate(positions.tolist()) for p in row}


def text_ids(model, words):
    return model.tokenizer(words, add_special_tokens=False).input_ids


@pytest.fixture(params=["one pass", "two passes"])
def path(request, monkeypatch):
    """Both ways of computing a reconstruction forward: one pass over the logits, or SDPA plus a scoring pass (what
    a long prompt takes on a CPU, forced here by a key limit of 0)."""
    if request.param == "two passes":
        monkeypatch.setattr(kvzip_module, "ONE_PASS_MAX_KEYS", {"cpu": 0, "default": 0})
    return request.param


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["budget_tokens=40", "budget=0.3,chunk_size=48", "budget_tokens=30,n_sink=0",
                                  "budget_tokens=36,chunk_size=64,head_budgets=adaptive,alpha_safeguard=0"])
def test_scores_and_kept_positions_equal_the_formula(models, arch, spec, path):
    model, n = models[arch], 130
    ids = random_ids(n, seed=21)
    method = ScoreRecorder(**parse_method_spec("kvzip:" + spec).params())
    session, calls = recorded_prefill(model, method, ids)
    g, inv_freq = model.geometry, model.hf.model.rotary_emb.inv_freq
    scaling, window = g.head_dim ** -0.5, g.sliding_window
    chunks = [(s, min(n, s + method.chunk_size)) for s in range(0, n, method.chunk_size)]
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    for layer in range(g.n_layers):
        qs, ks = calls[(layer, "q")], calls[(layer, "k")]
        assert len(qs) == 1 + len(chunks)  # the prompt, then one reconstruction forward per chunk
        k_ctx = rope(ks[0], torch.arange(n), inv_freq)
        want = torch.zeros(g.n_kv_heads, n, dtype=torch.float64)
        for (start, end), q_raw, k_raw in zip(chunks, qs[1:], ks[1:]):
            pos = torch.arange(n, n + q_raw.shape[1])
            want[:, start:end] = reference_scores(rope(q_raw, pos, inv_freq), k_ctx, rope(k_raw, pos, inv_freq),
                                                  start, end, method.n_sink, window, scaling)
        got = SCORES[layer].double()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7), (layer, (got - want).abs().max())
        # the kept positions: the sinks, then the best scores (per kv head, or across the kv heads with adaptive)
        score = want.clone()
        score[:, :method.n_sink] = float("inf")
        chosen = kept_entries(session, layer)
        groups = [range(g.n_kv_heads)] if method.head_budgets == "adaptive" else [[h] for h in range(g.n_kv_heads)]
        for heads in groups:
            mine = {(h, p) for h, p in chosen if h in heads}
            assert len(mine) == len(heads) * budgets[layer]
            dropped = [float(score[h, p]) for h in heads for p in range(n) if (h, p) not in mine]
            assert min(float(score[h, p]) for h, p in mine) >= max(dropped) - 1e-6
    if window is not None:  # an entry outside every reconstruction query's window received nothing
        assert float(SCORES[0][:, :n - window + 1].abs().max()) == 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk_size", [2048, 48])
def test_the_reconstruction_input_is_the_repeat_prompt_and_the_context(models, arch, chunk_size):
    """The queries of each reconstruction forward equal those of a plain full-attention forward over the token
    sequence ``context + repeat prompt (+ the previous chunk's last tokens) + answer prefix + chunk``."""
    model, n = models[arch], 110
    ids = random_ids(n, seed=5)
    calls = {}
    hooks = projection_hooks(model, calls)
    try:
        with torch.inference_mode():
            prefill(model, new_session(model, parse_method_spec(f"kvzip:budget_tokens=30,chunk_size={chunk_size}"),
                                       n, 1), ids)
    finally:
        for h in hooks:
            h.remove()
    starts = list(range(0, n, chunk_size))
    for t, start in enumerate(starts):
        end = min(n, start + chunk_size)
        head = text_ids(model, REPEAT_PROMPT) if t == 0 else (text_ids(model, CONTINUE_PROMPT)
                                                                + ids[max(0, start - OVERLAP):start].tolist())
        sequence = torch.cat([ids, torch.tensor(head + text_ids(model, ANSWER_PREFIX)), ids[start:end]])
        plain = {}
        hooks = projection_hooks(model, plain)
        try:
            with torch.inference_mode():
                prefill(model, new_session(model, Full(), len(sequence), 1), sequence)
        finally:
            for h in hooks:
                h.remove()
        for layer in range(model.geometry.n_layers):
            got, want = calls[(layer, "q")][1 + t], plain[(layer, "q")][0][:, n:]
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (layer, t)


# ---- what stays in the cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_only_prompt_entries_stay_and_the_bytes_drop(models, arch):
    model, n, budget = models[arch], 140, 40
    ids = random_ids(n, seed=8)
    full_session = new_session(model, Full(), n, NEW)
    session = new_session(model, parse_method_spec(f"kvzip:budget_tokens={budget},chunk_size=64"), n, NEW)
    with torch.inference_mode():
        full_logits = logits_of(model, prefill(model, full_session, ids))
        logits = logits_of(model, prefill(model, session, ids))
    # the prompt's own pass is full attention's (through the reconstruction's kernel where it is built: float32
    # rounding)
    assert torch.allclose(logits, full_logits, atol=1e-5) and torch.equal(logits.argmax(-1), full_logits.argmax(-1))
    for layer, full_kv in zip(session.cache.layers, full_session.cache.layers):
        keys, values, positions = layer.view()
        assert layer.length == budget and int(positions.max()) < n  # no reconstruction entry stays
        fk, fv, _ = full_kv.view()
        index = positions.unsqueeze(-1).expand_as(keys)
        assert torch.allclose(keys, fk.gather(2, index), atol=1e-5)  # the full prompt's own entries
        assert torch.allclose(values, fv.gather(2, index), atol=1e-5)
    out = attnkit.generate(model, ids, "kvzip", params={"budget_tokens": budget}, max_new_tokens=NEW,
                           stop_at_eos=False)
    full = attnkit.generate(model, ids, "full", max_new_tokens=NEW, stop_at_eos=False)
    per_token = per_token_bytes(model)
    assert out.stats.final_kv_bytes == (budget + NEW) * per_token < full.stats.final_kv_bytes
    assert out.stats.peak_kv_bytes == n * per_token  # the whole prompt until the reconstruction, nothing more
    assert out.token_ids[0] == full.token_ids[0]


def test_chunked_prefill_keeps_the_same_positions_and_tokens(models):
    model, n = models["qwen3"], 200
    ids = random_ids(n, seed=13)
    method = parse_method_spec("kvzip:budget=0.3,chunk_size=64")
    kept = []
    for chunk in (None, 70, 33):
        session = new_session(model, method, n, 1)
        with torch.inference_mode():
            prefill(model, session, ids, chunk_size=chunk)
        kept.append([held(session, layer) for layer in range(model.geometry.n_layers)])
    assert kept[0] == kept[1] == kept[2]
    one = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    chunked = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True,
                               chunk_size=70)
    assert chunked.token_ids == one.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(chunked.logits, one.logits)) < 1e-4


@pytest.mark.parametrize("last_scores", [True, False])
@pytest.mark.parametrize("kernel", [True, False])
def test_the_reconstruction_stops_at_the_last_layer_that_scores(models, monkeypatch, last_scores, kernel):
    """Its hidden states are dropped, so the reconstruction runs the layers up to the last one that scores, and that
    layer runs its attention alone, which computes its score but no output: the scores, kept positions, tokens and logits of a reconstruction that
    runs every layer in full (with the CPU kernel where it is built, and with torch operations)."""
    if not kernel:
        monkeypatch.setattr(scoring_native, "kernel_pays", lambda *a, **k: False)
    model, n = models["llama"], 130
    layers = model.geometry.n_layers
    ids = random_ids(n, seed=23)
    method = ScoreRecorder(budget_tokens=[40] * (layers - 1) + [40 if last_scores else 1000], chunk_size=48)

    def run():
        session, calls = recorded_prefill(model, method, ids)
        out = attnkit.generate(model, ids, method, max_new_tokens=6, stop_at_eos=False, keep_logits=True)
        forwards = [len(calls[(i, "q")]) for i in range(layers)]
        return dict(SCORES), [held(session, i) for i in range(layers)], out, forwards

    scores, kept, out, forwards = run()
    chunks = -(-n // method.chunk_size)
    assert forwards == [1 + chunks] * (layers - 1) + [1 + chunks if last_scores else 1]
    original = kvzip_module.run_decoder_layers

    def every_layer(model, hidden, positions, step, layers=None):
        if isinstance(step, kvzip_module.ReconstructionStep):
            step.last_layer, layers = len(model.hf.model.layers), None  # every layer, every output
        return original(model, hidden, positions, step, layers)

    monkeypatch.setattr(kvzip_module, "run_decoder_layers", every_layer)
    monkeypatch.setattr(kvzip_module, "run_layer_attention", lambda *a: None)  # every layer ran in full
    all_scores, all_kept, all_out, all_forwards = run()
    assert all_forwards == [1 + chunks] * layers
    assert scores.keys() == all_scores.keys() == set(range(layers if last_scores else layers - 1))
    for i in scores:
        assert torch.allclose(scores[i], all_scores[i], rtol=1e-5, atol=1e-7)
    assert kept == all_kept and out.token_ids == all_out.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, all_out.logits)) < 1e-5


def test_budgets_are_per_layer_where_the_paper_ranks_across_layers(models):
    """By design: every layer keeps its own ``kv x B`` entries (a batch's rows hold as many entries per layer as
    each other), where the paper's non-uniform budgets and kvpress's default (``layerwise=False``) keep the
    ``layers x kv x B`` best scores of the whole model, so layers keep different counts."""
    model, n, budget = models["llama"], 130, 40
    method = ScoreRecorder(budget_tokens=budget, head_budgets="adaptive", alpha_safeguard=0.0)
    SCORES.clear()
    session = new_session(model, method, n, 1)
    with torch.inference_mode():
        prefill(model, session, random_ids(n, seed=2))
    kv = model.geometry.n_kv_heads
    assert session.cache.lengths() == [kv * budget] * model.geometry.n_layers
    scores = torch.stack([SCORES[layer] for layer in range(model.geometry.n_layers)])  # [layers, kv, n]
    scores[..., :method.n_sink] = float("inf")
    top = scores.flatten().topk(model.geometry.n_layers * kv * budget).indices // (kv * n)
    global_counts = torch.bincount(top, minlength=model.geometry.n_layers).tolist()
    assert global_counts != [kv * budget] * model.geometry.n_layers and sum(global_counts) == 2 * kv * budget


# ---- batches, speculative drafts ------------------------------------------------------------------------------
def test_rows_of_a_session_reconstruct_their_own_prompts(models):
    model = models["llama"]
    ids = torch.stack([random_ids(90, seed=s) for s in (1, 2, 3)])
    method = parse_method_spec("kvzip:budget_tokens=24,chunk_size=40")
    session = new_session(model, method, 90, 1, rows=3)
    with torch.inference_mode():
        prefill(model, session, ids)
    for row in range(3):
        alone = new_session(model, method, 90, 1)
        with torch.inference_mode():
            prefill(model, alone, ids[row])
        for layer, mine in zip(session.cache.layers, alone.cache.layers):
            assert torch.equal(layer.view()[2][row].sort(-1).values, mine.view()[2][0].sort(-1).values)


def test_a_self_draft_prefills_its_own_cache(models):
    """A self-draft usually shares the target's prompt pass; that pass runs the target's layers, so a kvzip draft
    (a model-level method) prefills on its own and its cache is compressed."""
    model = models["llama"]
    draft = ModelDraft(None, "kvzip:budget_tokens=24")
    with torch.inference_mode():
        shared = draft.start(DraftRun(model, random_ids(80, seed=4), 8, SamplingConfig(), None))
    assert shared is None and draft.session.cache.lengths() == [24] * model.geometry.n_layers
    prompts = [random_ids(n, seed=i).tolist() for i, n in enumerate((100, 100, 70))]
    plain = attnkit.generate(model, prompts, "full", max_new_tokens=NEW, stop_at_eos=False)
    out = speculative_generate(model, prompts, "self", draft="kvzip:budget_tokens=24", gamma=3, max_new_tokens=NEW,
                               stop_at_eos=False)
    assert [o.token_ids for o in out] == [p.token_ids for p in plain]  # lossless, drafting from a kvzip cache


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,pattern", [
    ({}, r"kvzip needs a cache budget"),
    ({"budget": 0.5, "chunk_size": 0}, r"chunk_size must be a whole number >= 1 .*got 0"),
    ({"budget": 0.5, "n_sink": -1}, r"n_sink must be a whole number >= 0 .*got -1"),
    ({"budget": 0.5, "decode_every": 4}, r"decode_every=4 is not supported"),
    ({"budget": 0.5, "head_budgets": "global"}, r"head_budgets must be one of uniform, adaptive; got 'global'"),
    ({"budget": 0.5, "alpha_safeguard": 0.0}, r"alpha_safeguard=0.0 applies to head_budgets=adaptive only"),
    ({"budget": 0.5, "window_size": 8}, r"method 'kvzip' has no parameter window_size"),
])
def test_bad_parameters_are_refused_in_one_line(params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method("kvzip", **params)
    assert "\n" not in str(err.value)


def test_what_it_cannot_do_is_refused_in_one_line(models):
    model = models["llama"]
    cases = [
        (lambda: AttnkitCache(model, "kvzip", params={"budget_tokens": 30}, max_new_tokens=4),
         r"method 'kvzip' runs the decoder layers itself .* use attnkit.generate instead"),
        (lambda: parse_method_spec("a_shape:n_init=16,n_local=32+kvzip:budget_tokens=30"),
         r"'kvzip' runs the decoder layers itself \(a model-level hook\) and cannot be composed"),
        (lambda: attnkit.generate(model, random_ids(50, seed=1), "kvzip", params={"budget_tokens": 4},
                                  max_new_tokens=2),
         r"n_sink=4 sinks leave no slot to choose in the 4-slot budget of layer 0"),
    ]
    for call, pattern in cases:
        with pytest.raises(AttnkitError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value)


def test_spec_parses_and_describes():
    m = parse_method_spec("kvzip:budget_tokens=64/32,chunk_size=512,n_sink=0,head_budgets=adaptive")
    assert (m.budget_tokens, m.chunk_size, m.n_sink, m.head_budgets) == ([64, 32], 512, 0, "adaptive")
    assert "kvzip" in attnkit.methods.METHODS and attnkit.methods.KVzip is KVzip
    assert parse_method_spec("kvzip:budget=0.3").decode_only_appends()
