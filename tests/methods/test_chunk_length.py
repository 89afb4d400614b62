"""``chunk_length`` (ChunkKV: Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", arXiv 2502.00299) on every prompt scorer: exactly full at an unlimited budget on every
architecture, in a batch and through ``AttnkitCache``; at a small budget the kept positions are whole chunks (the
protected entries and one chunk cut to the budget aside), equal to a plain recomputation on hand-made tensors, at
the prompt and at every ``decode_every`` re-compression; a batch equals its prompts alone; bad values refused in
one line."""

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.calibrate.qfilter import calibrate_qfilter
from attnkit.forward import prefill
from attnkit.hf_cache import AttnkitCache
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.qfilter import dumps_filters
from attnkit.methods.spec import METHODS, parse_method_spec
from attnkit.session import layer_contexts, new_session
from helpers import assert_equals_full, drive, qkv, random_ids
from test_batch import assert_batch_equals_alone
from test_hf_cache import hf_batch

torch.set_num_threads(1)

NEW = 8
ARCHS = ["llama", "mistral", "qwen3"]
# every prompt scorer, with what lets it compress a prompt of about a hundred tokens
SCORERS = {"snapkv": "window_size=8", "knorm": "", "keydiff": "", "expected_attention": "", "kvzip": "",
           "kvzap": "window=8", "rkv": "window_size=4", "triattention": "window_size=4", "random": "seed=5",
           "lagkv": "lag_size=16", "cur": "", "cap": "",
           # leverage: in the first layer a repeated token's keys tie up to rounding, which a batch changes; the default
           # 48-column sketch, batched with decode_every=3, breaks one such tie the other way (docs/methods.md)
           "observed_attention": "", "leverage": "sketch_dimension=8", "non_causal_attention": "chunk_size=32",
           "compactor": "chunk_size=32", "finch": "question_tokens=8,positions=original", "qfilter": "",
           "kvgrad": "chunk_size=32"}
# the prompt scorers whose trained files choose every kv head's count once (restorekv: add trained entries after the
# compression): they refuse chunk_length
NO_CHUNKS = {"fastkvzip", "lukv", "restorekv"}
# the entries each one never evicts when the prompt of n tokens is compressed
PROTECTED = {"snapkv": lambda n: range(n - 8, n), "finch": lambda n: range(n - 8, n),
             "expected_attention": lambda n: range(4),
             "kvzip": lambda n: range(4), "cap": lambda n: range(4),
             "kvzap": lambda n: range(n - 8, n), "rkv": lambda n: range(n - 4, n),
             "triattention": lambda n: range(n - 4, n), "compactor": lambda n: [*range(8), *range(n - 4, n)]}
# the ones model.generate can host (kvzip runs a forward of its own after the prompt: attnkit.generate only)
HF_HOSTED = [name for name in SCORERS if METHODS[name].run_layers is None]


@pytest.fixture(scope="module")
def models(arch_models):
    return arch_models


@pytest.fixture(scope="module")
def configs(kvzap_configs, triattention_configs, arch_models, tmp_path_factory):
    """The calibration files of the scorers that need one, by method and architecture."""
    folder = tmp_path_factory.mktemp("qfilter")
    qfilter = {}
    for arch, model in arch_models.items():
        qfilter[arch] = folder / f"{arch}.json"
        qfilter[arch].write_text(dumps_filters(calibrate_qfilter(model, samples=2, length=96)))
    return {"kvzap": kvzap_configs, "triattention": triattention_configs, "qfilter": qfilter}


def spec(name: str, params: str, configs, arch: str = "llama") -> str:
    own = SCORERS[name] + (f",config={configs[name][arch]}" if name in configs else "")
    return f"{name}:" + ",".join(p for p in (own, params) if p)


def test_every_prompt_scorer_is_covered():
    assert {n for n, cls in METHODS.items() if issubclass(cls, PromptScorer)} == set(SCORERS) | NO_CHUNKS


@pytest.mark.parametrize("spec", ["fastkvzip:config=gates.safetensors,budget=0.3,chunk_length=8",
                                  "lukv:curve=curve.npy,budget=0.3,chunk_length=8",
                                  "restorekv:config=restore.safetensors,budget=0.3,chunk_length=8"])
