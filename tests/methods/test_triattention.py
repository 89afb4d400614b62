"""triattention (TriAttention, arXiv 2604.04921): statistics recorded here (``attnkit calibrate triattention``, a few
hundred tokens) on each architecture and on ``tiny``; at an unlimited budget exactly full (alone, in a batch of
prompts of different lengths, inside transformers' generate with AttnkitCache, a padded batch too); at a small
budget the cache is compressed to B after the prompt and back to B every decode_every tokens, the recent window
kept, each layer choosing for itself; the score equals the paper's series written out with cosines, and the kept
positions a plain float64 recomputation step by step; the recorded centres equal the model's own pre-RoPE queries;
the file round-trips, a file of another geometry or RoPE is refused, and so are bad parameters, in one line."""

import json
import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.kvzap import text_windows
from attnkit.calibrate.triattention import calibrate_triattention
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.spec import parse_method_spec
from attnkit.methods.triattention_stats import (
    FORMAT,
    dumps_stats,
    geometric_offsets,
    load_stats,
    stats_from_dict,
    trig_scores,
)
from attnkit.session import Step, layer_contexts, new_session
from helpers import (
    ROOT,
    ROPE,
    SMALL,
    assert_equals_full,
    drive,
    drive_shards,
    per_token_bytes,
    randn,
    random_ids,
    recompress_dense,
)

torch.set_num_threads(1)

NEW = 12
TINY_STATS = ROOT / "sweeps" / "triattention_tiny.json"


@pytest.fixture(scope="module")
def models(arch_models):
    return {**arch_models, "tiny": attnkit.load_model("tiny")}


@pytest.fixture(scope="module")
def stats(models, tmp_path_factory):
    """A statistics file per model: 2 windows of 96 tokens (tiny: 1 of 256)."""
    folder = tmp_path_factory.mktemp("triattention")
    out = {}
    for arch, model in models.items():
        samples, length = (1, 256) if arch == "tiny" else (2, 96)
        path = folder / f"{arch}.json"
        path.write_text(dumps_stats(calibrate_triattention(model, samples=samples, length=length)))
        out[arch] = str(path)
    return out


def spec(stats, arch, params):
    return parse_method_spec(f"triattention:config={stats[arch]},{params}")


# ---- unlimited budget: exactly full ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["tiny", "llama", "mistral", "qwen3"])
@pytest.mark.parametrize("params", ["budget_tokens=200", "budget_tokens=162,decode_every=3,window_size=4"])
def test_unlimited_budget_equals_full(models, stats, arch, params):
    assert_equals_full(models[arch], random_ids(150, seed=3), spec(stats, arch, params), NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unlimited_budget_equals_full_in_a_batch(models, stats, arch):
    prompts = [random_ids(n, seed=7 + n).tolist() for n in (120, 95, 120, 60)]
    assert_equals_full(models[arch], prompts, spec(stats, arch, "budget_tokens=300,decode_every=2,window_size=4"), NEW)


def hf_generate(model, ids, mask, cache, n):
    out = model.hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    rows = out.sequences.shape[0]
    return ([out.sequences[r, ids.shape[1]:].tolist() for r in range(rows)],
            [[lg[r] for lg in out.logits] for r in range(rows)])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("params", ["budget_tokens=400,decode_every=2",
                                    "budget_tokens=24,decode_every=5,window_size=4"])
def test_model_generate_through_attnkit_cache_equals_attnkit_generate(models, stats, arch, params):
    """One prompt, then a left-padded batch of prompts of different lengths, through transformers' generate."""
    model, n = models[arch], 16
    method = spec(stats, arch, params)
    prompts = [random_ids(k, seed=20 + k) for k in (37, 20, 37, 28)]
    width = max(p.shape[0] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[0],), 2), p]) for p in prompts])
    mask = torch.stack([(torch.arange(width) >= width - p.shape[0]).long() for p in prompts])
    for rows in ([1], [0, 1, 2, 3]):
        sub_ids, sub_mask = (prompts[1][None], None) if rows == [1] else (ids, mask)
        cache = AttnkitCache(model, method, max_new_tokens=n)
        tokens, logits = hf_generate(model, sub_ids, sub_mask, cache, n)
        for out_row, row in enumerate(rows):
            ours = attnkit.generate(model, prompts[row], method, max_new_tokens=n, stop_at_eos=False, keep_logits=True)
            assert tokens[out_row] == ours.token_ids
            assert max((a - b).abs().max().item() for a, b in zip(logits[out_row], ours.logits)) < 1e-4
            seen = prompts[row].shape[0] + n - 1
            if "400" in params:
                full = attnkit.generate(model, prompts[row], "full", max_new_tokens=n, stop_at_eos=False)
                assert ours.token_ids == full.token_ids
                assert cache.kept_lengths(out_row) == [seen] * 2
            else:
                assert max(cache.kept_lengths(out_row)) < seen


