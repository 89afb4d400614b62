"""Shared test helpers: the small random model's options and reproducible random token ids; the
chi-square test and prompts of the speculative decoding tests; driving an eviction method's hooks on
hand-made tensors (one layer, no model) and the dense reference selection rules."""

import functools
import shutil
import threading
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.cache import KVCache
from attnkit.heads import HeadShard
from attnkit.rope import Rope
from attnkit.sampling import SamplingConfig, next_token_distribution
from attnkit.session import Session, Step
from attnkit.speculative import speculative_generate

ROOT = Path(__file__).resolve().parents[1]  # the repository
SMALL = "layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"


def random_ids(n: int, seed: int = 0, vocab: int = 259) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- speculative decoding -------------------------------------------------------------------------------
SIGNIFICANCE = 0.001  # chi-square tests fail when P(statistic >= observed | lossless) < 0.1%


def chi_square_p_value(observed: dict, expected_probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    small_obs = small_exp = 0.0
    stat, cells = 0.0, 0
    for cell, prob in expected_probs.items():
        e, o = prob * n, observed.get(cell, 0)
        if e < 5:
            small_obs, small_exp = small_obs + o, small_exp + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp if small_exp >= 1 else 0.0
        cells += 1 if small_exp >= 1 else 0
    assert sum(observed.values()) == n
    assert not set(observed) - set(expected_probs), "a sample fell outside the target's support"
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def repetitive_prompt(n: int = 120) -> torch.Tensor:
    base = random_ids(17, seed=11)
    return torch.cat([base] * (n // 17 + 1))[:n]


def _filled(session):
    out = []
    for kv in session.cache.layers:
        k, v, p = kv.view()
        out.append((k, v, p, {name: s[:, :, :kv.length] for name, s in kv.extras.items()}))
    return out


def sharpened(seed: int, scale: float = 40.0, noise: float = 0.0, layers: int = 1):
    """A small random llama (one layer by default: the chi-square tests run it for thousands of samples) whose LM
    head is scaled up, so its distributions are far from uniform; `noise` perturbs the head (a draft that agrees with
    the target only partly)."""
    model = attnkit.load_model(f"random:llama:{SMALL.replace('layers=2', f'layers={layers}')},seed={seed}")
    with torch.no_grad():
        model.hf.lm_head.weight.mul_(scale)
        if noise:
            g = torch.Generator().manual_seed(99)
            model.hf.lm_head.weight.add_(torch.randn(model.hf.lm_head.weight.shape, generator=g) * noise)
    return model


def target_joint(target, prompt: torch.Tensor, config: SamplingConfig, n: int) -> dict[tuple, float]:
    """Exact probability of every n-token continuation under plain sampling from the target."""
    out: dict[tuple, float] = {}

    def walk(prefix, mass):
        if len(prefix) == n:
            out[prefix] = mass
            return
        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
        q = next_token_distribution(attnkit.score_tokens(target, ids)[-1], config).double()
        for x in torch.nonzero(q).flatten().tolist():
            walk(prefix + (x,), mass * float(q[x]))

    walk((), 1.0)
    return out


def sampled_runs(target, prompt: torch.Tensor, source, runs: int, singles: int = 10, **options) -> list:
    """`runs` sampled speculative generations of `prompt`, run ``i`` with seed ``i``: one batch of `runs` copies of
    the prompt (row ``i`` samples with seed ``i``; the sequences of a batch are independent), of which the first
    `singles` rows must be the single-prompt call with that seed, token for token: the samples are those of a loop
    of single-prompt calls, drawn side by side (one target forward per round for all of them)."""
    out = speculative_generate(target, prompt[None].expand(runs, -1), source, seed=0, **options)
    for seed in range(singles):
        assert speculative_generate(target, prompt, source, seed=seed, **options).token_ids == out[seed].token_ids, seed
    return out


# ---- eviction methods: driving a method's hooks on hand-made tensors --------------------------------------
D = 8
ROPE = Rope(inv_freq=1.0 / (100.0 ** (torch.arange(0, D, 2).float() / D)))


def drive(method, q, k, v, prompt_len, rope=ROPE, scaling=None, shard=None):
    """Prefill the first `prompt_len` tokens, then decode the rest one at a time (one layer); `shard`: the
    :class:`attnkit.heads.HeadShard` the heads of `q`, `k`, `v` are (None: the whole model's).

    Returns the session, the decode outputs, and per step the sorted positions each kv head holds
    (step 0: after prefill; step i: what the i-th decode query attended to)."""
    n = q.shape[2]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    session = Session(method, KVCache(1), 1, prompt_len, n - prompt_len, rope=rope, shard=shard)
    p = slice(0, prompt_len)
    Step(session, "prefill", torch.arange(prompt_len)).attention(0, q[:, :, p], k[:, :, p], v[:, :, p], scaling, None)
    held, outs = [positions(session)], []
    for t in range(prompt_len, n):
        s = slice(t, t + 1)
        outs.append(Step(session, "decode", torch.tensor([t])).attention(0, q[:, :, s], k[:, :, s], v[:, :, s],
                                                                        scaling, None))
        held.append(positions(session))
    return session, outs, held


def positions(session, layer=0):
    pos = session.cache.layers[layer].view()[2][0]
    return [sorted(row.tolist()) for row in pos]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def qkv(n, hq=4, kv=2, d=D, seed=0):
    return randn(1, hq, n, d, seed=seed), randn(1, kv, n, d, seed=seed + 1), randn(1, kv, n, d, seed=seed + 2)


def streaming_reference(q_raw, k_raw, v, t, kept, scaling):
    """StreamingLLM's re-indexed attention from keys before RoPE: cache entries at 0..C-1, query at C-1."""
    g = q_raw.shape[1] // k_raw.shape[1]
    outs = []
    for h in range(q_raw.shape[1]):
        idx = torch.tensor(kept[h // g])
        keys = ROPE.rotate(k_raw[0, h // g, idx], torch.arange(len(idx)))
        query = ROPE.rotate(q_raw[0, h, t:t + 1], len(idx) - 1)
        w = torch.softmax(query @ keys.T * scaling, dim=-1)
        outs.append(w @ v[0, h // g, idx])
    return torch.stack(outs)[None]


def heavy_hitter_tensors(n, heavy=(3, 9), kv=2, g=2):
    """Every query points along e0; keys `heavy` are long along e0, the others short and random."""
    k = randn(1, kv, n, D, seed=5) * 0.1
    k[:, :, list(heavy), 0] = 4.0
    q = randn(1, kv * g, n, D, seed=6) * 0.1
    q[..., 0] = 2.0
    return q, k, randn(1, kv, n, D, seed=7)


def recompress_dense(q, k, prompt_len, budget, every, choose):
    """The prompt compressed to `budget` by ``choose(h, held, next_pos)``, then tokens appended and, every `every`
    of them, the held entries compressed back to `budget` by the same rule. Held positions per step and kv head."""
    kv, n = k.shape[1], q.shape[2]
    held = [list(range(prompt_len)) for _ in range(kv)]
    if prompt_len > budget:
        held = [sorted(choose(h, held[h], prompt_len)) for h in range(kv)]
    steps = [held]
    for i, t in enumerate(range(prompt_len, n), 1):
        held = [row + [t] for row in held]
        if every and i % every == 0 and len(held[0]) > budget:
            held = [sorted(choose(h, held[h], t + 1)) for h in range(kv)]
        steps.append(held)
    return steps


def dense_reference(q, k, prompt_len, budget, recent, weights, reduce="mean"):
    """The eviction rule written plainly: full attention matrices, Python sets, no chunks, no slots.

    `weights(x, head, q_pos, k_pos, t)` turns logits x [g, queries, keys] into per-key weights.
    Returns per step (0 = after prefill) the sorted positions each kv head holds.
    """
    _, hq, n, d = q.shape
    kv = k.shape[1]
    g = hq // kv
    scale = d ** -0.5
    per_head = []
    for h in range(kv):
        score = torch.zeros(n, dtype=torch.float64)
        qh = q[0, h * g:(h + 1) * g]
        x = qh[:, :prompt_len] @ k[0, h, :prompt_len].T * scale
        x = x.masked_fill(torch.ones(prompt_len, prompt_len, dtype=torch.bool).triu(1), float("-inf"))
        w = weights(x, h, torch.arange(prompt_len), torch.arange(prompt_len), 0)
        w = w.mean(0) if reduce == "mean" else w.amax(0)
        score[:prompt_len] += w.sum(0).double()
        held = list(range(prompt_len))
        if prompt_len > budget:
            keep = [p for p in held if p >= prompt_len - recent]
            rest = sorted((p for p in held if p not in keep), key=lambda p: -score[p])
            held = sorted(keep + rest[:budget - len(keep)])
        steps = [sorted(held)]
        for t in range(prompt_len, n):
            if len(held) >= budget:
                held.remove(min((p for p in held if p < t - recent), key=lambda p: score[p]))
            held.append(t)
            x = (qh[:, t] @ k[0, h, held].T * scale)[:, None]
            w = weights(x, h, torch.tensor([t]), torch.tensor(held), t - prompt_len + 1)
            w = w.mean(0) if reduce == "mean" else w.amax(0)
            score[held] += w[0].double()
            steps.append(sorted(held))
        per_head.append(steps)
    return [[per_head[h][s] for h in range(kv)] for s in range(n - prompt_len + 1)]


def per_token_bytes(model) -> int:
    g = model.geometry
    return 2 * g.n_layers * g.n_kv_heads * g.head_dim * 4


def assert_shortcut_is_exact(model, cases, patch) -> None:
    """A method's fast path against its generic rule: each case ``(spec, prompt lengths, generate options)``
    runs as a batch of random prompts, then again after `patch()` swaps the fast path out; the tokens, the
    final KV bytes and the logits (bit for bit) must be the same."""
    def run(spec, lengths, options):
        prompts = [random_ids(n, seed=i).tolist() for i, n in enumerate(lengths)]
        outs = attnkit.generate(model, prompts, attnkit.parse_method_spec(spec), max_new_tokens=40,
                                stop_at_eos=False, keep_logits=True, **options)
        return [(o.token_ids, o.logits, o.stats.final_kv_bytes) for o in outs]

    fast = [run(*case) for case in cases]
    patch()
    generic = [run(*case) for case in cases]
    for case, a, b in zip(cases, fast, generic):
        for (ta, la, ba), (tb, lb, bb) in zip(a, b):
            assert ta == tb and ba == bb, case
            assert max((x - y).abs().max().item() for x, y in zip(la, lb)) == 0.0, case


def assert_equals_full(model, ids, method, max_new_tokens: int, same_bytes: bool = True):
    """`method` on `ids` (one prompt, or a list of prompts run as a batch) gives full attention's tokens and logits
    (within 1e-4) for every prompt and, with `same_bytes`, its final and peak KV bytes: the unlimited-budget
    exactness every method owes. Returns both generations (method's, full's)."""
    full = attnkit.generate(model, ids, "full", max_new_tokens=max_new_tokens, stop_at_eos=False, keep_logits=True)
    out = attnkit.generate(model, ids, method, max_new_tokens=max_new_tokens, stop_at_eos=False, keep_logits=True)
    pairs = zip(out, full) if isinstance(out, list) else [(out, full)]
    for o, f in pairs:
        assert o.token_ids == f.token_ids
        assert max((a - b).abs().max().item() for a, b in zip(o.logits, f.logits)) < 1e-4
        if same_bytes:
            assert (o.stats.final_kv_bytes, o.stats.peak_kv_bytes) == (f.stats.final_kv_bytes, f.stats.peak_kv_bytes)
    return out, full


def assert_attnkit_cache_equals_generate(model, ids, name: str, params: dict, max_new_tokens: int):
    """Method `name` with `params` through transformers' greedy ``generate`` on an
    :class:`~attnkit.hf_cache.AttnkitCache` gives attnkit.generate's tokens for the prompt `ids` ``[n]``. Returns the
    cache."""
    from attnkit.hf_cache import AttnkitCache

    ours = attnkit.generate(model, ids, name, params=params, max_new_tokens=max_new_tokens, stop_at_eos=False)
    cache = AttnkitCache(model, name, params=params, max_new_tokens=max_new_tokens)
    out = model.hf.generate(ids[None], past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=2)
    assert out[0, ids.shape[-1]:].tolist() == ours.token_ids
    return cache


# ---- the report's tests (tests/eval/report, tests/bench): one small sweep's results ---------------------------
REPORT_SPEC = "random:llama:layers=1,hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128"
REPORT_SWEEP = {"model": REPORT_SPEC, "samples": 2, "tasks": ["passkey", "code_completion"], "lengths": [256, 320],
                "budgets": [0.25, 0.5], "recipes": ["snapkv", "window"]}


def fresh_dir(tmp_path: Path, results: Path) -> Path:
    """A directory holding nothing but a copy of the results file."""
    from attnkit.eval.run import results as results_store

    d = tmp_path / "only_results"
    d.mkdir()
    shutil.copy(results, d / results_store.RESULTS_FILE)
    return d


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("chromium is not installed, so the report cannot be checked in a browser: install Debian's "
                "package (`apt-get install -y chromium`; `./run test` does it when it runs as root or with sudo)")


def drive_shards(method, q, k, v, prompt_len, ranks=2):
    """:func:`drive` on each of `ranks` tensor-parallel shards of the heads (rank r: the r-th 1/ranks of the query
    and kv heads, told by its :class:`attnkit.heads.HeadShard`), joined: the decode outputs concatenated over the
    heads, per step the positions each kv head holds."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qs, ks = heads // ranks, kv_heads // ranks
    # the shards side by side in threads, their sums added as a host's all-reduce would (in rank order)
    barrier, deposits = threading.Barrier(ranks, timeout=120), [None] * ranks

    def sum_across(rank, tensor):
        deposits[rank] = tensor
        barrier.wait()
        total = sum(deposits[1:], deposits[0])
        barrier.wait()
        return total

    runs = [None] * ranks

    def run(r):
        try:
            runs[r] = drive(method, q[:, r * qs:(r + 1) * qs], k[:, r * ks:(r + 1) * ks], v[:, r * ks:(r + 1) * ks],
                            prompt_len, shard=HeadShard(r * qs, r * ks, heads, kv_heads, ranks,
                                                        functools.partial(sum_across, r)))
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            runs[r] = error
            barrier.abort()  # the other shards stop waiting for this one's sums

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in runs if isinstance(r, BaseException) and not isinstance(r, threading.BrokenBarrierError)]
    if failed:
        raise failed[0]
    outs = [torch.cat(step, dim=1) for step in zip(*(run[1] for run in runs))]
    held = [sum(step, []) for step in zip(*(run[2] for run in runs))]
    return outs, held
