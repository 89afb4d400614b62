"""The C++ kernel of a per-step method's decode step (:mod:`attnkit.methods.decode_native`): its output, logits and
probabilities against torch's, the same bits wherever the entries lie (a strided tensor, a copy, vLLM-like blocks of
either layout), generations of the per-step methods that take it against the torch path, and its refusals."""

import pytest
import torch

import attnkit
from attnkit import native
from attnkit.methods import decode_native, scoring
from attnkit.methods.decode_native import Entries
from attnkit.methods.spec import parse_method_spec
from attnkit.vllm import paged
from helpers import randn, random_ids

pytestmark = pytest.mark.skipif(decode_native.library() is None, reason="no C++ compiler")  # CI has one
BUILDS = [i for i in native.runnable() if i != "native"] or ["native"]  # every instruction set this CPU runs

SHAPES = [  # rows, query heads, kv heads, entries, d, dv: GQA or not, groups of 1 to 7, a last tile partly filled
    (1, 8, 2, 37, 32, 32),
    (3, 8, 2, 256, 32, 32),
    (2, 4, 4, 100, 64, 64),
    (2, 6, 2, 65, 32, 48),
    (2, 7, 1, 130, 16, 16),
]


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch):
    monkeypatch.setenv(native.ENV_ISA, request.param)
    return request.param


