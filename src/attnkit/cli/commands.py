"""``attnkit methods``, ``generate`` and ``bench``: each checks its options before any model loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from attnkit.cli.options import int_list, positive_finite
from attnkit.cli.prompts import print_result, prompt_ids, read_prompts_file, run_prompts
from attnkit.cli.speculation import speculation_from_options
from attnkit.errors import AttnkitError
from attnkit.methods import METHODS
from attnkit.methods.spec import split_method_spec, split_spec_list
from attnkit.recipe import Recipe, as_recipe, load_recipe_file
from attnkit.speculative import speculative_generate
from attnkit.validate import fraction, whole


def recipe_from_options(method: str, params: list[str] | None, recipe_file: str | None) -> Recipe:
    """The recipe of ``--recipe FILE``, or of ``--method SPEC`` (the grammar of ``eval --methods``:
    ``snapkv:budget=0.3``, ``minference+snapkv``) with ``--param KEY=VALUE`` adding parameters to a
    single method."""
    if recipe_file:
        if method != "full" or params:
            raise AttnkitError("give either --recipe or --method/--param, not both")
        return load_recipe_file(recipe_file)
    if not params:
        return as_recipe(method, "--method")
    extra = {}
    for item in params:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise AttnkitError(f"--param expects key=value, got {item!r}")
        extra[key.strip()] = value
    parts = split_method_spec(method)
    if len(parts) != 1:
        raise AttnkitError(f"--param sets parameters of a single method, but --method {method!r} joins two; give "
                           f"each part's parameters in its spec, e.g. 'minference+snapkv:budget=0.3'")
    name, given = parts[0]
    twice = sorted(set(given) & set(extra))
    if twice:
        raise AttnkitError(f"parameter {', '.join(twice)} is given both in --method {method!r} and with --param")
    return Recipe.from_dict({"method": name, "params": {**given, **extra}}, "--method/--param")


def recipe_files(paths: list[str] | None) -> list[Recipe]:
    return [load_recipe_file(p) for p in paths or []]


def load(spec: str, context: int | None = None, args: argparse.Namespace | None = None):
    """The model of ``--model`` (a ``random:`` spec gets `context` positions when given), placed by
    ``--device-map`` / ``--offload-dir`` when `args` has them."""
    from attnkit.model import load_model, load_model_for_length

    options = placement_options(args)
    return load_model_for_length(spec, context, **options) if context else load_model(spec, **options)


def placement_options(args: argparse.Namespace | None) -> dict:
    """``device_map`` / ``offload_dir`` keywords of :func:`attnkit.load_model` from ``--device-map`` and
    ``--offload-dir``."""
    from attnkit.placement import parse_device_map

    device_map = getattr(args, "device_map", None)
    offload_dir = getattr(args, "offload_dir", None)
    if device_map is None:
        if offload_dir is not None:
            raise AttnkitError("--offload-dir is where --device-map's disk entries go; give --device-map with it")
        return {}
    return {"device_map": parse_device_map(device_map), "offload_dir": offload_dir}


def read_prompt_file(name: str) -> str:
    """The text of ``--prompt-file``: a UTF-8 file."""
    path = Path(name)
    if not path.is_file():
        raise AttnkitError(f"prompt file {name!r} does not exist" if not path.exists()
                           else f"prompt file {name!r} is not a file")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AttnkitError(f"prompt file {name!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start}); give a UTF-8 text file") from None


def cmd_methods(args: argparse.Namespace) -> int:
    for name in sorted(METHODS):
        cls = METHODS[name]
        print(f"{name:<12} {cls.summary}")
        print(f"    kvpress: {cls.kvpress or 'none'}")
        for f in cls.parameters():
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            print(f"    {f.name} = {default!r}")
    return 0


def check_sampling_options(args: argparse.Namespace) -> None:
    """``generate``'s token count and sampling settings, named by their flags."""
    whole("--max-new-tokens", args.max_new_tokens, minimum=1)
    if args.chunk_size is not None:
        whole("--chunk-size", args.chunk_size, minimum=1)
    positive_finite("--temperature", args.temperature)
    if args.top_k is not None:
        whole("--top-k", args.top_k, minimum=1)
    if args.top_p is not None:
        fraction("--top-p", args.top_p)
    if args.stop is not None and not all(args.stop):
        raise AttnkitError("--stop strings must be non-empty")


