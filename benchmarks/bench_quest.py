"""Quest's decoding step against full attention's, at a long context: the step's attention alone, and whole
decoding steps of a model (tokens per second), interleaved in one process, medians of repeats.

    python benchmarks/bench_quest.py --context 32768 --fraction 0.0625 --repeats 30

**Attention** (one layer, random keys and values in the layer geometry of `--model`): full's step is what the runner
does for a decoding query over the whole cache (:func:`attnkit.attention.sdpa`, grouped kv heads folded); Quest's
is the page bounds, the page choice and the attention over the chosen pages (the C++ kernel here; ``torch`` gathers
the pages instead, for comparison). `--fraction` of the context is read (``token_budget = fraction x context``).

**Decoding** (the whole model, random weights of `--model`'s geometry): each method prefills the same prompt once;
then rounds of `--steps` decoding steps, one step of each method in turn (the sessions copied each round), each
step's wall time recorded; tokens per second = 1 / median step. Quest runs with ``dense_layers=0`` (every layer
sparse) and with the paper's ``dense_layers=2``.

Prints a table of medians and ratios to full, and the bytes each step read (Quest's stats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import attnkit  # noqa: E402
from attnkit.attention import sdpa  # noqa: E402
from attnkit.cache import LayerKV  # noqa: E402
from attnkit.forward import forward, logits_of, prefill  # noqa: E402
from attnkit.methods import quest_native  # noqa: E402
from attnkit.methods.quest_pages import PagedLayerKV, choose_pages, gathered_attention, page_bounds  # noqa: E402
from attnkit.methods.spec import parse_method_spec  # noqa: E402
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

    runs = {"full": full, "quest (C++: choice, attention)": quest, "quest (torch: bounds, top-k, gather)": lambda q: quest(q, kernel=False)}
    if quest_native.library() is None:
        del runs["quest (C++: choice, attention)"]
    times = {name: [] for name in runs}
    for r in range(args.repeats + 3):
        q = torch.randn(1, g.n_q_heads, 1, g.head_dim, generator=gen)
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(q)
            if r >= 3:  # warm-up rounds are not counted
                times[name].append(time.perf_counter() - start)
    return [(name, statistics.median(t)) for name, t in times.items()]


def decode_steps(args) -> tuple[list[tuple[str, float]], dict]:
    model = attnkit.load_model(args.model)
    budget = int(args.fraction * args.context)
    specs = {"full": "full", f"quest:token_budget={budget},dense_layers=0": None,
             f"quest:token_budget={budget} (dense_layers=2)": f"quest:token_budget={budget}"}
    ids = torch.randint(3, model.geometry.vocab_size, (args.context,), generator=torch.Generator().manual_seed(1))
    sessions, firsts = {}, {}
    for label, spec in specs.items():
        method = parse_method_spec(spec or label)
        session = new_session(model, method, args.context, args.steps * (args.rounds + 1) + 1)
        with torch.no_grad():
            hidden = prefill(model, session, ids)
        sessions[label], firsts[label] = session, logits_of(model, hidden).argmax(-1)
    times = {label: [] for label in specs}
    position = args.context
    for _ in range(args.rounds):
        tokens = dict(firsts)
        for step in range(args.steps):
            for label, session in sessions.items():
                start = time.perf_counter()
                with torch.no_grad():
                    hidden = forward(model, tokens[label], position + step,
                                     lambda pos, s=session: Step(s, "decode", pos))
                    tokens[label] = logits_of(model, hidden).argmax(-1)
                times[label].append(time.perf_counter() - start)
        position += args.steps
    stats = {label: s.method.run_stats(s) for label, s in sessions.items()}
    return [(label, statistics.median(t)) for label, t in times.items()], stats


def table(rows: list[tuple[str, float]], unit: str) -> str:
    base = rows[0][1]
    lines = [f"{'':44} {unit:>12} {'speed vs full':>14}"]
    lines += [f"{name:44} {t * 1e3:12.3f} {base / t:13.2f}x" for name, t in rows]
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
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"context {args.context}, Quest reads {args.fraction:.4f} of it, page {args.page_size}, "
          f"{torch.get_num_threads()} threads, model {args.model}")
    print("\none layer's decoding attention (median ms per step)")
    print(table(attention_steps(args), "ms/step"))
    if not args.skip_decode:
        rows, stats = decode_steps(args)
        print("\nwhole decoding steps (median ms per token; speed = tokens/s over full's)")
        print(table(rows, "ms/token"))
        for label, st in stats.items():
            if st:
                print(f"{label}: reads {st['quest_bytes_read_per_step'] / 2**20:.2f} MiB per step of "
                      f"{st['quest_full_bytes_per_step'] / 2**20:.2f} MiB (fraction {st['quest_read_fraction']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
