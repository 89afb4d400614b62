"""kvgrad (KVgrad, kvpress's KVgradPress): equal to full at an unlimited budget on every architecture and in batches;
every layer's scores equal the input x gradient rule written plainly in float64 from a transformers forward (autograd
of the squared last hidden states over the whole token sequence prompt + reconstruction input, queries and keys caught
by hooks on the projections and rotated here), in one chunk and in several, and the kept positions are the sinks and
the best scores; the model's parameters get no gradient and keep their flags; rows of a batch keep what they keep
alone; AttnkitCache, compose and vLLM refuse it in one line; bad parameters are refused in one line."""

import copy
from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.forward import logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.full import Full
from attnkit.methods.kvgrad import KVgrad, attribution, value_output_norms
from attnkit.methods.spec import parse_method_spec
from attnkit.session import layer_contexts, new_session
from attnkit.vllm.plan import check_supported
from helpers import assert_equals_full, per_token_bytes, random_ids

torch.set_num_threads(1)

NEW = 8
REPEAT = "\n\nRepeat the previous context exactly."
CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"
ANSWER = "\n"
OVERLAP = 8


# ---- unlimited budget: exactly full ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (120, 97, 120)]
    for spec in ("kvgrad:budget=1.0", "kvgrad:budget_tokens=200,head_budgets=adaptive,chunk_size=40"):
        assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


# ---- the scores: the rule from a plain float64 transformers forward with autograd ------------------------------
SCORES: dict = {}


@dataclass(frozen=True)
class ScoreRecorder(KVgrad):
    """kvgrad that records each layer's scores (row 0) when it compresses the layer."""

    def rank(self, ctx):
        SCORES[ctx.index] = ctx.state.score[0].clone()
        return super().rank(ctx)


DOUBLE: dict = {}


def double_model(model):
    """A float64 copy of `model`'s transformers module (kept per model, the shared fixture left untouched)."""
    if id(model) not in DOUBLE:
        DOUBLE[id(model)] = copy.deepcopy(model.hf).double()
    return DOUBLE[id(model)]


