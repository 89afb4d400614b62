"""The C++ scoring kernel's prompt compressions inside vLLM's CPU worker on the torch thread count against one
worker, alternating, by attnkit's compaction metric: whether the kernel's second worker helps beside the engine's
own threads, which vLLM binds to the cores.

    python benchmarks/bench_vllm_workers.py --spec h2o:budget=0.2 --length 3900 --repeats 3

`--requests` prompts of about `--length` tokens (the bundled ``tiny``), 4 new tokens each; the method compresses each
prompt once per layer. The worker count is forced by wrapping :func:`attnkit.methods.scoring_native._sweep`, a
benchmark's knob only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attnkit
from attnkit.eval.data.task_registry import get_task
from attnkit.methods import scoring_native
from attnkit.vllm.stats import SchedulerWatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm as bv  # noqa: E402  (the engine set-up of the vLLM benchmarks)

WORKERS = {"count": None}  # None: the kernel's own choice (the torch thread count)
_sweep = scoring_native._sweep


def _forced(q, keys, values, scaling, reduce, rows, weights, threads, *args, **kwargs):
    return _sweep(q, keys, values, scaling, reduce, rows, weights, WORKERS["count"] or threads, *args, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="h2o:budget=0.2")
    parser.add_argument("--length", type=int, default=3900)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scoring_native._sweep = _forced
    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, args.length, seed=i).prompt for i in range(args.requests)]
    engine = bv.llm(max_model_len=4096, enable_prefix_caching=False, additional_config=bv.ON)
    watch = SchedulerWatch.attach(engine)
    bv.run_all(engine, watch, prompts[:1], args.spec, 4)  # warm: the kernel built, the guard's choice made
    for r in range(args.repeats):
        for count in (None, 1):
            WORKERS["count"] = count
            wall, *_, compressed, seconds = bv.run_all(engine, watch, prompts, args.spec, 4)
            print(f"repeat {r}: workers {count or 'torch'}: wall {wall:.2f} s, compressions {compressed:.0f} x "
                  f"{1e6 * seconds / max(compressed, 1):.0f} us", flush=True)


if __name__ == "__main__":
    main()
