"""The ``attnkit`` command: methods, generate, eval, bench, calibrate, demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from attnkit.errors import AttnkitError


def _method_from_args(args):
    """The recipe of --recipe FILE, or of --method/--param (a Recipe either way)."""
    from attnkit.methods.base import make_method
    from attnkit.recipe import Recipe, load_recipe_file

    if args.recipe:
        if args.method != "full" or args.param:
            raise AttnkitError("give either --recipe or --method/--param, not both")
        return load_recipe_file(args.recipe)
    params = {}
    for item in args.param or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise AttnkitError(f"--param expects key=value, got {item!r}")
        params[key] = value
    return Recipe.parse(make_method(args.method, **params))


def _recipe_files(paths) -> list:
    from attnkit.recipe import load_recipe_file

    return [load_recipe_file(p) for p in paths or []]


def _load(spec: str, context: int | None = None):
    from attnkit.model import load_model, load_model_for_length

    return load_model_for_length(spec, context) if context else load_model(spec)


def cmd_methods(args) -> int:
    from attnkit.methods import METHODS

    for name in sorted(METHODS):
        cls = METHODS[name]
        print(f"{name:<12} {cls.summary}")
        for f in cls.parameters():
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            print(f"    {f.name} = {default!r}")
    return 0


def _check_draft_options(args) -> None:
    """The draft options mean nothing without --speculate: refuse them rather than ignore them."""
    given = [flag for flag, value in (("--draft", args.draft is not None), ("--draft-lookup", args.draft_lookup),
                                      ("--draft-confidence", args.draft_confidence is not None),
                                      ("--draft-weights", args.draft_weights is not None)) if value]
    if given and not args.speculate:
        what = "is an option" if len(given) == 1 else "are options"
        raise AttnkitError(f"{', '.join(given)} {what} of speculative decoding's draft; add --speculate "
                           f"draft_model|prompt_lookup|self")


def cmd_generate(args) -> int:
    _check_draft_options(args)
    if (args.prompt is None) == (args.prompt_file is None):
        raise AttnkitError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise AttnkitError(f"prompt file {args.prompt_file!r} does not exist")
        prompt = path.read_text()
    else:
        prompt = args.prompt
    recipe = _method_from_args(args)
    method = recipe.method()
    model = _load(args.model)
    stream = None if args.json else (lambda _tok, delta: print(delta, end="", flush=True))
    sampling = dict(max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, do_sample=args.do_sample,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                    on_token=stream)
    if args.speculate and recipe.decode is not None:
        raise AttnkitError("give speculative decoding either in the recipe's 'decode' or with --speculate, not both")
    if args.speculate:
        from attnkit.speculative import speculative_generate

        if getattr(method, "name", None) != "full":
            raise AttnkitError(f"--speculate verifies with full attention; --method {method.describe()} is not used "
                               f"(for self-speculation give the draft's method with --draft)")
        out = speculative_generate(model, prompt, args.speculate, draft_spec=args.draft,
                                   draft_lookup=args.draft_lookup, draft_confidence=args.draft_confidence,
                                   draft_weights=args.draft_weights,
                                   gamma=args.gamma,
                                   adaptive_gamma=args.adaptive_gamma, **sampling)
    else:
        out = recipe.generate(model, prompt, **sampling)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.as_dict()}))
    else:
        print()
        s = out.stats
        print(f"[{s.method}] {s.prompt_tokens} prompt tokens, {s.new_tokens} new; prefill {s.prefill_s:.3f} s, "
              f"decode {s.decode_tokens_per_s:.1f} tok/s, peak KV {s.peak_kv_bytes / 2**20:.2f} MiB, "
              f"final KV {s.final_kv_bytes / 2**20:.2f} MiB ({s.finish_reason})", file=sys.stderr)
        if args.speculate or recipe.decode is not None:
            forwards = f", {s.draft_forwards / s.rounds:.2f} draft forwards" if s.draft_forwards and s.rounds else ""
            weights = f", draft weights {s.draft_weight_bytes / 2**20:.2f} MiB" if s.draft_weight_bytes else ""
            print(f"[speculate {s.draft}] acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_forward:.2f} "
                  f"tokens per target forward, {s.mean_gamma:.2f} drafted{forwards} per round, "
                  f"{s.tokens_per_s:.1f} tok/s end to end{weights}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from attnkit.bench.speed import format_bench, run_bench
    from attnkit.runner import check_benchmark_tokens

    _check_draft_options(args)
    check_benchmark_tokens(args.new_tokens, name="--new-tokens")  # before the model loads
    if args.speculate:
        from attnkit.speculative.bench import bench_from_args

        return bench_from_args(args)
    from attnkit.bench.speed import measure_bandwidth

    methods = _split_methods(args.methods) + _recipe_files(args.recipe)
    model = _load(args.model, context=args.context + args.new_tokens)

    def progress(r, spec, stats):
        print(f"  repeat {r + 1}/{args.repeats} {spec}: prefill {stats.prefill_s:.3f} s, "
              f"decode {stats.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)

    print(f"bench {model.spec}: {args.context} prompt tokens, {args.new_tokens} new tokens, "
          f"{args.repeats} interleaved repeats", file=sys.stderr)
    bandwidth = None
    if args.bandwidth_mib > 0:
        bandwidth = measure_bandwidth(model.device, args.bandwidth_mib * 2**20)
        print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (median of copies/sums of {args.bandwidth_mib} MiB)",
              file=sys.stderr)
    rows = run_bench(model, args.context, args.new_tokens, methods, args.repeats, args.seed, progress,
                     bandwidth=bandwidth)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_bench(rows))
    return 0


def _split_methods(text: str) -> list[str]:
    """Split "full,window:window=1024,foo:a=1,b=2" into method specs (a part with '=' before any ':'
    continues the previous method's parameters; so does "a=1+snapkv:budget=0.3", the rest of a
    composition "minference:config=f,a=1+snapkv:budget=0.3")."""
    specs: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part.split(":", 1)[0] and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    if not specs:
        raise AttnkitError("--methods is empty; give e.g. full,window:window=1024")
    return specs


def _name_list(text: str, what: str) -> list[str]:
    """"a, b,c" -> ["a", "b", "c"] (a comma-separated option such as --tasks)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise AttnkitError(f"{what} is empty")
    return names


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AttnkitError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise AttnkitError(f"{what} is empty")
    return values


