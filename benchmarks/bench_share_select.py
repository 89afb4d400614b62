"""Share-Attention and Select-Attention against full attention: attention-op time and generation speed.

    python benchmarks/bench_share_select.py --model tiny --context 2048 --new-tokens 32 \
        --share-config share.json --out results/bench_share_select.json

Two measurements, each interleaved (every variant once per repeat, in turn) and reported as medians:

1. **Attention op** of one layer on random q/k/v of the model's geometry: the prompt (all queries, causal)
   and one decode query over ``context`` keys, for
   - ``dense``: the fused kernel ``full`` uses (SDPA),
   - ``explicit``: the explicit-softmax path of ``share`` with every head essential (no sharing), which
     separates the cost of the path from the saving of sharing,
   - ``fused`` (prompt only): the fused-kernel prefill of ``share`` (one SDPA call per pair of kv heads a
     shared head links; a head shared across kv groups recomputes its softmax, see its skipped fraction),
   - ``shared``: the explicit path with the config's sharing (the layer ``--layer``; or, without a config, a
     synthetic one keeping ``--retention`` of the heads, essential heads spread over the kv groups).
   The fraction of QK^T + softmax head-operations skipped is printed beside the times.
2. **Generation** (:func:`attnkit.bench.speed.run_bench`): prefill seconds, decode tokens/s and KV bytes of
   ``full``, ``share``, ``select`` and ``gemfilter`` (``--methods`` replaces the list) on one random prompt.

Keep it small on a CPU (e.g. ``--model random:llama --context 2048``); the real numbers come from a quiet
machine or a GPU (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnkit.attention import attend
from attnkit.bench.speed import format_bench, run_bench
from attnkit.generation import sync
from attnkit.methods.share import LayerPlan, ShareConfig, shared_attention, shared_prefill_fused
from attnkit.methods.spec import split_spec_list
from attnkit.model import load_model, load_model_for_length


def synthetic_config(n_layers: int, n_heads: int, n_kv: int, retention: float) -> dict:
    """Every layer keeps round(retention x heads) essential heads, spread over the kv groups; an even shared head
    uses an essential head of its own kv group, an odd one of the NEXT kv group (the cross-group case of GQA),
    when there is one."""
    keep = max(1, min(n_heads, round(retention * n_heads)))
    g = n_heads // n_kv
    essential = sorted(sorted(range(n_heads), key=lambda h: (h % g, h // g))[:keep])
    share_to = {}
    for h in range(n_heads):
        if h not in essential:
            other = [e for e in essential if e // g == (h // g + h % 2) % n_kv] or essential
            share_to[str(h)] = other[h % len(other)]
    layer = {"essential_heads": essential, "share_to": share_to}
    return {"n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv, "layers": [layer] * n_layers}


def _time(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def bench_attention_op(model, context: int, plan: LayerPlan, repeats: int) -> list[dict]:
    """Medians of the prompt and decode attention ops of one layer (see the module docstring)."""
    geo, device, dtype = model.geometry, model.device, model.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, geo.n_q_heads, context, geo.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, geo.n_kv_heads, context, geo.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(1, geo.n_kv_heads, context, geo.head_dim, generator=gen).to(device, dtype)
    pos = torch.arange(context, device=device)
    scale = geo.head_dim ** -0.5
    identity = LayerPlan.identity(geo.n_q_heads, geo.n_kv_heads)
    variants = {
        "dense": lambda qq, qp: attend(qq, k, v, scale, qp, pos),
        "explicit": lambda qq, qp: shared_attention(qq, k, v, scale, qp, pos, None, identity),
        "shared": lambda qq, qp: shared_attention(qq, k, v, scale, qp, pos, None, plan),
        "fused": lambda qq, qp: shared_prefill_fused(qq, k, v, scale, plan),
    }
    phases = {"prefill": (q, pos), "decode": (q[:, :, -1:], pos[-1:])}
    times = {(ph, name): [] for ph in phases for name in variants}
    for _ in range(repeats):
        for ph, (qq, qp) in phases.items():
            for name, fn in variants.items():
                if name == "fused" and ph == "decode":
                    continue
                times[(ph, name)].append(_time(lambda fn=fn, qq=qq, qp=qp: fn(qq, qp), device))
    skipped = {"shared": 1 - len(plan.essential) / geo.n_q_heads,
               "fused": 1 - sum(len(x) for x in plan.pairs(geo.n_kv_heads).values()) / geo.n_q_heads}
    rows = []
    for ph in phases:
        dense, explicit = (statistics.median(times[(ph, n)]) for n in ("dense", "explicit"))
        for name in variants:
            if not times[(ph, name)]:
                continue
            t = statistics.median(times[(ph, name)])
            rows.append({"phase": ph, "variant": name, "context": context, "median_ms": 1000 * t,
                         "x_dense": dense / t, "x_explicit": explicit / t,
                         "head_ops_skipped": skipped.get(name, 0.0)})
    return rows


def format_op_rows(rows: list[dict]) -> str:
    lines = [f"{'phase':<8} {'variant':<9} {'median ms':>10} {'x dense':>8} {'x explicit':>11} {'QK+softmax skipped':>19}",
             "-" * 70]
    for r in rows:
        lines.append(f"{r['phase']:<8} {r['variant']:<9} {r['median_ms']:>10.3f} {r['x_dense']:>8.2f} "
                     f"{r['x_explicit']:>11.2f} {100 * r['head_ops_skipped']:>18.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--share-config", default=None, help="calibrated share config (default: a synthetic one)")
    p.add_argument("--retention", type=float, default=0.5, help="synthetic config: fraction of heads kept")
    p.add_argument("--layer", type=int, default=None, help="the layer whose sharing the op bench uses (default: middle)")
    p.add_argument("--filter-layer", type=int, default=None, help="select/gemfilter filter layer (default: middle)")
    p.add_argument("--p-decode", type=float, default=0.95)
    p.add_argument("--methods", default=None, help="generation methods (attnkit bench --methods syntax)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-generation", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="JSON file for all rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    positions = args.context + args.new_tokens
    if args.device == "cpu":
        model = load_model_for_length(args.model, positions)
    else:
        model = (load_model(args.model, device=args.device, context=positions)
                 if args.model.startswith("random:") and "context=" not in args.model
                 else load_model(args.model, device=args.device))
    geo = model.geometry
    config_path = args.share_config
    if config_path is None:
        config_path = str(Path(tempfile.gettempdir()) / "attnkit_share_synthetic.json")
        Path(config_path).write_text(json.dumps(synthetic_config(geo.n_layers, geo.n_q_heads, geo.n_kv_heads,
                                                                 args.retention)))
    config = ShareConfig.load(config_path)
    config.check(geo.n_layers, geo.n_q_heads, geo.n_kv_heads, repr(model.spec))
    layer = geo.n_layers // 2 if args.layer is None else args.layer
    plan = config.plan(layer, geo.n_kv_heads)
    skipped_all = 1 - sum(config.retention()) / config.n_layers
    print(f"{model.spec}: {geo.n_layers} layers, {geo.n_q_heads} q / {geo.n_kv_heads} kv heads; share config "
          f"{config_path}: layer {layer} keeps {len(plan.essential)}/{geo.n_q_heads} heads, all layers skip "
          f"{100 * skipped_all:.1f} % of QK^T+softmax head-ops", file=sys.stderr)

    op_rows = bench_attention_op(model, args.context, plan, args.repeats)
    print(f"attention op, layer geometry, {args.context} keys, {args.repeats} interleaved repeats (medians):")
    print(format_op_rows(op_rows))

    gen_rows = []
    if not args.skip_generation:
        fl = "" if args.filter_layer is None else f"filter_layer={args.filter_layer},"
        methods = split_spec_list(args.methods) if args.methods else [
            "full", "share:config=none", f"share:config={config_path}",
            f"select:{fl}p_decode={args.p_decode}", f"select:{fl}p_decode={args.p_decode},share_config={config_path}",
            f"gemfilter:{fl}k=0.1"]

        def progress(r, spec, stats):
            print(f"  repeat {r + 1}/{args.repeats} {spec}: prefill {stats.prefill_s:.3f} s, "
                  f"decode {stats.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)

        gen_rows = run_bench(model, args.context, args.new_tokens, methods, args.repeats, 0, progress)
        print(f"\ngeneration, {args.context} prompt tokens + {args.new_tokens} new, {args.repeats} interleaved "
              f"repeats (medians):")
        print(format_bench(gen_rows))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": model.spec, "share_config": config_path, "layer": layer,
                                   "head_ops_skipped_all_layers": skipped_all, "attention_op": op_rows,
                                   "generation": gen_rows}, indent=1, default=str) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