# ---- small budget: the cache's size, the window, per-layer choices --------------------------------------------
@pytest.mark.parametrize("every", [1, 4])
def test_the_cache_is_compressed_to_budget_every_decode_every_tokens_and_keeps_the_window(models, stats, every):
    model, n, budget, window, steps = models["llama"], 100, 32, 8, 30
    method = spec(stats, "llama", f"budget_tokens={budget},decode_every={every},window_size={window}")
    session = new_session(model, method, n, steps)
    assert [method.planned_slots(ctx) for ctx in layer_contexts(session)] == [budget + every] * 2
    lengths = []
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=5))).argmax())
        assert session.cache.lengths() == [budget] * 2  # the prompt compressed after prefill
        for i in range(steps):
            hidden = forward(model, torch.tensor([token]), n + i, lambda p: Step(session, "decode", p))
            token = int(logits_of(model, hidden[-1:]).argmax())
            lengths.append(session.cache.lengths())
            assert session.cache.nbytes() == (budget + every) * per_token_bytes(model)
            if (i + 1) % every == 0:  # just compressed: B entries, the last `window` positions among them
                recent = set(range(n + i + 1 - window, n + i + 1))
                for kv in session.cache.layers:
                    held = kv.view()[2][0]
                    assert held.shape[-1] == budget
                    assert all(recent <= set(row.tolist()) for row in held)
        # each layer and kv head chooses its own entries (the authors' default shares one choice across layers)
        held = [set(map(tuple, kv.view()[2][0].tolist())) for kv in session.cache.layers]
        assert held[0] != held[1]
    if every == 1:
        assert lengths == [[budget] * 2] * steps
    else:
        assert [step[0] for step in lengths[:8]] == [33, 34, 35, 32, 33, 34, 35, 32]


def test_a_small_budget_runs_on_every_architecture_and_frees_memory(models, stats):
    ids = random_ids(160, seed=9)
    for arch, model in models.items():
        out = attnkit.generate(model, ids, spec(stats, arch, "budget_tokens=40,decode_every=8,window_size=8"),
                               max_new_tokens=30, stop_at_eos=False)
        full = attnkit.generate(model, ids, "full", max_new_tokens=30, stop_at_eos=False)
        assert len(out.token_ids) == 30, arch
        assert out.stats.final_kv_bytes == 48 * per_token_bytes(model) < full.stats.final_kv_bytes


# ---- the score against the formula, the kept positions against a plain recomputation -------------------------
def stats_dict(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, inv_freq=None, seed=0):
    """Random statistics in the file's format: centres of any phase, mean norms above their moduli."""
    f = head_dim // 2
    inv_freq = ROPE.inv_freq if inv_freq is None else inv_freq
    layers = []
    for i in range(n_layers):
        re, im = randn(n_heads, f, seed=seed + 3 * i), randn(n_heads, f, seed=seed + 3 * i + 1)
        spread = randn(n_heads, f, seed=seed + 3 * i + 2).abs()
        layers.append({"center_real": re.tolist(), "center_imag": im.tolist(),
                       "abs_mean": (torch.complex(re, im).abs() + spread).tolist()})
    return {"format": FORMAT, "model": "hand-made", "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
            "head_dim": head_dim, "inv_freq": inv_freq.tolist(), "layers": layers}


