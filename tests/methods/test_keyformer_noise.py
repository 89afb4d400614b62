"""Keyformer's counter-based noise (attnkit.methods.keyformer_noise): the distributions of eq. 5 and 11, the
decode-step tables equal to the reference draws bit for bit, and the prompt's scores computed in one pass with
the attention output (eq. 9 from the probabilities and exp(zeta)) equal to the separate statistic."""

import pytest
import torch

import attnkit
from attnkit.cache import KVCache
from attnkit.methods import eviction, scoring
from attnkit.methods import keyformer_noise as keyformer_noise_module
from attnkit.methods.keyformer_noise import DecodeNoise, GumbelFactorWeights, gumbel_factor, keyformer_noise
from attnkit.session import LayerContext, Session, Step
from helpers import drive, drive_shards, qkv

torch.set_num_threads(1)


def test_keyformer_noise_distributions():
    heads, pos = 2, torch.arange(400)
    gumbel = keyformer_noise("gumbel", 3, 0, heads, 2, pos, pos)
    gauss = keyformer_noise("gaussian", 3, 0, heads, 2, pos, pos)
    for sample in (gumbel, gauss):  # both have the Gumbel's mean and standard deviation (section 4.6.3)
        assert sample.mean().item() == pytest.approx(0.5772, abs=0.01)
        assert sample.std().item() == pytest.approx(1.2825, abs=0.01)
    assert (gumbel - gumbel.mean()).pow(3).mean().item() > 0.5  # skewed (Gumbel) vs symmetric (Gaussian)
    assert abs((gauss - gauss.mean()).pow(3).mean().item()) < 0.1
    assert keyformer_noise("constant", 3, 0, heads, 2, pos, pos) == 0.5772
    # draws of neighbouring heads, queries and keys are uncorrelated (|r| < 0.02 over 80k pairs; 0.014 = 4 sigma)
    for a, b in ((gumbel[0, 0, 0], gumbel[0, 0, 1]), (gumbel[0, 0, 0, :-1], gumbel[0, 0, 0, 1:]),
                 (gumbel[0, 0, 0, :, :-1], gumbel[0, 0, 0, :, 1:]), (gumbel[0, 0, 0], gumbel[0, 1, 0])):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()) < 0.02
    assert not torch.equal(gumbel, keyformer_noise("gumbel", 3, 1, heads, 2, pos, pos))  # per layer


@pytest.mark.parametrize("noise", ["gumbel", "gaussian"])
def test_keyformer_decode_noise_is_bitwise_the_reference_noise(noise):
    kv, g, layers = 2, 3, 3
    tables = DecodeNoise(noise, 5, layers, kv * g, torch.device("cpu"))
    session = Session(attnkit.make_method("keyformer", budget_tokens=8), KVCache(layers), layers, 4, 4)
    gen = torch.Generator().manual_seed(0)
    for q in (3, 17, 100, 5000):  # positions past the key table grow it
        step = Step(session, "decode", torch.tensor([q]))
        for layer in range(layers):
            k_pos = torch.randint(0, q + 1, (1, kv, 9), generator=gen)
            ctx = LayerContext(step, layer, 1.0, None)
            expected = keyformer_noise(noise, 5, layer, kv, g, torch.tensor([q]), k_pos)
            assert torch.equal(tables(ctx, k_pos), expected)


@pytest.mark.parametrize("kind", ["gumbel", "factor", "gaussian"])
def test_the_draw_table_is_the_same_built_in_chunks_or_at_once(kind, monkeypatch):
    """The table is built in cache-sized chunks on a CPU; its entries do not depend on the chunking (a
    chunk that does not divide the size included)."""
    device = torch.device("cpu")
    tables = []
    for chunk in (4099, 1 << 30):
        monkeypatch.setattr(keyformer_noise_module, "_TABLES", {})
        monkeypatch.setitem(keyformer_noise_module._TABLE_CHUNK, "cpu", chunk)
        tables.append(keyformer_noise_module._table(kind, device, 10))
    assert tables[0].shape[0] > keyformer_noise_module.TABLE_SIZE
    assert torch.equal(tables[0], tables[1])


