"""duo_attention (DuoAttention, Xiao et al. 2024, arXiv 2410.10819): equal to full attention when every head is a
retrieval head or the window covers everything (three architectures); a streaming head holds exactly its sinks and
recent window, a retrieval head everything, in the bytes the flat layer allocates; the outputs equal a dense
reference with per-head masks; the calibration (`attnkit calibrate duo`): its file round-trips, reduces its
objective, is deterministic, and a geometry mismatch is refused; bad parameters and files are one-line errors."""

import json

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit.calibrate.duo import _GateProbe, _hidden, calibrate_duo, dumps_config
from attnkit.cli import main as cli_main
from attnkit.errors import AttnkitError
from attnkit.eval.run.peers import KvpressRunner
from attnkit.forward import forward, logits_of, prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.base import Method
from attnkit.methods.duo_attention import (
    CONFIG_FORMAT,
    duo_config_from_dict,
    load_duo_config,
    select_heads,
    streaming_attention,
)
from attnkit.methods.spec import make_method, parse_method_spec
from attnkit.recipe import peer
from attnkit.session import Step, layer_contexts, new_session
from attnkit.speculative.generate import speculative_generate
from helpers import SMALL, random_ids

torch.set_num_threads(1)

NEW = 12
MIXED = "duo_attention:pattern=RS/SR,sinks=4,recent=16"


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


def gen(model, ids, spec, new=NEW):
    return attnkit.generate(model, ids, spec, max_new_tokens=new, stop_at_eos=False, keep_logits=True)


def worst(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def config_for(model, alpha, retrieval, **extra):
    g = model.geometry
    return {"format": CONFIG_FORMAT, "n_layers": g.n_layers, "n_heads": g.n_q_heads, "n_kv_heads": g.n_kv_heads,
            "layers": [{"alpha": a, "retrieval_heads": r} for a, r in zip(alpha, retrieval)], **extra}


# ---- exactness ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["duo_attention:retrieval_ratio=1", "duo_attention:pattern=RR/RR,sinks=0,recent=0",
                                  "duo_attention:retrieval_ratio=0,recent=200",
                                  "duo_attention:pattern=RS/SR,sinks=2,recent=200,prefill=streaming"])
def test_every_head_retrieval_or_a_covering_window_equals_full(models, arch, spec):
    model, ids = models[arch], random_ids(150, seed=3)
    full, out = gen(model, ids, "full"), gen(model, ids, spec)
    assert out.token_ids == full.token_ids and worst(out, full) < 1e-4
    assert (out.stats.final_kv_bytes, out.stats.peak_kv_bytes) == (full.stats.final_kv_bytes, full.stats.peak_kv_bytes)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_all_streaming_heads_are_streamingllm_with_its_budget(models, arch):
    """Every head streaming: sinks + the recent window + the incoming token is StreamingLLM's cache of B = sinks +
    recent + 1 slots (the same attended set at every decode step), in the same bytes."""
    model, ids = models[arch], random_ids(150, seed=4)
    duo = gen(model, ids, "duo_attention:retrieval_ratio=0,sinks=4,recent=16")
    ref = gen(model, ids, "streaming:budget_tokens=21,sinks=4")
    assert duo.token_ids == ref.token_ids and worst(duo, ref) < 1e-4
    assert duo.stats.final_kv_bytes == ref.stats.final_kv_bytes


