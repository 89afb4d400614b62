"""``attnkit tune``: the recipe for a model, tasks and lengths that keeps an accuracy floor at the least cost
(:mod:`attnkit.eval.tune.search`); resumable from ``--out``, on Ray with ``--ray``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit.cli.commands import load
from attnkit.cli.evaluate import DEFAULT_MULTI_QUERIES, check_ray_options
from attnkit.cli.options import int_list, name_list
from attnkit.errors import AttnkitError


def cmd_tune(args: argparse.Namespace) -> int:
    from attnkit.eval.run.sweep import positions_for
    from attnkit.eval.tune.search import RECIPE_FILE, TuneSettings, run_tune, summary_text
    from attnkit.eval.tune.space import load_space

    if not args.out:
        raise AttnkitError("tune needs --out DIR (where results.jsonl, recipe.json and the report are written)")
    check_ray_options(args)
    protocol = args.protocol
    queries = args.queries if args.queries is not None else (DEFAULT_MULTI_QUERIES if protocol == "multi-query" else 1)
    settings = TuneSettings(
        tasks=name_list(args.tasks, "--tasks"), lengths=int_list(args.lengths, "--lengths", minimum=2),
        model=args.model, floor=args.floor, target=args.target, samples=args.samples, rounds=args.rounds,
        eta=args.eta, seed=args.seed, protocol=protocol, queries=queries, confirm=args.confirm,
        space=load_space(args.space) if args.space else None,
        **({} if args.batch_size is None else {"batch_size": args.batch_size}))
    settings.check()
    echo(f"tune {settings.model}: {settings.target} at score / full >= {settings.floor:g} on "
         f"{', '.join(settings.tasks)} x {', '.join(map(str, settings.lengths))} tokens; "
         f"{settings.rounds} rounds of {' + '.join(str(n) for n, _ in settings.plan()[:-1])} samples -> {args.out}")
    if args.ray:
        from attnkit.eval.run.ray_cells import CellPool

        with CellPool(settings.model, positions=positions_for(settings.lengths), workers=args.workers,
                      address=args.ray_address) as pool:
            echo(f"{len(pool.actors)} Ray workers on {pool.device}")
            log = run_tune(settings, args.out, pool=pool, progress=not args.no_progress, echo=echo)
    else:
        model = load(settings.model, positions_for(settings.lengths), args) if args.device_map else None
        log = run_tune(settings, args.out, model=model, progress=not args.no_progress, echo=echo)
    print(summary_text(log))
    out = Path(args.out)
    print(f"recipe: {out / RECIPE_FILE}; report: {out / 'report.html'}; log: {out / 'tune.json'}; Pareto front: "
          f"{out / 'pareto.json'}", file=sys.stderr)
    if not log["winner"]["fallback"] and not settings.confirm:
        n, seed = settings.plan()[-1]
        print(f"check it on fresh samples: attnkit eval --model {settings.model} --tasks {','.join(settings.tasks)} "
              f"--lengths {','.join(map(str, settings.lengths))} --methods full --recipe {out / RECIPE_FILE} "
              f"--samples {n} --seed {seed}", file=sys.stderr)
    return 0


def echo(line: str) -> None:
    print(line, file=sys.stderr)
