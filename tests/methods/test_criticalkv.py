"""criticalkv=true on a prompt scorer (CriticalKV, arXiv 2502.03805; kvpress's CriticalKVPress / CriticalAdaKVPress):
equal to full at an unlimited budget on every architecture, batched; the kept positions equal a plain recomputation
of the two stages (the scorer's best ``int(ratio B)``, then ``(s + epsilon) x mean_h ||v W_o[h]||_1``), per kv head
and with AdaKV's counts per head, also re-compressing while decoding; SnapKV's window stays and its score is its
votes averaged over the window; through transformers' generate (AttnkitCache) the same tokens; bad parameters and a
module without an output projection refused in one line, and vLLM refuses it in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.cache import KVCache
from attnkit.methods.spec import parse_method_spec
from attnkit.session import Session, Step
from helpers import ROPE, assert_attnkit_cache_equals_generate, assert_equals_full, qkv, randn, random_ids

torch.set_num_threads(1)

NEW = 10
HQ, KV, D, HIDDEN = 4, 2, 8, 12


class Attention(torch.nn.Module):
    """A stand-in attention module: only its output projection is read."""

    def __init__(self, seed=3, o_proj=True):
        super().__init__()
        if o_proj:
            self.o_proj = torch.nn.Linear(HQ * D, HIDDEN, bias=False)
            self.o_proj.weight.data = randn(HIDDEN, HQ * D, seed=seed)


def drive(method, q, k, v, prompt_len, module):
    """One layer: the prompt, then one token per step, the attention module handed over as the hosts do."""
    n = q.shape[2]
    session = Session(method, KVCache(1), 1, prompt_len, n - prompt_len, rope=ROPE)

    def step(phase, pos, s):
        st = Step(session, phase, pos)
        st.note_layer_input(0, None, module)
        st.attention(0, q[:, :, s], k[:, :, s], v[:, :, s], D ** -0.5, None)
        return [sorted(row.tolist()) for row in session.cache.layers[0].view()[2][0]]

    held = [step("prefill", torch.arange(prompt_len), slice(0, prompt_len))]
    held += [step("decode", torch.tensor([t]), slice(t, t + 1)) for t in range(prompt_len, n)]
    return session, held


def projected_norm(v, weight, head, pos):
    """mean over the query heads of kv head `head`'s group of ||v W_o[h]||_1, written out."""
    g = HQ // KV
    value = v[0, head, pos].double().tolist()
    total = 0.0
    for t in range(g):
        h = head * g + t
        total += sum(abs(sum(value[e] * float(weight[c, h * D + e]) for e in range(D))) for c in range(HIDDEN))
    return total / g


def two_stages(held, score, norm, count, ratio, eps, forced=()):
    """The forced entries and the best by `score` up to int(ratio x count) (at least 1), then by (s + eps) x norm."""
    first = max(1, int(ratio * count)) if ratio > 0 else 0
    by_score = sorted(held, key=lambda p: (p not in forced, -score[p]))
    stage1 = set(by_score[:max(first, len(forced))])
    rest = sorted((p for p in held if p not in stage1), key=lambda p: -(score[p] + eps) * norm[p])
    return sorted(stage1) + rest[:count - len(stage1)]


def knorm_scores(k, v, weight, head, held):
    score = {p: -float(k[0, head, p].double().norm()) for p in held}
    return score, {p: projected_norm(v, weight, head, p) for p in held}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["snapkv:budget_tokens=200,criticalkv=true",
                                  "knorm:budget_tokens=200,criticalkv=true,head_budgets=adaptive"])
def test_unlimited_budget_equals_full_batched(arch_models, arch, spec):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, parse_method_spec(spec), NEW)


@pytest.mark.parametrize("every,ratio", [(0, 0.5), (4, 0.5), (0, 0.25), (3, 0.0)])
def test_kept_positions_equal_a_plain_recomputation_of_the_two_stages(every, ratio):
    q, k, v = qkv(64, seed=31)
    module = Attention()
    budget, prompt_len = 14, 50
    method = attnkit.make_method("knorm", budget_tokens=budget, criticalkv=True, first_stage_ratio=ratio,
                                 decode_every=every)
    _, got = drive(method, q, k, v, prompt_len, module)
    weight = module.o_proj.weight.detach()
    held = [list(range(prompt_len)) for _ in range(KV)]
    want = []
    for t in range(prompt_len, q.shape[2] + 1):
        if t == prompt_len or (every and (t - prompt_len) % every == 0 and len(held[0]) > budget):
            held = [two_stages(held[h], *knorm_scores(k, v, weight, h, held[h]), budget, ratio, 1e-4)
                    for h in range(KV)]
        want.append([sorted(row) for row in held])
        held = [row + [t] for row in held]
    assert got == want[:len(got)]
    # the value term decides: the kept set differs from the scorer's own top entries
    plain = drive(attnkit.make_method("knorm", budget_tokens=budget), q, k, v, prompt_len, module)[1]
    assert got[0] != plain[0]


