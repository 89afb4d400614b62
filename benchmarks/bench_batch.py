"""Batches: decoding throughput and KV memory of the eviction methods against full attention, many prompts at once.

    python benchmarks/bench_batch.py --out results/batch

Three measurements, each side by side in one process (methods in turn within every repeat, medians):

1. **Fixed batch** (`--batch`, `--context`, `--budget-tokens`): every method decodes the same batch of
   long prompts; tokens/s of the whole batch and KV bytes, relative to full attention.
2. **Batching pays** (`--short-context`, `--batches`): tokens/s of each method at each batch size,
   relative to the same method at batch 1.
3. **A KV memory cap** (`--kv-cap-mib`, default: what full attention needs for `--cap-full-sequences`
   sequences): how many sequences of `--context` tokens each method fits in the cap (from one sequence's
   measured peak), and the tokens/s of that batch, relative to full attention under the same cap.
4. **Batched evaluation** (`--eval-model`, `--eval-tasks`, `--eval-length`, `--eval-samples`,
   `--eval-batch`): `attnkit eval`'s harness at batch 1 and at `--eval-batch`, interleaved: wall time of
   each and whether every cell's score and predictions are the same.

Writes `OUT/capacity.json` (all rows), `OUT/capacity.md` (the three tables) and `OUT/capacity.png`;
`attnkit report DIR` shows the cap table and plot when `DIR/capacity.json` exists. The default model has
the bundled `tiny`'s geometry with random weights (timings do not depend on what the weights learnt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnkit.bench.capacity import capacity_rows, fixed_batch_rows, format_rows, scaling_rows
from attnkit.eval.report.plots import plot_capacity
from attnkit.eval.run.harness import run_eval
from attnkit.methods.spec import split_spec_list
from attnkit.model import load_model

TINY_GEOMETRY = "random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,context=16384"


def eval_rows(model, tasks: list[str], methods: list[str], length: int, samples: int, batch: int,
              repeats: int) -> list[dict]:
    """The eval harness at batch 1 and at `batch`, interleaved; medians of wall time, scores compared."""
    walls: dict[int, list[float]] = {1: [], batch: []}
    outcome: dict[int, list] = {}
    for _ in range(repeats):
        for size in (1, batch):
            start = time.perf_counter()
            rows = run_eval(model, tasks, [length], methods, samples, progress=False, batch_size=size)
            walls[size].append(time.perf_counter() - start)
            outcome[size] = [(r["task"], r["recipe"], r["score"], r.get("predictions")) for r in rows]
    base = statistics.median(walls[1])
    return [{"batch_size": size, "wall_s": statistics.median(walls[size]),
             "speedup": base / statistics.median(walls[size]), "same_scores": outcome[size] == outcome[1]}
            for size in (1, batch)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_GEOMETRY)
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of the fixed batch and the cap runs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--methods", default=None, help="comma-separated method specs; the first must be full "
                                                   "(default: full, streaming, h2o, snapkv at --budget-tokens)")
    p.add_argument("--short-context", type=int, default=128)
    p.add_argument("--batches", default="1,8", help="batch sizes of the scaling table (the first is the base)")
    p.add_argument("--short-new-tokens", type=int, default=64)
    p.add_argument("--kv-cap-mib", type=float, default=None)
    p.add_argument("--cap-full-sequences", type=int, default=2, help="default cap: full attention's KV for this "
                                                                      "many sequences of --context tokens")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eval-model", default="tiny")
    p.add_argument("--eval-tasks", default="passkey,kv_retrieval")
    p.add_argument("--eval-methods", default="full,snapkv:budget=0.3")
    p.add_argument("--eval-length", type=int, default=2048)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--eval-batch", type=int, default=8)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: fixed, scaling, cap, eval")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16 is what a GPU runs)")
    p.add_argument("--out", required=True, help="directory for capacity.json / .md / .png")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    b = f"budget_tokens={args.budget_tokens}"
    methods = split_spec_list(args.methods) if args.methods else ["full", f"streaming:{b}", f"h2o:{b}",
                                                                  f"snapkv:{b}"]
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "device": args.device, "threads": torch.get_num_threads(), "argv": sys.argv[1:]}
    tables = []
    if "fixed" not in skip:
        rows = fixed_batch_rows(model, methods, args.context, args.batch, args.new_tokens, args.repeats)
        result["fixed"] = rows
        tables.append(f"### Batch {args.batch}, {args.context}-token prompts\n\n" + format_rows(rows, [
            ("spec", "method"), ("tokens_per_s", "tokens/s"), ("tokens_per_s_vs_full", "tokens/s vs full"),
            ("peak_kv_bytes_per_sequence", "peak KV bytes / sequence"), ("peak_kv_vs_full", "peak KV vs full"),
            ("held_kv_bytes_total", "KV held after decoding"), ("held_kv_vs_full", "held KV vs full")]))
    if "scaling" not in skip:
        batches = [int(x) for x in args.batches.split(",")]
        rows = scaling_rows(model, methods, args.short_context, batches, args.short_new_tokens, args.repeats)
        result["scaling"] = rows
        tables.append(f"### Batch sizes, {args.short_context}-token prompts\n\n" + format_rows(rows, [
            ("spec", "method"), ("batch", "batch"), ("tokens_per_s", "tokens/s"),
            ("vs_first_batch", f"vs batch {batches[0]}")]))
    if "cap" not in skip:
        g = model.geometry
        per_token = 2 * g.n_layers * g.n_kv_heads * g.head_dim * model.dtype.itemsize
        cap = int(args.kv_cap_mib * 2**20) if args.kv_cap_mib else \
            args.cap_full_sequences * (args.context + args.new_tokens) * per_token
        rows = capacity_rows(model, methods, args.context, args.new_tokens, cap, args.max_batch, args.repeats)
        result["capacity"] = rows
        tables.append(f"### A KV cap of {cap / 2**20:.1f} MiB, {args.context}-token prompts\n\n" + format_rows(rows, [
            ("spec", "method"), ("kv_bytes_per_sequence", "KV bytes / sequence"), ("sequences", "sequences"),
            ("sequences_vs_full", "vs full"), ("tokens_per_s", "tokens/s"),
            ("tokens_per_s_vs_full", "tokens/s vs full")]))
        plot = plot_capacity(rows)
        if plot:
            (out / "capacity.png").write_bytes(plot.png)
    if "eval" not in skip:
        rows = eval_rows(load_model(args.eval_model, device=args.device, dtype=args.dtype), args.eval_tasks.split(","),
                         split_spec_list(args.eval_methods), args.eval_length, args.eval_samples, args.eval_batch,
                         args.repeats)
        result["eval"] = rows
        tables.append(f"### `attnkit eval` of {args.eval_model} at {args.eval_length} tokens, {args.eval_samples} "
                      f"samples per cell\n\n" + format_rows(rows, [
                          ("batch_size", "batch size"), ("wall_s", "wall s"), ("speedup", "vs batch 1"),
                          ("same_scores", "same scores and predictions as batch 1")]))
    (out / "capacity.json").write_text(json.dumps(result, indent=1) + "\n")
    text = f"Model {args.model} on {args.device}, {torch.get_num_threads()} threads, medians of {args.repeats}\n\n" \
        + "\n\n".join(tables) + "\n"
    (out / "capacity.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
