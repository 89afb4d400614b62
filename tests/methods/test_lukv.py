"""lukv (LU-KV, arXiv 2602.08585): curves in kvpress's .npy and attnkit's safetensors read alike; at an unlimited
budget exactly full on every architecture, batched; each layer's and kv head's kept entries equal a plain
recomputation of kvpress's rule (the curve's row for 1 - B/n, counts rounded as kvpress does, sinks and window
first, then Expected Attention's best); through transformers' generate (AttnkitCache) the same tokens; the profile's
convex-hull relaxation and greedy allocation against brute force; the committed tiny curve is tiny's shape; bad
parameters, curves of another geometry and vLLM refused in one line."""

import itertools

import numpy as np
import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.lukv import _ScoreRecorder, hull_costs, pair_curve
from attnkit.cli import main
from attnkit.forward import prefill
from attnkit.methods.lukv import load_curve, save_curve
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from attnkit.vllm.plan import check_supported
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, random_ids

torch.set_num_threads(1)

NEW = 8


def random_curve(layers: int, heads: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [np.clip((i + 1) / 100 + rng.normal(0, 0.15, (layers, heads)), 0, 0.99) for i in range(99)]
    return np.stack(rows).astype(np.float32)


@pytest.fixture(scope="module")
def curves(arch_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lukv")
    out = {}
    for i, (arch, model) in enumerate(arch_models.items()):
        np.save(folder / f"{arch}.npy", random_curve(model.geometry.n_layers, model.geometry.n_kv_heads, i))
        out[arch] = str(folder / f"{arch}.npy")
    return out


def spec(curves, arch, params):
    return parse_method_spec(f"lukv:curve={curves[arch]},{params}")


# ---- files and exactness ----------------------------------------------------------------------------------------
def test_npy_and_safetensors_hold_the_same_curve(curves, tmp_path):
    array = np.load(curves["llama"])
    st = load_curve(save_curve(tmp_path / "c.safetensors", array, {"model": "m"}))
    assert torch.equal(st.curve, load_curve(curves["llama"]).curve) and st.meta == {"model": "m"}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("params", ["budget=1.0", "budget_tokens=400"])
def test_unlimited_budget_equals_full_batched(arch_models, curves, arch, params):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, spec(curves, arch, params), NEW)


# ---- which entries stay -----------------------------------------------------------------------------------------
def plain_counts(prune: list[float], n: int) -> list[int]:
    """kvpress's rounding, in plain Python over float32 values."""
    ideal = [float(np.float32(min(1.0, max(0.0, float(np.float32(1.0) - np.float32(p))))) * np.float32(n))
             for p in prune]
    total = int(np.round(np.float32(sum(np.float32(x) for x in ideal))))
    total = min(len(prune) * n, max(len(prune), total))
    counts = [int(np.floor(x)) for x in ideal]
    rest = total - sum(counts)
    for h in sorted(range(len(prune)), key=lambda h: -(ideal[h] - counts[h]))[:max(0, rest)]:
        counts[h] += 1
    return [min(n, max(1, c)) for c in counts]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("budget", [40, 90])
def test_each_head_keeps_its_curve_count_of_protected_then_best_scored(arch_models, curves, arch, budget):
    model, ids = arch_models[arch], random_ids(150, seed=11)
    n, sink, window = ids.shape[0], 4, 1
    recorder = _ScoreRecorder(epsilon=0.02, budget_tokens=5)  # expected_attention's scores, as lukv's rank sees them
    session = new_session(model, recorder, n, 0)
    with torch.inference_mode():
        prefill(model, session, ids)
    method = spec(curves, arch, f"budget_tokens={budget}")
    ours = new_session(model, method, n, 1)
    with torch.inference_mode():
        prefill(model, ours, ids)
    curve = np.load(curves[arch])
    row = max(0, min(98, int(round((1 - budget / n) * 100)) - 1))
    sizes = []
    for i, layer in enumerate(ours.cache.layers):
        counts = plain_counts(curve[row, i].tolist(), n)
        heads = layer.extras["head"][0, 0, :layer.length]
        pos = layer.positions[0, 0, :layer.length]
        for h, count in enumerate(counts):
            score = session.state.scores[i][h].tolist()
            protected = [p for p in range(n) if p < sink or p >= n - window]
            rest = sorted((p for p in range(n) if p not in protected), key=lambda p: (-score[p], p))
            assert set(pos[heads == h].tolist()) == set((protected + rest)[:count]), (i, h)
        sizes += counts
    assert len(set(sizes)) > 1  # the curve gives heads and layers different counts
    out = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False)
    assert out.stats.final_kv_bytes < attnkit.generate(model, ids, "full", max_new_tokens=NEW,
                                                       stop_at_eos=False).stats.final_kv_bytes


def test_attnkit_cache_equals_generate(arch_models, curves):
    assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(130, seed=4), "lukv",
                                         {"curve": curves["llama"], "budget": 0.3}, NEW)