def test_adaptive_counts_are_adakvs_and_each_heads_entries_the_two_stages():
    q, k, v = qkv(60, seed=32)
    module = Attention(seed=4)
    budget, n, alpha = 12, 60, 0.2
    method = attnkit.make_method("knorm", budget_tokens=budget, criticalkv=True, head_budgets="adaptive")
    session, _ = drive(method, q, k, v, n, module)
    layer = session.cache.layers[0]
    owner, pos = layer.extras["head"][0, 0, :layer.length], layer.view()[2][0, 0]
    got = [sorted(pos[owner == h].tolist()) for h in range(KV)]
    weight = module.o_proj.weight.detach()
    scores = [knorm_scores(k, v, weight, h, range(n)) for h in range(KV)]
    # AdaKV: each head's safeguard (its best int(alpha B)) first, then the kv x B best scores across heads
    safe = max(1, int(alpha * budget))
    best = [sorted(range(n), key=lambda p, h=h: -scores[h][0][p])[:safe] for h in range(KV)]
    ranked = sorted(((h, p) for h in range(KV) for p in range(n)),
                    key=lambda hp: (hp[1] not in best[hp[0]], -scores[hp[0]][0][hp[1]]))
    counts = [sum(1 for h, _ in ranked[:KV * budget] if h == head) for head in range(KV)]
    assert sum(counts) == KV * budget and counts[0] != counts[1]
    want = []
    for h in range(KV):
        first = int(counts[h] * 0.5)  # each head's stage 1: of its own count, no floor of one
        score, norm = scores[h]
        by_score = sorted(range(n), key=lambda p: (p not in best[h], -score[p]))
        stage1 = set(by_score[:max(first, safe)])
        rest = sorted((p for p in range(n) if p not in stage1), key=lambda p: -(score[p] + 1e-4) * norm[p])
        want.append(sorted(list(stage1) + rest[:counts[h] - len(stage1)]))
    assert got == want


def test_snapkv_keeps_its_window_and_weighs_its_averaged_votes(arch_models):
    model = arch_models["llama"]
    ids = random_ids(160, seed=9)
    method = parse_method_spec("snapkv:budget_tokens=40,window_size=8,kernel_size=1,criticalkv=true")
    from attnkit.forward import prefill
    from attnkit.session import new_session
    session = new_session(model, method, 160, 2)
    seen = {}
    original = type(method).critical_score

    def spy(self, ctx):
        out = original(self, ctx)
        seen[ctx.index] = (out, self.rank(ctx), ctx.state.window_q.shape[2])
        return out

    type(method).critical_score = spy
    try:
        with torch.inference_mode():
            prefill(model, session, ids)
    finally:
        type(method).critical_score = original
    for index, layer in enumerate(session.cache.layers):
        held = layer.view()[2][0]
        assert all(set(range(152, 160)) <= set(row.tolist()) for row in held)  # the window
        score, votes, window = seen[index]
        assert window == 8 and torch.allclose(score * window, votes)


def test_through_transformers_generate(arch_models):
    ids = random_ids(120, seed=5)
    for params in ({"budget_tokens": 40, "window_size": 8, "criticalkv": True},
                   {"budget_tokens": 40, "window_size": 8, "criticalkv": True, "head_budgets": "adaptive"}):
        assert_attnkit_cache_equals_generate(arch_models["llama"], ids, "snapkv", params, 8)


@pytest.mark.parametrize("params,match", [
    ({"criticalkv": 2}, "criticalkv must be True or False"),
    ({"criticalkv": True, "first_stage_ratio": 1.5}, "first_stage_ratio must be"),
    ({"criticalkv": True, "critical_epsilon": -1.0}, "critical_epsilon must be"),
    ({"first_stage_ratio": 0.3}, "apply with criticalkv=true only"),
    ({"criticalkv": True, "chunk_length": 8}, "chunk_length=8"),
    ({"criticalkv": True, "segment_length": 8}, "segment_length=8"),
])
def test_bad_parameters_are_refused_in_one_line(params, match):
    with pytest.raises(AttnkitError, match=match) as err:
        attnkit.make_method("knorm", budget_tokens=16, **params)
    assert "\n" not in str(err.value)


def test_a_module_without_an_output_projection_is_refused_in_one_line():
    q, k, v = qkv(40, seed=2)
    with pytest.raises(AttnkitError, match="output projection") as err:
        drive(attnkit.make_method("knorm", budget_tokens=10, criticalkv=True), q, k, v, 40, Attention(o_proj=False))
    assert "\n" not in str(err.value)


def test_vllm_refuses_it_in_one_line():
    from attnkit.vllm.plan import check_supported
    with pytest.raises(AttnkitError, match="output projection") as err:
        check_supported(parse_method_spec("snapkv:budget=0.3,criticalkv=true"), "vllm")
    assert "\n" not in str(err.value)