class MaskedReference(Method):
    """One forward over prompt + generated tokens, each query head masked by the DuoAttention rule directly:
    retrieval heads causal, streaming heads sinks + p - recent .. p (prompt queries too with prefill=streaming)."""

    name = "duo-reference"

    def __init__(self, retrieval, sinks, recent, prompt_len, streaming_prefill):
        self.retrieval, self.sinks, self.recent = retrieval, sinks, recent
        self.prompt_len, self.streaming_prefill = prompt_len, streaming_prefill

    def prefill_output(self, ctx, q, keys, values, positions):
        pos = positions[0, 0]
        g = q.shape[1] // keys.shape[1]
        causal = masks.boolean_mask(masks.sliding_window(ctx.native_window), ctx.q_pos, pos)
        lam = causal & ((pos[None] < self.sinks) | (ctx.q_pos[:, None] - pos[None] <= self.recent))
        if not self.streaming_prefill:
            lam = lam | (causal & (ctx.q_pos[:, None] < self.prompt_len))
        mask = torch.stack([causal if self.retrieval[ctx.index][h // g] else lam for h in range(q.shape[1])])
        k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None], scale=ctx.scaling)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("prefill_mode", ["full", "streaming"])
def test_outputs_equal_a_dense_reference_with_per_head_masks(models, arch, prefill_mode):
    model, n = models[arch], 90
    ids = random_ids(n, seed=5)
    out = gen(model, ids, f"duo_attention:pattern=RS/SR,sinks=3,recent=10,prefill={prefill_mode}", new=20)
    seq = torch.cat([ids, torch.tensor(out.token_ids[:-1])])
    probe = MaskedReference([[True, False], [False, True]], 3, 10, n, prefill_mode == "streaming")
    with torch.inference_mode():
        hidden = prefill(model, new_session(model, probe, seq.shape[0], 0), seq, all_positions=True)
        ref = logits_of(model, hidden)[n - 1:]
    assert ref.argmax(-1).tolist() == out.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref)) < 1e-4


# ---- what each head holds -------------------------------------------------------------------------------------
def held(session, layer):
    """Per kv head, the sorted positions a flat layer holds."""
    kv = session.cache.layers[layer]
    heads, pos = kv.extras["head"][0, 0, :kv.length].tolist(), kv.positions[0, 0, :kv.length].tolist()
    return [sorted(p for h, p in zip(heads, pos) if h == head) for head in range(2)]


def test_streaming_heads_hold_sinks_and_recent_retrieval_heads_everything(models):
    model, n, sinks, recent = models["llama"], 100, 4, 16
    method = parse_method_spec(MIXED)
    session = new_session(model, method, n, NEW, rows=2)
    ids = torch.stack([random_ids(n, seed=6), random_ids(n, seed=7)])
    retrieval = [[0], [1]]  # RS/SR
    with torch.inference_mode():
        token = logits_of(model, prefill(model, session, ids)).argmax(-1)
        for layer in range(2):
            for h in range(2):
                want = list(range(n)) if h in retrieval[layer] else list(range(sinks)) + list(range(n - recent, n))
                assert held(session, layer)[h] == want
        for step in range(NEW - 1):
            p = n + step
            forward(model, token.view(2, 1), p, lambda pos: Step(session, "decode", pos))
            for layer in range(2):
                kv = session.cache.layers[layer]
                for h in range(2):
                    want = list(range(p + 1)) if h in retrieval[layer] else \
                        list(range(sinks)) + list(range(max(sinks, p - recent), p + 1))
                    assert held(session, layer)[h] == want, (step, layer, h)
                # both rows hold the same positions, each in the same slots
                assert torch.equal(kv.positions[0], kv.positions[1]) and torch.equal(kv.extras["head"][0],
                                                                                     kv.extras["head"][1])
    # bytes: a retrieval head n + generated entries, a streaming head sinks + recent + 1, per layer and row
    entries = 2 * ((n + NEW) + (sinks + recent + 1))
    assert session.cache.kv_nbytes() == 2 * entries * 2 * model.geometry.head_dim * 4  # rows x entries x K, V x d x f32


def test_bytes_fall_with_the_streaming_heads(models):
    model, n = models["llama"], 150
    ids = random_ids(n, seed=8)
    per_entry = 2 * model.geometry.head_dim * 4
    full = gen(model, ids, "full")
    assert full.stats.final_kv_bytes == 2 * 2 * (n + NEW) * per_entry
    for spec, layers in ((MIXED, [(n + NEW) + 21] * 2), ("duo_attention:retrieval_ratio=0,sinks=4,recent=16", [42, 42]),
                         ("duo_attention:pattern=RS/SS,sinks=4,recent=16", [(n + NEW) + 21, 42])):
        out = gen(model, ids, spec)
        assert out.stats.final_kv_bytes == sum(layers) * per_entry, spec
        # the peak: layer 1's whole prompt (2 kv heads x n) beside layer 0 already compacted
        assert out.stats.peak_kv_bytes == (layers[0] + 2 * n) * per_entry