def rope(x, positions, inv_freq):
    """Llama-family RoPE in float64 (halves rotated), ``x`` ``[heads, tokens, d]``."""
    angles = positions.double()[:, None] * inv_freq.double()
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def plain_pass(model, sequence, n):
    """A float64 transformers forward over `sequence` (the prompt's `n` tokens, then a reconstruction input); per
    layer the queries and keys after RoPE ``[heads, tokens, d]``, the values and the gradient norm of ``Phi`` (the
    squared norms of the last layer's output summed over the reconstruction tokens) at the attention output of each
    reconstruction token."""
    hf, g = double_model(model), model.geometry
    caught, attn_out, hooks = {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        for kind, module, heads in (("q", getattr(a, "q_norm", None) or a.q_proj, g.n_q_heads),
                                    ("k", getattr(a, "k_norm", None) or a.k_proj, g.n_kv_heads),
                                    ("v", a.v_proj, g.n_kv_heads)):
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, i=i, kind=kind, heads=heads: caught.__setitem__(
                    (i, kind), out.reshape(out.shape[0], -1, heads, g.head_dim)[0].transpose(0, 1))))
        hooks.append(a.register_forward_hook(lambda mod, args, out, i=i: attn_out.__setitem__(i, out[0])))
    last = {}
    hooks.append(hf.model.layers[-1].register_forward_hook(
        lambda mod, args, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.enable_grad():
            hf.model(input_ids=sequence[None])
            phi = last["h"][0, n:].square().sum()
            grads = torch.autograd.grad(phi, [attn_out[i] for i in range(g.n_layers)])
    finally:
        for h in hooks:
            h.remove()
    positions = torch.arange(sequence.shape[0])
    inv_freq = hf.model.rotary_emb.inv_freq
    return [(rope(caught[(i, "q")].detach(), positions, inv_freq), rope(caught[(i, "k")].detach(), positions, inv_freq),
             caught[(i, "v")].detach(), grads[i][0, n:].norm(dim=-1)) for i in range(g.n_layers)]


def reference_scores(model, ids, chunk_size, n_sink):
    """``[layers][kv, n]`` float64: KVgrad's score of every prompt entry, chunk by chunk (kvzip's inputs)."""
    g, n = model.geometry, ids.shape[0]
    hf = double_model(model)
    tok = model.tokenizer
    window = g.sliding_window
    scaling = g.head_dim ** -0.5
    group = g.n_q_heads // g.n_kv_heads
    out = [torch.zeros(g.n_kv_heads, n, dtype=torch.float64) for _ in range(g.n_layers)]
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        head = (tok(REPEAT, add_special_tokens=False).input_ids if start == 0 else
                tok(CONTINUE, add_special_tokens=False).input_ids + ids[max(0, start - OVERLAP):start].tolist())
        sequence = torch.cat([ids, torch.tensor(head + tok(ANSWER, add_special_tokens=False).input_ids),
                              ids[start:end]])
        m = sequence.shape[0] - n
        sink = min(n_sink, start)
        k_pos = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + m)])
        q_pos = torch.arange(n, n + m)
        allowed = k_pos[None] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None] > q_pos[:, None] - window
        for layer, (q, k, v, grad_norm) in enumerate(plain_pass(model, sequence, n)):
            w_o = hf.model.layers[layer].self_attn.o_proj.weight.detach()  # [hidden, hq * d]
            for j in range(g.n_kv_heads):
                best = torch.zeros(end - start, dtype=torch.float64)
                for h in range(j * group, (j + 1) * group):
                    logits = q[h, n:] @ k[j, k_pos].T * scaling
                    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)[:, sink:sink + end - start]
                    written = (v[j, start:end] @ w_o[:, h * g.head_dim:(h + 1) * g.head_dim].T).norm(dim=-1)
                    best = torch.maximum(best, (probs * written[None] * grad_norm[:, None]).amax(0))
                out[layer][j, start:end] = best
    return out


def kept_entries(session, layer):
    """The (kv head, position) pairs row 0 of `layer` holds (a head-adaptive layer is flat: its heads in extras)."""
    kv = session.cache.layers[layer]
    positions = kv.view()[2][0]
    if "head" in kv.extras:
        return set(zip(kv.extras["head"][0, 0, :kv.length].tolist(), positions[0].tolist()))
    return {(h, p) for h, row in enumerate(positions.tolist()) for p in row}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["budget_tokens=40", "budget=0.3,chunk_size=48", "budget_tokens=30,n_sink=0,chunk_size=64",
                                  "budget_tokens=36,chunk_size=64,head_budgets=adaptive,alpha_safeguard=0"])
def test_scores_and_kept_positions_equal_the_rule(arch_models, arch, spec):
    model, n = arch_models[arch], 130
    ids = random_ids(n, seed=21)
    method = ScoreRecorder(**parse_method_spec("kvgrad:" + spec).params())
    SCORES.clear()
    session = new_session(model, method, n, 4)
    with torch.inference_mode():
        prefill(model, session, ids)
    want = reference_scores(model, ids, method.chunk_size, method.n_sink)
    g = model.geometry
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    for layer in range(g.n_layers):
        got = SCORES[layer].double()
        assert float(want[layer].max()) > 0
        assert torch.allclose(got, want[layer], rtol=1e-4, atol=1e-6 * float(want[layer].max())), \
            (layer, (got - want[layer]).abs().max())
        score = want[layer].clone()
        score[:, :method.n_sink] = float("inf")
        chosen = kept_entries(session, layer)
        groups = [range(g.n_kv_heads)] if method.head_budgets == "adaptive" else [[h] for h in range(g.n_kv_heads)]
        for heads in groups:
            mine = {(h, p) for h, p in chosen if h in heads}
            assert len(mine) == len(heads) * budgets[layer]
            dropped = [float(score[h, p]) for h in heads for p in range(n) if (h, p) not in mine]
            assert min(float(score[h, p]) for h, p in mine) >= max(dropped) * (1 - 1e-4)