def test_the_table_counters_give_its_uniforms_bit_for_bit():
    """What the decode kernel computes its Gumbel draws from (table_counters): the table's entries' uniforms, by the
    integer steps the kernel takes (MurmurHash3's finaliser of the salted position, then the row's mix) on unsigned
    32-bit numbers, equal the torch path's to the bit, and -log(-log u) of them the table's entries to float rounding."""
    row, salt, m1, m2 = keyformer_noise_module.table_counters()
    t = torch.cat([torch.arange(5000), torch.randint(0, 1 << 23, (5000,))])
    mask = (1 << 32) - 1

    def mul(x, m):  # unsigned 32-bit products, as the kernel's, in int64 without overflow
        return ((x * (m >> 16) & mask) << 16) + x * (m & 0xFFFF) & mask

    k = t ^ salt
    k ^= k >> 16
    k = mul(k, m1)
    k ^= k >> 13
    k = mul(k, m2)
    k ^= k >> 16
    x = mul(k ^ row, m1)
    x ^= x >> 16
    x = mul(x, m2)
    bits = ((x >> 9) | 0x3F800000).to(torch.int32)
    u = bits.view(torch.float32) - (1.0 - 2.0 ** -24)
    zero = torch.zeros(1, dtype=torch.int64)
    assert torch.equal(u, keyformer_noise_module.counter_uniforms(0, 0x7AB1E, zero, zero, t))
    table = keyformer_noise_module._table("gumbel", torch.device("cpu"), int(t.max()) + 1)
    assert torch.allclose(-(-u.log()).log(), table[t], rtol=1e-6, atol=1e-7)


def test_gumbel_factor_is_exp_of_the_gumbel_draws_as_bfloat16():
    pos = torch.arange(300)
    zeta = keyformer_noise("gumbel", 4, 2, 2, 3, pos, pos)
    factor = gumbel_factor(4, 2, 2, 3, pos, pos)
    assert torch.equal(factor.to(torch.bfloat16).float(), factor)  # bfloat16 values, held exactly in either dtype
    assert torch.allclose(factor, zeta.exp(), rtol=2.0 ** -8, atol=0)  # rounded to the nearest
    assert not torch.allclose(factor, zeta.exp(), rtol=1e-5, atol=0)
    table, _ = GumbelFactorWeights(4, 2, 2).table_and_offsets(3, pos, 299, torch.bfloat16)
    assert table.dtype == torch.bfloat16
    assert torch.equal(table.float(), GumbelFactorWeights(4, 2, 2).table_and_offsets(3, pos, 299)[0][:table.shape[0]])


@pytest.mark.parametrize("spec", ["keyformer:seed=3", "keyformer:noise=gaussian,tau_init=1.5", "h2o:gqa_reduce=max",
                                  "keyformer:noise=constant"])
def test_prefill_scores_in_one_pass_equal_the_separate_statistic(spec, monkeypatch):
    """The one-pass prefill (output and score from the same blocks) keeps what the separate statistic
    (the path used when another method supplies the prompt's output, compose, or past ONE_PASS_MAX_KEYS)
    keeps, and never calls it."""
    q, k, v = qkv(80, seed=4)
    method = attnkit.parse_method_spec(spec + ",budget_tokens=20,recent_tokens=4")
    composed = attnkit.make_method("compose", prefill="full", cache=method)
    separate = drive(composed, q, k, v, prompt_len=60)
    monkeypatch.setitem(scoring.ONE_PASS_MAX_KEYS, "cpu", 59)  # a 60-token prompt is "long"
    long_prompt = drive(method, q, k, v, prompt_len=60)
    assert long_prompt[2] == separate[2]
    monkeypatch.setitem(scoring.ONE_PASS_MAX_KEYS, "cpu", 60)

    def forbidden(*args, **kwargs):
        raise AssertionError("the one-pass prefill computed the statistic a second time")

    monkeypatch.setattr(eviction, "attention_statistics", forbidden)
    session, outs, held = drive(method, q, k, v, prompt_len=60)
    assert held == separate[2]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs, separate[1]))
    layer = session.cache.layers[0]
    if spec.startswith("h2o"):  # the scores themselves agree, not just the choice
        assert torch.allclose(layer.extras["score"][:, :, :layer.length],
                              separate[0].cache.layers[0].extras["score"][:, :, :layer.length], atol=1e-5)


