"""Decode speed and KV memory of the eviction methods against full attention, at several prompt lengths.

    python benchmarks/bench_eviction.py --contexts 16384,32768 --budget-tokens 2048 --new-tokens 128 \
        --out results/bench_eviction.json

For each context it runs `attnkit.bench.speed.run_bench` (every method once per repeat, interleaved,
medians over repeats, ratios to `full`) on the same random prompt and prints the table; all rows go to
`--out` as JSON. The methods default to full + streaming, h2o, keyformer, snapkv at the same budget;
`--methods` replaces them (the `attnkit bench --methods` syntax).

Each context also times `full` decoding after a 16-token prompt, interleaved with the others: the cost
of a decode step with (almost) no context -- layers, sampling, Python -- that no cache method can go
below. `full`'s time at the context divided by it bounds every method's decode speed-up (printed).
On a 2-layer model of a few MB on a CPU that bound is low; a Llama-family attention geometry (head_dim
128, 4 query heads per kv head) makes the KV cache, not this fixed cost, dominate as in real models:

    python benchmarks/bench_eviction.py --model random:llama:head_dim=128 --contexts 16384,32768 ...

For figures worth keeping, run it on a quiet machine, one run at a time, with OMP_NUM_THREADS=1 and
``--threads 1 --repeats 3 --budget-tokens 2048 --new-tokens 128 --contexts 16384,32768``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import attnkit
from attnkit.bench.speed import format_bench, run_bench
from attnkit.methods.spec import split_spec_list
from attnkit.model import load_model

OVERHEAD_PROMPT = 16  # prompt tokens of the no-context decode step


def default_methods(budget: int) -> list[str]:
    b = f"budget_tokens={budget}"
    return ["full", f"streaming:{b}", f"h2o:{b}", f"keyformer:{b}", f"snapkv:{b}"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama")
    p.add_argument("--contexts", default="16384,32768")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budget-tokens", type=int, default=2048)
    p.add_argument("--methods", default=None, help="comma-separated method specs (default: full + the four)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="JSON file for all rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = split_spec_list(args.methods) if args.methods else default_methods(args.budget_tokens)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    rows = []
    for context in contexts:
        spec = args.model
        if spec.startswith("random:") and "context=" not in spec:
            model = load_model(spec, device=args.device, context=context + args.new_tokens)
        else:
            model = load_model(spec, device=args.device)
        t0 = time.time()

        overhead, runs = [], []

        def progress(r, method, stats, context=context, model=model, overhead=overhead, runs=runs):
            print(f"  [{context}] repeat {r + 1}/{args.repeats} {method}: prefill {stats.prefill_s:.2f} s, "
                  f"decode {stats.decode_tokens_per_s:.1f} tok/s, KV {stats.final_kv_bytes / 2**20:.1f} MiB",
                  file=sys.stderr, flush=True)
            runs.append(method)
            if len(runs) % len(methods) == 0:  # after each repeat of the methods: the decode step without context
                ids = torch.randint(3, model.geometry.vocab_size, (OVERHEAD_PROMPT,),
                                    generator=torch.Generator().manual_seed(r))
                out = attnkit.generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
                overhead.append(1000.0 / out.stats.decode_tokens_per_s)

        got = run_bench(model, context, args.new_tokens, methods, args.repeats, progress=progress)
        print(f"\n{model.spec}, {context} prompt tokens, {args.new_tokens} new, {args.repeats} repeats "
              f"({time.time() - t0:.0f} s)")
        print(format_bench(got))
        ms = statistics.median(overhead)
        full_ms = got[0]["decode_ms_per_token"]
        print(f"decode step after a {OVERHEAD_PROMPT}-token prompt (full): {ms:.3f} ms/token; full at {context}: "
              f"{full_ms:.3f} ms/token, so no method can decode more than {full_ms / ms:.2f}x faster than full here")
        for row in got:
            row.update(model=model.spec, device=str(args.device), threads=torch.get_num_threads(),
                       no_context_ms_per_token=ms, speedup_bound=full_ms / ms)
        rows.extend(got)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"rows: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