def in_blocks(keys: torch.Tensor, values: torch.Tensor, layout, size=16, seed=0):
    """`keys`/`values` ``[rows, kv, n, d]`` written into a paged cache of `layout` at shuffled slots of shuffled
    blocks, and their :class:`Entries` there (:func:`attnkit.vllm.paged.entries`)."""
    rows, kv, n, d = keys.shape
    gen = torch.Generator().manual_seed(seed)
    per_row = -(-2 * n // size)
    blocks = rows * per_row + 3
    k_cache, v_cache = paged.split_cache(torch.zeros(blocks, kv, size, 2 * d))  # vLLM's CPU cache tensor
    tables = torch.randperm(blocks, generator=gen)[:rows * per_row].view(rows, per_row)
    slots = torch.stack([torch.stack([torch.randperm(per_row * size, generator=gen)[:n] for _ in range(kv)])
                         for _ in range(rows)])
    found = paged.entries(k_cache, v_cache, layout, tables, slots)
    for half, entries, src in ((k_cache, found[0], keys), (v_cache, found[1], values)):
        flat = half.as_strided((half.untyped_storage().nbytes() // 4 - half.storage_offset(),), (1,))
        numbers = entries.offsets.unsqueeze(-1) + torch.arange(d) * entries.step
        flat[numbers.flatten()] = src.flatten()
    return found, (k_cache, v_cache, tables, slots)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_torch(shape, threads, build):
    rows, hq, kv, n, d, dv = shape
    q, k, v = randn(rows, hq, 1, d, seed=1), randn(rows, kv, n, d, seed=2) * 2, randn(rows, kv, n, dv, seed=3)
    out, logits, probs = decode_native.attend(q, k, v, d ** -0.5, threads=threads)
    ref = scoring.attend_with_logits(q, k, v, d ** -0.5, native=False)
    assert out.shape == (rows, hq, 1, dv) and logits.shape == probs.shape == (rows, kv, hq // kv, 1, n)
    assert (out - ref[0]).abs().max() < 1e-5
    assert (logits - ref[1]).abs().max() < 1e-5
    assert torch.allclose(probs, ref[2], rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(decode_native.attend(q, k, v, d ** -0.5, threads=3 - threads),
                                                  (out, logits, probs)))  # the same bits on any thread count


@pytest.mark.parametrize("layout", [paged.Layout(None, None), paged.Layout(paged.TRANSPOSED, None)],
                         ids=["rows", "keys transposed"])
@pytest.mark.parametrize("size", [16, 64])
def test_the_same_bits_wherever_the_entries_lie(layout, size, build):
    """vLLM's blocks read in place (its CPU layout transposes each block's keys: in blocks of 64 slots swept whole),
    a strided tensor, a contiguous copy and a transposed view: one kernel, one arithmetic, the same output, logits and
    probabilities to the bit; entries moved where they lie land whole, one kv head's alone."""
    rows, hq, kv, n, d = 3, 8, 2, 150, 32
    q, k, v = randn(rows, hq, 1, d, seed=4), randn(rows, kv, n, d, seed=5), randn(rows, kv, n, d, seed=6)
    (ke, ve), (k_cache, v_cache, tables, slots) = in_blocks(k, v, layout, size)
    assert torch.equal(ke.tensor(), k) and torch.equal(ve.tensor(), v)
    copies = paged.gather_heads(k_cache, v_cache, layout, tables, slots)
    assert torch.equal(copies[0], k) and torch.equal(copies[1], v)  # the host's gather reads the same entries
    want = decode_native.attend(q, k, v, d ** -0.5)
    strided = k.transpose(2, 3).contiguous().transpose(2, 3)  # each key's numbers n apart
    apart = v.transpose(2, 3).contiguous().transpose(2, 3)  # and each value's: the rows copied into a tile first
    # the value rows read where they lie (vLLM's blocks), in a strided tensor, and copied: the same sums
    for keys, values in ((ke, ve), (strided, v), (Entries.of(k), Entries.of(v)), (strided, apart),
                         (Entries.of(strided), Entries.of(apart))):
        got = decode_native.attend(q, keys, values, d ** -0.5)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # through attend_with_logits, where the kernel runs: and a copy where it does not (torch's arithmetic)
    assert all(torch.equal(a, b) for a, b in zip(scoring.attend_with_logits(q, ke, ve, d ** -0.5), want))
    off = scoring.attend_with_logits(q, ke, ve, d ** -0.5, native=False)
    assert all(torch.equal(a, b) for a, b in zip(off, scoring.attend_with_logits(q, k, v, d ** -0.5, native=False)))
    # entries moved within the cache (a herd's relocation): the moved ones' numbers at their new addresses, every
    # other entry as it was
    source, target = ke.offsets[:, :, :20], ke.offsets[:, :, 100:120]
    ke.move(source[:, :1], target[:, :1])  # one kv head's entries alone
    moved = k.clone()
    moved[:, :1, 100:120] = k[:, :1, :20]
    assert torch.equal(ke.tensor(), moved)
    ve.move(ve.offsets[:, :, :20], ve.offsets[:, :, 100:120])
    assert torch.equal(ve.tensor()[:, :, 100:120], v[:, :, :20]) and torch.equal(ve.tensor()[:, :, :100], v[:, :, :100])


def test_where_it_runs(monkeypatch):
    q, k, v = randn(2, 8, 1, 32, seed=1), randn(2, 2, 40, 32, seed=2), randn(2, 2, 40, 32, seed=3)
    assert decode_native.runs(q, k, v, None)
    assert not decode_native.runs(randn(2, 8, 3, 32, seed=1), k, v, None)  # several queries: torch
    assert not decode_native.runs(q, k, v, torch.ones(2, 2, 4, 1, 40, dtype=torch.bool))  # a window's mask
    assert not decode_native.runs(q, k, randn(2, 2, 40, 24, seed=3), None)  # value heads not a multiple of 16
    assert not decode_native.runs(q.double(), k.double(), v.double(), None)
    with pytest.raises(ValueError, match="do not fit"):
        decode_native.attend(q, k[:1], v, 32 ** -0.5)
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert not decode_native.runs(q, k, v, None)


@pytest.mark.parametrize("spec", ["h2o:budget_tokens=48", "tova:budget_tokens=48",
                                  "keyformer:budget_tokens=48,gqa_reduce=max",
                                  "keyformer:budget_tokens=48,noise=gaussian"])
def test_per_step_generations_keep_the_tokens_of_the_torch_path(arch_models, monkeypatch, spec):
    """A batch of per-step generations evicting on every step: the kernel takes every layer's decode step, and the
    tokens and logits (within 1e-4) are the torch path's."""
    model = arch_models["llama"]
    prompts = [random_ids(70, seed=s) for s in (1, 2, 3)]

    def run():
        return attnkit.generate(model, prompts, parse_method_spec(spec), max_new_tokens=30, stop_at_eos=False,
                                keep_logits=True)

    calls = []
    kernel = decode_native.attend
    monkeypatch.setattr(decode_native, "attend", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    with_kernel = run()
    assert len(calls) >= model.geometry.n_layers * 29
    monkeypatch.setattr(decode_native, "runs", lambda *a: False)
    torch_path = run()
    for a, b in zip(with_kernel, torch_path):
        assert a.token_ids == b.token_ids
        assert max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) < 1e-4


@pytest.mark.parametrize("noise", ["gumbel", "gaussian", "constant", "none"])
@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_keyformers_score_in_the_same_call(noise, reduce, build):
    """Keyformer's eq. 9 for the step (its draws at each held key's position, each row's temperature, the group
    reduced) from the kernel's call equals torch's softmax of the noisy logits over the kernel's own logits; asked
    for only some of its outputs, the kernel gives the same bits of those."""
    from attnkit.methods.keyformer_noise import (
        EULER_GAMMA,
        TABLE_SIZE,
        _table,
        row_offsets,
        table_counters,
        table_draws,
    )

    rows, hq, kv, n, d = 3, 8, 2, 90, 32
    q, k, v = randn(rows, hq, 1, d, seed=7), randn(rows, kv, n, d, seed=8), randn(rows, kv, n, d, seed=9)
    gen = torch.Generator().manual_seed(1)
    positions = torch.stack([torch.stack([torch.randperm(400, generator=gen)[:n] for _ in range(kv)])
                             for _ in range(rows)])
    tau = torch.tensor([1.0, 1.37, 1.9])
    q_pos = torch.tensor([400, 410, 420])
    if noise in ("gumbel", "gaussian"):
        table = _table(noise, torch.device("cpu"), TABLE_SIZE + 421)
        offsets = torch.cat([row_offsets(5, 2, kv, hq // kv, q_pos[r:r + 1]) for r in range(rows)])
        score = decode_native.KeyformerScore(table, offsets.reshape(rows, hq), positions, tau, reduce)
        zeta = table_draws(noise, offsets, positions, largest=420)
    else:
        shift = EULER_GAMMA if noise == "constant" else 0.0
        score = decode_native.KeyformerScore(None, None, positions, tau, reduce, shift)
        zeta = shift
    out, logits, probs, got = decode_native.attend(q, k, v, d ** -0.5, score=score)
    want = torch.softmax((logits + zeta) / tau.view(-1, 1, 1, 1, 1), dim=-1)
    want = scoring.reduce_heads(want, reduce)[:, :, 0]
    assert got.shape == (rows, kv, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(decode_native.attend(q, k, v, d ** -0.5), (out, logits, probs)))
    if noise == "gumbel":  # the table's draws computed from their counters: within float rounding of the logarithms
        hashed = decode_native.attend(q, k, v, d ** -0.5, score=decode_native.KeyformerScore(
            None, score.offsets, positions, tau, reduce, counters=table_counters()))
        assert torch.equal(hashed[0], out) and torch.allclose(hashed[3], want, rtol=1e-5, atol=1e-7)
    # without the logits and probabilities (what Keyformer's step asks for), or the logits alone (H2O's and TOVA's):
    # the same bits of what is asked for
    alone = decode_native.attend(q, k, v, d ** -0.5, score=score, logits=False, probabilities=False)
    assert alone[1] is None and alone[2] is None and torch.equal(alone[0], out) and torch.equal(alone[3], got)
    no_logits = scoring.attend_with_logits(q, k, v, d ** -0.5, logits=False)
    assert no_logits[1] is None and torch.equal(no_logits[0], out) and torch.equal(no_logits[2], probs)


def test_a_layout_the_kernel_cannot_address_is_gathered():
    """A layout that permutes each block's numbers (one :func:`attnkit.vllm.paged.learn_layout` may find) has no
    entry addresses: the host gathers copies instead (:func:`attnkit.vllm.paged.gather_heads`)."""
    size, d, kv = 16, 8, 2
    k_cache, v_cache = paged.split_cache(torch.zeros(4, kv, size, 2 * d))
    order = torch.randperm(size * d, generator=torch.Generator().manual_seed(0))
    slots = torch.arange(10).view(1, 1, 10).expand(1, kv, 10)
    tables = torch.tensor([[2, 0]])
    assert paged.entries(k_cache, v_cache, paged.Layout(order, None), tables, slots) is None
    assert paged.entries(k_cache, v_cache, paged.Layout(None, None), tables, slots) is not None


def test_the_victims_loop_picks_torchs_argmin(build):
    """scoring.lowest on a CPU runs the kernel's loop (decode_native.lowest): per row and kv head the same index as
    torch's argmin over the rank with protected entries at +inf, through ties (the first least), -0.0 beside 0.0, a
    NaN (the first), every entry protected or +inf (0), ranks and masks at any strides (a slice of a longer buffer,
    kv heads apart, a mask broadcast), vector-sized rows and rows with a tail."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        rows, kv, n = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen)), \
            int(torch.randint(1, 70, (1,), generator=gen))
        buffer = torch.randint(-2, 3, (rows, kv, n + 5), generator=gen).float()  # few values: ties everywhere
        rank = buffer[:, :, 2:n + 2] if trial % 3 else buffer.transpose(0, 1).contiguous().transpose(0, 1)[..., :n]
        if trial % 4 == 1:
            rank[..., ::2] = -0.0
        if trial % 5 == 0:
            rank[-1, -1, n // 2] = float("nan")
        if trial % 7 == 0:
            rank.fill_(float("inf"))
        protect = torch.rand(rows, kv, n, generator=gen) < (trial % 4) / 3 if trial % 6 else None
        if protect is not None and trial % 11 == 0:
            protect = protect[:1, :1].expand(rows, kv, n)
        expected = (rank if protect is None else rank.masked_fill(protect, float("inf"))).argmin(-1, keepdim=True)
        got = decode_native.lowest(rank, protect)
        assert got is not None and torch.equal(got, expected), (trial, got, expected)
        assert torch.equal(scoring.lowest(rank, protect), expected)
    assert decode_native.lowest(rank.double(), None) is None  # not float32: torch's argmin decides


def test_the_victims_loop_off_without_the_kernel(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    rank = torch.tensor([[[3.0, 1.0, 1.0, 2.0]]])
    assert decode_native.lowest(rank, None) is None
    assert scoring.lowest(rank, torch.tensor([[[False, True, False, False]]])).tolist() == [[[2]]]
