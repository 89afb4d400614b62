"""expected_attention with calibrated query statistics (``stats=FILE``, kvpress's ExpectedAttentionStatsPress):
`attnkit calibrate expected_attention` writes the mean and unbiased covariance of the queries before RoPE (sinks left
out), equal to a plain recomputation; equal to full at an unlimited budget on every architecture, batched; the kept
positions equal a plain recomputation of the expected attention from the file's moments (explicit rotation matrices,
entry by entry), at the prompt and at every ``decode_every`` re-compression; through transformers' generate
(AttnkitCache) the same tokens; a file of another model, or a missing or malformed one, refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.expected_attention import calibrate_expected_attention
from attnkit.cli import main
from attnkit.methods.expected_attention_stats import save_moments
from attnkit.methods.spec import parse_method_spec
from helpers import (
    ROPE,
    SMALL,
    assert_attnkit_cache_equals_generate,
    assert_equals_full,
    drive,
    qkv,
    randn,
    random_ids,
    recompress_dense,
)

torch.set_num_threads(1)

NEW = 12


@pytest.fixture(scope="module")
def stats(arch_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ea_stats")
    return {arch: str(save_moments(folder / f"{arch}.safetensors", *calibrate_expected_attention(model, samples=2,
                                                                                                  length=96)))
            for arch, model in arch_models.items()}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_unlimited_budget_equals_full_batched(arch_models, stats, arch):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    for params in ("budget_tokens=200", "budget_tokens=200,decode_every=3"):
        assert_equals_full(arch_models[arch], prompts,
                           parse_method_spec(f"expected_attention:stats={stats[arch]},{params}"), NEW)


def test_small_budget_batch_equals_each_prompt_alone(arch_models, stats):
    model = arch_models["llama"]
    prompts = [random_ids(n, seed=n).tolist() for n in (130, 95, 130)]
    for params in ("budget_tokens=32", "budget=0.3,decode_every=3"):
        method = parse_method_spec(f"expected_attention:stats={stats['llama']},{params}")
        batch = attnkit.generate(model, prompts, method, max_new_tokens=NEW, stop_at_eos=False)
        for prompt, out in zip(prompts, batch):
            alone = attnkit.generate(model, prompt, method, max_new_tokens=NEW, stop_at_eos=False)
            assert out.token_ids == alone.token_ids
            assert out.stats.final_kv_bytes == alone.stats.final_kv_bytes


def test_the_statistics_equal_a_plain_recomputation():
    """The queries before RoPE captured from transformers' own forward (its apply_rotary_pos_emb's input), the first
    n_sink positions of every window left out: mean and unbiased covariance per layer and query head."""
    import transformers.models.llama.modeling_llama as llama

    from attnkit.calibrate.kvzap import text_windows

    model = attnkit.load_model(f"random:llama:{SMALL}")
    mean, cov, meta = calibrate_expected_attention(model, samples=3, length=64, seed=2, n_sink=4)
    windows = torch.tensor(text_windows(model, "train", 3, 64, 2))
    captured = []
    original = llama.apply_rotary_pos_emb

    def capture(q, k, *args, **kwargs):
        captured.append(q.detach().clone())
        return original(q, k, *args, **kwargs)

    llama.apply_rotary_pos_emb = capture
    try:
        with torch.no_grad():
            model.hf(windows)
    finally:
        llama.apply_rotary_pos_emb = original
    for i, q in enumerate(captured):  # [b, hq, n, d], one per layer in order
        x = q[:, :, 4:].double().transpose(0, 1).reshape(q.shape[1], -1, q.shape[-1])  # [hq, N, d]
        mu = x.mean(dim=1)
        dev = x - mu[:, None]
        sigma = dev.transpose(1, 2) @ dev / (x.shape[1] - 1)
        assert torch.allclose(mean[i].double(), mu, atol=1e-5), i
        assert torch.allclose(cov[i].double(), sigma, atol=1e-5), i
    assert meta["calibration"]["queries_per_head"] == 3 * 60


def rotation(pos: int, d: int) -> torch.Tensor:
    """RoPE's rotation at position `pos` as a plain d x d matrix (transformers' half-split pairs (i, i + d/2))."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i, f in enumerate(ROPE.inv_freq.double().tolist()):
        c, s = math.cos(pos * f), math.sin(pos * f)
        r[i, i], r[i, i + d // 2], r[i + d // 2, i], r[i + d // 2, i + d // 2] = c, -s, s, c
    return r


def test_kept_positions_equal_a_plain_recomputation(tmp_path):
    q, k, v = qkv(64, seed=81)
    hq, kv, d = q.shape[1], k.shape[1], k.shape[-1]
    mu = randn(1, hq, d, seed=3)
    a = randn(1, hq, d, d, seed=4)
    sigma = a @ a.transpose(-1, -2) / d
    path = save_moments(tmp_path / "s.safetensors", mu, sigma, {"model": "hand-made",
                                                                 "inv_freq": ROPE.inv_freq.tolist()})
    budget, prompt_len, sinks, future = 18, 45, 3, 7

    def choose(h, held, next_pos):
        rbar = sum(rotation(next_pos + j, d) for j in range(future)) / future
        keys, norms = k[0, h].double(), v[0, h].double().norm(dim=-1)
        scores = {p: 0.0 for p in held if p >= sinks}
        g = hq // kv
        for head in range(h * g, (h + 1) * g):
            m, s = rbar @ mu[0, head].double(), rbar @ sigma[0, head].double() @ rbar.T
            logit = {p: float(m @ keys[p]) / math.sqrt(d) + float(keys[p] @ s @ keys[p]) / (2 * d) for p in scores}
            top = max(logit.values())
            total = sum(math.exp(x - top) for x in logit.values())
            for p in scores:
                scores[p] += math.exp(logit[p] - top) / total / g
        rest = sorted(scores, key=lambda p: -scores[p] * float(norms[p]))
        return [p for p in held if p < sinks] + rest[:budget - sinks]

    for every in (0, 3):
        method = attnkit.make_method("expected_attention", stats=str(path), budget_tokens=budget, n_sink=sinks,
                                     n_future_positions=future, decode_every=every)
        _, _, got = drive(method, q, k, v, prompt_len)
        assert got == recompress_dense(q, k, prompt_len, budget, every, choose)


def test_generate_through_attnkit_cache_equals_attnkit_generate(arch_models, stats):
    cache = assert_attnkit_cache_equals_generate(arch_models["qwen3"], random_ids(150, seed=3), "expected_attention",
                                                 {"stats": stats["qwen3"], "budget_tokens": 40, "decode_every": 8}, 16)
    assert max(cache.kept_lengths()) <= 48


def test_the_command_writes_a_file_the_method_reads(tmp_path, capsys):
    out = tmp_path / "ea.safetensors"
    spec = f"random:llama:{SMALL}"
    assert main(["calibrate", "expected_attention", "--model", spec, "--samples", "1", "--length", "64",
                 "--out", str(out)]) == 0
    assert "query statistics" in capsys.readouterr().out
    gen = attnkit.generate(attnkit.load_model(spec), random_ids(80).tolist(),
                           f"expected_attention:stats={out},budget=0.5", max_new_tokens=3, stop_at_eos=False)
    assert len(gen.token_ids) == 3


def test_a_file_of_another_model_is_refused_in_one_line(stats):
    other = attnkit.load_model("random:llama:layers=2,hidden=64,heads=2,kv_heads=2,head_dim=32,intermediate=128")
    with pytest.raises(AttnkitError, match="not this model") as caught:
        attnkit.generate(other, random_ids(80).tolist(), f"expected_attention:stats={stats['llama']},budget=0.5",
                         max_new_tokens=2, stop_at_eos=False)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("spec,match", [("expected_attention:budget=0.5,stats=/nonexistent.safetensors", "does not exist"),
                                        ("expected_attention:budget=0.5,stats={bad}", "not a safetensors file"),
                                        ("expected_attention:budget=0.5,stats=", "stats must be")])
def test_bad_parameters_are_refused_in_one_line(tmp_path, spec, match):
    bad = tmp_path / "bad.safetensors"
    bad.write_text("not tensors")
    with pytest.raises(AttnkitError, match=match) as caught:
        parse_method_spec(spec.format(bad=bad))
    assert "\n" not in str(caught.value)
