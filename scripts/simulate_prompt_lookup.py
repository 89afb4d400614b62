"""Replay prompt lookup's drafting against a model's own greedy outputs, offline, under a cost model of
the verification forward: how many tokens a round would emit, and what speed-up over plain decoding a
verification costing ``1 + c * drafted`` one-token steps would give, or, with ``--measure-cost MODEL``,
the cost of a verification forward over ``n`` tokens measured on MODEL (in its one-token decoding steps,
at the same context length).

    OMP_NUM_THREADS=1 python scripts/simulate_prompt_lookup.py --model tiny --prompts 64 --cost 0.12
    OMP_NUM_THREADS=1 python scripts/simulate_prompt_lookup.py --model tiny --prompts 64 --measure-cost tiny

The measured costs are steady-state costs: forwards of one length in a row, after an untimed one (see
:func:`measure_verify_costs`). Inside the speculative loop, where the length changes from round to
round, a forward that does not follow one of its own size costs 5-20 % more, and the loop's own work
(lookup, acceptance, rollback) adds about 3 %, so the modelled speed-ups run above the benchmark's: 2.11x
modelled (64 prompts, ``--cost 0.12``) against 1.90x measured (2026-11-23, 1 thread, the same 64 prompts).
They rank drafting policies; the benchmark (scripts/bench_speculative.py) measures them.

Measuring another model's costs (e.g. a random-weight model of a larger geometry) replays `--model`'s
acceptances at that model's costs: what prompt lookup would give a model of that size if it copied as
well as ``tiny`` does (a projection, not a measurement of that model).

Greedy speculative output equals plain greedy output, so the target's verdicts are known in advance:
a draft is accepted while it agrees with the greedy continuation. The replay drives the real
:class:`attnkit.speculative.drafts.PromptLookupDraft` (adaptive proposal sizing, its acceptance model
updated by the verdicts) for each option set in ``--grid``, and also an oracle that copies the same
earlier occurrence but proposes exactly the drafts that will pass plus one (the bound on what better
proposal sizing alone could give). Prompts are the held-out code prompts of the speed benchmark
(:func:`attnkit.speculative.bench.code_prompt`, seeds 0..N-1).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import attnkit  # noqa: E402
from attnkit.methods.base import Step  # noqa: E402
from attnkit.runner import forward, logits_of, new_session, prefill  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import PromptLookupDraft, drop_newest  # noqa: E402
from attnkit.speculative.generate import VerifyingFull  # noqa: E402


def measure_verify_costs(spec: str, context: int, max_tokens: int, repeats: int = 7,
                         calls: int = 10) -> tuple[list[float], dict[int, float]]:
    """Cost of a target forward over ``n = 1 .. max_tokens`` tokens after a `context`-token prompt, in
    one-token decoding steps (``[0]`` is 1), timed as the speculative loop runs it (``n = 1`` a decoding
    step, more tokens a verification step): each ``n`` `calls` times per repeat, the ``n`` interleaved
    within a repeat, each block of timed calls after one untimed call of the same size; medians over
    `repeats`. Also the order penalty: the cost of a forward right after one over ``max_tokens`` tokens,
    over its cost after one of its own size, for a few sizes (``{n: ratio}``).

    The untimed call matters: on this CPU a forward that follows a larger one runs 5-20 % slower than
    the same forward after one of its own size (a lone attention call over 2k keys: 46 -> 64 us for one
    query after one of 17; not the allocator: tuned glibc, jemalloc and tcmalloc give the same). Any
    break in routine does it, a pause more than a change of size: a one-token forward costs 7 % more
    after a 4-token one, 9 % after a 17-token one, and 15-17 % after 5 ms of sleep, of a Python loop or
    of unrelated GEMMs (medians of 60 alternations, 2026-11-22). So timing the first call of each block made
    ``n = 1``, which follows the largest size, too dear and every ratio too small.
    The loop alternates sizes, so it pays part of that penalty; the steady costs are a lower bound."""
    model = attnkit.load_model(spec)
    session = new_session(model, VerifyingFull(), context, max_tokens)
    with torch.inference_mode():
        prefill(model, session, code_prompt(model, context))

        def run(n):
            ids = torch.randint(3, 200, (n,), device=model.device)
            phase = "decode" if n == 1 else "prefill"
            t = time.perf_counter()
            logits_of(model, forward(model, ids, context, lambda pos: Step(session, phase, pos, False),
                                     all_positions=True))
            elapsed = time.perf_counter() - t
            drop_newest(session, n)
            return elapsed

        times: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
        for n in times:  # warm-up
            run(n)
        for _ in range(repeats):
            for n in times:
                run(n)
                times[n].append(statistics.mean(run(n) for _ in range(calls)))
        after_big: dict[int, list[float]] = {n: [] for n in (1, 2, 4, 8) if n < max_tokens}
        after_own: dict[int, list[float]] = {n: [] for n in after_big}
        for _ in range(repeats * calls):
            for n in after_big:
                run(max_tokens)
                after_big[n].append(run(n))
                after_own[n].append(run(n))
    one = statistics.median(times[1])
    penalty = {n: statistics.median(after_big[n]) / statistics.median(after_own[n]) for n in after_big}
    return [statistics.median(times[n]) / one for n in times], penalty


def replay(prompt: list[int], truth: list[int], source: PromptLookupDraft | None, cost: float | list[float],
           cap: int, verify_cost: float) -> tuple[int, int, float]:
    """(tokens emitted after the first, rounds, modelled cost in one-token steps) of one generation.
    `source` None: the oracle (the source's match, proposals sized by hindsight). `cost`: per drafted
    token, or the measured cost of a forward over ``n + 1`` tokens at index ``n`` (drafted tokens)."""
    drafter = dataclasses.replace(source) if source is not None else PromptLookupDraft()  # a fresh index
    drafter.adaptive, drafter.verify_cost = source is not None, verify_cost
    context, i, rounds, steps = prompt + truth[:1], 1, 0, 0.0
    while i < len(truth):
        g = min(cap, len(truth) - i - 1)
        proposal = drafter.lookup(context, g) if g > 0 else []
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == truth[i + accepted]:
            accepted += 1
        if source is None:  # hindsight: the passing drafts and the first failing one
            proposal = proposal[:accepted + 1]
        elif g > 0:
            drafter.feedback(accepted)
        new = truth[i:i + accepted + 1]
        context += new
        i += len(new)
        rounds += 1
        steps += cost[len(proposal)] if isinstance(cost, list) else 1.0 + cost * len(proposal)
    return len(truth) - 1, rounds, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--cost", type=float, default=0.12, help="verification cost per drafted token, in steps")
    ap.add_argument("--measure-cost", default=None, metavar="MODEL",
                    help="use the verification costs measured on this model spec instead of --cost")
    ap.add_argument("--verify-cost", default="0.1",
                    help="the drafter's own cost estimate (sizing); several, separated by ',', give a row each")
    ap.add_argument("--max-gamma", type=int, default=16)
    ap.add_argument("--grid", default="max_ngram=3;max_ngram=4;max_ngram=8;max_ngram=12;max_ngram=3,max_candidates=2;"
                    "max_ngram=3,max_candidates=4;max_ngram=8,max_candidates=4",
                    help="option sets of prompt_lookup, separated by ';'")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_cost:
        cost, penalty = measure_verify_costs(args.measure_cost, args.context, args.max_gamma + 1)
        described = (f"verification costs measured on {args.measure_cost} at {args.context} tokens, n = 1.."
                     f"{args.max_gamma + 1}: " + " ".join(f"{c:.2f}" for c in cost)
                     + f"; a forward right after one over {args.max_gamma + 1} tokens costs "
                     + ", ".join(f"{r:.2f}x (n = {n})" for n, r in penalty.items()) + " its steady cost")
    else:
        cost, described = args.cost, f"verification modelled as 1 + {args.cost} x drafted steps"
    model = attnkit.load_model(args.model)
    runs = []
    for seed in range(args.prompts):
        ids = code_prompt(model, args.context, seed)
        out = attnkit.generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
        runs.append((ids.tolist(), out.token_ids))
    print(f"{args.model}: {args.prompts} held-out code prompts of {args.context} tokens, {args.new_tokens} greedy "
          f"tokens; cap {args.max_gamma}; {described}")
    print(f"{'drafter':<40} {'sizing cost':>11} {'tok/round':>9} {'x plain':>8} {'median prompt x plain':>22}")
    sets = [(spec, PromptLookupDraft(**{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}))
            for spec in args.grid.split(";")] + [("oracle sizing (max_ngram=3)", None)]
    for spec, source in sets:
        for verify_cost in [float(v) for v in args.verify_cost.split(",")] if source is not None else [0.0]:
            rows = [replay(p, t, source, cost, args.max_gamma, verify_cost) for p, t in runs]
            tokens, rounds, steps = (sum(r[k] for r in rows) for k in range(3))
            per_prompt = statistics.median(r[0] / r[2] for r in rows)
            sizing = f"{verify_cost:g}" if source is not None else "-"
            print(f"{spec:<40} {sizing:>11} {tokens / rounds:>9.2f} {tokens / steps:>8.2f} {per_prompt:>22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
