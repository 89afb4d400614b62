"""Every C++ kernel of ``attnkit/native`` built for each instruction set, one layer's work, against the torch path
it replaces, interleaved in one process, medians of repeats.

    OMP_NUM_THREADS=1 python benchmarks/bench_native.py --isas avx2,avx512 --threads 1 --clock cpu

Random operands in the layer geometry of `--model` (by default `tiny`'s: 8 query heads on 2 kv heads of 32):

- ``scoring`` (``scoring.cpp``, :mod:`attnkit.methods.scoring_native`): a `--length`-token prompt's causal attention
  with H2O's statistic, and with Keyformer's; the torch path is the blocked pass of
  :func:`attnkit.methods.scoring.attention_with_statistics`; SDPA (the output alone, what ``full`` runs) beside it.
- ``kvzip`` (``scoring.cpp`` again): one of KVzip's reconstruction chunks (2,048 prompt tokens repeated after 12 of
  a short prompt: 2,060 queries over the `--length`-token prompt and their own keys) in a layer that scores
  and passes its output on, :func:`attnkit.methods.kvzip.reconstruction_attention`; the torch path is SDPA for the
  output and a pass over the scored keys for the score.
- ``sparse`` (``sparse.cpp``, :mod:`attnkit.sparse.kernels`): a MInference layout of the prompt (vertical-slash,
  A-shape and block-sparse heads, tiles of 64), and the same kernel over every causal tile (how ``minference`` runs
  the heads it sends to dense attention); the path it replaces is FlexAttention compiled (``--flex``: its
  compilation takes minutes on a small CPU), SDPA over every causal pair beside it.
- ``paged`` (``paged.cpp``, :mod:`attnkit.methods.quest_native`): Quest's decoding step over a `--context`-token
  cache reading a sixteenth (the page choice and the attention); the torch path bounds, chooses, gathers and attends;
  SDPA over the whole cache (``full``'s step) beside it.
- ``decode`` (``decode.cpp``, :mod:`attnkit.methods.decode_native`): a per-step eviction method's decode step
  (the attention, its logits and probabilities) of `--rows` requests holding `--held` entries per kv head: in vLLM's
  CPU blocks read in place (``decode/b``; the torch path gathers them first) and in a tensor (``decode/t``).

Each row is one kernel and build (``<kernel> [<isa>]``) or a torch path, run once per round in a new order every
round (a row leaves its operands in the caches for the next); ``x torch`` is the median over rounds of the
torch path's time over the row's in the same round. ``--clock cpu`` times the process's CPU seconds (with one
thread: the work done, not the waits for a core on a shared machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from attnkit import native
from attnkit import sparse as sa
from attnkit.methods import decode_native, kvzip, quest_native, quest_pages, scoring, scoring_native
from attnkit.methods.keyformer_noise import GumbelFactorWeights
from attnkit.model import load_model
from attnkit.sparse.patterns import HeadPattern
from attnkit.vllm import paged

TINY_GEOMETRY = "random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,context=40000"
PATTERNS = [HeadPattern("vertical_slash", k_v=256, k_s=512), HeadPattern("a_shape", n_init=64, n_local=1024),
            HeadPattern("block_sparse", k_b=16), HeadPattern("vertical_slash", k_v=128, k_s=256)]


def groups(args) -> dict[str, dict[str, tuple]]:
    """kernel -> row -> (function, instruction set or None); the first row of each group is its torch path."""
    g = load_model(args.model).geometry
    hq, kv, d = g.n_q_heads, g.n_kv_heads, g.head_dim
    gen = torch.Generator().manual_seed(0)
    n, scale = args.length, d ** -0.5
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (hq, kv, kv))
    pos = torch.arange(n)
    weights = GumbelFactorWeights(seed=1, layer=0, kv_heads=kv)
    out = {"scoring": {"torch (blocked pass, H2O)": (lambda: scoring.attention_with_statistics(
        q, k, v, scale, pos, pos), None), "SDPA (output only)": (lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True), None)}}
    for isa in args.isas:
        out["scoring"][f"scoring, H2O [{isa}]"] = (lambda: scoring_native.prompt_attention_with_statistics(
            q, k, v, scale, threads=args.threads), isa)
        out["scoring"][f"scoring, Keyformer [{isa}]"] = (lambda: scoring_native.prompt_attention_with_statistics(
            q, k, v, scale, weights=weights, threads=args.threads), isa)
    chunk = min(2048, n)
    m = chunk + 12  # a reconstruction input: a short prompt, then a chunk of the prompt repeated
    rq = torch.randn(1, hq, m, d, generator=gen)
    rk, rv = (torch.cat([t, torch.randn(1, kv, m, d, generator=gen)], 2) for t in (k, v))
    out["kvzip"] = {"torch (SDPA, then the scored keys)": (lambda: kvzip.reconstruction_attention(
        rq, rk, rv, scale, n - chunk, n, 4, native=False, one_pass=False), None)}
    for isa in args.isas:
        out["kvzip"][f"scoring, KVzip chunk [{isa}]"] = (lambda: kvzip.reconstruction_attention(
            rq, rk, rv, scale, n - chunk, n, 4, native=True), isa)
    layout = sa.layout_for_patterns((PATTERNS * hq)[:hq], q, k, scale, block=64, last_q=64)

    def flexattention():
        pays = sa.kernels.native_pays
        sa.kernels.native_pays = lambda *a: False
        try:
            return sa.sparse_attention(q, k, v, layout, scale)
        finally:
            sa.kernels.native_pays = pays

    out["sparse"] = {"SDPA (every causal pair)": (lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=True), None)}
    if args.flex:
        out["sparse"] = {"torch (FlexAttention, compiled)": (flexattention, None), **out["sparse"]}
    every = layout.with_dense_heads(torch.ones(hq, dtype=torch.bool))  # how minference's dense heads run
    for isa in args.isas:
        out["sparse"][f"sparse [{isa}]"] = (lambda: sa.kernels.native_sparse_attention(q, k, v, layout, scale), isa)
        out["sparse"][f"sparse, every causal tile [{isa}]"] = (
            lambda: sa.kernels.native_sparse_attention(q, k, v, every, scale), isa)
    c, page = args.context, 16
    keys, values = (torch.randn(1, kv, c, d, generator=gen) for _ in range(2))
    low, high = (f(keys.view(1, kv, c // page, page, d), dim=3) for f in (torch.amin, torch.amax))
    count, step_q = c // page // 16, torch.randn(1, hq, 1, d, generator=gen)

    def torch_step():
        chosen = quest_pages.choose_pages(quest_pages.page_bounds(step_q, low, high), count, False, 0, page)
        return quest_pages.gathered_attention(step_q, keys, values, chosen, page, c, scale)

    def kernel_step():
        chosen = quest_native.choose_pages(step_q, low, high, count, False, 0, page)
        return quest_native.paged_decode(step_q, keys, values, chosen, page, c, scale, threads=args.threads)

    out["paged"] = {"torch (bounds, top-k, gather, SDPA)": (torch_step, None), "SDPA over the whole cache": (
        lambda: F.scaled_dot_product_attention(step_q, keys, values, scale=scale, enable_gqa=True), None)}
    for isa in args.isas:
        out["paged"][f"paged, choice and attention [{isa}]"] = (kernel_step, isa)
    out.update(decode_groups(args, hq, kv, d, gen))
    return out


def decode_groups(args, hq: int, kv: int, d: int, gen: torch.Generator) -> dict[str, dict[str, tuple]]:
    """``decode/b``: a stacked per-step step in vLLM's CPU blocks (`--rows` requests holding `--held` entries per kv
    head, scattered in a run of slots, each block's keys transposed), the kernel reading them in place against the
    host's gather and torch's product-softmax-product; ``decode/t``: the same entries in a tensor (attnkit's runner)."""
    rows, held, size = args.rows, args.held, 128
    per_row = -(-(held + held // 4) // size) + 1
    k_cache, v_cache = paged.split_cache(torch.randn(rows * per_row + 1, kv, size, 2 * d, generator=gen))
    tables = torch.randperm(rows * per_row + 1, generator=gen)[:rows * per_row].view(rows, per_row)
    slots = torch.stack([torch.stack([torch.randperm(held + held // 4, generator=gen)[:held] + size // 2
                                      for _ in range(kv)]) for _ in range(rows)])
    layout = paged.Layout(paged.TRANSPOSED, None)
    k_entries, v_entries = paged.entries(k_cache, v_cache, layout, tables, slots)
    keys, values = k_entries.tensor(), v_entries.tensor()
    q, scale = torch.randn(rows, hq, 1, d, generator=gen), d ** -0.5
    out = {"decode/b": {"torch (gather, product-softmax-product)": (lambda: scoring.attend_with_logits(
        q, *paged.gather_heads(k_cache, v_cache, layout, tables, slots), scale, native=False), None)},
        "decode/t": {"torch (product-softmax-product)": (lambda: scoring.attend_with_logits(
            q, keys, values, scale, native=False), None)}}
    for isa in args.isas:
        out["decode/b"][f"decode, in place [{isa}]"] = (lambda: decode_native.attend(
            q, k_entries, v_entries, scale, threads=args.threads), isa)
        out["decode/t"][f"decode [{isa}]"] = (lambda: decode_native.attend(q, keys, values, scale,
                                                                           threads=args.threads), isa)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_GEOMETRY, help="the layer geometry (its first layer's)")
    p.add_argument("--isas", default="avx2,avx512", help="instruction sets to build for, comma-separated")
    p.add_argument("--length", type=int, default=8192, help="prompt tokens (scoring, sparse)")
    p.add_argument("--context", type=int, default=32768, help="cached tokens of Quest's step (paged)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--step-repeats", type=int, default=50, help="repeats of the short paged and decode rows")
    p.add_argument("--rows", type=int, default=32, help="requests of the decode rows")
    p.add_argument("--held", type=int, default=256, help="entries each kv head holds in the decode rows")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--flex", action="store_true", help="time FlexAttention too (compiles first: minutes)")
    args = p.parse_args(argv)
    args.isas = [x.strip() for x in args.isas.split(",") if x.strip()]
    torch.set_num_threads(args.threads)
    timer = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"CPU {native.cpu_model()}, {args.threads} thread(s), clock {args.clock}, torch {torch.__version__}; "
          f"builds: " + ", ".join(f"{isa} -> {native.built_isa(native.load('scoring', None, isa))}"
                                  for isa in args.isas))
    print(f"{'kernel':8} {'row':42} {'median ms':>10} {'x torch':>8}")
    with torch.no_grad():
        for kernel, rows in groups(args).items():
            times = {name: [] for name in rows}
            repeats = args.step_repeats if kernel in ("paged", "decode/b", "decode/t") else args.repeats
            names = list(rows)
            for r in range(repeats + 1):
                # a new order every round: a row leaves its operands in the caches for the next one
                for name in random.Random(r).sample(names, len(names)):
                    fn, isa = rows[name]
                    with native.settings(isa):
                        start = timer()
                        fn()
                        elapsed = timer() - start
                    if r:  # the first round builds, compiles and warms up
                        times[name].append(elapsed)
            ref = times[next(iter(rows))]
            for name, t in times.items():
                ratio = statistics.median(a / b for a, b in zip(ref, t))
                print(f"{kernel:8} {name:42} {statistics.median(t) * 1e3:10.3f} {ratio:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