@pytest.mark.parametrize("prefill_mode", ["full", "streaming"])
def test_chunked_prefill_equals_one_chunk(models, prefill_mode):
    model, ids = models["mistral"], random_ids(130, seed=13)
    spec = f"duo_attention:pattern=RS/SR,sinks=4,recent=20,prefill={prefill_mode}"
    one = gen(model, ids, spec)
    chunked = attnkit.generate(model, ids, spec, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True, chunk_size=40)
    assert chunked.token_ids == one.token_ids and worst(chunked, one) < 1e-4


def test_short_prompt_grows_then_rolls(models):
    """A prompt shorter than sinks + recent: the streaming heads keep it all, then fill up to sinks + recent + 1 and
    roll; the tokens equal the dense reference."""
    model, n = models["llama"], 10
    ids = random_ids(n, seed=9)
    out = gen(model, ids, "duo_attention:pattern=SR/RS,sinks=2,recent=12", new=20)
    seq = torch.cat([ids, torch.tensor(out.token_ids[:-1])])
    probe = MaskedReference([[False, True], [True, False]], 2, 12, n, False)
    with torch.inference_mode():
        ref = logits_of(model, prefill(model, new_session(model, probe, seq.shape[0], 0), seq, all_positions=True))
    assert ref[n - 1:].argmax(-1).tolist() == out.token_ids


def test_planned_slots_bound_the_allocation(models):
    model, n = models["llama"], 150
    method = parse_method_spec(MIXED)
    session = new_session(model, method, n, NEW)
    assert [method.planned_slots(ctx) for ctx in layer_contexts(session)] == [-(-(n + NEW + 21) // 2)] * 2


def test_model_generate_with_an_attnkit_cache_equals_attnkit_generate(models):
    model, ids = models["qwen3"], random_ids(120, seed=6)
    ours = gen(model, ids, MIXED)
    cache = AttnkitCache(model, MIXED, max_new_tokens=NEW)
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=2)
    assert out[0, ids.shape[0]:].tolist() == ours.token_ids
    assert cache.nbytes() == ours.stats.final_kv_bytes


def test_composed_with_a_sparse_prefill(models):
    model, ids = models["llama"], random_ids(120, seed=10)
    spec = "a_shape:n_init=16,n_local=32,block_size=16+" + MIXED
    out = gen(model, ids, spec)
    assert out.stats.final_kv_bytes == gen(model, ids, MIXED).stats.final_kv_bytes
    with pytest.raises(AttnkitError, match="duo_attention") as err:
        gen(model, ids, spec + ",prefill=streaming")
    assert "\n" not in str(err.value)


def test_streaming_attention_equals_a_dense_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    pos = torch.arange(70)
    for sinks, recent, window in ((3, 9, None), (0, 0, None), (5, 20, 12), (80, 5, None)):
        out = streaming_attention(q, k, v, 0.3, pos, pos, sinks, recent, window, block=16)
        allowed = masks.boolean_mask(masks.sliding_window(window), pos, pos) & (
            (pos[None] < sinks) | (pos[:, None] - pos[None] <= recent))
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                             attn_mask=allowed, scale=0.3)
        assert (out - ref).abs().max() < 1e-12


# ---- the head choice ------------------------------------------------------------------------------------------
def test_select_heads_by_threshold_and_by_ratio():
    alpha = [[0.9, 0.1], [0.5, 0.3], [0.05, 0.7]]
    assert select_heads(alpha, threshold=0.5) == [[True, False], [True, False], [False, True]]
    assert select_heads(alpha, retrieval_ratio=0.5) == [[True, False], [True, False], [False, True]]
    assert select_heads(alpha, retrieval_ratio=1 / 3) == [[True, False], [False, False], [False, True]]
    assert select_heads(alpha, retrieval_ratio=0.0) == [[False, False]] * 3
    assert select_heads(alpha, retrieval_ratio=1.0) == [[True, True]] * 3
    # equal gates: the lower (layer, head) becomes a streaming head first
    assert select_heads([[0.2, 0.2], [0.2, 0.2]], retrieval_ratio=0.5) == [[False, False], [True, True]]


