"""Prefill time of the scoring eviction methods (h2o, keyformer, snapkv) against full attention.

    OMP_NUM_THREADS=1 python benchmarks/bench_scoring.py --lengths 8192,32768 --repeats 3 --threads 1 \
        --out results/bench_scoring.json

A scoring method pays for its prompt statistics on every prompt: H2O and Keyformer sum a function of every
prompt query's attention per key (computed in the same sweep as the prompt's attention output: on a CPU by the C++
kernel of :mod:`attnkit.methods.scoring_native`, ``ATTNKIT_NATIVE=0`` for the torch path), SnapKV scores only its
observation window.
For every length: one random prompt; every method runs once untimed, then ``--repeats`` rounds, each
running every method once on the same prompt in turn (``--no-warmup`` skips the untimed run) (interleaved, so a drift of the machine hits all
alike). Reported per method: the median prefill seconds (``generate(..., max_new_tokens=1)
.stats.prefill_s``: the whole model, embeddings to the last hidden state) and ``speed_vs_full``, the
median over repeats of full's prefill time over the method's in the same repeat (1.0: as fast as full;
pairing the runs of a repeat keeps a machine whose load drifts from skewing the ratio).

The default model has random weights in the geometry of the bundled ``tiny`` model, with room for
32k positions: the timing is meaningful, the outputs are not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import attnkit
from attnkit.methods.spec import parse_method_spec
from attnkit.model import load_model

DEFAULT_MODEL = ("random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,"
                 "context=40000")
DEFAULT_METHODS = "full;h2o:budget=0.2;keyformer:budget=0.2;snapkv:budget=0.2"


def prefill_seconds(model, ids, spec: str) -> float:
    out = attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=1, stop_at_eos=False)
    return out.stats.prefill_s


def bench_length(model, length: int, methods: list[str], repeats: int, seed: int, say,
                 warmup: bool = True) -> list[dict]:
    ids = torch.randint(3, model.geometry.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    for m in methods if warmup else ():  # warm-up (the noise tables, the allocator)
        prefill_seconds(model, ids, m)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(repeats):
        for m in methods:
            t = prefill_seconds(model, ids, m)
            times[m].append(t)
            say(f"  [{length}] repeat {r + 1}/{repeats} {m}: prefill {t:.2f} s")
    full = times[methods[0]]
    return [{"length": length, "method": m, "prefill_s": statistics.median(times[m]), "prefill_all_s": times[m],
             "speed_vs_full": statistics.median(f / t for f, t in zip(full, times[m]))} for m in methods]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--lengths", default="8192")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="method specs separated by ';', the first one the reference (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 is what a GPU runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first run of every method")
    p.add_argument("--block-elements", type=int, default=None,
                   help="entries per block of the blocked scoring passes on this device (default: "
                        "attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS)")
    p.add_argument("--out", default=None, help="JSON file for all rows")
    args = p.parse_args(argv)
    if args.block_elements:
        from attnkit.methods import scoring
        scoring.SCORE_BLOCK_ELEMENTS[torch.device(args.device).type] = args.block_elements
    if args.threads:
        torch.set_num_threads(args.threads)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    model = load_model(args.model, device=args.device, dtype=args.dtype)
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        t0 = time.perf_counter()
        rows += bench_length(model, length, methods, args.repeats, args.seed, say, not args.no_warmup)
        say(f"  [{length}] done in {time.perf_counter() - t0:.0f} s")
    print(f"model {args.model}, {torch.get_num_threads()} thread(s), {args.repeats} repeats, "
          f"attnkit {attnkit.__version__}, torch {torch.__version__}")
    print(f"{'length':>7} {'method':<24} {'prefill s':>10} {'speed vs full':>14}")
    for r in rows:
        print(f"{r['length']:>7} {r['method']:<24} {r['prefill_s']:>10.2f} {r['speed_vs_full']:>13.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