def cmd_eval(args) -> int:
    from attnkit.eval.harness import LONGBENCH_PREFIX, format_table, run_eval

    if args.sweep:
        return _eval_sweep(args)
    model = _load(args.model or "tiny")
    data = None
    if args.data:
        from attnkit.eval.longbench import LongBenchData

        data = LongBenchData.load(args.data)
    if args.tasks is None:
        tasks = [LONGBENCH_PREFIX + d for d in data.datasets()] if data is not None else ["passkey"]
    else:
        tasks = _name_list(args.tasks, "--tasks")
    methods = (_split_methods(args.methods or "full") if args.methods or not args.recipe else [])
    methods += _recipe_files(args.recipe)
    rows = run_eval(model, tasks, _int_list(args.lengths, "--lengths"), methods,
                    args.samples, seed=args.seed, out_dir=Path(args.out) if args.out else None,
                    progress=not args.no_progress, data=data)
    print(format_table(rows))
    if args.out:
        print(f"results: {Path(args.out) / 'results.jsonl'}", file=sys.stderr)
    return 0


def _eval_sweep(args) -> int:
    from attnkit.eval.harness import format_table
    from attnkit.eval.sweep import load_sweep, run_sweep

    given = [f"--{n}" for n in ("tasks", "methods", "recipe", "data") if getattr(args, n)]
    if given:
        raise AttnkitError(f"--sweep FILE sets the tasks, recipes and data; drop {', '.join(given)}")
    if not args.out:
        raise AttnkitError("--sweep needs --out DIR (where results.jsonl is written and resumed from)")
    sweep = load_sweep(args.sweep)
    if args.model:
        sweep.model = args.model
    print(f"sweep {args.sweep}: {sweep.cell_count()} cells on {sweep.model} ({len(sweep.tasks)} tasks x "
          f"{len(sweep.lengths)} lengths x recipes/budgets, {sweep.samples} samples each) -> {args.out}",
          file=sys.stderr)
    rows = run_sweep(sweep, args.out, progress=not args.no_progress)
    print(format_table(rows))
    print(f"results: {Path(args.out) / 'results.jsonl'}; report: attnkit report {args.out}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from attnkit.eval.report import write_report

    page = write_report(args.dir, out=args.out)
    print(f"report: {page}")
    return 0


def cmd_demo(args) -> int:
    """A few-minute evaluation of the bundled model: full attention vs a small sliding window."""
    from attnkit.eval.harness import format_table, run_eval
    from attnkit.model import BUNDLED, bundled_path

    spec = args.model
    if spec in BUNDLED and not (bundled_path(spec) / "config.json").is_file():
        spec = "random:llama"
        print(f"the bundled model {args.model!r} is not built yet (scripts/train_tiny.py makes it): running the "
              f"demo on {spec}, a random-weight model, whose scores mean nothing")
    model = _load(spec)
    print(f"attnkit demo: {model.spec} ({model.geometry.n_layers} layers, {model.geometry.n_q_heads} query / "
          f"{model.geometry.n_kv_heads} kv heads), retrieval at 1k and 2k tokens, full vs window:window=256")
    t0 = time.time()
    rows = run_eval(model, ["passkey", "kv_retrieval", "code_completion"], [1024, 2048],
                    ["full", "window:window=256"], args.samples, seed=0,
                    out_dir=Path(args.out) if args.out else None, progress=True)
    print(format_table(rows))
    if args.out:
        from attnkit.eval.report import write_report

        print(f"report: {write_report(args.out)}")
    print(f"demo finished in {time.time() - t0:.0f} s")
    return 0


def _speculation_arguments(p) -> None:
    g = p.add_argument_group("speculative decoding (lossless: output distributed as without it)")
    g.add_argument("--speculate", choices=["draft_model", "prompt_lookup", "self"], default=None,
                   help="draft source; the target verifies with full attention")
    g.add_argument("--gamma", type=int, default=4, help="drafted tokens per target forward (default 4)")
    g.add_argument("--adaptive-gamma", action="store_true", help="adapt gamma to the observed acceptance")
    g.add_argument("--draft", default=None, metavar="SPEC",
                   help="draft_model: model spec (default tiny-draft); prompt_lookup: max_ngram=N,min_ngram=M; "
                        "self: the draft cache's method (default streaming:budget_tokens=256,sinks=4)")
    g.add_argument("--draft-lookup", action="store_true",
                   help="draft_model/self: the draft verifies prompt-lookup guesses several tokens per forward "
                        "(TriForce's hierarchy; needs a draft cache that only appends: self defaults to "
                        "snapkv:budget_tokens=512)")
    g.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="draft_model/self: stop drafting after a token the draft gave less than probability P "
                        "(gamma becomes a cap; e.g. 0.3)")
    g.add_argument("--draft-weights", choices=["same", "int8"], default=None,
                   help="draft_model/self: int8 drafts with weight-only int8 copies of the model's linear layers "
                        "(the target verifies with its own); same (default): the model's own weights")