def test_a_config_deploys_its_choice_or_another_ratio(models):
    model, ids = models["llama"], random_ids(120, seed=11)
    config = config_for(model, [[0.9, 0.2], [0.4, 0.6]], [[0], [1]], sinks=4, recent=16)
    same = gen(model, ids, make_method("duo_attention", config=config))
    assert same.token_ids == gen(model, ids, MIXED).token_ids  # the file's sinks / recent are the defaults
    assert gen(model, ids, make_method("duo_attention", config=config, retrieval_ratio=0.25)).token_ids == \
        gen(model, ids, "duo_attention:pattern=RS/SS,sinks=4,recent=16").token_ids
    assert gen(model, ids, make_method("duo_attention", config=config, threshold=0.3)).token_ids == \
        gen(model, ids, "duo_attention:pattern=RS/RR,sinks=4,recent=16").token_ids


# ---- the calibration ------------------------------------------------------------------------------------------
CAL = dict(length=200, tasks=["passkey"], steps=6, sinks=4, recent=16)


@pytest.fixture(scope="module")
def calibrated(models):
    return calibrate_duo(models["llama"], **CAL)


def test_calibration_reduces_its_objective_and_round_trips(models, calibrated, tmp_path):
    obj = calibrated["objective"]
    assert obj["initial"] == pytest.approx(0.05) and obj["final"] < obj["initial"]  # every gate 1: exactly lambda
    assert obj["history"][-1] < obj["history"][0] and len(obj["history"]) == CAL["steps"]
    path = tmp_path / "duo.json"
    path.write_text(dumps_config(calibrated))
    loaded = load_duo_config(path)
    assert loaded.alpha == [layer["alpha"] for layer in calibrated["layers"]]
    assert loaded.retrieval == [[h in layer["retrieval_heads"] for h in range(2)] for layer in calibrated["layers"]]
    assert (loaded.sinks, loaded.recent, loaded.n_layers, loaded.n_kv_heads) == (4, 16, 2, 2)
    assert json.loads(path.read_text()) == calibrated
    out = gen(models["llama"], random_ids(60, seed=1), f"duo_attention:config={path}")
    assert len(out.token_ids) == NEW


def test_every_gate_open_is_full_attention(models):
    model, ids = models["qwen3"], random_ids(80, seed=2)
    with torch.no_grad():
        full = _hidden(model, ids, _GateProbe(None, 2, 8))
        mixed = _hidden(model, ids, _GateProbe(torch.ones(2, 2), 2, 8))
        closed = _hidden(model, ids, _GateProbe(torch.zeros(2, 2), 2, 8))
    assert torch.equal(full, mixed) and not torch.allclose(full, closed)


def test_calibration_is_deterministic(models, calibrated):
    again = calibrate_duo(models["llama"], **CAL)
    assert dumps_config(again) == dumps_config(calibrated)
    other = calibrate_duo(models["llama"], **dict(CAL, seed=3))
    assert other["prompts"] != calibrated["prompts"]


def test_a_config_of_another_geometry_is_refused(models, calibrated, tmp_path):
    path = tmp_path / "duo.json"
    path.write_text(dumps_config(calibrated))
    other = attnkit.load_model(f"random:llama:{SMALL.replace('layers=2', 'layers=3')}")
    with pytest.raises(AttnkitError, match=r"calibrated for 2 layers x 2 kv heads .* the model has 3 layers") as err:
        gen(other, random_ids(40, seed=1), f"duo_attention:config={path}")
    assert "\n" not in str(err.value)
    fewer_kv = attnkit.load_model(f"random:llama:{SMALL.replace('kv_heads=2', 'kv_heads=1')}")
    with pytest.raises(AttnkitError, match=r"x 1 kv heads") as err:
        gen(fewer_kv, random_ids(40, seed=1), f"duo_attention:config={path}")
    other_heads = dict(calibrated, n_heads=8)  # the same layers and kv heads, twice the query heads
    with pytest.raises(AttnkitError, match=r"\(8 query heads\) but the model has 2 layers x 2 kv heads \(4 query"):
        gen(models["llama"], random_ids(40, seed=1), make_method("duo_attention", config=other_heads))
    with pytest.raises(AttnkitError, match=r"pattern='RS/SR/RR' names 3 layers"):
        gen(models["llama"], random_ids(40, seed=1), "duo_attention:pattern=RS/SR/RR,sinks=2,recent=4")
    with pytest.raises(AttnkitError, match=r"x 3/3 kv heads but the model has 2 layers x 2 kv heads"):
        gen(models["llama"], random_ids(40, seed=1), "duo_attention:pattern=RSS/SRS,sinks=2,recent=4")