def cmd_generate(args: argparse.Namespace) -> int:
    speculation = speculation_from_options(args)
    check_sampling_options(args)
    given = [flag for flag, value in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                      ("--prompts-file", args.prompts_file)) if value is not None]
    if len(given) != 1:
        raise AttnkitError("give exactly one of --prompt TEXT, --prompt-file FILE or --prompts-file FILE.jsonl"
                           + (f" (got {' and '.join(given)})" if given else ""))
    if args.batch_size is not None:
        if args.prompts_file is None:
            raise AttnkitError("--batch-size splits the prompts of --prompts-file FILE.jsonl into batches; give one")
        whole("--batch-size", args.batch_size, minimum=1)
    recipe = recipe_from_options(args.method, args.param, args.recipe)
    method = recipe.method()
    if speculation is not None and recipe.decode is not None:
        raise AttnkitError("give speculative decoding either in the recipe's 'decode' or with --speculate, not both")
    if speculation is not None and getattr(method, "name", None) != "full":
        raise AttnkitError(f"--speculate verifies with full attention; --method {method.describe()} is not used "
                           f"(for self-speculation give the draft's method with --draft)")
    speculative = speculation is not None or recipe.decode is not None
    if args.prompts_file is not None:
        prompts = read_prompts_file(args.prompts_file)  # checked before the model loads
    else:
        prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
    model = load(args.model, args=args)
    sampling = dict(max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, do_sample=args.do_sample,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)

    def run(prompt, **options):
        options = {**sampling, **options}
        if speculation is not None:
            return speculative_generate(model, prompt, speculation, **options)
        return recipe.generate(model, prompt, **options)

    if args.prompts_file is not None:
        ids = prompt_ids(model, prompts, args.prompts_file, args.max_new_tokens)

        def emit(i, gen):
            print_result(i, prompts[i], gen, args.json)
            if not args.json:
                print_generation_stats(gen.stats, speculative, prefix=f"prompt {i}: ")
                sys.stderr.flush()

        run_prompts(run, ids, args.batch_size, args.seed, emit)
        return 0
    stream = None if args.json else (lambda _tok, delta: print(delta, end="", flush=True))
    out = run(prompt, on_token=stream)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.as_dict()}))
    else:
        print()
        print_generation_stats(out.stats, speculative=speculative)
    return 0


def print_generation_stats(s, speculative: bool, prefix: str = "") -> None:
    """The one-line summary of a generation (and of its speculation) on stderr, after `prefix`."""
    print(f"{prefix}[{s.method}] {s.prompt_tokens} prompt tokens, {s.new_tokens} new; prefill {s.prefill_s:.3f} s, "
          f"decode {s.decode_tokens_per_s:.1f} tok/s, peak KV {s.peak_kv_bytes / 2**20:.2f} MiB, "
          f"final KV {s.final_kv_bytes / 2**20:.2f} MiB ({s.finish_reason})", file=sys.stderr)
    if speculative:
        forwards = f", {s.draft_forwards / s.rounds:.2f} draft forwards" if s.draft_forwards and s.rounds else ""
        weights = f", draft weights {s.draft_weight_bytes / 2**20:.2f} MiB" if s.draft_weight_bytes else ""
        print(f"[speculate {s.draft}] acceptance {s.acceptance_rate:.2f}, {s.tokens_per_target_forward:.2f} "
              f"tokens per target forward, {s.mean_gamma:.2f} drafted{forwards} per round, "
              f"{s.tokens_per_s:.1f} tok/s end to end{weights}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    from attnkit.bench.speculative import bench_speculative, format_rows
    from attnkit.bench.speed import (
        check_batch_sizes,
        check_benchmark_tokens,
        format_bench,
        measure_bandwidth,
        run_bench,
    )

    speculation = speculation_from_options(args)
    check_benchmark_tokens(args.new_tokens, name="--new-tokens")  # before the model loads
    whole("--context", args.context, minimum=1)
    whole("--repeats", args.repeats, minimum=1)
    whole("--bandwidth-mib", args.bandwidth_mib, minimum=0)
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes", minimum=1)
    if speculation is not None:
        if batch_sizes != [1]:
            raise AttnkitError("--speculate decodes one prompt at a time; give --batch-sizes 1 with it")
        rows = bench_speculative(args.model, speculation, context=args.context, new_tokens=args.new_tokens,
                                 repeats=args.repeats, seed=args.seed)
        print(json.dumps(rows) if args.json else format_rows(rows))
        return 0
    methods = split_spec_list(args.methods) + recipe_files(args.recipe)
    check_batch_sizes(batch_sizes, [as_recipe(m, "--methods") for m in methods], "--batch-sizes")  # before the model loads
    model = load(args.model, context=args.context + args.new_tokens, args=args)

    def progress(r, spec, run):
        batch = f" x{run.batch_size}" if len(batch_sizes) > 1 or run.batch_size > 1 else ""
        print(f"  repeat {r + 1}/{args.repeats} {spec}{batch}: prefill {run.prefill_s:.3f} s, "
              f"decode {run.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)

    batches = f", batch sizes {', '.join(map(str, batch_sizes))}" if batch_sizes != [1] else ""
    print(f"bench {model.spec}: {args.context} prompt tokens, {args.new_tokens} new tokens, "
          f"{args.repeats} interleaved repeats{batches}", file=sys.stderr)
    bandwidth = None
    if args.bandwidth_mib > 0:
        bandwidth = measure_bandwidth(model.device, args.bandwidth_mib * 2**20)
        print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (median of copies/sums of {args.bandwidth_mib} MiB)",
              file=sys.stderr)
    rows = run_bench(model, args.context, args.new_tokens, methods, args.repeats, args.seed, progress,
                     bandwidth=bandwidth, batch_sizes=batch_sizes)
    print(json.dumps(rows) if args.json else format_bench(rows))
    return 0