def plain_score(c: complex, m: float, k_pre: list[float], omega: list[float], distance: float, offsets, how):
    """S_h of one key for one query head, band by band with cosines (float64): c, m the head's centre and mean norm
    per band, k_pre the key before RoPE, `distance` = t0 - p."""
    f = len(omega)
    kb = [complex(k_pre[j], k_pre[j + f]) for j in range(f)]
    series = [sum(abs(c[j]) * abs(kb[j]) * math.cos(omega[j] * (distance + o) + math.atan2(
        (c[j] * kb[j].conjugate()).imag, (c[j] * kb[j].conjugate()).real)) for j in range(f)) for o in offsets]
    trig = sum(series) / len(series) if how == "mean" else max(series)
    return trig + sum((m[j] - abs(c[j])) * abs(kb[j]) for j in range(f))


@pytest.mark.parametrize("how", ["mean", "max"])
def test_the_score_is_the_series_over_future_distances(how):
    """Rows and kv heads holding different positions: the score of the cached keys (after RoPE) is the series of the
    keys before RoPE at their distances."""
    center, abs_mean = stats_from_dict(stats_dict(n_heads=6, n_kv_heads=3)).layer(0, "cpu")  # [3, 2, 4] each
    k_pre = randn(2, 3, 10, 8, seed=4) * 2
    pos = torch.stack([torch.randperm(400, generator=torch.Generator().manual_seed(s))[:10] for s in range(6)])
    pos = pos.reshape(2, 3, 10)
    cached = ROPE.rotate(k_pre, pos)  # what the cache holds: keys after RoPE at their positions
    offsets = geometric_offsets(1000)
    got = trig_scores(cached, center, abs_mean, ROPE.inv_freq, 450, offsets, how)
    omega = ROPE.inv_freq.double().tolist()
    for b in range(2):
        for g in range(3):
            for h in range(2):
                c, m = center[g, h].tolist(), abs_mean[g, h].tolist()
                for i in range(10):
                    want = plain_score(c, m, k_pre[b, g, i].double().tolist(), omega, 450 - int(pos[b, g, i]),
                                       offsets, how)
                    assert abs(float(got[b, g, h, i]) - want) < 1e-4 * (1 + abs(want))
    blocks = trig_scores(cached, center, abs_mean, ROPE.inv_freq, 450, offsets, how,
                         block_elements=2 * 3 * 2 * 3)  # at most three keys per block: the same numbers
    assert torch.allclose(blocks, got, rtol=1e-6, atol=1e-6)
    assert geometric_offsets(65536)[-1] == 65536 and len(geometric_offsets(65536)) == 17


def dense_triattention_choose(k_pre, data, budget, window, offsets, how, reduce, normalize):
    """TriAttention's selection written plainly (float64, Python lists) for kv head `h` holding positions `held`,
    the next token at `next_pos`: each query head's series, standardised over the held entries, reduced over the
    group, the window kept plus the best of the rest."""
    layer = data["layers"][0]
    g = data["n_heads"] // data["n_kv_heads"]
    omega = data["inv_freq"]

    def choose(h, held, next_pos):
        per_head = []
        for j in range(h * g, (h + 1) * g):
            c = [complex(a, b) for a, b in zip(layer["center_real"][j], layer["center_imag"][j])]
            s = torch.tensor([plain_score(c, layer["abs_mean"][j], k_pre[0, h, p].double().tolist(), omega,
                                          next_pos - p, offsets, how) for p in held], dtype=torch.float64)
            per_head.append((s - s.mean()) / s.std() if normalize else s)
        score = torch.stack(per_head).amax(0) if reduce == "max" else torch.stack(per_head).mean(0)
        keep = [p for p in held if p >= next_pos - window]
        rest = [held[i] for i in score.argsort(descending=True).tolist() if held[i] < next_pos - window]
        return keep + rest[:budget - len(keep)]
    return choose


@pytest.mark.parametrize("every,how,reduce,normalize,window", [
    (1, "mean", "max", True, 4), (3, "mean", "max", True, 0), (4, "max", "mean", True, 2),
    (3, "mean", "max", False, 4)])
