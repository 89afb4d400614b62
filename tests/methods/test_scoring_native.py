"""The C++ kernel of the CPU scoring pass (:mod:`attnkit.methods.scoring_native`): its output and statistics against
the blocked pass of :mod:`attnkit.methods.scoring`, the generations that take it against the torch path, its
refusals, and its build (cached per machine; without a compiler the torch path, with a warning)."""

import pytest
import torch

import attnkit
from attnkit import native
from attnkit.methods import kvzip, scoring, scoring_native
from attnkit.methods.keyformer_noise import GumbelFactorWeights
from attnkit.methods.spec import parse_method_spec
from helpers import randn, random_ids

pytestmark = pytest.mark.skipif(scoring_native.library() is None, reason="no C++ compiler")  # CI has one
BUILDS = [i for i in native.runnable() if i != "native"] or ["native"]  # every instruction set this CPU runs


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch):
    """The kernel built for each instruction set this CPU runs (AVX2 and AVX-512 on an x86-64 CPU with both)."""
    monkeypatch.setenv(native.ENV_ISA, request.param)
    return request.param


def hf_layout(b, heads, n, d, seed):
    """``[b, heads, n, d]`` with transformers' strides (a transposed ``[b, n, heads, d]``)."""
    return randn(b, n, heads, d, seed=seed).transpose(1, 2)


def operands(b, hq, kv, m, n, d, dv, seed=0):
    return hf_layout(b, hq, m, d, seed), hf_layout(b, kv, n, d, seed + 1) * 2, hf_layout(b, kv, n, dv, seed + 2)


