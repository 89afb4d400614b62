"""Prefill time of the scoring eviction methods (h2o, keyformer, snapkv) against full attention.

    OMP_NUM_THREADS=1 python benchmarks/bench_scoring.py --lengths 8192,32768 --repeats 3 --threads 1 \
        --out results/bench_scoring.json
    OMP_NUM_THREADS=1 python benchmarks/bench_scoring.py --lengths 8192 --threads 1 --native avx2,avx512,off

``--native`` runs every method after the first (the reference) once per setting, all interleaved in one process:
an instruction set (``avx2``, ``avx512``, ``native``: the C++ kernels built for it, run where the guard of
:mod:`attnkit.native.guard` finds them faster, or always with ``ATTNKIT_NATIVE=1`` in the environment),
``<isa>:on`` (that build, always run) or ``off`` (the torch path, ``ATTNKIT_NATIVE=0``). Each row says which
kernels ran (``native``: the guard's choices its runs consulted, ``-`` for none).

A scoring method pays for its prompt statistics on every prompt: H2O and Keyformer sum a function of every
prompt query's attention per key (computed in the same sweep as the prompt's attention output: on a CPU by the C++
kernel of :mod:`attnkit.methods.scoring_native`, ``ATTNKIT_NATIVE=0`` for the torch path), SnapKV scores only its
observation window.
With ``--clock cpu`` the times are the process's CPU seconds per call instead (one thread: the work done, not the
waits for a core where other processes share the machine).
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
import dataclasses
import json
import statistics
import sys
import time

import torch

import attnkit
from attnkit import native
from attnkit.methods.spec import parse_method_spec
from attnkit.model import load_model
from attnkit.native import guard

DEFAULT_MODEL = ("random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,"
                 "context=40000")
DEFAULT_METHODS = "full;h2o:budget=0.2;keyformer:budget=0.2;snapkv:budget=0.2"


def prefill_seconds(model, ids, spec: str, clock: str = "wall") -> float:
    """The prefill's wall seconds (``stats.prefill_s``), or with `clock` ``cpu`` the process's CPU seconds over the
    whole call (the prefill and one token)."""
    start = time.process_time()
    out = attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=1, stop_at_eos=False)
    return out.stats.prefill_s if clock == "wall" else time.process_time() - start


def setting(text: str | None) -> tuple[str | None, str | None]:
    """``--native``'s entry -> (instruction set, ``$ATTNKIT_NATIVE``) for :func:`attnkit.native.settings`."""
    if text is None:
        return None, None
    if text == "off":
        return None, "0"
    isa, _, forced = text.partition(":")
    if forced not in ("", "on"):
        raise SystemExit(f"bench_scoring: --native entries are an instruction set, <isa>:on or off; got {text!r}")
    return isa, "1" if forced else None


def runs_of(methods: list[str], settings: list[str]) -> list[tuple[str, str, str | None]]:
    """(label, spec, setting) of every run of a repeat: the reference once, each other method per setting."""
    runs = [(methods[0], methods[0], None)]
    for m in methods[1:]:
        runs += [(f"{m} [{s}]" if s else m, m, s) for s in settings or [None]]
    return runs


def bench_length(model, length: int, methods: list[str], repeats: int, seed: int, say,
                 warmup: bool = True, settings: list[str] | None = None, clock: str = "wall") -> list[dict]:
    ids = torch.randint(3, model.geometry.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    runs = runs_of(methods, settings or [])
    used: dict[str, str] = {}

    def run(label, spec, which) -> float:
        mark = guard.mark()
        with native.settings(*setting(which)):
            t = prefill_seconds(model, ids, spec, clock)
        used[label] = guard.summary(mark)
        return t

    for label, spec, which in runs if warmup else ():  # warm-up (the noise tables, the allocator, the guard)
        run(label, spec, which)
    times: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for r in range(repeats):
        for label, spec, which in runs:
            t = run(label, spec, which)
            times[label].append(t)
            say(f"  [{length}] repeat {r + 1}/{repeats} {label}: prefill {t:.2f} s")
    full = times[runs[0][0]]
    return [{"length": length, "method": label, "prefill_s": statistics.median(times[label]),
             "prefill_all_s": times[label], "native": used[label],
             "speed_vs_full": statistics.median(f / t for f, t in zip(full, times[label]))} for label, _, _ in runs]


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
    p.add_argument("--native", default="", help="settings of the C++ kernels each method after the first runs under, "
                   "comma-separated: an instruction set (avx2, avx512, native), <isa>:on, off (default: the "
                   "environment's, once)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: the prefill's wall time; cpu: the process's CPU time per call (with one thread, what "
                        "the run computed, not its waits for a core on a shared machine)")
    p.add_argument("--extend-context", action="store_true",
                   help="raise the model's position limit to the longest length (RoPE extrapolates untrained: the "
                        "timing is meaningful, the outputs are not): the bundled tiny at 8k")
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
    longest = max(int(x) for x in args.lengths.split(","))
    if args.extend_context and model.geometry.max_positions <= longest:
        model.hf.config.max_position_embeddings = longest + 1
        model.geometry = dataclasses.replace(model.geometry, max_positions=longest + 1)
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        t0 = time.perf_counter()
        rows += bench_length(model, length, methods, args.repeats, args.seed, say, not args.no_warmup,
                             [x.strip() for x in args.native.split(",") if x.strip()], args.clock)
        say(f"  [{length}] done in {time.perf_counter() - t0:.0f} s")
    print(f"model {args.model}, {torch.get_num_threads()} thread(s), {args.repeats} repeats, "
          f"attnkit {attnkit.__version__}, torch {torch.__version__}")
    print(f"CPU {native.cpu_model()}, ATTNKIT_NATIVE={native.switch()}, clock {args.clock}")
    width = max(24, *(len(r["method"]) for r in rows))
    print(f"{'length':>7} {'method':<{width}} {'prefill s':>10} {'speed vs full':>14}  native (kernel: on/off, isa, why)")
    for r in rows:
        print(f"{r['length']:>7} {r['method']:<{width}} {r['prefill_s']:>10.2f} {r['speed_vs_full']:>13.2f}x  "
              f"{r['native']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