def test_the_rule_is_not_kvzips(arch_models):
    """The gradient and the value norms change the choice: kvgrad keeps other entries than kvzip at one budget."""
    model, ids = arch_models["llama"], random_ids(130, seed=21)
    kept = []
    for name in ("kvgrad", "kvzip"):
        session = new_session(model, parse_method_spec(f"{name}:budget_tokens=40,chunk_size=512"), 130, 1)
        with torch.inference_mode():
            prefill(model, session, ids)
        kept.append([kept_entries(session, layer) for layer in range(model.geometry.n_layers)])
    assert kept[0] != kept[1]


def test_attribution_on_hand_made_tensors():
    """The blockwise maximum against a dense float64 computation, with a window."""
    gen = torch.Generator().manual_seed(3)
    b, kv, g, m, length, d, window = 2, 2, 3, 11, 30, 8, 20
    q, keys = torch.randn(b, kv * g, m, d, generator=gen), torch.randn(b, kv, length, d, generator=gen)
    k_pos, q_pos = torch.arange(length), torch.arange(length - m, length)
    vn, gn = torch.rand(b, kv, g, 7, generator=gen), torch.rand(b, m, generator=gen)
    got = attribution(q, keys, 0.3, q_pos, k_pos, slice(5, 12), vn, gn, window)
    allowed = (k_pos[None] <= q_pos[:, None]) & (k_pos[None] > q_pos[:, None] - window)
    for r in range(b):
        for j in range(kv):
            logits = torch.einsum("gid,ld->gil", q[r, j * g:(j + 1) * g].double(), keys[r, j].double()) * 0.3
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)[..., 5:12]
            want = (probs * vn[r, j, :, None, :].double() * gn[r, None, :, None].double()).amax(dim=(0, 1))
            assert torch.allclose(got[r, j].double(), want, rtol=1e-5)
    weight = torch.randn(16, kv * g * d, generator=gen)
    values = torch.randn(b, kv, 5, d, generator=gen)
    norms = value_output_norms(values, weight)
    for h in range(kv * g):
        direct = (values[:, h // g] @ weight[:, h * d:(h + 1) * d].T).norm(dim=-1)
        assert torch.allclose(norms[:, h // g, h % g], direct, rtol=1e-5)


# ---- no side effect on the model, the cache ------------------------------------------------------------------------
def test_no_parameter_gets_a_gradient_and_frozen_weights_work(arch_models):
    model, ids = arch_models["qwen3"], random_ids(100, seed=4)
    spec = "kvgrad:budget_tokens=30,chunk_size=40"
    out = attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    params = list(model.hf.parameters())
    assert all(p.grad is None and p.requires_grad for p in params)
    for p in params:
        p.requires_grad_(False)
    try:
        frozen = attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
    finally:
        for p in params:
            p.requires_grad_(True)
    assert frozen.token_ids == out.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(frozen.logits, out.logits)) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_only_prompt_entries_stay_and_the_bytes_drop(arch_models, arch):
    model, n, budget = arch_models[arch], 140, 40
    ids = random_ids(n, seed=8)
    full_session = new_session(model, Full(), n, NEW)
    session = new_session(model, parse_method_spec(f"kvgrad:budget_tokens={budget},chunk_size=64"), n, NEW)
    with torch.inference_mode():
        full_logits = logits_of(model, prefill(model, full_session, ids))
        logits = logits_of(model, prefill(model, session, ids))
    assert torch.equal(logits, full_logits)  # the prompt's own pass is full attention's
    for layer, full_kv in zip(session.cache.layers, full_session.cache.layers):
        keys, values, positions = layer.view()
        assert layer.length == budget and int(positions.max()) < n  # no reconstruction entry stays
        fk, fv, _ = full_kv.view()
        index = positions.unsqueeze(-1).expand_as(keys)
        assert torch.equal(keys, fk.gather(2, index)) and torch.equal(values, fv.gather(2, index))
    out = attnkit.generate(model, ids, "kvgrad", params={"budget_tokens": budget}, max_new_tokens=NEW,
                           stop_at_eos=False)
    full = attnkit.generate(model, ids, "full", max_new_tokens=NEW, stop_at_eos=False)
    assert out.stats.final_kv_bytes == (budget + NEW) * per_token_bytes(model) < full.stats.final_kv_bytes
    assert out.token_ids[0] == full.token_ids[0]


def test_rows_and_chunked_prefill_keep_what_one_prompt_keeps(arch_models):
    model, n = arch_models["llama"], 90
    ids = torch.stack([random_ids(n, seed=s) for s in (1, 2, 3)])
    method = parse_method_spec("kvgrad:budget_tokens=24,chunk_size=40")
    session = new_session(model, method, n, 1, rows=3)
    with torch.inference_mode():
        prefill(model, session, ids)
    for row in range(3):
        for chunk in (None, 33):
            alone = new_session(model, method, n, 1)
            with torch.inference_mode():
                prefill(model, alone, ids[row], chunk_size=chunk)
            for layer, mine in zip(session.cache.layers, alone.cache.layers):
                assert torch.equal(layer.view()[2][row].sort(-1).values, mine.view()[2][0].sort(-1).values)


# ---- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params,pattern", [
    ({}, r"kvgrad needs a cache budget"),
    ({"budget": 0.5, "chunk_size": 0}, r"chunk_size must be a whole number >= 1 .*got 0"),
    ({"budget": 0.5, "n_sink": -1}, r"n_sink must be a whole number >= 0 .*got -1"),
    ({"budget": 0.5, "decode_every": 4}, r"decode_every=4 is not supported"),
    ({"budget": 0.5, "criticalkv": True}, r"criticalkv=true is not supported"),
    ({"budget": 0.5, "head_budgets": "global"}, r"head_budgets must be one of uniform, adaptive; got 'global'"),
    ({"budget": 0.5, "layerwise": True}, r"method 'kvgrad' has no parameter layerwise"),
])
def test_bad_parameters_are_refused_in_one_line(params, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        attnkit.make_method("kvgrad", **params)
    assert "\n" not in str(err.value)


def test_what_it_cannot_do_is_refused_in_one_line(arch_models):
    model = arch_models["llama"]
    cases = [
        (lambda: AttnkitCache(model, "kvgrad", params={"budget_tokens": 30}, max_new_tokens=4),
         r"method 'kvgrad' runs the decoder layers itself .* use attnkit.generate instead"),
        (lambda: parse_method_spec("a_shape:n_init=16,n_local=32+kvgrad:budget_tokens=30"),
         r"'kvgrad' runs the decoder layers itself \(a model-level hook\) and cannot be composed"),
        (lambda: check_supported(parse_method_spec("kvgrad:budget=0.3"), "--method"),
         r"kvgrad.*not supported inside vLLM \(it scores the prompt with a backward pass"),
        (lambda: attnkit.generate(model, random_ids(50, seed=1), "kvgrad", params={"budget_tokens": 4},
                                  max_new_tokens=2),
         r"n_sink=4 sinks leave no slot to choose in the 4-slot budget of layer 0"),
    ]
    for call, pattern in cases:
        with pytest.raises(AttnkitError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value)


def test_spec_parses_and_describes():
    m = parse_method_spec("kvgrad:budget_tokens=64,chunk_size=128,n_sink=0,head_budgets=adaptive")
    assert (m.budget_tokens, m.chunk_size, m.n_sink, m.head_budgets) == (64, 128, 0, "adaptive")
    assert parse_method_spec("kvgrad:budget=0.3").chunk_size == 512  # kvpress's default
    assert "kvgrad" in attnkit.methods.METHODS and attnkit.methods.KVgrad is KVgrad and KVgrad.kvpress == "KVgradPress"
