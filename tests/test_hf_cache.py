"""AttnkitCache: attnkit methods inside transformers' own `model.generate`, same tokens as attnkit.generate."""

import threading

import pytest
import torch

import attnkit
from attnkit import AttnkitError
from attnkit.hf_cache import AttnkitCache
from helpers import SMALL, random_ids

torch.set_num_threads(1)

N = 25

CASES = [
    ("full", {}),
    ("streaming", {"budget_tokens": 40}),
    ("streaming", {"budget_tokens": 40, "positions": "reindex"}),
    ("h2o", {"budget_tokens": 40}),
    ("h2o", {"budget": 0.3, "gqa_reduce": "max"}),
    ("keyformer", {"budget_tokens": 40}),
    ("keyformer", {"budget_tokens": 40, "score": "shared", "noise": "gaussian"}),
    ("keyformer", {"budget": 0.3, "positions": "new"}),
    ("h2o", {"budget_tokens": 40, "decode_every": 8}),
    ("tova", {"budget_tokens": 40, "decode_every": 3}),
    ("keyformer", {"budget_tokens": 40, "score": "shared", "decode_every": 4}),
    ("snapkv", {"budget_tokens": 40, "window_size": 8, "decode_budget": 10}),
    ("rkv", {"budget_tokens": 40, "decode_every": 5}),
    ("quest", {"token_budget": 48, "dense_layers": 1}),
    ("duo_attention", {"retrieval_ratio": 0.0, "sinks": 4, "recent": 16}),
]


def hf_generate(model, ids, cache, new_tokens=N, **kwargs):
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True,
                            **kwargs)
    return out.sequences[0, ids.shape[0]:].tolist(), [lg[0] for lg in out.logits]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return attnkit.load_model(f"random:{request.param}:{SMALL}")


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in CASES])
def test_model_generate_equals_attnkit_generate(model, name, params):
    ids = random_ids(150, seed=3)
    ours = attnkit.generate(model, ids, name, params=params, max_new_tokens=N, stop_at_eos=False, keep_logits=True)
    cache = AttnkitCache(model, name, params=params, max_new_tokens=N)
    tokens, logits = hf_generate(model, ids, cache)
    assert tokens == ours.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(logits, ours.logits)) < 1e-4
    # positions stay original: the cache reports every token seen while holding only the kept ones
    assert cache.get_seq_length() == 150 + N - 1
    assert cache.nbytes() == ours.stats.final_kv_bytes
    if name not in ("full", "quest"):  # quest keeps every entry (each step reads some)
        assert max(cache.kept_lengths()) < 150


def test_full_cache_equals_transformers_dynamic_cache(model):
    ids = random_ids(120, seed=4)
    ref = model.hf.generate(ids[None], max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=2)
    tokens, _ = hf_generate(model, ids, AttnkitCache(model, "full", max_new_tokens=N))
    assert tokens == ref[0, 120:].tolist()


def test_sampling_and_reset(model):
    ids = random_ids(100, seed=5)
    cache = AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=10)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=10, do_sample=True, top_k=20,
                                eos_token_id=None, pad_token_id=2)
        runs.append(out[0, 100:].tolist())
        cache.reset()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("second", [20, 200], ids=["shorter", "longer"])
def test_a_used_cache_asks_for_reset(model, second):
    """A second generate on a used cache, with a prompt shorter than what it holds (generate then cuts the prompt
    to nothing) or longer, is one line that says to reset it; after reset() it generates the new prompt's tokens."""
    cache = AttnkitCache(model, "snapkv", params={"budget": 0.5}, max_new_tokens=5)
    model.hf.generate(random_ids(100, seed=7)[None], past_key_values=cache, max_new_tokens=5, do_sample=False,
                      eos_token_id=None, pad_token_id=2)
    ids = random_ids(second, seed=8)
    with pytest.raises(AttnkitError, match=r"cache\.reset\(\)") as info:
        model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=5, do_sample=False, eos_token_id=None,
                          pad_token_id=2)
    assert "\n" not in str(info.value)
    cache.reset()
    tokens, _ = hf_generate(model, ids, cache, new_tokens=5)
    assert tokens == attnkit.generate(model, ids, "snapkv", params={"budget": 0.5}, max_new_tokens=5,
                                      stop_at_eos=False).token_ids


def test_threads_do_not_mix(model):
    ids = random_ids(90, seed=6)
    expected = attnkit.generate(model, ids, "keyformer", params={"budget_tokens": 30}, max_new_tokens=12,
                                stop_at_eos=False).token_ids
    results = {}

    def work(i):
        cache = AttnkitCache(model, "keyformer", params={"budget_tokens": 30}, max_new_tokens=12)
        results[i] = hf_generate(model, ids, cache, new_tokens=12)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: expected, 1: expected}


