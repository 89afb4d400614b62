"""kivi (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750):
the codes against the formula in float64, the storage against a full-precision mirror under every kind of write
(append, in-place eviction, compaction, ring, the flat per-head layout), exactness when the residual covers the
whole sequence (three architectures, batches, eviction and sparse prefill), the bytes held, the accuracy on
`tiny` at 4 and 2 bits, the spec / recipe / CLI / model.generate / speculative routes, and what is refused."""

import json

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.bench.speculative import code_prompt
from attnkit.cache import LayerKV
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.kivi import Kivi
from attnkit.methods.spec import parse_method_spec
from attnkit.quant.kivi import pack, unpack
from attnkit.quant.layer import KiviLayerKV
from attnkit.recipe import Recipe
from attnkit.session import Step, new_session
from attnkit.speculative import speculative_generate
from helpers import SMALL, random_ids

torch.set_num_threads(1)
NEW = 12
LENGTHS = (130, 95, 130)  # two prompts of one length share a session (rows), one alone


def prompts():
    return [random_ids(n, seed=i).tolist() for i, n in enumerate(LENGTHS)]


# ---- the codes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_codes_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 2, 7, 32), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 32 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


def outlier_kv(b, h, n, d, seed=0):
    """Keys with a few large, offset channels (the paper's Figure 2) and plain values."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[::5] = 20.0
    keys = torch.randn(b, h, n, d, generator=g) * scale + 3.0 * (torch.arange(d) % 3)
    return keys, torch.randn(b, h, n, d, generator=g)


def reference(x: torch.Tensor, bits: int):
    """float64 asymmetric quantization over the second-to-last axis (a group's members): z, s, codes, x'."""
    x = x.double()
    lo, hi = x.amin(-2, keepdim=True), x.amax(-2, keepdim=True)
    s = (hi - lo) / (2 ** bits - 1)
    q = torch.where(s > 0, ((x - lo) / torch.where(s > 0, s, 1.0)).round(), torch.zeros_like(x))
    return lo, s, q, q * s + lo


@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_values_per_token_against_the_float64_formula(bits):
    """Seal a 100-token prompt (residual 20, groups of 8) then decode 40 tokens: the quantized keys are groups of 8
    consecutive tokens per channel, the values groups of 8 channels per token; every element is within s/2 of its
    input and its code is the float64 formula's (bar float32 rounding at a tie); the residual is exact."""
    b, h, d, G, R = 2, 2, 16, 8, 20
    keys, values = outlier_kv(b, h, 140, d)
    layer = KiviLayerKV.allocate_dense(bits, R, G, b, h, 140, d, torch.float32, "cpu", False, 100)
    layer.append(keys[:, :, :100], values[:, :, :100], torch.arange(100))
    layer.seal(100)
    for p in range(100, 140):
        layer.append(keys[:, :, p:p + 1], values[:, :, p:p + 1], torch.tensor([p]))
        layer.settle()
    k, v, pos = layer.view()
    assert pos[0, 0].tolist() == list(range(140)) and layer.rows == R
    quantized = 120  # tokens 80..119 left the residual in five groups of 8; 120..139 are the residual
    assert torch.equal(k[:, :, quantized:], keys[:, :, quantized:]) and torch.equal(v[:, :, quantized:],
                                                                                      values[:, :, quantized:])
    # keys: per channel over groups of 8 tokens
    x = keys[:, :, :quantized].reshape(b, h, -1, G, d)
    _, s, q, _ = reference(x, bits)
    ours = k[:, :, :quantized].reshape(b, h, -1, G, d).double()
    assert ((ours - x.double()).abs() <= s / 2 * (1 + 1e-5) + 1e-6).all()
    codes = unpack(layer.kcodes[:, :, :quantized], bits).reshape(b, h, -1, G, d).double()
    assert (codes != q).float().mean() < 1e-3 and (codes - q).abs().max() <= 1
    # values: per token over groups of 8 channels
    y = values[:, :, :quantized].reshape(b, h, quantized, d // G, G).transpose(-1, -2)
    _, s, q, _ = reference(y, bits)
    ours = v[:, :, :quantized].reshape(b, h, quantized, d // G, G).transpose(-1, -2).double()
    assert ((ours - y.double()).abs() <= s / 2 * (1 + 1e-5) + 1e-6).all()
    codes = unpack(layer.vcodes[:, :, :quantized], bits).reshape(b, h, quantized, d // G, G).transpose(-1, -2)
    assert (codes.double() != q).float().mean() < 1e-3


# ---- the storage against a full-precision mirror -------------------------------------------------------------
def assert_within_bounds(layer: KiviLayerKV, plain: LayerKV):
    """Same slots and positions as the mirror; residual entries exact; every quantized entry within s/2 of its
    input (its group's and its token's scales) and inside its key group's range."""
    k, v, pos = layer.view()
    pk, pv, ppos = plain.view()
    assert torch.equal(pos, ppos)
    group = layer.slot_group[:, :, :layer.length].long()
    res = group < 0
    assert torch.equal(k[res], pk[res]) and torch.equal(v[res], pv[res])
    g = group.clamp(min=0).unsqueeze(-1).expand_as(k)
    s, z = layer.kscale.gather(2, g), layer.kzero.gather(2, g)
    q = ~res.unsqueeze(-1)
    tol = 1e-5 * (1 + pk.abs())
    assert (((k - pk).abs() <= s / 2 + tol) | ~q).all()
    assert (((pk >= z - tol) & (pk <= z + s * (2 ** layer.bits - 1) + tol)) | ~q).all()
    vs = layer.vscale[:, :, :layer.length].repeat_interleave(layer.channels, -1)
    assert (((v - pv).abs() <= vs / 2 + 1e-5 * (1 + pv.abs())) | ~q).all()
    assert layer.groups_used <= layer.kscale.shape[2]


def mirrored(ring=False, capacity=64, prompt=50, kv=2, d=8, bits=2, R=6, G=4):
    layer = KiviLayerKV.allocate_dense(bits, R, G, 2, kv, capacity, d, torch.float32, "cpu", ring, prompt)
    plain = LayerKV.allocate(2, kv, capacity, d, torch.float32, "cpu", ring)
    keys, values = outlier_kv(2, kv, prompt, d, seed=1)
    for kv_layer in (layer, plain):
        kv_layer.append(keys, values, torch.arange(prompt))
    return layer, plain


def test_storage_follows_appends_in_place_evictions_and_compactions():
    layer, plain = mirrored()
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(2, 2, 50, generator=g).argsort(-1)[..., :30].sort(-1).values  # a prompt compression
    for kv_layer in (layer, plain):
        kv_layer.keep(keep, spare=10)
    layer.seal(50)
    assert layer.keys is None and layer.sealed
    assert_within_bounds(layer, plain)
    for p in range(50, 170):
        k, v = outlier_kv(2, 2, 1, 8, seed=p)
        if layer.length < layer.capacity:
            ops = ("append", (k, v, torch.tensor([p])))
        else:  # evict a random slot per row and head, the new token takes it
            ops = ("write_slots", (torch.randint(0, layer.length, (2, 2, 1), generator=g), k, v, torch.tensor([p])))
        for kv_layer in (layer, plain):
            getattr(kv_layer, ops[0])(*ops[1])
        layer.settle()
        if p % 25 == 0:  # a re-compression (decode_every)
            keep = torch.rand(2, 2, layer.length, generator=g).argsort(-1)[..., :24].sort(-1).values
            for kv_layer in (layer, plain):
                kv_layer.keep(keep, spare=16)
        assert_within_bounds(layer, plain)
    # the table holds at most one row per living group (compaction), plus a flush of room
    live = layer.slot_group[:, :, :layer.length].long()
    assert layer.kscale.shape[2] <= max(int(torch.unique(live[r, h][live[r, h] >= 0]).numel())
                                        for r in range(2) for h in range(2)) * 2 + 2


def test_storage_ring_and_write_slot():
    layer, plain = mirrored(ring=True, capacity=20, prompt=30)
    layer.seal(30)
    assert_within_bounds(layer, plain)
    for p in range(30, 70):
        k, v = outlier_kv(2, 2, 1, 8, seed=p)
        for kv_layer in (layer, plain):
            kv_layer.append(k, v, torch.tensor([p]))
        layer.settle()
        assert_within_bounds(layer, plain)
    for p in range(70, 80):  # one slot for every row and head (StreamingLLM's victim)
        k, v = outlier_kv(2, 2, 1, 8, seed=p)
        for kv_layer in (layer, plain):
            kv_layer.write_slot(p % 7, k, v, torch.tensor([p]))
        layer.settle()
        assert_within_bounds(layer, plain)


def test_storage_flat_head_adaptive_layout():
    layer, plain = mirrored(capacity=40, prompt=40)
    g = torch.Generator().manual_seed(3)
    heads = torch.cat([torch.zeros(2, 30, dtype=torch.long), torch.ones(2, 20, dtype=torch.long)], 1)
    slots = torch.cat([torch.rand(2, 40, generator=g).argsort(-1)[:, :30].sort(-1).values,
                       torch.rand(2, 40, generator=g).argsort(-1)[:, :20].sort(-1).values], 1)
    for kv_layer in (layer, plain):
        kv_layer.keep_flat(heads, slots, spare=20)
    layer.seal(40)
    assert layer.owners == 2 and layer.kscale.shape[1] == 1
    assert_within_bounds(layer, plain)
    for p in range(40, 60):
        k, v = outlier_kv(2, 2, 1, 8, seed=p)
        for kv_layer in (layer, plain):
            kv_layer.append_flat(k, v, torch.tensor([p]))
        layer.settle()
        assert_within_bounds(layer, plain)
    assert torch.equal(layer.extras["head"][:, :, :layer.length], plain.extras["head"][:, :, :plain.length])


# ---- exactness: the residual covers the whole sequence ------------------------------------------------------
EXACT = ["full", "snapkv:budget_tokens=40,window_size=8", "h2o:budget_tokens=32", "streaming:budget_tokens=40",
         "tova:budget_tokens=32", "keyformer:budget_tokens=32", "window:window=40",
         "knorm:budget_tokens=32,head_budgets=adaptive", "snapkv:budget_tokens=40,window_size=8,decode_every=3",
         "minference:k_v=4,k_s=16,compile=false+snapkv:budget_tokens=40,window_size=8",
         "a_shape:n_init=16,n_local=32,block_size=16,compile=false+h2o:budget_tokens=32"]


def generate_batch(model, spec, **options):
    return attnkit.generate(model, prompts(), parse_method_spec(spec), max_new_tokens=NEW, stop_at_eos=False,
                            keep_logits=True, **options)


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max((p - q).abs().max().item() for p, q in zip(x.logits, y.logits)) == 0.0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", EXACT)
def test_a_residual_covering_the_sequence_is_the_cache_method_exactly(arch_models, arch, spec):
    """Nothing is ever quantized: tokens and logits are the wrapped method's (evicting, composed with sparse
    prefill, head-adaptive) at batch 3, on llama, mistral (its own sliding window) and qwen3."""
    model = arch_models[arch]
    assert_same(generate_batch(model, f"{spec}+kivi:residual=1000"), generate_batch(model, spec))


@pytest.mark.parametrize("spec", ["full", "snapkv:budget_tokens=400", "h2o:budget_tokens=400",
                                  "streaming:budget_tokens=400", "tova:budget_tokens=400",
                                  "a_shape:n_init=200,n_local=200,block_size=16,compile=false+h2o:budget_tokens=400"])
def test_unlimited_budget_and_residual_equal_full(arch_models, spec):
    """Nothing evicted, nothing quantized: full's tokens (and the unquantized method's logits exactly; a_shape's
    sparse prefill kernel differs from full's dense one by float rounding)."""
    model = arch_models["llama"]
    quantized = generate_batch(model, f"{spec}+kivi:bits=2,residual=1000")
    assert_same(quantized, generate_batch(model, spec))
    assert [g.token_ids for g in quantized] == [g.token_ids for g in generate_batch(model, "full")]


# ---- memory --------------------------------------------------------------------------------------------------
HD64 = "layers=2,hidden=128,heads=4,kv_heads=2,head_dim=64,intermediate=128"


def per_entry_bytes(d, bits, group, itemsize=4):
    """Bytes one kept entry (a key and a value of one kv head) costs once quantized: the codes, the value's scale
    and zero per group of channels, its slot's group index, and its share of a full key group's scale and zero."""
    return 2 * d * bits // 8 + 2 * itemsize * (d // min(group, d)) + 4 + 2 * itemsize * d / group


def test_bytes_at_4_bits_and_with_an_eviction_method():
    """At 4 bits a 2000-token prompt + 8 tokens holds at most 0.3 of full's bytes (head_dim 64, float32, residual
    128, groups of 32: 0.195 per entry + 160 residual tokens at full precision); behind snapkv (0.3 of the
    prompt) the quantized bytes are snapkv's entries times the same per-entry factor plus the residual."""
    model = attnkit.load_model(f"random:llama:{HD64}")
    ids = random_ids(2000, seed=5).tolist()

    def held(spec):
        return attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=8, stop_at_eos=False).stats

    full, kivi = held("full"), held("kivi:bits=4")
    snap, snap_kivi = held("snapkv:budget=0.3"), held("snapkv:budget=0.3+kivi:bits=4")
    assert kivi.final_kv_bytes <= 0.3 * full.final_kv_bytes
    assert kivi.peak_kv_bytes < full.peak_kv_bytes  # the prompt in full precision, the generation's slots later
    entry = 2 * 64 * 4  # one full-precision entry
    factor = per_entry_bytes(64, 4, 32) / entry
    slots, kept = full.final_kv_bytes // entry, snap.final_kv_bytes // entry  # entries over layers and kv heads
    extra = 2 * 2 * (128 + 32) * entry  # 2 layers x 2 kv heads x 160 full-precision residual rows
    table_room = 2 * 2 * 2 * 64 * 4  # one flush of headroom in each key-group table
    assert kivi.final_kv_bytes <= slots * factor * entry + extra + table_room
    assert snap_kivi.final_kv_bytes <= kept * factor * entry + extra + table_room
    assert snap_kivi.final_kv_bytes < 0.5 * snap.final_kv_bytes and snap_kivi.final_kv_bytes < 0.6 * kivi.final_kv_bytes


def test_nbytes_counts_every_tensor_the_storage_holds():
    layer, _ = mirrored(capacity=64, prompt=50, d=8, bits=4)
    dense = layer.nbytes()
    assert dense == layer.keys.nbytes + layer.values.nbytes
    layer.seal(50)
    held = [layer.kcodes, layer.vcodes, layer.vscale, layer.vzero, layer.slot_group, layer.kscale, layer.kzero,
            layer.rkeys, layer.rvalues]
    assert layer.nbytes() == sum(t.nbytes for t in held) < 2 * layer.positions.numel() * 8 * 4  # full's, same slots
    assert layer.kcodes.shape[-1] == 8 * 4 // 8 and layer.kcodes.dtype == torch.uint8


# ---- accuracy on the bundled model -----------------------------------------------------------------------------
def teacher_forced(model, spec, ids, tokens):
    """Logits of every step when the method is fed `tokens` (full attention's choices) after the prompt."""
    session = new_session(model, parse_method_spec(spec), len(ids), len(tokens))
    with torch.inference_mode():
        out = [logits_of(model, prefill(model, session, torch.tensor([ids]))[:, -1])[0]]
        for i, token in enumerate(tokens[:-1]):
            hidden = forward(model, torch.tensor([[token]]), len(ids) + i, lambda p: Step(session, "decode", p))
            out.append(logits_of(model, hidden[:, -1])[0])
    return torch.stack(out)


def test_four_bits_stay_close_to_full_on_tiny_two_bits_less():
    tiny = attnkit.load_model("tiny")
    ids = code_prompt(tiny, 1024).tolist()
    full = attnkit.generate(tiny, ids, "full", max_new_tokens=32, stop_at_eos=False, keep_logits=True)
    ref = torch.stack(full.logits)
    errors = {}
    for bits in (4, 2):
        logits = teacher_forced(tiny, f"kivi:bits={bits}", ids, full.token_ids)
        agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        errors[bits] = (logits - ref).abs().amax(-1).mean().item()
        assert agree >= (0.95 if bits == 4 else 0.8), (bits, agree)
    assert errors[4] < 0.25 and errors[2] > 3 * errors[4], errors  # largest logit change, mean over steps


# ---- routes ----------------------------------------------------------------------------------------------------
def test_spec_grammar_and_recipes():
    m = parse_method_spec("minference:k_v=4,k_s=16+snapkv:budget=0.3+kivi:bits=2,group=16")
    assert isinstance(m, Kivi) and (m.bits, m.group, m.residual) == (2, 16, 128)
    assert m.cache_method.name == "compose" and m.cache == "minference:k_v=4,k_s=16+snapkv:budget=0.3"
    assert parse_method_spec("kivi").cache_method.name == "full"
    recipe = Recipe.parse({"cache": "snapkv:budget=0.3", "quantize": {"method": "kivi",
                                                                       "params": {"bits": 4, "residual": 64}}})
    assert recipe.label == "snapkv:budget=0.3+kivi:bits=4,residual=64"
    method = recipe.method()
    assert isinstance(method, Kivi) and method.cache_method.name == "snapkv" and method.residual == 64
    assert Recipe.parse(recipe.to_dict()).method().describe() == method.describe()
    assert Recipe.parse(recipe.label).method().describe() == method.describe()
    swept = Recipe.parse({"method": "h2o", "quantize": "kivi:bits=2"}).with_budget(0.5)
    assert swept.method().cache_method.budget == 0.5 and swept.takes_budget() is False
    json.dumps(method.params())


@pytest.mark.parametrize("spec,pattern", [
    ("kivi+snapkv:budget=0.3", r"a quantizer \(kivi\) comes last"),
    ("snapkv:budget=0.3+kivi+kivi", r"comes last, once"),
    ("a_shape+snapkv:budget=0.3+h2o:budget=0.3", r"joins exactly two"),
    ("kivi:bits=3", r"bits must be one of 2, 4, 8; got 3"),
    ("kivi:residual=-1", r"residual"),
    ("kivi:group=0", r"group"),
    ("snapkv:budget=0.3+kivi:cache=full", r"drop cache="),
    ("streaming:budget=0.3,positions=reindex+kivi", r"re-rotates keys it already stored"),
    ("select+kivi", r"runs the decoder layers itself"),
    ("gemfilter:k=8+kivi", r"runs the decoder layers itself"),
])
def test_bad_specs_are_refused_in_one_line(spec, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        parse_method_spec(spec)
    assert "\n" not in str(err.value)


def test_a_head_dim_the_groups_do_not_divide_is_refused(small_llama):
    with pytest.raises(AttnkitError, match=r"head_dim=16 must be a multiple of the value group \(12 channels\)"):
        attnkit.generate(small_llama, "hello", "kivi:group=12", max_new_tokens=2)
    with pytest.raises(AttnkitError, match=r"'quantize' names a quantizer"):
        Recipe.parse({"method": "full", "quantize": "h2o"})


def test_model_generate_route_equals_attnkit_generate(small_llama):
    ids = random_ids(120, seed=9)
    spec = "h2o:budget_tokens=48+kivi:bits=4,residual=16,group=8"
    ours = attnkit.generate(small_llama, ids, parse_method_spec(spec), max_new_tokens=NEW, stop_at_eos=False)
    cache = AttnkitCache(small_llama, spec, max_new_tokens=NEW)
    out = small_llama.hf.generate(ids[None], past_key_values=cache, max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False)
    assert out[0, 120:].tolist() == ours.token_ids
    assert cache.nbytes() == ours.stats.final_kv_bytes


def test_a_quantized_self_draft_keeps_speculation_lossless(small_llama):
    ids = random_ids(150, seed=4).tolist()
    plain = attnkit.generate(small_llama, ids, "full", max_new_tokens=16, stop_at_eos=False)
    out = speculative_generate(small_llama, ids, "self", gamma=3, max_new_tokens=16, stop_at_eos=False,
                               draft="snapkv:budget=0.5,window_size=8+kivi:bits=2,residual=8,group=8")
    assert out.token_ids == plain.token_ids


def test_cli_generate_and_bench(tmp_path, capsys):
    model = f"random:llama:{SMALL}"
    assert main(["generate", "--model", model, "--prompt", "hello world " * 20, "--max-new-tokens", "4",
                 "--method", "snapkv:budget=0.5,window_size=8+kivi:bits=4,residual=16,group=8"]) == 0
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"cache": "h2o:budget_tokens=64", "quantize": {"method": "kivi", "params": {"bits": 2}}}))
    assert main(["generate", "--model", model, "--prompt", "hello world " * 20, "--max-new-tokens", "4",
                 "--recipe", str(recipe)]) == 0
    assert main(["bench", "--model", model, "--context", "256", "--new-tokens", "4", "--repeats", "1",
                 "--methods", "full,kivi:bits=4,group=16"]) == 0
    assert "kivi:bits=4,group=16" in capsys.readouterr().out


def test_duo_attention_under_kivi_is_refused(small_llama):
    """duo_attention's streaming heads take tokens the retrieval heads do not (a flat layer of uneven rows):
    the quantized residual cannot hold that, so the run is refused before any token is generated."""
    ids = list(range(3, 83))
    with pytest.raises(AttnkitError, match="duo_attention"):
        attnkit.generate(small_llama, ids, "duo_attention:pattern=RS/SR,sinks=4,recent=16+kivi:residual=8,group=8",
                         max_new_tokens=4)
