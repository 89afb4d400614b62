"""Batches through attnkit.generate: every method gives each prompt of a batch exactly the tokens (and, within
tolerance, the logits) of that prompt alone, at an unlimited budget and at a small one; sequences stay
independent (budgets per prompt, rows that finish leave the batch); bad input is refused in one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError, generation
from attnkit.calibrate.kvzap import calibrate_kvzap
from attnkit.calibrate.triattention import calibrate_triattention
from attnkit.cli import main
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.budget import resolve_budget
from attnkit.methods.kvzap_predictor import save_predictor
from attnkit.methods.spec import METHODS, parse_method_spec
from attnkit.methods.triattention_stats import dumps_stats
from attnkit.session import Step, new_session
from helpers import SMALL, per_token_bytes, random_ids

torch.set_num_threads(1)

NEW = 10
# lengths: two pairs of equal lengths (rows of one session) and one alone (a session of its own)
LENGTHS = (130, 95, 130, 160, 95)

UNLIMITED = [
    "snapkv:budget=1.0,window_size=8,then=knorm:budget=1.0",
    "think:key_channels=0", "snapkv:budget_tokens=400+think:key_channels=0",
    "finch:budget_tokens=400,question_tokens=8", "simlayerkv:lazy_threshold=1.0,n_recent=16",
    "knorm:budget_tokens=400,chunk_length=8,low_entropy_chunk_length=2",
    "full", "window:window=400", "streaming:budget_tokens=400", "h2o:budget_tokens=400",
    "keyformer:budget_tokens=400", "keyformer:score=shared,budget_tokens=400", "snapkv:budget_tokens=400",
    "minference:k_v=0,k_s=400", "a_shape:n_init=200,n_local=200,block_size=16",
    "minference:pattern=block_sparse,k_b=20,block_size=16",
    "share:config=none", "select:filter_layer=1,p_decode=1.0", "gemfilter:filter_layer=1,k=400",
    "minference:k_v=0,k_s=400+h2o:budget_tokens=400", "h2o:budget_tokens=8000,layer_budgets=pyramid",
    "knorm:budget_tokens=400", "keydiff:budget_tokens=400,decode_every=2", "tova:budget_tokens=400",
    "random:budget_tokens=400,decode_every=2", "lagkv:budget_tokens=400,lag_size=16",
    "cur:budget_tokens=400,sketch=8", "observed_attention:budget_tokens=400",
    "leverage:budget_tokens=400,decode_every=2", "non_causal_attention:budget_tokens=400,chunk_size=32",
    "compactor:budget_tokens=400,chunk_size=32",
    "cap:budget_tokens=400", "cap:budget_tokens=400,decode_every=2", "kvcompose:budget=1.0",
    "kvcompose:budget_tokens=400,structured=false",
    "snapkv:budget_tokens=400,window_size=8,decode_every=3", "rkv:budget_tokens=400,window_size=4,decode_every=3",
    "expected_attention:budget_tokens=400", "expected_attention:budget_tokens=400,decode_every=2",
    "knorm:budget_tokens=400,head_budgets=adaptive",
    "duo_attention:retrieval_ratio=1", "duo_attention:pattern=RS/SR,sinks=4,recent=400,prefill=streaming",
    "kivi:residual=1000", "snapkv:budget_tokens=400+kivi:bits=2,residual=1000",
    "minference:k_v=0,k_s=400+h2o:budget_tokens=400+kivi:residual=1000",
    "kvzip:budget_tokens=400", "kvzip:budget_tokens=400,head_budgets=adaptive",
    "kvgrad:budget_tokens=400,chunk_size=64",
    "quest:token_budget=400,dense_layers=0", "quest:budget=1.0,dense_layers=1,per_query_head=true",
    "h2o:budget_tokens=400,decode_every=8", "tova:budget_tokens=400,decode_every=3",
    "keyformer:score=shared,budget_tokens=400,decode_every=4",
    "knorm:budget_tokens=400,merge=true", "cam:budget_tokens=400,decode_every=2",
    "knorm:score_threshold=-inf,threshold_decode=true", "snapkv:budget_tokens=400,window_size=8,positions=reindexed",
]
SMALL_BUDGET = [
    "snapkv:budget_tokens=60,window_size=8,then=keydiff:budget=0.5",
    "snapkv:budget_tokens=40,window_size=8,criticalkv=true",
    "knorm:budget_tokens=32,criticalkv=true,head_budgets=adaptive",
    "knorm:budget_tokens=32,segment_length=20", "snapkv:budget_tokens=40,window_size=8,block_size=16",
    "knorm:score_threshold=-0.5,threshold_window=16,threshold_decode=true", "keydiff:budget_tokens=32,positions=reindexed",
    "keydiff:budget=0.3,decode_every=3,decode_fraction=0.25",
    "think:key_channels=0.5", "snapkv:budget_tokens=40,window_size=8+think:key_channels=0.5,window_size=16",
    "finch:budget_tokens=32,question_tokens=8", "finch:budget=0.3,question_tokens=8,positions=original",
    "simlayerkv:lazy_threshold=0,n_recent=24", "simlayerkv:lazy_threshold=0.5,n_recent=40,n_last=3",
    "snapkv:budget_tokens=40,window_size=8,chunk_length=8,low_entropy_chunk_length=2",
    "window:window=32", "streaming:budget_tokens=32", "h2o:budget_tokens=32", "h2o:budget=0.3",
    "keyformer:budget_tokens=32", "keyformer:score=shared,budget=0.4", "snapkv:budget_tokens=40,window_size=8",
    "snapkv:budget=0.4,window_size=8", "minference:k_v=4,k_s=16", "a_shape:n_init=16,n_local=32,block_size=16",
    "select:filter_layer=0,p_decode=0.5", "gemfilter:filter_layer=0,k=24",
    "a_shape:n_init=16,n_local=32,block_size=16+snapkv:budget_tokens=40,window_size=8",
    "h2o:budget_tokens=40,layer_budgets=pyramid", "snapkv:budget=0.4,window_size=8,layer_budgets=pyramid",
    "knorm:budget_tokens=32", "knorm:budget=0.3,decode_every=1", "keydiff:budget_tokens=32,decode_every=4",
    "keydiff:budget=0.3", "tova:budget_tokens=32", "tova:budget=0.3", "random:budget=0.3,decode_every=4",
    "lagkv:budget=0.3,lag_size=16", "lagkv:budget_tokens=32,lag_size=8,decode_every=4,cross_scoring=true",
    "cur:budget=0.3", "cur:budget_tokens=32,leverage=kv_avg,local_window=0,decode_every=3", "cur:budget=0.3,sketch=8",
    "observed_attention:budget=0.3", "observed_attention:budget_tokens=32,head_budgets=adaptive",
    "leverage:budget=0.3", "leverage:budget_tokens=32,sketch_dimension=0,decode_every=3",
    "non_causal_attention:budget=0.3,chunk_size=32", "compactor:budget_tokens=32,chunk_size=24",
    "compactor:budget=0.3,head_budgets=adaptive",
    "cap:budget=0.3", "cap:budget_tokens=32,decode_every=3,tau=2.0", "kvcompose:budget=0.3",
    "kvcompose:budget_tokens=32,structured=false",
    "snapkv:budget_tokens=40,window_size=8,decode_every=3", "rkv:budget_tokens=40,window_size=8,decode_every=3",
    "rkv:budget=0.4", "expected_attention:budget_tokens=32", "expected_attention:budget=0.3,decode_every=3",
    "snapkv:budget_tokens=40,window_size=8,head_budgets=adaptive", "knorm:budget_tokens=32,head_budgets=adaptive",
    "keydiff:budget=0.3,head_budgets=adaptive", "expected_attention:budget_tokens=32,head_budgets=adaptive",
    "duo_attention:pattern=RS/SR,sinks=4,recent=16", "duo_attention:retrieval_ratio=0,sinks=2,recent=24",
    "duo_attention:pattern=SR/SS,sinks=4,recent=16,prefill=streaming",
    "kivi:bits=4,residual=16,group=8", "h2o:budget_tokens=32+kivi:bits=2,residual=8,group=8",
    "streaming:budget_tokens=32+kivi:residual=8,group=8", "tova:budget=0.3+kivi:residual=8,group=8",
    "knorm:budget_tokens=32,head_budgets=adaptive+kivi:residual=8,group=8",
    "a_shape:n_init=16,n_local=32,block_size=16+snapkv:budget_tokens=40,window_size=8+kivi:bits=2,residual=8,group=8",
    "kvzip:budget_tokens=32", "kvzip:budget=0.3,chunk_size=48",
    "kvgrad:budget_tokens=32,chunk_size=48", "kvgrad:budget=0.3,head_budgets=adaptive,alpha_safeguard=0",
    "kvzip:budget_tokens=32,chunk_size=64,head_budgets=adaptive,alpha_safeguard=0",
    "quest:token_budget=32,dense_layers=0", "quest:budget=0.3,page_size=8,dense_layers=1,per_query_head=true",
    "h2o:budget_tokens=32,decode_every=8", "h2o:budget_tokens=40,layer_budgets=pyramid,decode_every=5",
    "tova:budget=0.3,decode_every=3", "keyformer:budget_tokens=32,decode_every=4",
    "keyformer:score=shared,budget=0.4,decode_every=3",
    "snapkv:budget_tokens=40,window_size=8,decode_every=3,merge=true,merge_fraction=0.5",
    "cam:budget_tokens=32,decode_every=3,merge_budget=8",
]


@pytest.fixture(scope="module")
def models():
    return {"llama": attnkit.load_model(f"random:llama:{SMALL}"),
            "mistral": attnkit.load_model(f"random:mistral:{SMALL},sliding_window=64"),
            "qwen3": attnkit.load_model(f"random:qwen3:{SMALL}")}


def prompts(seed=0):
    return [random_ids(n, seed=seed + i).tolist() for i, n in enumerate(LENGTHS)]


def assert_batch_equals_alone(model, spec, **options):
    method = parse_method_spec(spec)
    batch_prompts = prompts()
    batch = attnkit.generate(model, batch_prompts, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True,
                             **options)
    assert len(batch) == len(batch_prompts)
    for i, (prompt, out) in enumerate(zip(batch_prompts, batch)):
        alone = attnkit.generate(model, prompt, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True,
                                 **options)
        assert out.token_ids == alone.token_ids, (spec, i)
        worst = max((a - b).abs().max().item() for a, b in zip(out.logits, alone.logits))
        assert worst < 1e-4, (spec, i, worst)
        assert out.stats.prompt_tokens == len(prompt) and out.stats.batch_size == len(batch_prompts)
        if "kivi" in spec and "residual=1000" not in spec:
            # kivi's key-group table is one tensor per layer, sized by the batch row (and kv head) with the most
            # living groups and compacted when full: a row's share of it differs from its table alone
            for held in ("final_kv_bytes", "peak_kv_bytes"):
                assert abs(getattr(out.stats, held) / getattr(alone.stats, held) - 1) < 0.1, (spec, i, held)
            continue
        assert (out.stats.final_kv_bytes, out.stats.peak_kv_bytes) == (alone.stats.final_kv_bytes,
                                                                       alone.stats.peak_kv_bytes), (spec, i)
    return batch


@pytest.mark.parametrize("spec", UNLIMITED)
def test_unlimited_budget_batch_equals_alone_and_full(models, spec):
    model = models["llama"]
    batch = assert_batch_equals_alone(model, spec)
    full = attnkit.generate(model, prompts(), "full", max_new_tokens=NEW, stop_at_eos=False)
    assert [b.token_ids for b in batch] == [f.token_ids for f in full]


def test_every_registered_method_is_covered():
    named = {part.split(":")[0] for spec in UNLIMITED + SMALL_BUDGET for part in spec.split("+")}
    # compose: "A+B"; static, kvzap, triattention (they read a calibration file): below; qfilter (it reads one too):
    # tests/methods/test_qfilter.py, batched
    # fastkvzip, lukv (they read trained gates / a budget curve): test_fastkvzip_and_lukv_from_files
    # restorekv (it reads trained restore weights): tests/methods/test_restorekv.py, batched
    assert set(METHODS) - {"compose", "minference_static", "kvzap", "triattention", "qfilter", "fastkvzip",
                           "lukv", "restorekv"} <= named


def test_static_patterns_from_a_file(models, tmp_path):
    """minference_static reads its per-head indices from a calibration file (written here by the command)."""
    path = tmp_path / "static.json"
    assert main(["calibrate", "patterns", "--model", f"random:llama:{SMALL}", "--length", "256", "--flops-budget",
                 "0.5", "--block-size", "16", "--tasks", "passkey", "--samples", "1", "--static",
                 "--out", str(path)]) == 0
    assert_batch_equals_alone(models["llama"], f"minference_static:config={path},compile=false")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_kvzap_from_a_trained_surrogate(models, arch, tmp_path):
    """kvzap reads a surrogate trained for the model (`attnkit calibrate kvzap`'s training, a few hundred tokens)."""
    layers, meta = calibrate_kvzap(models[arch], samples=2, length=96, heldout=1)
    path = save_predictor(tmp_path / "kvzap.safetensors", "linear", layers, meta)
    for params in ("budget_tokens=400", "threshold=-inf", "budget_tokens=32,window=8",
                   "budget=0.3,window=4,decode_every=3", "threshold=-3,window=16"):
        batch = assert_batch_equals_alone(models[arch], f"kvzap:config={path},{params}")
        if "400" in params or "inf" in params:
            full = attnkit.generate(models[arch], prompts(), "full", max_new_tokens=NEW, stop_at_eos=False)
            assert [b.token_ids for b in batch] == [f.token_ids for f in full]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_triattention_from_calibrated_statistics(models, arch, tmp_path):
    """triattention reads the model's query statistics (`attnkit calibrate triattention`'s, a few hundred tokens)."""
    path = tmp_path / "triattention.json"
    path.write_text(dumps_stats(calibrate_triattention(models[arch], samples=2, length=96)))
    for params in ("budget_tokens=400", "budget_tokens=32,window_size=8", "budget=0.3,window_size=4,decode_every=3"):
        batch = assert_batch_equals_alone(models[arch], f"triattention:config={path},{params}")
        if "400" in params:
            full = attnkit.generate(models[arch], prompts(), "full", max_new_tokens=NEW, stop_at_eos=False)
            assert [b.token_ids for b in batch] == [f.token_ids for f in full]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_fastkvzip_and_lukv_from_files(models, arch, tmp_path):
    """fastkvzip reads gates (`attnkit calibrate fastkvzip`'s training, a few steps), lukv a budget curve (any
    [99, layers, kv heads] array); unlimited budgets give full's tokens, small ones each prompt's alone."""
    import numpy as np

    from attnkit.calibrate.fastkvzip import calibrate_fastkvzip
    from attnkit.methods.fastkvzip_gates import save_gates
    model = models[arch]
    layers, meta = calibrate_fastkvzip(model, samples=2, length=96, heldout=1, steps=20, batch_size=64)
    gates = save_gates(tmp_path / "gates.safetensors", layers, meta)
    geo = model.geometry
    rows = np.linspace(0.01, 0.99, 99, dtype=np.float32)[:, None, None]
    np.save(tmp_path / "curve.npy", np.clip(rows + np.linspace(-0.1, 0.1, geo.n_layers * geo.n_kv_heads).reshape(
        1, geo.n_layers, geo.n_kv_heads), 0, 0.99).astype(np.float32))
    full = attnkit.generate(model, prompts(), "full", max_new_tokens=NEW, stop_at_eos=False)
    for method in (f"fastkvzip:config={gates},budget_tokens=400", f"fastkvzip:config={gates},budget=1.0,layerwise=true",
                   f"lukv:curve={tmp_path / 'curve.npy'},budget_tokens=400"):
        batch = assert_batch_equals_alone(model, method)
        assert [b.token_ids for b in batch] == [f.token_ids for f in full]
    for method in (f"fastkvzip:config={gates},budget_tokens=40", f"fastkvzip:config={gates},budget=0.3,layerwise=true",
                   f"lukv:curve={tmp_path / 'curve.npy'},budget=0.3"):
        assert_batch_equals_alone(model, method)


@pytest.mark.parametrize("spec", SMALL_BUDGET)
def test_small_budget_batch_equals_alone(models, spec):
    assert_batch_equals_alone(models["llama"], spec)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
@pytest.mark.parametrize("spec", ["full", "h2o:budget_tokens=32", "snapkv:budget=0.4,window_size=8",
                                  "streaming:budget_tokens=400", "keyformer:score=shared,budget_tokens=32",
                                  "tova:budget_tokens=32", "knorm:budget_tokens=32",
                                  "keydiff:budget_tokens=32,decode_every=3",
                                  "snapkv:budget_tokens=40,window_size=8,decode_every=2",
                                  "expected_attention:budget_tokens=32,decode_every=2",
                                  "duo_attention:pattern=RS/SR,sinks=4,recent=16",
                                  "h2o:budget_tokens=32+kivi:bits=4,residual=8,group=8",
                                  "kvzip:budget_tokens=32,chunk_size=64"])
def test_other_architectures(models, arch, spec):
    assert_batch_equals_alone(models[arch], spec)


def test_chunked_prefill_and_sampling_batch_equal_alone(models):
    assert_batch_equals_alone(models["llama"], "h2o:budget_tokens=32", chunk_size=40)
    assert_batch_equals_alone(models["llama"], "kvzip:budget_tokens=32,chunk_size=64", chunk_size=40)
    model = models["llama"]
    batch = attnkit.generate(model, prompts(), "h2o", params={"budget_tokens": 32}, max_new_tokens=NEW,
                             stop_at_eos=False, do_sample=True, seed=7, temperature=1.3)
    for i, out in enumerate(batch):  # prompt i samples with seed 7 + i
        alone = attnkit.generate(model, prompts()[i], "h2o", params={"budget_tokens": 32}, max_new_tokens=NEW,
                                 stop_at_eos=False, do_sample=True, seed=7 + i, temperature=1.3)
        assert out.token_ids == alone.token_ids


def test_fractional_budget_is_a_fraction_of_each_prompt(models):
    model = models["llama"]
    batch = attnkit.generate(model, prompts(), "h2o", params={"budget": 0.5}, max_new_tokens=NEW, stop_at_eos=False)
    per_token = per_token_bytes(model)
    expected = [resolve_budget(0.5, None, 0, 2, n) for n in LENGTHS]
    assert [b.stats.final_kv_bytes // per_token for b in batch] == expected
    assert len(set(expected)) == 3


def test_a_finished_row_leaves_its_session_and_the_others_go_on(models):
    """Dropping the middle row of a 3-row session mid-generation leaves rows 0 and 2 exactly as alone."""
    model = models["llama"]
    for spec in ("h2o:budget_tokens=32", "keyformer:score=shared,budget_tokens=32", "snapkv:budget_tokens=40,window_size=8",
                 "snapkv:budget_tokens=40,window_size=8,decode_every=3", "tova:budget_tokens=32",
                 "expected_attention:budget_tokens=32,decode_every=3", "h2o:budget_tokens=32+kivi:residual=4,group=4",
                 "kvzip:budget_tokens=32,chunk_size=40"):
        method = parse_method_spec(spec)
        ids = torch.stack([random_ids(90, seed=s) for s in (1, 2, 3)])
        session = new_session(model, method, 90, 12, rows=3)
        tokens = []
        with torch.inference_mode():
            token = logits_of(model, prefill(model, session, ids)[:, -1]).argmax(-1)
            for i in range(12):
                tokens.append(token)
                if i == 4:
                    session.keep_rows([0, 2])
                    token = token[[0, 2]]
                    assert session.cache.rows == 2 and session.cache.layers[0].positions.shape[0] == 2
                hidden = forward(model, token[:, None], 90 + i, lambda p, s=session: Step(s, "decode", p))
                token = logits_of(model, hidden[:, -1]).argmax(-1)
        rows = [[int(t[r]) for t in tokens[:5]] + [int(t[j]) for t in tokens[5:]] for r, j in ((0, 0), (2, 1))]
        for r, got in zip((0, 2), rows):
            alone = attnkit.generate(model, ids[r], method, max_new_tokens=12, stop_at_eos=False)
            assert got == alone.token_ids, spec


def test_stops_are_per_sequence(models):
    model = models["llama"]
    ps = prompts()
    alone = [attnkit.generate(model, p, "full", max_new_tokens=NEW, stop_at_eos=False) for p in ps]
    stop = alone[1].text[2:4]  # a stop string prompt 1 meets early; the others may or may not
    batch = attnkit.generate(model, ps, "full", max_new_tokens=NEW, stop_at_eos=False, stop=stop)
    for p, out in zip(ps, batch):
        single = attnkit.generate(model, p, "full", max_new_tokens=NEW, stop_at_eos=False, stop=stop)
        assert (out.text, out.token_ids, out.stats.finish_reason) == (single.text, single.token_ids,
                                                                      single.stats.finish_reason)
    assert batch[1].stats.finish_reason == "stop"


def test_input_forms(models):
    model = models["llama"]
    ids = torch.stack([random_ids(40, seed=s) for s in range(3)])
    from_tensor = attnkit.generate(model, ids, "full", max_new_tokens=4, stop_at_eos=False)
    from_lists = attnkit.generate(model, ids.tolist(), "full", max_new_tokens=4, stop_at_eos=False)
    assert [g.token_ids for g in from_tensor] == [g.token_ids for g in from_lists]
    texts = attnkit.generate(model, ["a b c", "hello there, world"], "full", max_new_tokens=3, stop_at_eos=False)
    assert isinstance(texts, list) and len(texts) == 2
    single = attnkit.generate(model, ids[0].tolist(), "full", max_new_tokens=4, stop_at_eos=False)
    assert single.token_ids == from_lists[0].token_ids
    streamed = []
    attnkit.generate(model, ids.tolist(), "full", max_new_tokens=4, stop_at_eos=False,
                     on_token=lambda i, t, text: streamed.append((i, t)))
    assert sorted({i for i, _ in streamed}) == [0, 1, 2]
    assert [t for i, t in streamed if i == 2] == from_lists[2].token_ids


@pytest.mark.parametrize("prompt,pattern", [
    ([], r"batch of prompts is empty"),
    (["some text", [5, 6, 7]], r"mixes texts and token ids \(prompt 0 is text, prompt 1 is ids\)"),
    ([[5, 6], []], r"prompt 1 is empty"),
    ([[5, 6], [5, 999]], r"token id 999 in prompt 1 is outside the vocabulary"),
    ([[5, 6], [5, 1.5]], r"whole numbers, got 1.5 in prompt 1"),
    ([[5] * 10, [5] * 5000], r"prompt 1 has 5000 tokens; model .* allows at most 4096"),
])
def test_bad_batches(models, prompt, pattern):
    with pytest.raises(AttnkitError, match=pattern):
        attnkit.generate(models["llama"], prompt, "full", max_new_tokens=2)


def test_parameters_that_do_not_fit_one_prompt_are_refused_before_any_work(models):
    # snapkv's observation window (32) must fit the budget: 0.3 of the 95-token prompts is 29 slots
    with pytest.raises(AttnkitError, match=r"prompts 1, 4 \(95 tokens\): .*observation window \(32 tokens\) "
                                           r"does not fit in the 29-slot budget"):
        attnkit.generate(models["llama"], prompts(), "snapkv", params={"budget": 0.3}, max_new_tokens=2)


def test_a_batch_that_cannot_fit_in_memory_is_refused(models, monkeypatch):
    import attnkit.runner as runner
    model = models["llama"]
    need = sum(n + 4 for n in LENGTHS) * per_token_bytes(model)
    monkeypatch.setattr(runner, "available_memory", lambda device: need - 1)
    with pytest.raises(AttnkitError, match=r"a batch of 5 prompts needs about .* GiB of KV cache with full.*smaller batch"):
        attnkit.generate(model, prompts(), "full", max_new_tokens=4)
    # a budget that fits: h2o keeps 32 slots per sequence
    out = attnkit.generate(model, prompts(), "h2o", params={"budget_tokens": 32}, max_new_tokens=4, stop_at_eos=False)
    assert len(out) == 5
    assert generation.available_memory("cpu") > 0