def test_errors(model):
    ids = random_ids(60, seed=7)
    sdpa_model = attnkit.load_model(f"random:llama:{SMALL}")
    sdpa_model.hf.set_attn_implementation("sdpa")
    with pytest.raises(AttnkitError, match="attn_implementation='sdpa'.*'attnkit'"):
        AttnkitCache(sdpa_model, "h2o", params={"budget_tokens": 30}, max_new_tokens=5)
    with pytest.raises(AttnkitError, match="max_new_tokens must be the generation length"):
        AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=0)
    with pytest.raises(AttnkitError, match="recent window larger than the budget"):
        AttnkitCache(model, "h2o", params={"budget_tokens": 30, "recent_tokens": 31}, max_new_tokens=5)
    with pytest.raises(AttnkitError, match="method 'kvzip' runs the decoder layers itself .* use attnkit.generate"):
        AttnkitCache(model, "kvzip", params={"budget_tokens": 30}, max_new_tokens=5)  # its reconstruction forward
    with pytest.raises(AttnkitError, match="built for max_new_tokens=5"):
        hf_generate(model, ids, AttnkitCache(model, "h2o", params={"budget_tokens": 30}, max_new_tokens=5),
                    new_tokens=9)
    with pytest.raises(AttnkitError, match="one token per forward"):
        hf_generate(model, ids, AttnkitCache(model, "full", max_new_tokens=5), new_tokens=5, prefill_chunk_size=16)
    cache = AttnkitCache(model, "full", max_new_tokens=5)
    model.hf(torch.stack([ids, ids]), past_key_values=cache)
    with pytest.raises(AttnkitError, match="batch of 3 rows but the prompt had 2"):
        model.hf(torch.stack([ids[:1]] * 3), past_key_values=cache)


# ---- a padded batch --------------------------------------------------------------------------------------
LENGTHS = [37, 20, 37, 28]  # rows 0 and 2 share a session without being neighbours
SPARSE = {"k_v": 4, "k_s": 8, "block_size": 16, "compile": False}


def share_config(model):
    """Share-Attention clusters for the small model: query head 1 reuses head 0's map, head 3 head 2's."""
    g = model.geometry
    layer = {"essential_heads": [0, 2], "share_to": {"1": 0, "3": 2}}
    return {"n_layers": g.n_layers, "n_heads": g.n_q_heads, "n_kv_heads": g.n_kv_heads, "layers": [layer] * g.n_layers}


BATCH_CASES = [  # (method, params, whether the rows' caches end holding fewer tokens than they saw)
    ("full", {}, False),
    ("window", {"window": 12}, True),
    ("streaming", {"budget_tokens": 12}, True),
    ("streaming", {"budget_tokens": 100}, False),
    ("h2o", {"budget_tokens": 12}, True),
    ("h2o", {"budget_tokens": 100, "gqa_reduce": "max"}, False),
    ("keyformer", {"budget_tokens": 12}, True),
    ("keyformer", {"budget_tokens": 100, "positions": "new"}, False),
    ("h2o", {"budget_tokens": 12, "decode_every": 4}, True),
    ("tova", {"budget_tokens": 12, "decode_every": 3}, True),
    ("tova", {"budget_tokens": 100, "decode_every": 4}, False),
    ("keyformer", {"budget_tokens": 12, "score": "shared", "decode_every": 2}, True),
    ("snapkv", {"budget_tokens": 12, "window_size": 4, "decode_budget": 4}, True),
    ("snapkv", {"budget": 1.0, "window_size": 4}, False),
    ("rkv", {"budget_tokens": 12, "window_size": 4, "decode_every": 3}, True),
    ("rkv", {"budget_tokens": 100}, False),
    ("quest", {"token_budget": 32, "dense_layers": 0}, False),  # every entry kept; each step reads 32 of them
    ("a_shape", {"n_init": 4, "n_local": 8, "block_size": 16, "compile": False}, False),
    ("minference", SPARSE, False),
    ("compose", {"prefill": "minference:k_v=4,k_s=8,block_size=16,compile=false",
                 "cache": "snapkv:budget_tokens=12,window_size=4"}, True),
    ("share", "config", False),
    ("duo_attention", {"retrieval_ratio": 0.0, "sinks": 2, "recent": 6}, True),
    ("duo_attention", {"pattern": "RS/SR", "sinks": 4, "recent": 100, "prefill": "streaming"}, False),
]