def cmd_calibrate(args) -> int:
    """``attnkit calibrate patterns|heads|filter-layer``: the list arguments parsed here, then the tool's
    ``main`` (module ``attnkit.calibrate.<args.calibration>``)."""
    import importlib

    args.tasks = _name_list(args.tasks, "--tasks")
    if getattr(args, "layers", None) is not None:
        args.layers = _int_list(args.layers, "--layers")
    return importlib.import_module(f"attnkit.calibrate.{args.calibration}").main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Faster, lighter long-context inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the registered methods and their parameters")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("generate", help="generate text with a method")
    p.add_argument("--model", default="tiny", help="tiny, tiny-draft, random:<arch>[:k=v,..], or a model dir")
    p.add_argument("--prompt")
    p.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--method", default="full")
    p.add_argument("--param", action="append", metavar="KEY=VALUE", help="method parameter (repeatable)")
    p.add_argument("--recipe", help="JSON/YAML recipe file (instead of --method/--param)")
    p.add_argument("--chunk-size", type=int, default=None, help="prefill the prompt in chunks of N tokens")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    _speculation_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="prefill/decode time and KV memory of methods vs full, interleaved")
    p.add_argument("--model", default="random:llama")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", default="full,window:window=1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", action="append", metavar="FILE", help="a recipe file to bench too (repeatable)")
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="tensor size for the memory-bandwidth measurement behind the decode floor (0: skip)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--json", action="store_true")
    _speculation_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eval", help="task scores of methods relative to full")
    p.add_argument("--model", default=None, help="model spec (default tiny, or the sweep's)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default passkey, or every dataset of --data)")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--methods", default=None, help="comma-separated method specs (default full)")
    p.add_argument("--recipe", action="append", metavar="FILE", help="a recipe file to evaluate too (repeatable)")
    p.add_argument("--sweep", metavar="FILE", help="a sweep file (recipes x budgets x tasks x lengths); resumable")
    p.add_argument("--data", metavar="FILE.jsonl", help="LongBench-format items: tasks longbench:DATASET")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for results.jsonl and table.txt")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("calibrate", help="offline calibration tools that write JSON configs")
    calibrations = p.add_subparsers(dest="calibration", required=True)
    c = calibrations.add_parser("patterns", help="MInference: search a sparse pattern per head (Alg. 1, Table 7)")
    c.add_argument("--model", default="tiny")
    c.add_argument("--length", type=int, required=True, help="calibration prompt length in tokens")
    c.add_argument("--flops-budget", type=float, required=True,
                   help="kernel FLOPs as a fraction of dense causal attention at --length (0 < f <= 1)")
    c.add_argument("--out", required=True, help="the JSON config to write")
    c.add_argument("--tasks", default="passkey,kv_retrieval,code_completion", help="calibration prompt tasks")
    c.add_argument("--samples", type=int, default=1, help="prompts per task")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--block-size", type=int, default=64)
    c.add_argument("--last-q", type=int, default=64, help="queries that estimate vertical/slash lines (Alg. 2)")
    c.add_argument("--static", action="store_true", help="also store the first prompt's indices (minference_static)")
    c.add_argument("--threads", type=int, default=None)
    c.set_defaults(func=cmd_calibrate, calibration="patterns")
    c = calibrations.add_parser("heads", help="Share-Attention: cluster heads by the eq. 9 distance (seed 000, 4.1)")
    c.add_argument("--model", default="tiny")
    c.add_argument("--out", required=True, help="the JSON share config to write")
    th = c.add_mutually_exclusive_group()
    th.add_argument("--threshold", type=float, default=None, help="one threshold for every layer (default 0.18)")
    th.add_argument("--thresholds", default=None, metavar="FILE", help="one threshold per layer (JSON list or numbers)")
    th.add_argument("--threshold-schedule", default=None, metavar="LOW,HIGH[,A:B]",
                    help="HIGH for layers A..B-1 (default: the middle-to-late band), LOW for the others")
    c.add_argument("--length", type=int, default=1024, help="calibration prompt length in tokens")
    c.add_argument("--tasks", default="passkey,kv_retrieval,code_completion", help="calibration prompt tasks")
    c.add_argument("--samples", type=int, default=1, help="prompts per task")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--split", choices=["calibration", "train"], default="calibration",
                   help="calibration: held-out text, seeds apart from eval; train: the training stream (slower)")
    c.add_argument("--threads", type=int, default=None)
    c.set_defaults(func=cmd_calibrate, calibration="heads")
    c = calibrations.add_parser("filter-layer", help="Select-Attention: sweep the filter layer on calibration tasks")
    c.add_argument("--model", default="tiny")
    c.add_argument("--tasks", default="passkey,kv_retrieval", help="calibration tasks (scored by their metric)")
    c.add_argument("--length", type=int, default=1024)
    c.add_argument("--samples", type=int, default=2, help="samples per task")
    c.add_argument("--p", type=float, default=0.95, help="top-p mass kept while decoding (p_decode)")
    c.add_argument("--layers", default=None, help="comma-separated candidate layers (default: all but the last)")
    c.add_argument("--prefill-select", action="store_true", help="also select at prefill (p_prefill = --p)")
    c.add_argument("--value-weighted", action="store_true", help="weight attention by value norms (seed ref. [6])")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--split", choices=["calibration", "train"], default="calibration")
    c.add_argument("--out", default=None, help="optional JSON file with the table")
    c.add_argument("--threads", type=int, default=None)
    c.set_defaults(func=cmd_calibrate, calibration="filter_layer")

    p = sub.add_parser("report", help="an HTML page (tables, plots) and PNGs from a results directory")
    p.add_argument("dir", help="a directory holding results.jsonl (from eval --out or eval --sweep)")
    p.add_argument("--out", default=None, help="the HTML file to write (default DIR/report.html)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("demo", help="the main job: a short evaluation of the bundled model")
    p.add_argument("--model", default="tiny")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--out", default="attnkit-results/demo")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise AttnkitError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
        return args.func(args)
    except AttnkitError as exc:
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
