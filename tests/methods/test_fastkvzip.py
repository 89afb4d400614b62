"""fastkvzip (Fast KVzip, arXiv 2601.17668): gates in kvpress's torch format (randomly initialised) and attnkit's
safetensors (trained here) score the same; at an unlimited budget exactly full on every architecture, batched; the
kept entries after the prompt equal a plain recomputation of the paper's gate (float64, token by token) and
kvpress's rule (sinks and window protected; the best across every layer and kv head, or across each layer's kv
heads with layerwise=true; any choice among equal scores at the boundary); through transformers' generate
(AttnkitCache) the same tokens; gates trained on tiny rank KVzip's entries far better than untrained ones; bad
parameters, foreign gates and vLLM refused in one line."""

import math

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.fastkvzip import calibrate_fastkvzip, held_out_fit, init_gate
from attnkit.calibrate.kvzap import collect, text_windows
from attnkit.cli import main
from attnkit.forward import prefill
from attnkit.methods.fastkvzip_gates import NAMES, load_gates, save_gates, save_kvpress_format
from attnkit.methods.spec import parse_method_spec
from attnkit.session import new_session
from attnkit.vllm.plan import check_supported
from helpers import assert_attnkit_cache_equals_generate, assert_equals_full, random_ids

torch.set_num_threads(1)

NEW = 8


def random_gates(model, seed: int, sinks: int = 16, dim: int = 16) -> list[dict]:
    """Gates as kvpress's FastKVzipGate would hold them, every tensor drawn at random (a spread of scores)."""
    g = torch.Generator().manual_seed(seed)
    geo = model.geometry
    hidden, heads, group = model.hf.config.hidden_size, geo.n_kv_heads, geo.n_q_heads // geo.n_kv_heads

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return [{"q_proj.weight": draw(heads * group * dim, hidden, scale=0.3), "q_proj.bias": draw(heads * group * dim),
             "k_proj.weight": draw(heads * dim, hidden, scale=0.3), "q_norm.weight": 1 + draw(dim, scale=0.2),
             "k_norm.weight": 1 + draw(dim, scale=0.2), "k_base": draw(heads, 1, sinks, dim),
             "b": draw(heads, 1, group)} for _ in range(geo.n_layers)]


