"""One layer of one KVzip reconstruction forward: its attention output and score, the ways attnkit computes them.

    OMP_NUM_THREADS=1 python benchmarks/bench_reconstruction.py --lengths 8192,32768 --threads 1 --repeats 5

KVzip's reconstruction input (``--queries`` tokens: a repeat prompt and a chunk of the context) attends to the whole
prompt (``length`` keys) and to its own keys; its score is the most attention each chunk key gets from a softmax
over the scored keys only (the sinks, the chunk, the input's own keys). Random float32 tensors, ``--heads`` query
heads over ``--kv-heads`` kv heads of ``--head-dim``. Variants, each run once per repeat in turn (interleaved):

- ``one sweep``: :func:`attnkit.methods.kvzip.reconstruction_attention` as kvzip runs it on a CPU, the C++ kernel's
  single sweep over every key for the output and the score;
- ``two sweeps``: the kernel's output sweep over every key, then its score sweep over the scored keys (gathered);
- ``score alone``: what the last layer that scores computes (``output=False``: a sweep over the scored keys);
- ``torch``: the torch path (``native=False``: one pass up to ``kvzip.ONE_PASS_MAX_KEYS`` keys, SDPA and a scoring
  pass beyond).

Reported: median seconds over the repeats after the first, and each variant's time over ``two sweeps``' in the same
repeat (median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnkit.methods import kvzip, scoring_native


def variants(q, keys, values, scaling, start, end, sink):
    n = keys.shape[2] - q.shape[2]
    positions = torch.arange(keys.shape[2])
    scored = torch.cat([positions[:sink], positions[start:end], positions[n:]])

    def two_sweeps():
        scoring_native.prompt_attention(q, keys, values, scaling)
        scoring_native.prompt_statistics(q, keys[:, :, scored], scaling, reduce="max", rows="max")

    run = kvzip.reconstruction_attention
    return {"one sweep": lambda: run(q, keys, values, scaling, start, end, sink, native=True),
            "two sweeps": two_sweeps,
            "score alone": lambda: run(q, keys, values, scaling, start, end, sink, native=True, output=False),
            "torch": lambda: run(q, keys, values, scaling, start, end, sink, native=False)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="8192", help="prompt lengths (keys before the input), comma-separated")
    p.add_argument("--queries", type=int, default=2100, help="reconstruction input tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prompt tokens the input repeats (scored)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if scoring_native.library() is None:
        raise SystemExit("bench_reconstruction: the C++ kernel is not available (no compiler, or ATTNKIT_NATIVE=0)")
    g = torch.Generator().manual_seed(0)
    print(f"{args.queries} queries, {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.chunk} scored "
          f"chunk keys, {torch.get_num_threads()} thread(s), {args.repeats} repeats (the first not counted)")
    print(f"{'keys':>7} {'variant':<12} {'seconds':>8} {'x two sweeps':>13}")
    for n in (int(x) for x in args.lengths.split(",")):
        m, d = args.queries, args.head_dim
        q = torch.randn(1, args.heads, m, d, generator=g)
        keys, values = (torch.randn(1, args.kv_heads, n + m, d, generator=g) for _ in range(2))
        start = min(args.chunk, max(0, n - args.chunk))  # a chunk after the first: sinks in the softmax
        runs = variants(q, keys, values, d ** -0.5, start, min(n, start + args.chunk), 4)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, f in runs.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        kept = {name: ts[1:] or ts for name, ts in times.items()}
        for name, ts in kept.items():
            ratio = statistics.median(t / r for t, r in zip(ts, kept["two sweeps"]))
            print(f"{n:>7} {name:<12} {statistics.median(ts):>8.3f} {ratio:>12.2f}x")


if __name__ == "__main__":
    main()