def test_cli_calibrate_duo(tmp_path, capsys):
    out = tmp_path / "duo.json"
    rc = cli_main(["calibrate", "duo", "--model", f"random:llama:{SMALL}", "--out", str(out), "--length", "200",
                   "--tasks", "passkey", "--steps", "3", "--sinks", "4", "--recent", "16", "--retrieval-ratio", "0.5"])
    assert rc == 0 and "objective" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["selection"] == {"retrieval_ratio": 0.5} and sum(len(x["retrieval_heads"]) for x in data["layers"]) == 2
    for argv, message in ((["--steps", "0"], "steps must be a whole number >= 1"),
                          (["--retrieval-ratio", "1.5"], "retrieval_ratio must be a number with 0.0 <= x <= 1.0"),
                          (["--sinks", "-1"], "sinks must be a whole number >= 0"),
                          (["--tasks", "nope"], "unknown calibration task 'nope'")):
        assert cli_main(["calibrate", "duo", "--model", f"random:llama:{SMALL}", "--out", str(out), "--length", "200",
                         *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


# ---- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,pattern", [
    ("duo_attention", r"needs its retrieval heads: config=FILE .* got nothing"),
    ("duo_attention:retrieval_ratio=0.5", r"got retrieval_ratio=0.5 \(a ratio between 0 and 1 ranks the gates"),
    ("duo_attention:threshold=0.5", r"got threshold=0.5"),
    ("duo_attention:retrieval_ratio=1.5", r"retrieval_ratio must be a number with 0.0 <= x <= 1.0"),
    ("duo_attention:pattern=RX/SR", r"pattern must give one letter per kv head, R .* got 'RX/SR'"),
    ("duo_attention:pattern=RS/SR,retrieval_ratio=0.5", r"pattern names every head"),
    ("duo_attention:retrieval_ratio=1,threshold=0.5", r"give retrieval_ratio or threshold, not both"),
    ("duo_attention:retrieval_ratio=1,sinks=-2", r"sinks must be a whole number >= 0 \(tokens\), got -2"),
    ("duo_attention:retrieval_ratio=1,recent=1.5", r"recent='1.5' is not a valid int"),
    ("duo_attention:retrieval_ratio=1,prefill=lambda", r"prefill must be one of full, streaming; got 'lambda'"),
    ("duo_attention:config=/no/such/duo.json", r"duo config '/no/such/duo.json' does not exist \(write one with"),
    ("duo_attention:config=x.json,pattern=RS", r"give config or pattern, not both"),
])
def test_bad_parameters_are_one_line_errors(spec, pattern):
    with pytest.raises(AttnkitError, match=pattern) as err:
        parse_method_spec(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,pattern", [
    (lambda c: c.update(format="other"), r"not a duo_attention head config \(format 'other'"),
    (lambda c: c["layers"][0].update(alpha=[0.5]), r"layer 0 needs 'alpha', 2 gates in \[0, 1\]"),
    (lambda c: c["layers"][1].update(alpha=[0.5, 1.5]), r"layer 1 needs 'alpha'"),
    (lambda c: c["layers"][0].update(retrieval_heads=[2]), r"layer 0 'retrieval_heads' must list distinct kv heads 0..1"),
    (lambda c: c["layers"][0].update(retrieval_heads=[0, 0]), r"distinct kv heads"),
    (lambda c: c.update(n_layers=5), r"'n_layers' is 5 but 'layers' lists 2"),
    (lambda c: c.update(n_kv_heads=3), r"'n_kv_heads' must be a positive integer dividing 'n_heads'"),
    (lambda c: c.update(sinks=-1), r"sinks must be a whole number >= 0"),
])
def test_bad_config_files_are_one_line_errors(models, tmp_path, change, pattern):
    config = config_for(models["llama"], [[0.9, 0.2], [0.4, 0.6]], [[0], [1]])
    change(config)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(AttnkitError, match=pattern) as err:
        make_method("duo_attention", config=str(path))
    assert "\n" not in str(err.value)
    with pytest.raises(AttnkitError, match=pattern):
        duo_config_from_dict(config)
    path.write_text("{not json")
    with pytest.raises(AttnkitError, match=r"duo config .* is malformed"):
        make_method("duo_attention", config=str(path))