def left_padded(prompts: list[torch.Tensor], pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch and its 2-D attention mask, as a tokenizer with padding_side="left" makes them."""
    width = max(p.shape[0] for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - p.shape[0],), pad), p]) for p in prompts])
    mask = torch.stack([(torch.arange(width) >= width - p.shape[0]).long() for p in prompts])
    return ids, mask


def hf_batch(model, prompts, cache, new_tokens=N, **kwargs):
    """Each row's new tokens and per-step logits from transformers' generate on the left-padded batch."""
    ids, mask = left_padded(prompts)
    kwargs.setdefault("do_sample", False)
    out = model.hf.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                            eos_token_id=None, pad_token_id=2, output_logits=True, return_dict_in_generate=True,
                            **kwargs)
    rows = out.sequences.shape[0]
    return ([out.sequences[r, ids.shape[1]:].tolist() for r in range(rows)],
            [[lg[r] for lg in out.logits] for r in range(rows)])


@pytest.mark.parametrize("name,params,evicts", BATCH_CASES,
                         ids=[f"{n}-{'-'.join(map(str, p.values())) if isinstance(p, dict) else p}" for n, p, _ in BATCH_CASES])
def test_a_padded_batch_gives_each_row_its_prompt_alone(model, name, params, evicts):
    """Prompts of different lengths, left padded in one batch through transformers' generate: every row gets
    exactly the tokens (and logits) of its prompt alone through attnkit.generate, and holds what it holds."""
    if params == "config":
        params = {"config": share_config(model)}
    prompts = [random_ids(n, seed=20 + i) for i, n in enumerate(LENGTHS)]
    cache = AttnkitCache(model, name, params=params, max_new_tokens=12)
    tokens, logits = hf_batch(model, prompts, cache, new_tokens=12)
    alone = [attnkit.generate(model, p, name, params=params, max_new_tokens=12, stop_at_eos=False, keep_logits=True)
             for p in prompts]
    for row, ours in enumerate(alone):
        assert tokens[row] == ours.token_ids, f"row {row}"
        assert max((a - b).abs().max().item() for a, b in zip(logits[row], ours.logits)) < 1e-4
        assert cache.row_nbytes(row) == ours.stats.final_kv_bytes
        seen = LENGTHS[row] + 12 - 1  # its real tokens only (the last new token is never fed)
        assert max(cache.kept_lengths(row)) < seen if evicts else cache.kept_lengths(row) == [seen] * 2
    assert cache.nbytes() == sum(cache.row_nbytes(r) for r in range(len(prompts)))
    assert cache.get_seq_length() == max(LENGTHS) + 12 - 1  # transformers' columns, padding included
    rows = [rows for rows, _ in cache.groups]
    assert rows == ([(0, 2), (1,), (3,)] if cache.method.batches else [(0,), (1,), (2,), (3,)])
    if len(rows) > 1:
        with pytest.raises(AttnkitError, match="sessions.*session_of"):
            cache.kv  # noqa: B018


def test_one_padded_prompt_equals_it_unpadded(model):
    ids = random_ids(30, seed=8)
    for name, params in [("h2o", {"budget_tokens": 12}), ("keyformer", {"budget_tokens": 12}), ("full", {})]:
        plain, plain_logits = hf_generate(model, ids, AttnkitCache(model, name, params=params, max_new_tokens=10),
                                          new_tokens=10)
        padded = torch.cat([torch.full((5,), 2), ids])[None]
        mask = (torch.arange(35) >= 5).long()[None]
        cache = AttnkitCache(model, name, params=params, max_new_tokens=10)
        out = model.hf.generate(padded, attention_mask=mask, past_key_values=cache, max_new_tokens=10,
                                do_sample=False, eos_token_id=None, pad_token_id=2, output_logits=True,
                                return_dict_in_generate=True)
        assert out.sequences[0, 35:].tolist() == plain
        assert max((a[0] - b).abs().max().item() for a, b in zip(out.logits, plain_logits)) < 1e-4
        assert cache.paddings == [5] and cache.get_seq_length() == 35 + 9
        assert cache.kv.lengths() == cache.kept_lengths() and cache.nbytes() == cache.row_nbytes(0)


def test_a_padded_batch_on_a_sliding_window_model():
    """Mistral's window is in transformers' mask by column and in the method by position: after each row's
    padding they say the same, so a padded batch is accepted and each row is its prompt alone."""
    model = attnkit.load_model(f"random:mistral:{SMALL},sliding_window=16")
    prompts = [random_ids(n, seed=30 + i) for i, n in enumerate([40, 22, 31])]
    for name, params in [("full", {}), ("h2o", {"budget_tokens": 12})]:
        tokens, _ = hf_batch(model, prompts, AttnkitCache(model, name, params=params, max_new_tokens=8), new_tokens=8)
        assert tokens == [attnkit.generate(model, p, name, params=params, max_new_tokens=8, stop_at_eos=False).token_ids
                          for p in prompts]


def test_sampling_a_padded_batch(model):
    """Sampling with top_k=1 is greedy; with a fixed seed a sampled batch repeats itself, and every row's
    token was drawn from the distribution of its own prompt and tokens (logits of full attention on them)."""
    prompts = [random_ids(n, seed=40 + i) for i, n in enumerate([26, 15, 33])]
    greedy, _ = hf_batch(model, prompts, AttnkitCache(model, "h2o", params={"budget_tokens": 12}, max_new_tokens=8),
                         new_tokens=8)
    top1, _ = hf_batch(model, prompts, AttnkitCache(model, "h2o", params={"budget_tokens": 12}, max_new_tokens=8),
                       new_tokens=8, do_sample=True, top_k=1)
    assert top1 == greedy
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(hf_batch(model, prompts, AttnkitCache(model, "full", max_new_tokens=8), new_tokens=8,
                             do_sample=True, top_k=50, temperature=1.5))
    (tokens, logits), (again, _) = runs
    assert tokens == again
    assert tokens != [attnkit.generate(model, p, "full", max_new_tokens=8, stop_at_eos=False).token_ids
                      for p in prompts]  # it did sample
    for row, p in enumerate(prompts):
        assert all(3 <= t < model.hf.config.vocab_size for t in tokens[row])
        full = attnkit.score_tokens(model, torch.cat([p, torch.tensor(tokens[row][:-1])]))[p.shape[0] - 1:]
        assert max((a - b).abs().max().item() for a, b in zip(logits[row], full)) < 1e-4
        top = [set(lg.topk(50).indices.tolist()) for lg in logits[row]]
        assert all(t in allowed for t, allowed in zip(tokens[row], top))


def test_several_sequences_per_prompt(model):
    prompts = [random_ids(n, seed=50 + i) for i, n in enumerate([24, 17])]
    params = {"budget_tokens": 12}
    cache = AttnkitCache(model, "keyformer", params=params, max_new_tokens=8)
    # transformers refuses num_return_sequences without sampling; top_k=1 samples greedily
    tokens, _ = hf_batch(model, prompts, cache, new_tokens=8, num_return_sequences=2, do_sample=True, top_k=1)
    single = [attnkit.generate(model, p, "keyformer", params=params, max_new_tokens=8, stop_at_eos=False).token_ids
              for p in prompts]
    assert tokens == [single[0], single[0], single[1], single[1]]
    assert [rows for rows, _ in cache.groups] == [(0, 1), (2, 3)]  # a prompt's sequences share its session
    torch.manual_seed(2)
    sampled, _ = hf_batch(model, prompts, AttnkitCache(model, "h2o", params=params, max_new_tokens=8), new_tokens=8,
                          num_return_sequences=3, do_sample=True)
    assert len(sampled) == 6 and all(len(row) == 8 for row in sampled)


def test_what_a_padded_batch_cannot_honour_is_refused(model):
    prompts = [random_ids(n, seed=60 + i) for i, n in enumerate([20, 14])]
    ids, mask = left_padded(prompts)

    def run(**kwargs):
        kwargs = {"attention_mask": mask, "do_sample": False, **kwargs}
        model.hf.generate(ids, past_key_values=AttnkitCache(model, "h2o", params={"budget_tokens": 8},
                                                            max_new_tokens=4),
                          max_new_tokens=4, eos_token_id=None, pad_token_id=2, **kwargs)

    with pytest.raises(AttnkitError, match="beam search"):
        run(num_beams=2)
    holes = mask.clone()
    holes[1, 10] = 0  # hides a token after the padding
    with pytest.raises(AttnkitError, match="mask of batch row 1 is not causal attention by position after the row's left padding"):
        run(attention_mask=holes)
    right = torch.stack([torch.cat([p, torch.full((20 - p.shape[0],), 2)]) for p in prompts])
    with pytest.raises(AttnkitError, match="mask of batch row 1 .* left padding only"):
        model.hf.generate(right, attention_mask=(right != 2).long(), max_new_tokens=4, do_sample=False,
                          past_key_values=AttnkitCache(model, "full", max_new_tokens=4), pad_token_id=2)
    with pytest.raises(AttnkitError, match="position ids of batch row 1 are not its positions"):  # row 0 has no padding
        run(position_ids=torch.arange(20).expand(2, 20))
    with pytest.raises(AttnkitError, match="batch row 1 has no token"):
        run(attention_mask=torch.stack([mask[0], torch.zeros(20, dtype=torch.long)]))