@pytest.fixture(scope="module")
def gate_files(arch_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fastkvzip")
    return {arch: str(save_kvpress_format(folder / f"{arch}.pt", random_gates(model, seed=i)))
            for i, (arch, model) in enumerate(arch_models.items())}


def spec(gate_files, arch, params):
    return parse_method_spec(f"fastkvzip:config={gate_files[arch]},{params}")


def reference_gate(w: dict, x: torch.Tensor) -> torch.Tensor:
    """The paper's gate, in float64, written out head by head: ``[H, n]`` for inputs ``[n, D]``."""
    w = {k: v.double() for k, v in w.items()}
    x = x.double()
    heads, _, sinks, d = w["k_base"].shape
    group = w["b"].shape[-1]

    def rms(t, scale):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * scale

    q = rms((x @ w["q_proj.weight"].T + w["q_proj.bias"]).reshape(-1, heads, group, d), w["q_norm.weight"])
    k = rms((x @ w["k_proj.weight"].T).reshape(-1, heads, d), w["k_norm.weight"])
    out = torch.zeros(heads, x.shape[0], dtype=torch.float64)
    for h in range(heads):
        for g in range(group):
            own = (q[:, h, g] * k[:, h]).sum(-1) / math.sqrt(d) + w["b"][h, 0, g]
            base = q[:, h, g] @ w["k_base"][h, 0].T / math.sqrt(d)  # [n, S]
            out[h] += torch.exp(own) / (torch.exp(own) + torch.exp(base).sum(-1)) / group
    return out


def layer_inputs(model, ids):
    with torch.no_grad():
        hidden = model.hf(ids[None], output_hidden_states=True).hidden_states
    return [layer.input_layernorm(hidden[i])[0] for i, layer in enumerate(model.hf.model.layers)]


def held(layer) -> list[set]:
    """Per kv head, the positions a flat layer holds."""
    heads = layer.extras["head"][0, 0, :layer.length]
    pos = layer.positions[0, 0, :layer.length]
    return [set(pos[heads == h].tolist()) for h in range(int(heads.max()) + 1)]


# ---- files ------------------------------------------------------------------------------------------------------
def test_both_formats_hold_the_same_gates_and_score_alike(arch_models, tmp_path):
    model = arch_models["llama"]
    layers = random_gates(model, seed=7)
    pt = load_gates(save_kvpress_format(tmp_path / "g.pt", layers))
    st = load_gates(save_gates(tmp_path / "g.safetensors", layers, {"model": "x"}))
    x = torch.randn(1, 30, model.hf.config.hidden_size)
    for i in range(len(layers)):
        assert torch.equal(pt.scores(i, x), st.scores(i, x))
        assert torch.allclose(pt.scores(i, x)[0].double(), reference_gate(layers[i], x[0]), atol=1e-5)
    half = torch.load(tmp_path / "g.pt")  # the published gates are bfloat16: read and upcast
    torch.save({"module": [{k: v.bfloat16() for k, v in w.items()} for w in half["module"]], "loss": [0.1]},
               tmp_path / "bf16.pt")
    assert load_gates(tmp_path / "bf16.pt").layers[0]["k_base"].dtype == torch.float32


# ---- exactly full where nothing is dropped ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("params", ["budget=1.0", "budget=1.0,layerwise=true", "budget_tokens=400"])
def test_unlimited_budget_equals_full_batched(arch_models, gate_files, arch, params):
    prompts = [random_ids(n, seed=n).tolist() for n in (150, 97, 150)]
    assert_equals_full(arch_models[arch], prompts, spec(gate_files, arch, params), NEW)


# ---- which entries stay -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_kept_entries_are_the_best_gate_scores(arch_models, gate_files, arch, layerwise):
    model, ids, budget = arch_models[arch], random_ids(160, seed=3), 40
    n, n_sink, window = ids.shape[0], 4, max(1, int(160 * 0.02))
    method = spec(gate_files, arch, f"budget_tokens={budget},layerwise={str(layerwise).lower()}")
    session = new_session(model, method, n, 1)
    with torch.inference_mode():
        prefill(model, session, ids)
    gates = torch.load(gate_files[arch])["module"]
    scores = []
    for i, x in enumerate(layer_inputs(model, ids)):
        s = reference_gate(gates[i], x)
        s[:, :n_sink] = s[:, n - window:] = math.inf
        scores.append(s)
    heads = scores[0].shape[0]
    groups = [[s] for s in scores] if layerwise else [scores]  # what competes: each layer alone, or all of them
    counts = []
    for group in groups:
        values = torch.cat([s.reshape(-1) for s in group])
        bar = values.topk(len(group) * heads * budget).values[-1]  # the lowest score kept
        for s in group:
            i = next(j for j, t in enumerate(scores) if t is s)
            kept = held(session.cache.layers[i])
            for h in range(heads):
                above = set(torch.nonzero(s[h] > bar).flatten().tolist())
                at = set(torch.nonzero(s[h] == bar).flatten().tolist())  # ties at the bar (equal tokens): any
                assert above <= kept[h] <= above | at, (i, h)
            counts.append([len(k) for k in kept])
        assert sum(map(sum, counts[-len(group):])) == len(group) * heads * budget
    if not layerwise:  # across layers: the counts differ between layers and heads
        assert len({c for row in counts for c in row}) > 1
    out = attnkit.generate(model, ids, method, max_new_tokens=NEW, stop_at_eos=False)
    assert 0 < out.stats.method_stats["fastkvzip_kept_fraction"] < 1


@pytest.mark.parametrize("params", [{"budget_tokens": 40}, {"budget": 0.3, "layerwise": True}])
def test_attnkit_cache_equals_generate(arch_models, gate_files, params):
    assert_attnkit_cache_equals_generate(arch_models["llama"], random_ids(130, seed=4), "fastkvzip",
                                         dict(params, config=gate_files["llama"]), NEW)


# ---- training ---------------------------------------------------------------------------------------------------
def test_gates_trained_on_tiny_rank_kvzip_entries(tmp_path):
    """Trained on 4 windows of 256 tokens (300 SGD steps), the gates' top 30 % holds far more of kvzip's top 30 % on
    held-out text than untrained gates do (chance: 0.3); the command writes a file the method reads."""
    model = attnkit.load_model("tiny")
    layers, meta = calibrate_fastkvzip(model, samples=4, length=256, heldout=2, steps=300, batch_size=256)
    trained = sum(f["kept_overlap"] for f in meta["heldout"]["layers"]) / len(layers)
    xs, logs = collect(model, text_windows(model, "heldout", 2, 256, seed=0), lambda _: None)
    geo = model.geometry
    fresh = [init_gate(xs[0].shape[1], geo.n_kv_heads, geo.n_q_heads // geo.n_kv_heads, 16, 16,
                       torch.Generator().manual_seed(0)) for _ in xs]
    untrained = sum(held_out_fit(w, x, y.exp(), 2)["kept_overlap"] for w, x, y in zip(fresh, xs, logs)) / len(xs)
    assert trained > 0.42 and trained > untrained + 0.08, (trained, untrained)
    path = save_gates(tmp_path / "g.safetensors", layers, meta)
    out = attnkit.generate(model, random_ids(200, seed=1), f"fastkvzip:config={path},budget=0.3", max_new_tokens=4)
    assert len(out.token_ids) == 4
    assert main(["calibrate", "fastkvzip", "--model", "tiny", "--samples", "1", "--length", "128", "--heldout", "1",
                 "--steps", "5", "--out", str(tmp_path / "cli.safetensors")]) == 0
    assert load_gates(tmp_path / "cli.safetensors").n_layers == geo.n_layers


# ---- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, message", [
    ("budget=0.3", "needs config=FILE"),
    ("config=/nonexistent.pt,budget=0.3", "does not exist"),
    ("CONFIG,budget=0.3,decode_every=2", "decode_every=2 is not supported"),
    ("CONFIG,budget=0.3,head_budgets=adaptive", "head_budgets='adaptive' is not supported"),
    ("CONFIG,budget=0.3,window_ratio=2", "window_ratio"),
    ("CONFIG,budget=0.3,layerwise=maybe", "layerwise"),
    ("CONFIG", "budget"),
])
def test_bad_parameters_are_refused_in_one_line(gate_files, params, message):
    with pytest.raises(AttnkitError, match=message) as err:
        parse_method_spec("fastkvzip:" + params.replace("CONFIG", f"config={gate_files['llama']}"))
    assert "\n" not in str(err.value)