def test_kept_positions_equal_a_plain_recomputation(tmp_path, every, how, reduce, normalize, window):
    n, prompt_len, budget = 56, 30, 14
    k_pre = randn(1, 2, n, 8, seed=11) * 1.5
    q, v = randn(1, 4, n, 8, seed=12), randn(1, 2, n, 8, seed=13)
    k = ROPE.rotate(k_pre, torch.arange(n))  # the keys after RoPE, as the host hands them over
    data = stats_dict(seed=5)
    path = tmp_path / "stats.json"
    path.write_text(dumps_stats(data))
    method = attnkit.make_method("triattention", config=str(path), budget_tokens=budget, decode_every=every,
                                 window_size=window, offset_max_length=256, aggregation=how, gqa_reduce=reduce,
                                 normalize=normalize)
    session, _, got = drive(method, q, k, v, prompt_len)
    choose = dense_triattention_choose(k_pre, data, budget, window, geometric_offsets(256), how, reduce, normalize)
    assert got == recompress_dense(q, k, prompt_len, budget, every, choose)
    assert session.cache.layers[0].capacity == budget + every


def test_each_tensor_parallel_shard_reads_its_own_heads_statistics(tmp_path):
    """A shard holding the model's second kv head (numbered 0 in it) scores with that head's statistics, so the
    shards together keep what the whole model keeps; the file is checked against the whole model's heads (half of
    them, not told which, is refused)."""
    n, prompt_len = 56, 30
    q, k, v = randn(1, 4, n, 8, seed=12), ROPE.rotate(randn(1, 2, n, 8, seed=11), torch.arange(n)), randn(1, 2, n, 8,
                                                                                                          seed=13)
    path = tmp_path / "stats.json"
    path.write_text(dumps_stats(stats_dict(seed=5)))
    method = attnkit.make_method("triattention", config=str(path), budget_tokens=14, decode_every=3, window_size=2,
                                 offset_max_length=256)
    _, outs, held = drive(method, q, k, v, prompt_len)
    shard_outs, shard_held = drive_shards(method, q, k, v, prompt_len)
    assert shard_held == held
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(shard_outs, outs))
    with pytest.raises(AttnkitError, match="kv heads 1 .file: 2."):  # half the heads, not told which: refused
        drive(method, q[:, 2:], k[:, 1:], v[:, 1:], prompt_len)


