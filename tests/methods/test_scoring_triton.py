"""The Triton kernels of the scoring pass (:mod:`attnkit.methods.scoring_triton`), run here by Triton's interpreter
(``TRITON_INTERPRET=1``: the same kernels executed on the CPU), against the blocked passes they replace on a GPU,
and the GPU paths of H2O, Keyformer and KVzip forced on a CPU: the same statistics, kept entries and tokens."""

import os

import pytest
import torch

import attnkit
from attnkit.methods import eviction, kvzip, scoring
from attnkit.methods.keyformer_noise import GumbelFactorWeights
from attnkit.methods.spec import parse_method_spec
from helpers import qkv, randn, random_ids

torch.set_num_threads(1)
SMALL = (16, 16)  # tiles small enough that every test crosses several of them


@pytest.fixture(scope="module")
def kernels():
    """The kernel module, its kernels run by Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from attnkit.methods import scoring_triton
    return scoring_triton


def grouped_logits(q, k, scaling, q_pos, k_pos):
    g = q.shape[1] // k.shape[1]
    logits = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scaling
    return logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def test_row_normalisers_are_the_log_sum_exp(kernels):
    q, k, _ = qkv(77, hq=8, kv=2, d=24, seed=1)  # head size not a power of two, length not a multiple of a tile
    q, k = torch.cat([q, randn(*q.shape, seed=5)]), torch.cat([k, randn(*k.shape, seed=6)])
    pos = torch.arange(77)
    lse = kernels.row_normalisers(q, k, 0.3, pos, pos, block=SMALL)
    assert lse.shape == (2, 8, 77) and lse.dtype == torch.float32
    assert torch.allclose(lse.double(), torch.logsumexp(grouped_logits(q, k, 0.3, pos, pos), -1), atol=1e-5)


@pytest.mark.parametrize("rows,reduce", [("sum", "mean"), ("sum", "max"), ("max", "max")])
def test_column_statistics_equal_the_blocked_pass(kernels, rows, reduce):
    n = 90
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(n, hq=8, kv=2, d=32, seed=2))  # HF's layout
    pos = torch.arange(n)
    lse = kernels.row_normalisers(q, k, 0.25, pos, pos, block=SMALL)
    stats = kernels.column_statistics(q, k, 0.25, pos, pos, lse, rows=rows, reduce=reduce, block=SMALL)
    if rows == "sum":
        _, ref = scoring.attention_with_statistics(q, k, v, 0.25, pos, pos, reduce=reduce)
    else:  # KVzip's score: the most attention a key receives, over the queries and the group's heads
        ref = torch.softmax(grouped_logits(q, k, 0.25, pos, pos), -1).view(1, 2, 4, n, n).amax(dim=(2, 3))
    assert stats.shape == (1, 2, n)
    assert torch.allclose(stats.double(), ref.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_statistics(kernels, dtype):
    """Half-precision queries and keys (a GPU's inference dtypes), the statistic against the blocked pass on the same
    rounded operands in float32. (The interpreter multiplies bfloat16 blocks in float32, see ``_prepared``.)"""
    n = 80
    q, k, v = (x.mul(2).to(dtype) for x in qkv(n, hq=8, kv=2, d=32, seed=12))
    pos = torch.arange(n)
    out, stats = kernels.prompt_attention_with_statistics(q, k, v, 0.25, pos, reduce="max")
    ref_out, ref = scoring.attention_with_statistics(q.float(), k.float(), v.float(), 0.25, pos, pos, reduce="max")
    assert out.dtype == dtype and torch.allclose(out.float(), ref_out, atol=2e-2)
    assert ((stats - ref).abs() / ref).max() < 1e-4  # the log-sum-exp comes from the half-precision flash kernel


def test_keyformer_noise_is_read_from_the_same_table(kernels):
    """Eq. 9 at temperature 1 with the Gumbel factors: the kernels read the draw table at each row's offset plus the
    key position, so the output and the statistic are the blocked pass's, draw for draw."""
    n = 70
    q, k, v = qkv(n, hq=4, kv=2, d=16, seed=3)
    q = q.mul(2)
    pos = torch.arange(n)
    weights = GumbelFactorWeights(seed=4, layer=1, kv_heads=2)
    for reduce in ("mean", "max"):
        out, stats = kernels.prompt_attention_with_statistics(q, k, v, 0.25, pos, reduce=reduce, weights=weights)
        ref_out, ref = scoring.attention_with_statistics(q, k, v, 0.25, pos, pos, reduce=reduce, weights=weights)
        assert torch.allclose(out, ref_out, atol=1e-5)
        assert torch.allclose(stats, ref, rtol=1e-5, atol=1e-6)
    _, probs = scoring.attention_with_statistics(q, k, v, 0.25, pos, pos)
    assert not torch.allclose(ref, probs, atol=1e-2)  # the noise changes the statistic


def test_kvzip_scored_keys_equal_the_blocked_pass(kernels, monkeypatch):
    """A reconstruction chunk's score: the softmax over the scored keys only (sinks, the chunk, the input's own keys),
    its maximum per chunk key; the kernels against :func:`attnkit.methods.kvzip.max_attention`."""
    n, m = 120, 40
    q = randn(2, 8, m, 16, seed=8)
    keys, values = randn(2, 2, n + m, 16, seed=9), randn(2, 2, n + m, 16, seed=10)
    ref_out, ref = kvzip.reconstruction_attention(q, keys, values, 0.25, 50, 90, 4, one_pass=False, native=False)
    out, score = kvzip.reconstruction_attention(q, keys, values, 0.25, 50, 90, 4, kernels=True)
    assert torch.equal(out, ref_out) and score.shape == (2, 2, 40)
    assert torch.allclose(score, ref, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(kernels, "kernels_pay", lambda q: True)  # where they run by default: not with a window
    _, windowed = kvzip.reconstruction_attention(q, keys, values, 0.25, 50, 90, 4, window=64)
    _, windowed_ref = kvzip.reconstruction_attention(q, keys, values, 0.25, 50, 90, 4, window=64, kernels=False)
    assert torch.equal(windowed, windowed_ref)
    with pytest.raises(ValueError, match="window=64"):
        kvzip.reconstruction_attention(q, keys, values, 0.25, 50, 90, 4, window=64, kernels=True)


@pytest.mark.parametrize("spec", ["h2o:budget=0.3,gqa_reduce=max", "keyformer:budget_tokens=40",
                                  "keyformer:budget=0.3,gqa_reduce=max", "h2o:budget_tokens=1000,gqa_reduce=max"])
def test_the_kernel_path_keeps_the_same_tokens(kernels, arch_models, monkeypatch, spec):
    """The GPU path of a prompt's statistic forced on a CPU (flash for the output, the kernels for the statistic):
    the same tokens and logits as the blocked pass on a ragged batch, and full attention's at an unlimited
    budget. H2O's mean over the group keeps its two flash calls (``fused_pays``), so it is not tested here."""
    model = arch_models["llama"]
    prompts = [random_ids(n, seed=30 + n) for n in (90, 130, 61)]
    run = lambda method: attnkit.generate(model, prompts, parse_method_spec(method), max_new_tokens=8,  # noqa: E731
                                          stop_at_eos=False, keep_logits=True)
    blocked = run(spec)
    calls = []
    tiled = kernels.prompt_attention_with_statistics
    monkeypatch.setattr(eviction, "kernels_pay", lambda q: True)
    monkeypatch.setattr(eviction, "prompt_attention_with_statistics", lambda *a, **kw: calls.append(1) or tiled(*a, **kw))
    forced = run(spec)
    unlimited = "1000" in spec  # nothing to evict: no statistic to gather, full attention's output
    assert len(calls) == (0 if unlimited else model.geometry.n_layers * len(prompts))
    reference = run("full") if unlimited else blocked
    for a, b in zip(forced, reference):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


def test_kvzip_with_the_kernels_keeps_the_same_tokens(kernels, arch_models, monkeypatch):
    """KVzip's reconstruction scored by the kernels (forced on a CPU) keeps the entries the blocked pass keeps."""
    model = arch_models["qwen3"]
    prompts = [random_ids(n, seed=40 + n) for n in (90, 130)]
    run = lambda: attnkit.generate(model, prompts, parse_method_spec("kvzip:budget=0.3,chunk_size=48"),  # noqa: E731
                                   max_new_tokens=8, stop_at_eos=False, keep_logits=True)
    blocked = run()
    calls = []
    scored = kernels.column_statistics
    monkeypatch.setattr(kernels, "kernels_pay", lambda q: True)
    monkeypatch.setattr(kernels, "column_statistics", lambda *a, **kw: calls.append(1) or scored(*a, **kw))
    forced = run()
    assert calls  # every reconstruction chunk of every layer that evicts
    for a, b in zip(forced, blocked):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


def test_kernels_only_run_on_a_gpu(kernels):
    assert not kernels.kernels_pay(torch.zeros(1, 8, 4, 32))