# ---- the profile ------------------------------------------------------------------------------------------------
def test_hull_costs_are_the_lower_convex_hull_of_the_cumulative_loss():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lost = rng.exponential(size=12) * (rng.random(12) < 0.6)
        costs = hull_costs(lost)
        cum, hull = np.concatenate([[0], np.cumsum(lost)]), np.concatenate([[0], np.cumsum(costs)])
        assert np.all(np.diff(costs) >= -1e-12) and abs(hull[-1] - cum[-1]) < 1e-9
        assert np.all(hull <= cum + 1e-9)
        for a, b in itertools.combinations(range(13), 2):  # no chord of the cumulative loss passes below the hull
            for x in range(a, b + 1):
                assert hull[x] <= cum[a] + (cum[b] - cum[a]) * (x - a) / (b - a) + 1e-9


def test_pair_curve_takes_the_cheapest_evictions_across_layers_and_heads():
    """Utilities that already fall with the scorer's ranking (so the hull changes nothing): at every level the
    evictions taken are the globally cheapest, each head keeping at least sink + window and 1 %."""
    rng = np.random.default_rng(1)
    layers, heads, n, sink, window = 2, 3, 40, 2, 1
    scores = rng.random((layers, heads, n))
    utility = np.zeros_like(scores)
    for lay, h in itertools.product(range(layers), range(heads)):
        utility[lay, h] = np.argsort(np.argsort(scores[lay, h])) * rng.uniform(0.1, 3.0) / n  # monotone in score
    curve = pair_curve(utility, scores, sink, window)
    assert curve.shape == (99, layers, heads)
    mid = [sorted(utility[lay, h, sink:n - window]) for lay, h in itertools.product(range(layers), range(heads))]
    for level in (10, 40, 80, 99):
        target = int(round(level / 100 * layers * heads * n))
        candidates = sorted((c, u) for u, costs in enumerate(mid) for c in costs)[:target]
        expected = np.bincount([u for _, u in candidates], minlength=layers * heads).reshape(layers, heads) / n
        assert np.allclose(curve[level - 1], expected), level
    assert np.all(curve[-1] <= 1 - (sink + window) / n + 1e-12)


def test_the_committed_tiny_curve_and_the_command(tmp_path):
    tiny = attnkit.load_model("tiny")
    committed = load_curve("sweeps/lukv_tiny.safetensors")
    committed.check_model(tiny.geometry.n_layers, tiny.geometry.n_kv_heads)
    kept = 1 - committed.curve.mean(dim=(1, 2))
    assert torch.allclose(kept, 1 - torch.arange(1, 100) / 100, atol=0.02)  # each row prunes about its share
    assert main(["calibrate", "lukv", "--model", "tiny", "--tasks", "passkey", "--samples", "1", "--length", "160",
                 "--new-tokens", "4", "--out", str(tmp_path / "c.safetensors"), "--npy", str(tmp_path / "c.npy")]) == 0
    assert torch.equal(load_curve(tmp_path / "c.safetensors").curve, load_curve(tmp_path / "c.npy").curve)
    out = attnkit.generate(tiny, random_ids(200), f"lukv:curve={tmp_path / 'c.npy'},budget=0.3", max_new_tokens=3)
    assert len(out.token_ids) == 3


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, message", [
    ("budget=0.3", "needs curve=FILE"),
    ("curve=/nonexistent.npy,budget=0.3", "does not exist"),
    ("CURVE,budget=0.3,decode_every=2", "decode_every=2 is not supported"),
    ("CURVE,budget=0.3,head_budgets=adaptive", "head_budgets='adaptive' is not supported"),
    ("CURVE,budget=0.3/0.5", "one budget"),
    ("CURVE,budget=0.3,sink=-1", "sink"),
])
def test_bad_parameters_are_refused_in_one_line(curves, params, message):
    with pytest.raises(AttnkitError, match=message) as err:
        parse_method_spec("lukv:" + params.replace("CURVE", f"curve={curves['llama']}"))
    assert "\n" not in str(err.value)


def test_bad_curves_and_vllm_are_refused_in_one_line(arch_models, curves, tmp_path):
    np.save(tmp_path / "flat.npy", np.zeros((99, 2), dtype=np.float32))
    (tmp_path / "text.npy").write_text("no array")
    for name, message in (("flat.npy", r"float array \[99, layers, kv heads\]"), ("text.npy", "neither")):
        with pytest.raises(AttnkitError, match=message) as err:
            parse_method_spec(f"lukv:curve={tmp_path / name},budget=0.3")
        assert "\n" not in str(err.value)
    np.save(tmp_path / "wide.npy", random_curve(5, 2, 0))
    with pytest.raises(AttnkitError, match="curve for 5 layers") as err:
        attnkit.generate(arch_models["llama"], random_ids(150), f"lukv:curve={tmp_path / 'wide.npy'},budget=0.3",
                         max_new_tokens=2)
    assert "\n" not in str(err.value)
    with pytest.raises(AttnkitError, match="differs per kv head") as err:
        check_supported(spec(curves, "llama", "budget=0.3"), "recipe")
    assert "\n" not in str(err.value)
