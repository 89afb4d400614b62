"""Prefill time of sparse prefill (minference, a_shape, ...) against dense SDPA prefill, at several lengths.

    # 1. search a pattern config once (MInference calibrates at one length and uses it at all lengths)
    attnkit calibrate patterns --model "random:llama:layers=2,hidden=512,heads=8,kv_heads=2,head_dim=64,intermediate=1024,context=66000" \
        --length 8192 --flops-budget 0.15 --out results/patterns_bench.json --threads 1
    # 2. prefill time, interleaved with full attention, medians of --repeats
    python benchmarks/bench_prefill.py --config results/patterns_bench.json --lengths 8192,16384,32768,65536 \
        --threads 1 --repeats 3 --out results/bench_prefill.json

For every length: one random prompt; every method runs once untimed (FlexAttention compiles for the
length), then ``--repeats`` rounds, each running ``full`` then every other method on the same prompt
(interleaved, so a drift of the machine hits all alike). Reported per method: median prefill seconds
(``generate(..., max_new_tokens=1).stats.prefill_s``: the whole model, embeddings to last hidden state),
the ratio to ``full`` (dense SDPA), and for sparse methods where that time goes
(:func:`attnkit.sparse_attention.profile`): ``index`` (Alg. 2/3 estimates and the layout), ``build``
(padding, gathering vertical columns, the BlockMask), ``kernel`` (FlexAttention), the share of the
prefill spent building indices (index + build), and the mean density (pairs computed / causal pairs).

``--attention-only`` times one attention layer instead (random q, k, v of the model's geometry, the
config's first layer): dense causal SDPA against index building + kernel.

``--model tiny`` holds 4096 positions; ``--extend-context`` raises the limit (RoPE extrapolates
untrained: the timing is meaningful, the model's outputs are not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnkit import sparse as sa
from attnkit.methods.spec import parse_method_spec, split_spec_list
from attnkit.model import load_model
from attnkit.runner import generate

DEFAULT_MODEL = "random:llama:layers=2,hidden=512,heads=8,kv_heads=2,head_dim=64,intermediate=1024"


def load(spec: str, context: int, extend: bool):
    if spec.startswith("random:") and "context=" not in spec:
        return load_model(spec, context=context)
    model = load_model(spec)
    if model.geometry.max_positions < context:
        if not extend:
            raise SystemExit(f"{spec} allows {model.geometry.max_positions} positions; pass --extend-context")
        model.hf.config.max_position_embeddings = context
        model.geometry = dataclasses.replace(model.geometry, max_positions=context)
    return model


def time_prefill(model, ids, method) -> tuple[float, dict]:
    with sa.profile() as prof:
        out = generate(model, ids, method, max_new_tokens=1, stop_at_eos=False)
    return out.stats.prefill_s, prof.as_dict()


def bench_model(model, length: int, specs: list[str], repeats: int, seed: int, say) -> list[dict]:
    ids = torch.randint(3, model.geometry.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    methods = [parse_method_spec(s) for s in specs]
    for spec, m in zip(specs, methods):  # warm-up: compiles the kernel for this length
        t0 = time.perf_counter()
        time_prefill(model, ids, m)
        say(f"  [{length}] warm-up {spec}: {time.perf_counter() - t0:.1f} s")
    samples = {s: [] for s in specs}
    for r in range(repeats):
        for spec, m in zip(specs, methods):
            t, prof = time_prefill(model, ids, m)
            samples[spec].append((t, prof))
            say(f"  [{length}] repeat {r + 1}/{repeats} {spec}: prefill {t:.2f} s"
                + (f" (index+build {prof['index_s'] + prof['build_s']:.2f} s, kernel {prof['kernel_s']:.2f} s)"
                   if prof["sparse_calls"] else ""))
    rows = []
    for spec in specs:
        times = [t for t, _ in samples[spec]]
        med = statistics.median(times)
        profs = [p for _, p in samples[spec]]
        row = {"length": length, "method": spec, "prefill_s": med, "prefill_all_s": times}
        if any(p["sparse_calls"] for p in profs):
            overhead = statistics.median(p["index_s"] + p["build_s"] for p in profs)
            kernel = statistics.median(p["kernel_s"] for p in profs)
            row.update(index_s=statistics.median(p["index_s"] for p in profs),
                       build_s=statistics.median(p["build_s"] for p in profs), kernel_s=kernel,
                       index_share_of_prefill=overhead / med, index_share_of_attention=overhead / (overhead + kernel),
                       mean_density=profs[-1]["mean_density"], sparse_calls=profs[-1]["sparse_calls"],
                       dense_calls=profs[-1]["dense_calls"])
        rows.append(row)
    full = next(r for r in rows if r["method"] == "full")
    for row in rows:
        row["speedup_vs_full"] = full["prefill_s"] / row["prefill_s"]
    return rows


def bench_attention(model, length: int, specs: list[str], repeats: int, seed: int, say) -> list[dict]:
    """One layer: dense causal SDPA vs each sparse method's index building + kernel on random q, k, v."""
    geo = model.geometry
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, geo.n_q_heads, length, geo.head_dim, generator=g)
    k = torch.randn(1, geo.n_kv_heads, length, geo.head_dim, generator=g)
    v = torch.randn(1, geo.n_kv_heads, length, geo.head_dim, generator=g)
    scaling = geo.head_dim ** -0.5

    class _Ctx:  # what SparsePrefill.layer_patterns reads
        index = 0

        class session:
            n_layers = geo.n_layers
            shared: dict = {}

    def run(method):
        if method.name == "full":
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
            return time.perf_counter() - t0, None
        patterns = method.layer_patterns(_Ctx, geo.n_q_heads)
        with sa.profile() as prof:
            t0 = time.perf_counter()
            with sa.timed("index"):
                layout = sa.layout_for_patterns(patterns, q, k, scaling, block=method.block(),
                                                last_q=method.estimate_rows(),
                                                width=method.column_width(patterns, length) or None)
            sa.record_call(layout)
            sa.sparse_attention(q, k, v, layout, scaling, compiled=method.compile)
            return time.perf_counter() - t0, prof.as_dict()

    methods = [parse_method_spec(s) for s in specs]
    for m in methods:
        run(m)
    samples = {s: [] for s in specs}
    for r in range(repeats):
        for spec, m in zip(specs, methods):
            t, prof = run(m)
            samples[spec].append((t, prof))
            say(f"  [{length}] attention repeat {r + 1}/{repeats} {spec}: {t:.3f} s")
    rows = []
    for spec in specs:
        med = statistics.median(t for t, _ in samples[spec])
        row = {"length": length, "method": spec, "attention_s": med}
        profs = [p for _, p in samples[spec] if p]
        if profs:
            overhead = statistics.median(p["index_s"] + p["build_s"] for p in profs)
            row.update(index_s=overhead, kernel_s=statistics.median(p["kernel_s"] for p in profs),
                       index_share=overhead / med, mean_density=profs[-1]["mean_density"])
        rows.append(row)
    full = next(r for r in rows if r["method"] == "full")
    for row in rows:
        row["speedup_vs_full"] = full["attention_s"] / row["attention_s"]
    return rows