def gumbel_cdf(x):
    return torch.exp(-torch.exp(-x))


def gaussian_cdf(x):
    return 0.5 * (1 + torch.erf((x - 0.5772) / (1.2825 * 2 ** 0.5)))


@pytest.mark.parametrize("kind, cdf", [("gumbel", gumbel_cdf), ("gaussian", gaussian_cdf)])
def test_table_draws_pass_a_kolmogorov_smirnov_test(kind, cdf):
    """200k draws of one layer (many rows, each reading its own stretch of the table) against the CDF of
    eq. 5 / eq. 11: the KS distance stays under the 0.1 % critical value 1.95 / sqrt(n)."""
    pos = torch.arange(500)
    x = keyformer_noise(kind, 11, 3, 2, 2, pos[::5], pos).flatten().double().sort().values
    n = x.numel()
    ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((ecdf - cdf(x)).abs(), (ecdf - 1 / n - cdf(x)).abs()).max().item()
    assert ks < 1.95 / n ** 0.5
    if kind == "gumbel":  # and not the other one
        other = gaussian_cdf(x)
        assert (ecdf - other).abs().max().item() > 5 / n ** 0.5


def test_noise_of_a_block_does_not_depend_on_chunks_rows_or_the_copy_path():
    """A (query, key) pair gets the same draw whichever block, chunk or key range it is computed in, and
    the strided row copy of contiguous positions equals the indexed read of arbitrary ones."""
    pos = torch.arange(300)
    whole = keyformer_noise("gumbel", 2, 1, 2, 3, pos, pos)
    part = keyformer_noise("gumbel", 2, 1, 2, 3, pos[130:147], pos[100:147])  # a windowed block of a chunk
    assert torch.equal(part, whole[..., 130:147, 100:147])
    per_head = torch.stack([pos[100:147], pos[100:147]]).unsqueeze(0)  # the indexed path: [b, kv, keys]
    assert torch.equal(keyformer_noise("gumbel", 2, 1, 2, 3, pos[130:147], per_head), part)
    scattered = torch.tensor([[[5, 9, 200], [0, 1, 299]]])
    got = keyformer_noise("gumbel", 2, 1, 2, 3, pos[7:8], scattered)
    assert torch.equal(got[0, 0, :, 0], whole[0, 0, :, 7][:, [5, 9, 200]])
    assert torch.equal(got[0, 1, :, 0], whole[0, 1, :, 7][:, [0, 1, 299]])
    assert torch.allclose(gumbel_factor(2, 1, 2, 3, pos[130:147], pos[100:147]), part.exp(), rtol=2.0 ** -8, atol=0)


@pytest.mark.parametrize("spec", ["keyformer:budget_tokens=20", "keyformer:budget_tokens=20,noise=gaussian",
                                  "keyformer:budget_tokens=20,decode_every=4"])
def test_each_tensor_parallel_shard_draws_its_own_heads_noise(spec):
    """A shard holding the model's second half of the heads (numbered from 0 in it) draws those heads' noise, so the
    shards together keep what the whole model keeps; a shard that drew as heads 0.. would not."""
    q, k, v = qkv(48, hq=4, kv=2)
    method = attnkit.parse_method_spec(spec)
    _, outs, held = drive(method, q, k, v, 30)
    shard_outs, shard_held = drive_shards(method, q, k, v, 30)
    assert shard_held == held
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shard_outs, outs))
    _, _, unaware = drive(method, q[:, 2:], k[:, 1:], v[:, 1:], 30)  # the second half as if it were heads 0..
    assert [step[0] for step in unaware] != [step[1] for step in held]
    pos = torch.arange(40)
    assert torch.equal(keyformer_noise("gumbel", 0, 0, 1, 2, pos, pos, first_head=2),
                       keyformer_noise("gumbel", 0, 0, 2, 2, pos, pos)[:, 1:])