def test_scorers_of_trained_counts_refuse_chunks_in_one_line(spec):
    with pytest.raises(AttnkitError, match=r"chunk_length=8 is not supported") as err:
        parse_method_spec(spec)
    assert "\n" not in str(err.value)


# ---- unlimited budget: exactly full ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_unlimited_budget_equals_full_in_a_batch(models, configs, arch, name):
    prompts = [random_ids(n, seed=30 + i).tolist() for i, n in enumerate((90, 61, 90))]
    for params in ("budget_tokens=200,chunk_length=7", "budget=1.0,chunk_length=16"):
        assert_equals_full(models[arch], prompts, parse_method_spec(spec(name, params, configs, arch)), NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unlimited_budget_through_attnkit_cache_equals_full(models, configs, arch):
    model = models[arch]
    prompts = [random_ids(n, seed=40 + i) for i, n in enumerate((70, 55, 70))]
    full = [attnkit.generate(model, p, "full", max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
            for p in prompts]
    for name in HF_HOSTED:
        method = parse_method_spec(spec(name, "budget_tokens=200,chunk_length=5", configs, arch))
        tokens, logits = hf_batch(model, prompts, AttnkitCache(model, method, max_new_tokens=NEW), new_tokens=NEW)
        for row, ours in enumerate(full):
            assert tokens[row] == ours.token_ids, (name, row)
            assert max((a - b).abs().max().item() for a, b in zip(logits[row], ours.logits)) < 1e-4, (name, row)


# ---- small budget: whole chunks ----------------------------------------------------------------------------------
def kept_after_prompt(model, method, ids):
    session = new_session(model, method, ids.shape[-1], 4)
    with torch.inference_mode():
        prefill(model, session, ids)
    budgets = [method.layer_budget(ctx) for ctx in layer_contexts(session)]
    return [[sorted(row.tolist()) for row in layer.view()[2][0]] for layer in session.cache.layers], budgets


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_small_budget_keeps_whole_chunks(models, configs, arch, name):
    """Every kv head of every layer holds exactly its budget: the protected entries, the chunks holding them and
    other whole chunks, and at most one chunk cut short; a budget of whole chunks over a prompt the chunk divides
    holds whole chunks only."""
    n, c = 96, 8
    ids = random_ids(n, seed=7)
    protected = set(PROTECTED.get(name, lambda n: ())(n))
    for params in ("budget_tokens=40", "budget_tokens=37", "budget=0.3"):
        method = parse_method_spec(spec(name, f"{params},chunk_length={c}", configs, arch))
        kept, budgets = kept_after_prompt(models[arch], method, ids)
        budget = budgets[0]
        assert budgets == [budget] * len(kept) and budget < n
        for layer in kept:
            for held in layer:
                assert len(held) == budget and protected <= set(held)
                members = {}
                for p in held:
                    members.setdefault(p // c, set()).add(p)
                cut = [j for j, m in members.items() if not set(range(j * c, (j + 1) * c)) <= m]
                assert len(cut) <= (0 if budget % c == 0 else 1), (params, held)
                assert all(set(range(j * c, min(n, (j + 1) * c))) <= set(held) for j in {p // c for p in protected})


def chunk_reference(scores: dict, protected: set, budget: int, c: int) -> list[int]:
    """The kept positions: `protected`, then chunks (positions // c), those holding a protected position first, by
    the mean of their held members' `scores` (ties: the earlier chunk), each chunk's members by score, until
    `budget`."""
    chunks = {}
    for p in scores:
        chunks.setdefault(p // c, []).append(p)
    order = sorted(chunks, key=lambda j: (not protected & set(chunks[j]),
                                          -sum(scores[p] for p in chunks[j]) / len(chunks[j]), j))
    kept = list(protected)
    for j in order:
        for p in sorted(chunks[j], key=lambda p: -scores[p]):
            if len(kept) < budget and p not in kept:
                kept.append(p)
    return sorted(kept)


@pytest.mark.parametrize("c", [1, 4, 7])
def test_prompt_and_recompressions_equal_a_plain_recomputation(c):
    """knorm (score ``-||k||``) on hand-made keys, a prompt of 50 and 12 tokens decoded with decode_every=4: after the
    prompt and after every re-compression each kv head holds what :func:`chunk_reference` keeps from what it held."""
    prompt, budget, every = 50, 18, 4
    q, k, v = qkv(prompt + 12, seed=5)
    _, _, held = drive(parse_method_spec(f"knorm:budget_tokens={budget},chunk_length={c},decode_every={every}"),
                       q, k, v, prompt)
    for h in range(k.shape[1]):
        score = {p: -k[0, h, p].double().norm().item() for p in range(prompt + 12)}
        before = list(range(prompt))
        for step, now in enumerate(held):
            assert now[h] == chunk_reference({p: score[p] for p in before}, set(), budget, c) if step % every == 0 \
                else before, (c, step)
            before = now[h] + [prompt + step]
    if c == 1:  # chunks of one entry: the entries of highest score, as without chunks
        _, _, plain = drive(parse_method_spec(f"knorm:budget_tokens={budget},decode_every={every}"), q, k, v, prompt)
        assert held == plain


def test_snapkv_window_stays_and_the_rest_is_chunks():
    prompt, budget, c = 60, 24, 8
    q, k, v = qkv(prompt + 2, seed=9)
    _, _, held = drive(parse_method_spec(f"snapkv:budget_tokens={budget},window_size=6,chunk_length={c}"),
                       q, k, v, prompt)
    for kept in held[0]:
        rest = [p for p in kept if p < prompt - 6]
        assert len(kept) == budget and set(range(prompt - 6, prompt)) <= set(kept)
        # the window (54-59) and the rest of its chunks (48-53; 56-59 is the prompt's last, partial chunk), then 12
        # slots: one whole chunk and one cut to its best 4
        assert set(range(48, prompt)) <= set(kept)
        chunks = sorted({p // c for p in rest})
        assert len(chunks) == 3 and sum(1 for j in chunks if not set(range(j * c, (j + 1) * c)) <= set(kept)) == 1


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_small_budget_batch_equals_alone(models, configs, name):
    # they score the prompt once
    once = ("kvzip", "observed_attention", "non_causal_attention", "compactor", "finch", "kvgrad")
    every = "" if name in once else ",decode_every=3"
    for params in ("budget_tokens=40,chunk_length=8", f"budget=0.3,chunk_length=5{every}"):
        assert_batch_equals_alone(models["llama"], spec(name, params, configs))
    if name == "snapkv":  # the prompt in chunks, then a rolling window of generated tokens
        assert_batch_equals_alone(models["llama"], spec(name, "budget_tokens=40,decode_budget=4,chunk_length=8", configs))


def test_small_budget_through_attnkit_cache_equals_attnkit_generate(models, configs):
    model = models["llama"]
    prompts = [random_ids(n, seed=50 + i) for i, n in enumerate((90, 70, 90))]
    for name in HF_HOSTED:
        method = parse_method_spec(spec(name, "budget_tokens=32,chunk_length=6", configs))
        cache = AttnkitCache(model, method, max_new_tokens=NEW)
        tokens, logits = hf_batch(model, prompts, cache, new_tokens=NEW)
        for row, prompt in enumerate(prompts):
            alone = attnkit.generate(model, prompt, method, max_new_tokens=NEW, stop_at_eos=False, keep_logits=True)
            assert tokens[row] == alone.token_ids, (name, row)
            assert max((a - b).abs().max().item() for a, b in zip(logits[row], alone.logits)) < 1e-4, (name, row)
            assert max(cache.kept_lengths(row)) < len(prompt)


# ---- what is refused ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, match", [
    ({"chunk_length": -1}, "chunk_length must be a whole number >= 0 .*got -1"),
    ({"chunk_length": 2.5}, "chunk_length must be a whole number .*got 2.5"),
    ({"chunk_length": "x"}, "chunk_length.*x"),
    ({"chunk_length": 8, "head_budgets": "adaptive"}, "chunk_length=8 .*head_budgets=adaptive is not supported"),
])
@pytest.mark.parametrize("name", ["snapkv", "knorm", "kvzip"])
def test_bad_values_are_refused_in_one_line(name, params, match):
    with pytest.raises(AttnkitError, match=match) as info:
        attnkit.make_method(name, budget=0.3, **params)
    assert "\n" not in str(info.value)


def test_kvzap_threshold_refuses_it(configs):
    with pytest.raises(AttnkitError, match="chunk_length=8 applies to a budget") as info:
        parse_method_spec(f"kvzap:config={configs['kvzap']['llama']},threshold=-3,chunk_length=8")
    assert "\n" not in str(info.value)