SHAPES = [  # b, hq, kv, queries, keys, d, dv: a whole prompt or a chunk after one; GQA or not; any d, dv % 16 == 0
    (2, 8, 2, 150, 150, 32, 32),
    (1, 6, 3, 70, 201, 40, 48),
    (2, 4, 4, 33, 130, 64, 64),
    (1, 7, 1, 129, 129, 16, 128),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("keyformer", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_the_blocked_pass(shape, reduce, keyformer, threads, build):
    b, hq, kv, m, n, d, dv = shape
    q, k, v = operands(*shape)
    weights = GumbelFactorWeights(seed=3, layer=1, kv_heads=kv) if keyformer else None
    out, stats = scoring_native.prompt_attention_with_statistics(q, k, v, d ** -0.5, reduce=reduce, weights=weights,
                                                                 threads=threads)
    ref_out, ref_stats = scoring.attention_with_statistics(q, k, v, d ** -0.5, torch.arange(n - m, n),
                                                           torch.arange(n), reduce=reduce, weights=weights)
    assert out.shape == (b, hq, m, dv) and stats.shape == (b, kv, n) and stats.dtype == torch.float32
    assert (out - ref_out).abs().max() < 1e-5
    assert torch.allclose(stats, ref_stats, rtol=1e-5, atol=1e-6)
    again = scoring_native.prompt_attention_with_statistics(q, k, v, d ** -0.5, reduce=reduce, weights=weights,
                                                            threads=threads)
    assert torch.equal(again[1], stats)  # the same sums in the same order, whatever the timing


def test_the_most_attention_a_key_receives(build):
    """``rows="max"``: the maximum over the queries (KVzip's reduction), of the group's mean or maximum."""
    q, k, v = operands(1, 8, 2, 90, 90, 32, 32, seed=4)
    logits = (q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) * 0.2
    probs = torch.softmax(logits.masked_fill(torch.ones(90, 90, dtype=torch.bool).triu(1), float("-inf")), -1)
    for reduce, ref in (("max", probs.amax(dim=2)), ("mean", probs.view(1, 2, 4, 90, 90).mean(2).amax(2))):
        _, stats = scoring_native.prompt_attention_with_statistics(q, k, v, 0.2, reduce=reduce, rows="max")
        ref = ref.view(1, 2, 4, 90).amax(2) if reduce == "max" else ref
        assert torch.allclose(stats.double(), ref, rtol=1e-5, atol=1e-7)


def test_a_dominant_key_and_far_below_ones(build):
    """Logits 80 apart in one row: the online softmax rescales, and weights below float32's range are 0, not NaN."""
    q, k, v = operands(1, 2, 1, 100, 100, 16, 16, seed=5)
    k[:, :, 3] = q[:, 0, 50] * 60  # query 50 of head 0 (and its neighbours) sees key 3 far above the rest
    out, stats = scoring_native.prompt_attention_with_statistics(q, k, v, 1.0)
    ref_out, ref_stats = scoring.attention_with_statistics(q, k, v, 1.0, torch.arange(100), torch.arange(100))
    assert torch.isfinite(stats).all() and torch.isfinite(out).all()
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(stats, ref_stats, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["h2o:budget=0.3", "h2o:budget=0.3,gqa_reduce=max", "keyformer:budget_tokens=40",
                                  "keyformer:budget=0.3,gqa_reduce=max"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generations_keep_the_tokens_of_the_torch_path(arch_models, monkeypatch, spec, arch):
    """A ragged batch, whole prompts and prompts in chunks: the kernel takes every layer's prompt (and every chunk
    after the ones before it) and keeps the tokens and logits (within 1e-4) of the torch path."""
    model = arch_models[arch]
    prompts = [random_ids(n, seed=50 + n) for n in (90, 130, 61)]

    def run(chunk_size=None):
        return attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=8, stop_at_eos=False,
                                keep_logits=True, chunk_size=chunk_size)

    calls = []
    kernel = scoring_native.prompt_attention_with_statistics
    monkeypatch.setattr(scoring_native, "prompt_attention_with_statistics",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or kernel(*a, **kw))
    native, chunked = run(), run(chunk_size=40)
    assert len(calls) == model.geometry.n_layers * (len(prompts) + sum(-(-n // 40) for n in (90, 130, 61)))
    monkeypatch.setattr(scoring_native, "kernel_pays", lambda *a, **k: False)
    torch_path = run()
    for a, b, c in zip(native, chunked, torch_path):
        assert a.token_ids == b.token_ids == c.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, c.logits)) < 1e-4
        assert max((x - y).abs().max().item() for x, y in zip(b.logits, c.logits)) < 1e-4


@pytest.mark.parametrize("spec", ["full+h2o:budget=0.3", "full+keyformer:budget=0.3,gqa_reduce=max",
                                  "snapkv:budget_tokens=40,decode_every=8", "h2o:budget_tokens=40,decode_every=8"])
def test_a_statistic_alone_from_the_kernel(arch_models, monkeypatch, spec):
    """The statistic alone from the kernel (no values), beside another method's prompt output (``compose``) and for
    re-compressions while decoding (SnapKV's window votes, buffered H2O's steps): the tokens and logits (within 1e-4)
    of the torch path."""
    model = arch_models["llama"]
    prompts = [random_ids(n, seed=70 + n) for n in (90, 61)]
    decoding = "decode_every" in spec
    run = lambda: attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=30 if decoding else 8,  # noqa: E731
                                   stop_at_eos=False, keep_logits=True)
    calls = []
    statistic = scoring_native.prompt_statistics
    monkeypatch.setattr(scoring_native, "prompt_statistics", lambda *a, **kw: calls.append(1) or statistic(*a, **kw))
    native = run()
    if decoding:  # three compressions of every layer at least
        assert len(calls) >= 3 * model.geometry.n_layers
    else:
        assert len(calls) == model.geometry.n_layers * len(prompts)
    monkeypatch.setattr(scoring_native, "kernel_pays", lambda *a, **kw: False)
    for a, b in zip(native, run()):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


def held_with_window(kv, held, m, seed):
    """Per-kv-head positions of `held` entries in a decoding method's order: earlier positions in any order (a
    compression's survivors), then the last `m` steps' own, appended in order; and those steps' positions."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.arange(500, 500 + m)
    earlier = torch.stack([torch.randperm(500, generator=gen)[:held - m] for _ in range(kv)])
    return torch.cat([earlier, steps.expand(kv, m)], dim=1)[None], steps


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("m", [1, 8, 40])
def test_the_statistic_of_queries_whose_keys_end_the_held_entries(reduce, m, build, monkeypatch):
    """A decoding method's window queries over what it holds (SnapKV's votes, H2O's buffered steps): the kernel's
    statistic where the held entries end with the queries' own, the torch path's within float32 rounding; where
    they do not (an entry after the first query, queries out of order, a window), the torch path itself."""
    calls = []
    statistic = scoring_native.prompt_statistics
    monkeypatch.setattr(scoring_native, "prompt_statistics", lambda *a, **kw: calls.append(1) or statistic(*a, **kw))
    q, k, _ = operands(1, 8, 2, m, 70, 32, 32, seed=m)
    k_pos, q_pos = held_with_window(2, 70, m, seed=m)
    got = scoring_native.attention_statistics(q, k, 0.2, q_pos, k_pos, reduce=reduce)
    ref = scoring.attention_statistics(q, k, 0.2, q_pos, k_pos, reduce=reduce)
    assert calls == [1] and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    later = k_pos.clone()
    later[0, 1, 0] = q_pos[-1] + 1  # an entry no query sees yet
    shuffled = torch.cat([k_pos[..., :70 - m], k_pos[..., 70 - m:].flip(-1)], -1)
    cases = [(later, q_pos, None), (k_pos, q_pos, 16)] + ([(shuffled, q_pos.flip(0), None)] if m > 1 else [])
    for k_p, q_p, window in cases:
        got = scoring_native.attention_statistics(q, k, 0.2, q_p, k_p, reduce=reduce, window=window)
        assert torch.equal(got, scoring.attention_statistics(q, k, 0.2, q_p, k_p, reduce=reduce, window=window))
    assert calls == [1]
    assert scoring_native.ends_with_queries(q_pos, k_pos[0, 0]) and not scoring_native.ends_with_queries(q_pos, later)


@pytest.mark.parametrize("start,end,sink", [(0, 60, 0), (50, 90, 4), (100, 140, 4)])
def test_kvzip_reconstruction(start, end, sink, build):
    """KVzip's reconstruction forward: the output over every key, the score's softmax over the sinks, the chunk and
    the input's own keys, its maximum over the queries and the group's heads; against the torch passes."""
    n, m = 140, 70
    q = hf_layout(2, 6, m, 32, seed=8)
    keys, values = hf_layout(2, 2, n + m, 32, seed=9), hf_layout(2, 2, n + m, 32, seed=10)
    out, score = kvzip.reconstruction_attention(q, keys, values, 0.2, start, end, sink, native=True)
    for one_pass in (True, False):
        ref_out, ref = kvzip.reconstruction_attention(q, keys, values, 0.2, start, end, sink, one_pass=one_pass,
                                                      native=False)
        assert (out - ref_out).abs().max() < 1e-5
        assert score.shape == (2, 2, end - start) and torch.allclose(score, ref, rtol=1e-5, atol=1e-7)
    none, alone = kvzip.reconstruction_attention(q, keys, values, 0.2, start, end, sink, native=True, output=False)
    assert none is None and torch.allclose(alone, score, rtol=1e-5, atol=1e-7)  # the score without the output


def subset_reference(q, keys, values, scaling, scored, columns):
    """Dense float64: causal attention over every key, and the column maximum (over the queries and the group's
    heads) of the softmax over the scored keys only."""
    b, hq, m, _ = q.shape
    kv, n = keys.shape[1], keys.shape[2]
    k, v = (t.double().repeat_interleave(hq // kv, 1) for t in (keys, values))
    logits = (q.double() @ k.transpose(-1, -2)) * scaling
    seen = torch.arange(n)[None] <= torch.arange(n - m, n)[:, None]
    out = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1) @ v
    sub = torch.softmax(logits.masked_fill(~(seen & scored), float("-inf")), -1)
    return out, sub.view(b, kv, hq // kv, m, n).amax(dim=(2, 3))[..., columns]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", [  # b, hq, kv, queries, keys, d, dv, scored ranges, columns
    (2, 6, 2, 70, 210, 32, 32, [(0, 4), (50, 90), (140, 210)], (50, 90)),  # a chunk across a key tile's edge
    (1, 8, 2, 130, 400, 16, 48, [(0, 3), (128, 256), (270, 400)], (128, 256)),  # whole tiles
    (1, 4, 4, 40, 100, 64, 64, [(0, 100)], (0, 60)),  # every key scored: the plain softmax
])
def test_the_statistic_of_a_subset_of_keys(case, threads, build):
    """One sweep: the output over every key and the score's softmax over the scored keys only (KVzip's)."""
    b, hq, kv, m, n, d, dv, ranges, (lo, hi) = case
    q, k, v = operands(b, hq, kv, m, n, d, dv, seed=11)
    scored = torch.zeros(n, dtype=torch.bool)
    for a, z in ranges:
        scored[a:z] = True
    out, stats = scoring_native.prompt_attention_with_subset_statistics(
        q, k, v, d ** -0.5, scored, slice(lo, hi), reduce="max", rows="max", threads=threads)
    ref_out, ref = subset_reference(q, k, v, d ** -0.5, scored, slice(lo, hi))
    assert stats.shape == (b, kv, hi - lo) and (out.double() - ref_out).abs().max() < 1e-5
    assert torch.allclose(stats.double(), ref, rtol=1e-5, atol=1e-7)


def test_scored_keys_far_below_the_others_are_scored_in_a_sweep_of_their_own(monkeypatch, build):
    """A key outside the scored ones whose logit lies ~200 above theirs leaves their float32 exponentials (relative
    to the row's maximum) at zero: the one sweep says so (None), and the reconstruction scores them on their own."""
    n, m, start, end, sink, d = 140, 70, 50, 90, 4, 32
    q = hf_layout(1, 4, m, d, seed=12)
    keys, values = hf_layout(1, 2, n + m, d, seed=13), hf_layout(1, 2, n + m, d, seed=14)
    common = q.mean(dim=(0, 1, 2))
    q += 3 * common
    keys[:, :, 20] = common * 200 / (common.norm() ** 2 * 3 * d ** -0.5)  # position 20: neither sink nor chunk
    scored = torch.zeros(n + m, dtype=torch.bool)
    scored[:sink] = scored[start:end] = scored[n:] = True
    assert scoring_native.prompt_attention_with_subset_statistics(q, keys, values, d ** -0.5, scored,
                                                                  slice(start, end), reduce="max", rows="max") is None
    calls = []
    statistic = scoring_native.prompt_statistics
    monkeypatch.setattr(scoring_native, "prompt_statistics", lambda *a, **kw: calls.append(1) or statistic(*a, **kw))
    out, score = kvzip.reconstruction_attention(q, keys, values, d ** -0.5, start, end, sink, native=True)
    assert calls == [1]
    ref_out, ref = subset_reference(q, keys, values, d ** -0.5, scored, slice(start, end))
    assert (out.double() - ref_out).abs().max() < 1e-5 and float(ref.min()) > 0
    assert torch.allclose(score.double(), ref, rtol=1e-5, atol=1e-9)


def test_kvzip_keeps_the_tokens_of_the_torch_path(arch_models, monkeypatch):
    model = arch_models["qwen3"]
    prompts = [random_ids(n, seed=80 + n) for n in (90, 130)]
    run = lambda: attnkit.generate(model, prompts, parse_method_spec("kvzip:budget=0.3,chunk_size=48"),  # noqa: E731
                                   max_new_tokens=8, stop_at_eos=False, keep_logits=True)
    calls = []
    for name in ("prompt_statistics", "prompt_attention_with_subset_statistics", "prompt_attention"):
        function = getattr(scoring_native, name)
        monkeypatch.setattr(scoring_native, name, lambda *a, f=function, name=name, **kw: calls.append(name) or f(
            *a, **kw))
    native = run()
    # per reconstruction chunk (2 + 3 for the two prompts), one sweep in each layer, the last one's score alone;
    # before them, each prompt's own attention in each layer
    chunks, layers = 5, model.geometry.n_layers
    assert sorted(calls) == sorted(["prompt_attention_with_subset_statistics"] * chunks * (layers - 1)
                                   + ["prompt_statistics"] * chunks + ["prompt_attention"] * 2 * layers)
    monkeypatch.setattr(scoring_native, "kernel_pays", lambda *a, **k: False)
    for a, b in zip(native, run()):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


def test_an_unlimited_budget_is_full_attention(arch_models, monkeypatch):
    model = arch_models["llama"]
    prompts = [random_ids(n, seed=60 + n) for n in (70, 45)]
    monkeypatch.setattr(scoring_native, "prompt_attention_with_statistics", None)  # never called: nothing to evict
    run = lambda spec: attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=6,  # noqa: E731
                                        stop_at_eos=False)
    assert [r.token_ids for r in run("h2o:budget_tokens=1000")] == [r.token_ids for r in run("full")]


def test_what_the_kernel_takes():
    q = torch.zeros(1, 4, 8, 32)
    assert scoring_native.kernel_pays(q, q[:, :2], q[:, :2])
    assert not scoring_native.kernel_pays(q.bfloat16(), q[:, :2].bfloat16(), q[:, :2].bfloat16())  # float32 only
    assert not scoring_native.kernel_pays(q, q[:, :2], q[:, :2, :, :8])  # value heads a multiple of 16 wide
    assert not scoring_native.kernel_pays(q.to("meta"), q[:, :2].to("meta"), q[:, :2].to("meta"))  # a CPU only
    with pytest.raises(ValueError, match="4 query heads are not a multiple of 3 kv heads"):
        scoring_native.prompt_attention_with_statistics(q, q[:, :3], q[:, :3], 1.0)
    with pytest.raises(ValueError, match="refused q .* it takes no more queries than keys"):
        scoring_native.prompt_attention_with_statistics(q, q[:, :2, :4], q[:, :2, :4], 1.0)
    with pytest.raises(ValueError, match="takes float32 tensors on a CPU, not torch.bfloat16 on cpu"):
        scoring_native.prompt_statistics(q.bfloat16(), q[:, :2].bfloat16(), 1.0)
    with pytest.raises(ValueError, match="window=8"):
        kvzip.reconstruction_attention(q, q[:, :2], q[:, :2], 1.0, 0, 2, 0, window=8, native=True)
    out = scoring_native.prompt_attention(q, q[:, :2], q[:, :2], 1.0)
    assert out.shape == q.shape and torch.equal(out, scoring_native.prompt_attention_with_statistics(
        q, q[:, :2], q[:, :2], 1.0)[0])
    pos = torch.arange(10)
    assert scoring_native.is_prompt_tail(pos[6:], pos) and scoring_native.is_prompt_tail(pos, pos)
    assert not scoring_native.is_prompt_tail(pos[5:9], pos)  # not the last positions
    assert not scoring_native.is_prompt_tail(pos[6:] + 1, pos + 1)  # keys not from position 0


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernels as a new process finds them: nothing built or refused yet, the cache in `tmp_path`."""
    monkeypatch.setattr(native, "_libraries", {})
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    return tmp_path


def test_the_build_is_cached_per_machine(fresh_build, monkeypatch):
    assert scoring_native.library() is not None
    built = list((fresh_build / "kernels").glob("scoring-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native, "_libraries", {})

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)  # a second process finds the build
    assert scoring_native.library() is not None


def test_without_a_compiler_the_torch_path_runs(fresh_build, monkeypatch, arch_models):
    monkeypatch.setenv("CXX", str(fresh_build / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match=r"the C\+\+ kernel 'scoring' is not available .*torch operations run instead"):
        assert scoring_native.library() is None
    q = torch.zeros(1, 4, 8, 32)
    assert not scoring_native.kernel_pays(q, q[:, :2], q[:, :2])
    out = attnkit.generate(arch_models["llama"], random_ids(80, seed=7), parse_method_spec("h2o:budget=0.3"),
                           max_new_tokens=4, stop_at_eos=False)
    assert len(out.token_ids) == 4


def test_switched_off(fresh_build, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert scoring_native.library() is None
    assert not list(fresh_build.glob("**/*.so"))
