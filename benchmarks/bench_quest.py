"""Quest's decoding step against full attention's, at a long context: the step's attention alone, and whole
decoding steps of a model (tokens per second), interleaved in one process, medians of repeats.

    python benchmarks/bench_quest.py --context 32768 --fraction 0.0625 --repeats 30
    python benchmarks/bench_quest.py --context 32768 --fraction 0.0625 --repeats 30 --threads 1 --native avx2,avx512

**Attention** (one layer, random keys and values in the layer geometry of `--model`): full's step is what the runner
does for a decoding query over the whole cache (:func:`attnkit.attention.sdpa`, grouped kv heads folded); Quest's
is the page bounds, the page choice and the attention over the chosen pages (the C++ kernel here; ``torch`` gathers
the pages instead, for comparison). `--fraction` of the context is read (``token_budget = fraction x context``).
Each round draws a query and runs every variant on it, in a new order every round (a step leaves the pages it chose
in the caches for the next).

**Decoding** (the whole model, random weights of `--model`'s geometry): each method prefills the same prompt once;
then rounds of `--steps` decoding steps, one step of each method in turn (the sessions copied each round), each
step's wall time recorded; tokens per second = 1 / median step. Quest runs with ``dense_layers=0`` (every layer
sparse) and with the paper's ``dense_layers=2``.

``--native`` runs the C++ rows once per instruction set named (``avx2``, ``avx512``, ``native``: the kernels built
for it; :mod:`attnkit.native`), interleaved with the others in one process, and the ``dense_layers=0`` decoding once
per instruction set and once on the torch path (``ATTNKIT_NATIVE=0``); where the guard of
:mod:`attnkit.native.guard` decides (``ATTNKIT_NATIVE`` unset), the decoding rows say what it chose.

Prints the CPU, a table of medians and ratios to full, and the bytes each step read (Quest's stats).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import attnkit  # noqa: E402
from attnkit import native  # noqa: E402
from attnkit.attention import sdpa  # noqa: E402
from attnkit.cache import LayerKV  # noqa: E402
from attnkit.forward import forward, logits_of, prefill  # noqa: E402
from attnkit.methods import quest_native  # noqa: E402
from attnkit.methods.quest_pages import PagedLayerKV, choose_pages, gathered_attention, page_bounds  # noqa: E402
from attnkit.methods.spec import parse_method_spec  # noqa: E402
from attnkit.native import guard  # noqa: E402
from attnkit.session import Step, new_session  # noqa: E402

TINY_GEOMETRY = "random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,context=40000"


def attention_steps(args) -> list[tuple[str, float]]:
    g = attnkit.load_model(args.model).geometry
    n, ps = args.context, args.page_size
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, g.n_kv_heads, n, g.head_dim, generator=gen)
    values = torch.randn(1, g.n_kv_heads, n, g.head_dim, generator=gen)
    layer = PagedLayerKV.around(LayerKV.allocate(1, g.n_kv_heads, n, g.head_dim, torch.float32, keys.device), ps)
    layer.append(keys, values, torch.arange(n))
    pages = layer.pages
    count = max(2, int(args.fraction * n) // ps)
    scaling = g.head_dim ** -0.5

    def full(q):
        return sdpa(q, keys, values, scaling)

    def quest(q, kernel=True):
        summaries = layer.page_min[:, :, :pages], layer.page_max[:, :, :pages]
        if kernel:
            chosen = quest_native.choose_pages(q, *summaries, count, False, 0, ps)
            return quest_native.paged_decode(q, keys, values, chosen, ps, n, scaling)
        chosen = choose_pages(page_bounds(q, *summaries), count, False)
        return gathered_attention(q, keys, values, chosen, ps, n, scaling)

    runs = {"full": (full, None)}
    for isa in args.native or [None]:
        with native.settings(isa):
            if quest_native.library() is not None:
                isa_name = native.built_isa(quest_native.library())
                runs[f"quest (C++ {isa or 'native'} build: {isa_name}; choice, attention)"] = (quest, isa)
    runs["quest (torch: bounds, top-k, gather)"] = (lambda q: quest(q, kernel=False), None)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.repeats + 3):
        q = torch.randn(1, g.n_q_heads, 1, g.head_dim, generator=gen)
        # a new order every round: a step leaves the pages it chose in the caches for the next one
        for name in random.Random(r).sample(names, len(names)):
            fn, isa = runs[name]
            with native.settings(isa):
                start = args.timer()
                fn(q)
                elapsed = args.timer() - start
            if r >= 3:  # warm-up rounds are not counted
                times[name].append(elapsed)
    return [(name, statistics.median(t)) for name, t in times.items()]


def decode_steps(args) -> tuple[list[tuple[str, float]], dict, dict]:
    model = attnkit.load_model(args.model)
    budget = int(args.fraction * args.context)
    sparse = f"quest:token_budget={budget},dense_layers=0"
    specs = {"full": ("full", None)}  # label -> (spec, native setting: instruction set, or "off")
    for which in [*(args.native or [None]), *(["off"] if args.native else [])]:
        specs[f"{sparse} [{which}]" if which else sparse] = (sparse, which)
    specs[f"quest:token_budget={budget} (dense_layers=2)"] = (f"quest:token_budget={budget}", None)
    ids = torch.randint(3, model.geometry.vocab_size, (args.context,), generator=torch.Generator().manual_seed(1))
    sessions, firsts = {}, {}
    for label, (spec, _) in specs.items():
        method = parse_method_spec(spec)
        session = new_session(model, method, args.context, args.steps * (args.rounds + 1) + 1)
        with torch.no_grad():
            hidden = prefill(model, session, ids)
        sessions[label], firsts[label] = session, logits_of(model, hidden).argmax(-1)
    times = {label: [] for label in specs}
    used = {label: "-" for label in specs}
    position = args.context
    for _ in range(args.rounds):
        tokens = dict(firsts)
        for step in range(args.steps):
            for label, session in sessions.items():
                which = specs[label][1]
                mark = guard.mark()
                with native.settings(*((None, "0") if which == "off" else (which, None))):
                    start = args.timer()
                    with torch.no_grad():
                        hidden = forward(model, tokens[label], position + step,
                                         lambda pos, s=session: Step(s, "decode", pos))
                        tokens[label] = logits_of(model, hidden).argmax(-1)
                    times[label].append(args.timer() - start)
                used[label] = guard.summary(mark)
        position += args.steps
    stats = {label: s.method.run_stats(s) for label, s in sessions.items()}
    return [(label, statistics.median(t)) for label, t in times.items()], stats, used


def table(rows: list[tuple[str, float]], unit: str, notes: dict | None = None) -> str:
    base = rows[0][1]
    width = max(44, *(len(name) for name, _ in rows))
    lines = [f"{'':{width}} {unit:>12} {'speed vs full':>14}" + ("  native (kernel: on/off, isa, why)" if notes else "")]
    lines += [f"{name:{width}} {t * 1e3:12.3f} {base / t:13.2f}x" + (f"  {notes[name]}" if notes else "")
              for name, t in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=TINY_GEOMETRY)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--fraction", type=float, default=1 / 16, help="share of the context a Quest step reads")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30, help="attention steps timed per method")
    p.add_argument("--steps", type=int, default=16, help="decoding steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--native", default="", help="instruction sets to build and run the C++ kernels for, "
                   "comma-separated (avx2, avx512, native; default: $ATTNKIT_NATIVE_ISA, else native)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the process's CPU time (with one thread: the work done, not the waits for a "
                        "core on a shared machine)")
    args = p.parse_args(argv)
    args.native = [x.strip() for x in args.native.split(",") if x.strip()]
    args.timer = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"context {args.context}, Quest reads {args.fraction:.4f} of it, page {args.page_size}, "
          f"{torch.get_num_threads()} threads, model {args.model}")
    print(f"CPU {native.cpu_model()}, ATTNKIT_NATIVE={native.switch()}, clock {args.clock}")
    print("\none layer's decoding attention (median ms per step)")
    print(table(attention_steps(args), "ms/step"))
    if not args.skip_decode:
        rows, stats, used = decode_steps(args)
        print("\nwhole decoding steps (median ms per token; speed = tokens/s over full's)")
        print(table(rows, "ms/token", used))
        for label, st in stats.items():
            if st:
                print(f"{label}: reads {st['quest_bytes_read_per_step'] / 2**20:.2f} MiB per step of "
                      f"{st['quest_full_bytes_per_step'] / 2**20:.2f} MiB (fraction {st['quest_read_fraction']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