def test_multi_token_decode_steps_are_refused(models):
    model, n = models["llama"], 100
    session = new_session(model, parse_method_spec(MIXED), n, 4)
    with torch.inference_mode():
        token = int(logits_of(model, prefill(model, session, random_ids(n, seed=4))).argmax())
        with pytest.raises(AttnkitError, match=r"duo_attention decodes one token per step, got 2") as err:
            forward(model, torch.tensor([token, token]), n, lambda p: Step(session, "decode", p))
    assert "\n" not in str(err.value)


def test_cli_generate_refuses_a_bad_spec(capsys):
    assert cli_main(["generate", "--model", f"random:llama:{SMALL}", "--method", "duo_attention:retrieval_ratio=0.3",
                     "--prompt", "hello", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "duo_attention needs its retrieval heads" in err and err.count("\n") == 1


def test_speculative_draft_with_duo_attention_is_lossless(models):
    """A self-speculation draft cache with streaming heads (one token per draft forward, rolled back by snapshot):
    greedy output equals plain generation."""
    model, ids = models["llama"], random_ids(100, seed=2)
    plain = attnkit.generate(model, ids, "full", max_new_tokens=12, stop_at_eos=False)
    out = speculative_generate(model, ids, "self", draft="duo_attention:pattern=RS/SR,sinks=4,recent=8", gamma=3,
                               max_new_tokens=12, stop_at_eos=False)
    assert out.token_ids == plain.token_ids and out.stats.drafted_tokens > 0


# ---- side by side with kvpress's DuoAttentionPress ------------------------------------------------------------
def kvpress_prompts(model, n=256):
    from attnkit.eval.data.task_registry import TASKS

    prompts = {"random": [0] + random_ids(n - 1, seed=12).tolist()}
    for task in ("passkey", "code_completion", "needle_heldout"):
        prompts[task] = model.tokenizer(TASKS[task].make(model.tokenizer, n, seed=0).prompt).input_ids
    return prompts


@pytest.mark.skipif(peer.kvpress_python() is None, reason="kvpress is not installed (.venv-kvpress)")
def test_same_kept_positions_as_kvpress_duo_attention_press(models):
    """kvpress's DuoAttentionPress given the same heads (scores 1 retrieval / 0 streaming), sinks and window: after
    the prompt every (layer, kv head) keeps (kvpress: leaves unmasked) the same positions, and the first decode step
    attends to the same sets, on four kinds of prompt. From the second step on the streaming heads differ by design:
    kvpress keeps every generated token, attnkit rolls the window (docs/methods.md, duo_attention)."""
    model, sinks, recent, new = models["llama"], 8, 32, 4
    runner = KvpressRunner(model, threads=1)
    try:
        for kind, ids in kvpress_prompts(model).items():
            press = {"kind": "duo", "head_compression_ratio": 0.5, "head_scores": [[1.0, 0.0], [0.0, 1.0]],
                     "sink_size": sinks, "recent_size": recent}
            theirs = runner.worker.request({"case": {"prompt": ids, "new_tokens": new, "press": press}, "mode": "trace"})
            session = new_session(model, parse_method_spec(f"duo_attention:pattern=RS/SR,sinks={sinks},recent={recent}"),
                                  len(ids), new)
            with torch.inference_mode():
                token = int(logits_of(model, prefill(model, session, torch.tensor(ids))).argmax())
                ours_prefill = {str(i): held(session, i) for i in range(2)}
                ours_steps = []
                for step in range(new - 1):
                    hidden = forward(model, torch.tensor([token]), len(ids) + step,
                                     lambda p, s=session: Step(s, "decode", p))
                    token = int(logits_of(model, hidden).argmax())
                    ours_steps.append({str(i): held(session, i) for i in range(2)})
            assert theirs["after_prefill"] == ours_prefill, kind
            assert theirs["attended"][0] == ours_steps[0], kind
            n = len(ids)
            for layer, streaming in (("0", 1), ("1", 0)):  # kvpress: the prompt's window and every generated token
                assert theirs["attended"][2][layer][streaming] == list(range(sinks)) + list(range(n - recent, n + 3))
                assert ours_steps[2][layer][streaming] == list(range(sinks)) + list(range(n + 2 - recent, n + 3))
                assert theirs["attended"][2][layer][1 - streaming] == ours_steps[2][layer][1 - streaming]
    finally:
        runner.close()