# ---- calibration: the recorded statistics, the file, the command, refusals -------------------------------------
def test_the_centres_are_the_mean_of_the_models_own_queries_before_rope(models):
    """On llama the queries before RoPE are q_proj's output: their band means equal the file's centres."""
    model = models["llama"]
    config = calibrate_triattention(model, samples=2, length=96, seed=1)
    ids = torch.tensor(text_windows(model, "train", 2, 96, 1))
    seen = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, out, i=i: seen.__setitem__(i, out))
             for i, layer in enumerate(model.hf.model.layers)]
    with torch.inference_mode():
        model.hf(ids)
    for hook in hooks:
        hook.remove()
    d = model.geometry.head_dim
    for i, layer in enumerate(config["layers"]):
        q = seen[i].reshape(-1, model.geometry.n_q_heads, d).double()  # [tokens, heads, d]
        z = torch.complex(q[..., :d // 2], q[..., d // 2:])
        assert torch.allclose(torch.tensor(layer["center_real"], dtype=torch.float64), z.mean(0).real, atol=1e-5)
        assert torch.allclose(torch.tensor(layer["center_imag"], dtype=torch.float64), z.mean(0).imag, atol=1e-5)
        assert torch.allclose(torch.tensor(layer["abs_mean"], dtype=torch.float64), z.abs().mean(0), atol=1e-5)
    assert config["calibration"]["queries_per_head"] == 2 * 96
    assert config["inv_freq"] == pytest.approx(model.hf.model.rotary_emb.inv_freq.tolist(), rel=1e-7)


def test_the_file_round_trips_and_a_file_of_another_model_is_refused(models, stats, tmp_path):
    data = json.loads(open(stats["llama"]).read())
    loaded = load_stats(stats["llama"])
    assert (loaded.n_layers, loaded.n_heads, loaded.n_kv_heads, loaded.head_dim) == (2, 4, 2, 16)
    assert torch.equal(loaded.center[1].imag, torch.tensor(data["layers"][1]["center_imag"]))
    assert torch.equal(loaded.abs_mean[0], torch.tensor(data["layers"][0]["abs_mean"]))
    again = tmp_path / "again.json"
    again.write_text(dumps_stats(data))
    assert again.read_text() == open(stats["llama"]).read()
    assert {"model", "architecture", "date", "calibration", "rope_theta", "attnkit_version"} <= set(data)
    ids = random_ids(60, seed=2)
    for other, why in ((f"random:llama:{SMALL.replace('layers=2', 'layers=3')}", r"layers 3 \(file: 2\)"),
                       (f"random:llama:{SMALL.replace('heads=4', 'heads=8')}", r"query heads 8 \(file: 4\)"),
                       (f"random:llama:{SMALL},rope_theta=500000", "RoPE frequencies")):
        with pytest.raises(AttnkitError, match=why) as err:
            attnkit.generate(attnkit.load_model(other), ids, f"triattention:config={stats['llama']},budget_tokens=400",
                             max_new_tokens=2)
        assert "\n" not in str(err.value) and "attnkit calibrate triattention" in str(err.value)
    with pytest.raises(AttnkitError, match="RoPE frequencies"):  # the committed file of tiny, on tiny with yarn
        attnkit.generate(attnkit.load_model("tiny:yarn=8"), ids, f"triattention:config={TINY_STATS},budget_tokens=40",
                         max_new_tokens=2)
    broken = tmp_path / "broken.json"
    for bad, why in (({**data, "format": "other"}, "not a triattention statistics file"),
                     ({**data, "n_layers": 3}, "bad geometry"), ({**data, "inv_freq": [1.0]}, "inv_freq"),
                     ({**data, "layers": [data["layers"][0], {"center_real": []}]}, "layer 1 needs 'center_real'")):
        broken.write_text(json.dumps(bad))
        with pytest.raises(AttnkitError, match=why) as err:
            parse_method_spec(f"triattention:config={broken},budget=0.5")
        assert "\n" not in str(err.value)


def test_the_committed_tiny_file_loads_and_compresses(models):
    out = attnkit.generate(models["tiny"], random_ids(300, seed=1, vocab=4000),
                           f"triattention:config={TINY_STATS},budget_tokens=64,window_size=16,decode_every=16",
                           max_new_tokens=20, stop_at_eos=False)
    assert out.stats.final_kv_bytes <= (64 + 16) * per_token_bytes(models["tiny"])
    assert load_stats(TINY_STATS).model == "tiny"


def test_the_command_writes_a_file_the_method_reads(models, tmp_path, capsys):
    path = tmp_path / "stats.json"
    assert main(["calibrate", "triattention", "--model", f"random:llama:{SMALL}", "--samples", "2", "--length", "96",
                 "--out", str(path)]) == 0
    assert "concentration" in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert (data["n_layers"], data["n_heads"], data["calibration"]["samples"]) == (2, 4, 2)
    out = attnkit.generate(models["llama"], random_ids(100, seed=2), f"triattention:config={path},budget_tokens=40,"
                           f"window_size=8,decode_every=4", max_new_tokens=6, stop_at_eos=False)
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("params,why", [
    ("budget=0.5", "needs config=FILE.*attnkit calibrate triattention"),
    ("config=/nonexistent.json,budget=0.5", "does not exist.*attnkit calibrate triattention"),
    ("config=STATS,budget=0.5,window_size=-1", "window_size"),
    ("config=STATS,budget=0.5,offset_max_length=0", "offset_max_length"),
    ("config=STATS,budget=0.5,aggregation=median", "aggregation"),
    ("config=STATS,budget=0.5,gqa_reduce=sum", "gqa_reduce"),
    ("config=STATS,budget=0.5,normalize=maybe", "normalize"),
    ("config=STATS,budget=0.5,decode_every=-1", "decode_every"),
    ("config=STATS", "needs a cache budget"),
])
def test_bad_parameters_are_refused_in_one_line(stats, params, why):
    with pytest.raises(AttnkitError, match=why) as err:
        parse_method_spec("triattention:" + params.replace("STATS", stats["llama"]))
    assert "\n" not in str(err.value)


def test_a_window_that_fills_the_budget_is_refused(models, stats):
    with pytest.raises(AttnkitError, match="window_size=128 recent tokens fill the 40-slot budget") as err:
        attnkit.generate(models["llama"], random_ids(100, seed=2), spec(stats, "llama", "budget_tokens=40"),
                         max_new_tokens=4)
    assert "\n" not in str(err.value)