def table(rows: list[dict], key: str) -> str:
    head = f"{'length':>7} {'method':<44} {key:>11} {'x full':>7} {'index share':>12} {'density':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        share = r.get("index_share_of_prefill", r.get("index_share"))
        lines.append(f"{r['length']:>7} {r['method'][:44]:<44} {r[key]:>11.3f} {r['speedup_vs_full']:>7.2f} "
                     f"{'' if share is None else f'{100 * share:.1f} %':>12} "
                     f"{'' if r.get('mean_density') is None else format(r['mean_density'], '.3f'):>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--config", default=None, help="pattern config for minference (attnkit calibrate patterns)")
    p.add_argument("--methods", default=None, help="specs to time against full (default: minference:config=...)")
    p.add_argument("--lengths", default="8192,16384,32768,65536")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-only", action="store_true", help="time one attention layer, not the model")
    p.add_argument("--extend-context", action="store_true", help="raise a loaded model's position limit")
    p.add_argument("--out", default=None, help="JSON file for all rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.methods:
        specs = split_spec_list(args.methods)
    elif args.config:
        specs = [f"minference:config={args.config}"]
    else:
        raise SystemExit("give --config FILE (a searched pattern config) or --methods")
    specs = ["full"] + [s for s in specs if s != "full"]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]

    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for length in lengths:
        model = load(args.model, length + 1, args.extend_context)
        if args.attention_only:
            rows += bench_attention(model, length, specs, args.repeats, args.seed, say)
        else:
            rows += bench_model(model, length, specs, args.repeats, args.seed, say)
        print(table([r for r in rows if r["length"] == length], "attention_s" if args.attention_only else "prefill_s"),
              flush=True)
    meta = {"model": args.model, "threads": torch.get_num_threads(), "repeats": args.repeats,
            "torch": torch.__version__, "attention_only": args.attention_only}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
