"""``attnkit eval``, ``report``, ``demo`` and ``calibrate``: task scores of methods against full attention,
the HTML report of a results directory, and the offline calibration tools."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings
from pathlib import Path

from attnkit.cli.commands import load, recipe_files
from attnkit.cli.options import int_list, name_list
from attnkit.errors import AttnkitError
from attnkit.methods.spec import split_spec_list
from attnkit.validate import whole


def protocol_options(args: argparse.Namespace) -> dict:
    """``--protocol``, ``--queries`` and ``--seeds`` as :func:`attnkit.eval.run.harness.run_eval`'s keywords (only
    those given; ``--queries`` defaults to 4 when multi-query runs)."""
    out = {}
    if args.protocol is not None:
        out["protocols"] = name_list(args.protocol, "--protocol")
    if args.queries is not None:
        out["queries"] = whole("--queries", args.queries, minimum=1)
    elif "multi-query" in out.get("protocols", []):
        out["queries"] = DEFAULT_MULTI_QUERIES
    if args.seeds is not None:
        out["seeds"] = int_list(args.seeds, "--seeds", minimum=0)
    return out


DEFAULT_MULTI_QUERIES = 4


def long_output_options(args: argparse.Namespace) -> dict:
    """``--continuation-tokens`` and ``--stretch-tokens`` as :func:`attnkit.eval.run.harness.run_eval`'s keywords
    (only those given)."""
    out = {}
    if args.continuation_tokens is not None:
        out["continuation_tokens"] = whole("--continuation-tokens", args.continuation_tokens, minimum=1)
    if args.stretch_tokens is not None:
        out["stretch_tokens"] = whole("--stretch-tokens", args.stretch_tokens, minimum=0)
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from attnkit.eval.run.harness import format_table, run_eval

    whole("--samples", args.samples, minimum=1)
    if args.batch_size is not None:
        whole("--batch-size", args.batch_size, minimum=1)
    if args.sweep:
        return eval_sweep(args)
    if args.only:
        raise AttnkitError("--only picks recipes of a sweep: give --sweep FILE --out DIR")
    given = [f for f, v in (("--ray", args.ray), ("--ray-address", args.ray_address), ("--workers", args.workers)) if v]
    if given:
        raise AttnkitError(f"{', '.join(given)} run a sweep's cells on Ray: give --sweep FILE --out DIR")
    lengths = int_list(args.lengths, "--lengths", minimum=1)
    tasks = None if args.tasks is None else name_list(args.tasks, "--tasks")
    methods = (split_spec_list(args.methods or "full") if args.methods or not args.recipe else [])
    methods += recipe_files(args.recipe)
    protocol = protocol_options(args)
    model = load(args.model or "tiny", args=args)
    data = None
    if args.data:
        from attnkit.eval.data.user_data import load_data

        data = load_data(args.data)
    if tasks is None:
        tasks = data.tasks() if data is not None else ["passkey"]
    batch = {} if args.batch_size is None else {"batch_size": args.batch_size}
    before = cells_in(args.out) if args.out else set()
    rows = run_eval(model, tasks, lengths, methods, args.samples, seed=args.seed,
                    out_dir=Path(args.out) if args.out else None, progress=not args.no_progress, data=data, **batch,
                    **protocol, **long_output_options(args))
    print(format_table(rows))
    if args.out:
        reused = sum(r.get("cell") in before for r in rows)
        if reused:
            print(f"{reused} of {len(rows)} cells were already in {Path(args.out) / 'results.jsonl'} and were not run "
                  f"again (another --out directory measures them anew)", file=sys.stderr)
        print(f"results: {Path(args.out) / 'results.jsonl'}", file=sys.stderr)
    return 0


def cells_in(out: str) -> set:
    """The cell keys of ``OUT/results.jsonl`` (empty when there is none); read without repairing the file, which
    another run may be writing (``run_eval`` repairs it once it holds the directory's lock)."""
    from attnkit.eval.run.results import RESULTS_FILE, read_results

    path = Path(out) / RESULTS_FILE
    if not path.is_file():
        return set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unterminated last line, which run_eval removes under the lock
        return {r.get("cell") for r in read_results(path)}


def eval_sweep(args: argparse.Namespace) -> int:
    """``eval --sweep FILE``: the sweep file sets tasks, recipes and data; resumable from ``--out``."""
    from attnkit.eval.run.harness import format_table
    from attnkit.eval.run.sweep import load_sweep, run_sweep, sweep_positions

    given = [f"--{n}" for n in ("tasks", "methods", "recipe", "data", "queries", "seeds") if getattr(args, n)]
    given += [f"--{n.replace('_', '-')}" for n in ("continuation_tokens", "stretch_tokens")
              if getattr(args, n) is not None]
    if given:
        raise AttnkitError(f"--sweep FILE sets the tasks, recipes, data, protocols, queries, seeds and long-output "
                           f"tokens (continuation_tokens, stretch_tokens); drop "
                           f"{', '.join(given)} (--only and --protocol pick among its recipes and protocols)")
    if not args.out:
        raise AttnkitError("--sweep needs --out DIR (where results.jsonl is written and resumed from)")
    check_ray_options(args)
    sweep = load_sweep(args.sweep)
    if args.only:
        sweep.recipes = only_recipes(sweep.recipes, args.only, args.sweep)
    if args.protocol is not None:
        sweep.protocols = only_protocols(sweep.protocols, args.protocol, args.sweep)
    if args.model:
        sweep.model = args.model
    if args.batch_size is not None:
        sweep.batch_size = args.batch_size
    print(f"sweep {args.sweep}: {sweep.cell_count()} cells on {sweep.model} ({len(sweep.tasks)} tasks x "
          f"{len(sweep.lengths)} lengths x recipes/budgets, {sweep.samples} samples each) -> {args.out}",
          file=sys.stderr)
    if args.ray:
        rows = ray_sweep(args, sweep)
    else:
        model = load(sweep.model, sweep_positions(sweep), args) if args.device_map else None
        rows = run_sweep(sweep, args.out, model=model, progress=not args.no_progress)
    print(format_table(rows))
    print(f"results: {Path(args.out) / 'results.jsonl'}; report: attnkit report {args.out}", file=sys.stderr)
    return 0


def only_recipes(recipes: list, names: str, source: str) -> list:
    """The recipes of a sweep named in ``--only`` (comma-separated labels), in the sweep's order."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    labels = [r.label for r in recipes]
    unknown = [n for n in wanted if n not in labels]
    if not wanted or unknown:
        raise AttnkitError(f"--only {names!r}: {', '.join(unknown) or 'no name'} is not a recipe of {source}; "
                           f"its recipes: {', '.join(labels)}")
    return [r for r in recipes if r.label in wanted]


def only_protocols(protocols: list[str], names: str, source: str) -> list[str]:
    """The protocols of a sweep named in ``--protocol`` (comma-separated), in the sweep's order."""
    wanted = name_list(names, "--protocol")
    unknown = [n for n in wanted if n not in protocols]
    if unknown:
        raise AttnkitError(f"--protocol {names!r}: {unknown[0]} is not a protocol of {source}; its protocols: "
                           f"{', '.join(protocols)}")
    return [p for p in protocols if p in wanted]


def check_ray_options(args: argparse.Namespace) -> None:
    """--ray's companions go with it, and --ray with no placement of its own."""
    if not args.ray:
        if args.workers is not None or args.ray_address is not None:
            raise AttnkitError("--workers and --ray-address go with --ray")
        return
    if args.device_map or args.offload_dir:
        raise AttnkitError("--ray runs a whole model in each worker, on one device; drop --device-map/--offload-dir")
    if args.workers is not None:
        whole("--workers", args.workers, minimum=1)


def ray_sweep(args: argparse.Namespace, sweep) -> list[dict]:
    """``eval --sweep FILE --ray``: the cells on Ray actors (a local Ray unless --ray-address)."""
    from attnkit.eval.run.ray_cells import CellPool
    from attnkit.eval.run.sweep import run_sweep, sweep_positions

    print(f"starting {'a local Ray' if args.ray_address is None else 'on Ray at ' + args.ray_address} and its "
          f"workers (each loads {sweep.model})", file=sys.stderr)
    with CellPool(sweep.model, positions=sweep_positions(sweep), workers=args.workers, address=args.ray_address) as pool:
        print(f"{len(pool.actors)} Ray workers on {pool.device}", file=sys.stderr)
        return run_sweep(sweep, args.out, progress=not args.no_progress, pool=pool)


def cmd_report(args: argparse.Namespace) -> int:
    from attnkit.eval.report.page import write_report

    try:
        page = write_report(args.dir, out=args.out)
    except UnicodeDecodeError as exc:  # the results reader decodes UTF-8 without naming the file
        raise AttnkitError(f"{args.dir}: the results file is not UTF-8 JSON lines ({exc.reason} at byte "
                           f"{exc.start}); give the directory `attnkit eval --out` wrote") from None
    print(f"report: {page}")
    return 0


DEMO_METHODS = ["full", "window:window=256", "snapkv:budget_tokens=256", "quest:token_budget=256"]


def cmd_demo(args: argparse.Namespace) -> int:
    """A short evaluation of the bundled model: full attention against three ways of spending 256 tokens of
    attention (a sliding window; SnapKV, which keeps what the prompt's last queries attend to; Quest, which keeps the
    whole cache and reads the pages each query needs): scores, KV memory and decoding speed, side by side."""
    from attnkit.eval.report.summary import enrich, summarize
    from attnkit.eval.run.harness import format_table, run_eval
    from attnkit.model import BUNDLED, TRAINING_SCRIPT, bundled_path

    whole("--samples", args.samples, minimum=1)
    spec = args.model
    if spec in BUNDLED and not (bundled_path(spec) / "config.json").is_file():
        spec = "random:llama"
        print(f"the bundled model {args.model!r} is not built yet ({TRAINING_SCRIPT} makes it): running the "
              f"demo on {spec}, a random-weight model, whose scores mean nothing")
    model = load(spec)
    print(f"attnkit demo: {model.spec} ({model.geometry.n_layers} layers, {model.geometry.n_q_heads} query / "
          f"{model.geometry.n_kv_heads} kv heads), retrieval and code at 1k and 2k tokens: full attention against "
          f"256 tokens of attention spent three ways ({', '.join(DEMO_METHODS[1:])})")
    t0 = time.time()
    rows = run_eval(model, ["passkey", "kv_retrieval", "code_completion"], [1024, 2048], DEMO_METHODS, args.samples,
                    seed=0, out_dir=Path(args.out) if args.out else None, progress=True)
    print(format_table(rows))
    print("\nper method, over the cells (ratios to full; medians of speed and memory):")
    print(f"{'method':28s} {'score':>7s} {'KV memory':>10s} {'decode speed':>13s}")
    def ratio(v):
        return "-" if v is None else f"{v:.2f}x"

    for s in summarize(enrich(rows)[0]):
        print(f"{s['label']:28s} {ratio(s['score_rel_full']):>7s} {ratio(s['peak_kv_ratio']):>10s} "
              f"{ratio(s['decode_speedup']):>13s}")
    if args.out:
        from attnkit.eval.report.page import write_report

        print(f"report (the trade-off plotted): {write_report(args.out)}")
    print(f"demo finished in {time.time() - t0:.0f} s")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``attnkit calibrate patterns|heads|filter-layer|duo|kvzap|triattention|qfilter|expected_attention``: the list arguments parsed here, then the tool's
    ``main`` (module ``attnkit.calibrate.<args.calibration>``)."""
    if getattr(args, "tasks", None) is not None:
        args.tasks = name_list(args.tasks, "--tasks")
    if getattr(args, "layers", None) is not None:
        args.layers = int_list(args.layers, "--layers")
    return importlib.import_module(f"attnkit.calibrate.{args.calibration}").main(args)
