"""Ray's overhead on a sweep: 24 short cells run without Ray and on Ray workers, in one run of this script.

    OMP_NUM_THREADS=1 python benchmarks/bench_ray_sweep.py --workers 2 --length 1024 --samples 4 \
        --repeats 3 --out results/bench_ray_sweep.json

The sweep: tasks passkey and code_completion at one length, each with full, snapkv and window at four budgets,
streaming and h2o at one, and prompt-lookup speculative decoding (2 x 12 = 24 cells) on `--model`. Each repeat
runs it from scratch into a fresh results directory twice, interleaved: in this process with one torch thread
(``attnkit eval --sweep``), and on a pool of `--workers` Ray actors with one thread each (``--ray``; a local
Ray started once, before the first repeat, the actors keeping the model between repeats). The rows of the two
runs must be the same (timings aside), or the script stops.

Printed, medians over repeats: the wall time without Ray; with Ray the sweep's wall time and their ratio (the
goal on a two-core machine with two workers: at most 0.65), and once, what starting costs (Ray, the actors,
their models), with the ratio of start + sweep to the plain sweep. Per-cell overhead: the actors' time not
spent inside a cell, per cell ((workers x sweep wall - the cells' walls) / cells: scheduling, transfers, the
driver's work between cells, idle actors at the end), and the median latency from a cell's end on its worker
to its outcome in the driver (the result's transfer). `--out` writes every measurement as JSON.

Smallest run (a check that it works, not a measurement): ``--length 256 --samples 1 --repeats 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from attnkit.eval.run import results as results_store
from attnkit.eval.run.ray_cells import CellPool
from attnkit.eval.run.sweep import run_sweep, sweep_from_dict, sweep_positions


def sweep_spec(model: str, length: int, samples: int) -> dict:
    return {"model": model, "samples": samples, "seed": 0, "tasks": ["passkey", "code_completion"],
            "lengths": [length], "budgets": [0.2, 0.4, 0.6, 0.8],
            "recipes": ["snapkv", "window", "streaming:budget=0.3", "h2o:budget=0.3",
                        {"name": "pl", "decode": {"speculate": "prompt_lookup", "gamma": 4}}]}


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in results_store.VOLATILE_FIELDS} for r in rows]


class Recorder:
    """Wraps a pool's ``run`` to note each outcome and when the driver received it."""

    def __init__(self, pool: CellPool):
        self.pool, self.real, self.seen = pool, pool.run, []
        pool.run = self.run

    def run(self, jobs, follow=None):
        for job, outcome in self.real(jobs, follow):
            self.seen.append((time.time(), outcome))
            yield job, outcome


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens of every cell")
    p.add_argument("--samples", type=int, default=4, help="samples per cell")
    p.add_argument("--workers", type=int, default=2, help="Ray actors (one torch thread each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for every measurement")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sweep_dict = sweep_spec(args.model, args.length, args.samples)
    cells = sweep_from_dict(sweep_dict).cell_count()
    t0 = time.perf_counter()
    pool = CellPool(args.model, positions=sweep_positions(sweep_from_dict(sweep_dict)), workers=args.workers,
                    threads=1)
    start_s = time.perf_counter() - t0
    recorder = Recorder(pool)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ray-sweep-") as tmp:
            for r in range(args.repeats):
                t = time.perf_counter()
                plain = run_sweep(sweep_from_dict(sweep_dict), Path(tmp) / f"plain{r}", progress=False)
                plain_s = time.perf_counter() - t
                recorder.seen.clear()
                t = time.perf_counter()
                on_ray = run_sweep(sweep_from_dict(sweep_dict), Path(tmp) / f"ray{r}", progress=False, pool=pool)
                ray_s = time.perf_counter() - t
                if stable(on_ray) != stable(plain):
                    raise SystemExit("the rows on Ray differ from the rows without Ray")
                cell_s = sum(o["wall_s"] for _, o in recorder.seen)
                runs.append({"plain_s": plain_s, "ray_s": ray_s, "cells_s": cell_s,
                             "overhead_per_cell_s": (args.workers * ray_s - cell_s) / cells,
                             "result_latency_s": statistics.median(got - o["ended"] for got, o in recorder.seen),
                             "cells_per_worker": {str(pid): sum(o["pid"] == pid for _, o in recorder.seen)
                                                  for pid in sorted({o["pid"] for _, o in recorder.seen})}})
    finally:
        pool.close()

    def med(key):
        return statistics.median(run[key] for run in runs)

    plain_s, ray_s = med("plain_s"), med("ray_s")
    summary = {"model": args.model, "length": args.length, "samples": args.samples, "cells": cells,
               "workers": args.workers, "repeats": args.repeats, "plain_s": plain_s, "ray_s": ray_s,
               "ratio": ray_s / plain_s, "start_s": start_s, "ratio_with_start": (start_s + ray_s) / plain_s,
               "overhead_per_cell_s": med("overhead_per_cell_s"), "result_latency_s": med("result_latency_s"),
               "runs": runs}
    print(f"{cells} cells on {args.model}, {args.length} tokens x {args.samples} samples, {args.workers} Ray workers, "
          f"medians of {args.repeats}")
    print("| without Ray (s) | Ray sweep (s) | ratio | Ray start (s) | ratio with start | overhead per cell (s) "
          "| result latency (ms) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {plain_s:.2f} | {ray_s:.2f} | {ray_s / plain_s:.2f} | {start_s:.1f} | "
          f"{(start_s + ray_s) / plain_s:.2f} | {summary['overhead_per_cell_s']:.3f} | "
          f"{1000 * summary['result_latency_s']:.1f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
