"""The C++ kernel of MInference's sparse prefill on a CPU (``attnkit/native/sparse.cpp``, run by
:func:`attnkit.sparse.sparse_attention` in float32): held to the dense-mask reference of the same layout, for every
pattern and tile size it takes; the method's generations against FlexAttention's; what it refuses."""

import pytest
import torch

import attnkit
from attnkit import native
from attnkit import sparse as sa
from attnkit.methods.spec import parse_method_spec
from attnkit.sparse.patterns import HeadPattern as HP
from helpers import SMALL, random_ids

pytestmark = pytest.mark.skipif(sa.kernels.native.load("sparse", sa.kernels.NATIVE_SIGNATURE) is None,
                                reason="no C++ compiler")  # CI has one
BUILDS = [i for i in native.runnable() if i != "native"] or ["native"]  # every instruction set this CPU runs

MIXED = [HP("a_shape", n_init=5, n_local=37), HP("vertical_slash", k_v=9, k_s=6), HP("block_sparse", k_b=3),
         HP("vertical_slash", k_v=3, k_s=30)]


def operands(n, nq, hq, kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, nq, hq, d, generator=g).transpose(1, 2)  # transformers' strides
    return q, torch.randn(1, kv, n, d, generator=g), torch.randn(1, kv, n, d, generator=g)


@pytest.fixture
def calls(monkeypatch):
    """The kernel's calls, counted; dynamo must compile nothing."""
    import torch._dynamo.utils as dynamo_utils

    seen = []
    kernel = sa.kernels.native_sparse_attention
    monkeypatch.setattr(sa.kernels, "native_sparse_attention", lambda *a: seen.append(1) or kernel(*a))
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    yield seen
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("n,nq,width", [(192, 192, None), (203, 203, None), (203, 70, None), (203, 203, "block"),
                                        (700, 300, None)])
@pytest.mark.parametrize("heads,d", [((4, 2), 16), ((4, 4), 32), ((8, 2), 64)])
def test_the_kernel_equals_the_reference(calls, monkeypatch, build, block, n, nq, width, heads, d):
    """Mixed patterns (A-shape, vertical-slash with gathered columns, block-sparse), GQA and not, lengths that are
    and are not multiples of the tile, a whole prompt and its last chunk, a fixed column width."""
    monkeypatch.setenv(native.ENV_ISA, build)
    hq, kv = heads
    q, k, v = operands(n, nq, hq, kv, d, seed=n + nq + d)
    patterns = (MIXED * 2)[:hq]
    layout = sa.layout_for_patterns(patterns, q, k, 0.25, block=block, last_q=16,
                                    width=block if width == "block" else None)
    assert not layout.dense and layout.columns is not None
    out = sa.sparse_attention(q, k, v, layout, 0.25)
    torch.testing.assert_close(out, sa.reference_attention(q, k, v, layout, 0.25), atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_heads_without_tiles_are_zero(calls):
    """A head the method sends to dense attention keeps no tile: the kernel leaves zeros there (no NaN) and the
    other heads their layout's attention."""
    q, k, v = operands(150, 150, 4, 2, 16, seed=1)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=16, last_q=16)
    drop = torch.tensor([False, True, False, True])
    out = sa.sparse_attention(q, k, v, layout.without_heads(drop), 0.25)
    ref = sa.reference_attention(q, k, v, layout, 0.25)
    assert torch.equal(out[:, drop], torch.zeros_like(out[:, drop]))
    torch.testing.assert_close(out[:, ~drop], ref[:, ~drop], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("n,nq", [(150, 150), (203, 70)])
def test_dense_heads_in_the_same_call(calls, monkeypatch, build, n, nq):
    """Heads the method sends to dense attention, given every causal tile (``with_dense_heads``): the kernel gives
    them dense causal attention (SDPA's, within float32 rounding) and the other heads their layout's, in one call;
    every head dense is the whole layer's dense attention."""
    import torch.nn.functional as F

    monkeypatch.setenv(native.ENV_ISA, build)
    q, k, v = operands(n, nq, 4, 2, 16, seed=n)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=16, last_q=16)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.25,
                                           attn_mask=torch.ones(nq, n, dtype=torch.bool).tril(n - nq))
    ref = sa.reference_attention(q, k, v, layout, 0.25)
    for heads in ([False, True, False, True], [True] * 4):
        heads = torch.tensor(heads)
        merged = layout.with_dense_heads(heads)
        assert bool((merged.density[heads] >= 1).all())  # every causal tile (the diagonal ones whole)
        out = sa.sparse_attention(q, k, v, merged, 0.25)
        torch.testing.assert_close(out, torch.where(heads[None, :, None, None], dense, ref), atol=1e-5, rtol=1e-5)
    assert calls == [1, 1]


@pytest.mark.parametrize("spec", ["minference:k_v=8,k_s=24,block_size=16,dense_above=1",
                                  "minference:pattern=block_sparse,k_b=3,block_size=16",
                                  "a_shape:n_init=16,n_local=48,block_size=16,dense_above=1"])
def test_generations_keep_flexattentions_tokens(monkeypatch, spec):
    """Every layer sparse (``dense_above=1`` keeps dense-ish heads on their pattern): the same tokens as
    FlexAttention's, logits within 1e-4. FlexAttention runs eagerly (``compile=false``: it evaluates the layout's
    mask on every pair, no graph to compile; the compiled one is held to the same reference in
    tests/methods/test_minference.py)."""
    model = attnkit.load_model(f"random:llama:{SMALL}")
    ids = random_ids(260, seed=9)
    kernel_calls = []
    kernel = sa.kernels.native_sparse_attention
    monkeypatch.setattr(sa.kernels, "native_sparse_attention", lambda *a: kernel_calls.append(1) or kernel(*a))

    def run(options):
        with sa.profile() as prof:
            out = attnkit.generate(model, ids, parse_method_spec(spec + options), max_new_tokens=6, stop_at_eos=False,
                                   keep_logits=True)
        assert prof.sparse_calls == model.geometry.n_layers
        return out

    native = run("")
    assert len(kernel_calls) == model.geometry.n_layers  # the C++ kernel ran every layer's prefill
    flex = run(",compile=false")
    assert len(kernel_calls) == model.geometry.n_layers  # and none of FlexAttention's
    assert native.token_ids == flex.token_ids
    assert max((x - y).abs().max().item() for x, y in zip(native.logits, flex.logits)) < 1e-4


def test_what_the_kernel_takes():
    q, k, v = operands(130, 130, 4, 2, 16, seed=2)
    layout = sa.layout_for_patterns(MIXED, q, k, 0.25, block=16, last_q=16)
    assert sa.kernels.native_pays(q, k, v, layout)
    assert not sa.kernels.native_pays(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout)  # float32 only
    assert not sa.kernels.native_pays(q, k.double(), v, layout)
    assert not sa.kernels.native_pays(q, k, v[..., :8], layout)  # value heads a multiple of 16 wide
    wide = sa.layout_for_patterns(MIXED, q, k, 0.25, block=128, last_q=16)
    assert not sa.kernels.native_pays(q, k, v, wide)  # tiles of at most 64 keys