def test_budgets_the_protected_entries_fill_and_foreign_gates_are_refused(arch_models, gate_files, tmp_path):
    model = arch_models["llama"]
    with pytest.raises(AttnkitError, match="fill the 5-slot budget") as err:
        attnkit.generate(model, random_ids(150), spec(gate_files, "llama", "budget_tokens=5"), max_new_tokens=2)
    assert "\n" not in str(err.value)
    tiny = attnkit.load_model("tiny")
    with pytest.raises(AttnkitError, match="holds gates for") as err:
        attnkit.generate(tiny, random_ids(150), spec(gate_files, "llama", "budget=0.3"), max_new_tokens=2)
    assert "\n" not in str(err.value)
    broken = torch.load(gate_files["llama"])
    del broken["module"][1]["b"]
    torch.save(broken, tmp_path / "broken.pt")
    (tmp_path / "text.pt").write_text("not a file of gates")
    for name, message in (("broken.pt", "layer 1's gate holds"), ("text.pt", "neither")):
        with pytest.raises(AttnkitError, match=message) as err:
            parse_method_spec(f"fastkvzip:config={tmp_path / name},budget=0.3")
        assert "\n" not in str(err.value)
    layers = random_gates(model, seed=1)
    other = save_gates(tmp_path / "other.safetensors", layers, {"model": "m", "fingerprints": [1.0] * len(layers)})
    with pytest.raises(AttnkitError, match="not this model's") as err:
        attnkit.generate(model, random_ids(150), f"fastkvzip:config={other},budget=0.3", max_new_tokens=2)
    assert "\n" not in str(err.value)
    assert NAMES[-1] == "b"


def test_vllm_refuses_it_in_one_line(gate_files):
    with pytest.raises(AttnkitError, match="gates choose across kv heads") as err:
        check_supported(spec(gate_files, "llama", "budget=0.3,layerwise=true"), "recipe")
    assert "\n" not in str(err.value)
