"""Prefill time, decode speed and KV memory of methods against `full`, interleaved in one process.

Each repeat runs every method once on the same random prompt, in turn, so drifts of the machine hit
all methods alike; the reported figure is the median over repeats, and ratios are taken to `full`.
Methods are method specs or recipes (:mod:`attnkit.recipe`, e.g. with speculative decoding).

**Batches.** With several batch sizes, each repeat runs every method at every batch size (a batch of B
holds B prompts of the same length, generated side by side by :func:`attnkit.generate`); a row's decode
speed is then the whole batch's tokens per second, its KV bytes are per sequence and in total, and its
ratios are to `full` at the same batch size.

**The decode floor.** Decoding one token reads every weight once (the input embedding table aside:
one row of it) and every kept KV entry once, so a token cannot take less than
``(weight bytes + kept KV bytes) / memory bandwidth`` (a batch's step reads the weights once for all its
sequences). :func:`measure_bandwidth` measures the
bandwidth of this machine (the median of repeated large copies and sums, the faster of the two);
:func:`run_bench` puts the floor beside the measured decode time per token.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from attnkit import validate
from attnkit.errors import AttnkitError
from attnkit.generation import sync
from attnkit.model import LoadedModel
from attnkit.recipe import as_recipe

FIELDS = ("prefill_s", "decode_tokens_per_s", "peak_kv_bytes", "final_kv_bytes")


@dataclass(frozen=True)
class BenchRun:
    """What one run of a method on a batch of `batch_size` prompts measured.

    ``prefill_s``: wall time of the batch's prefill; ``decode_tokens_per_s``: decode tokens of all the
    batch's sequences per second of decoding wall time (its sequences decode in the same forwards; at
    batch size 1, the sequence's own rate); ``peak_kv_bytes`` / ``final_kv_bytes``: KV of one sequence
    (every sequence holds the same); ``*_total`` the batch's."""

    batch_size: int
    prefill_s: float
    decode_tokens_per_s: float
    peak_kv_bytes: int
    final_kv_bytes: int
    peak_kv_bytes_total: int
    final_kv_bytes_total: int

    @classmethod
    def of(cls, gens: list) -> BenchRun:
        stats = [g.stats for g in gens]
        steps = sum(round(s.decode_tokens_per_s * s.decode_s) for s in stats)
        wall = max(s.decode_s for s in stats)  # every sequence starts decoding at once and runs to the end
        return cls(len(stats), max(s.prefill_s for s in stats), steps / wall if steps and wall > 0 else 0.0,
                   max(s.peak_kv_bytes for s in stats), max(s.final_kv_bytes for s in stats),
                   sum(s.peak_kv_bytes for s in stats), sum(s.final_kv_bytes for s in stats))


def measure_bandwidth(device="cpu", nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth of `device` in bytes/s: the median over `repeats` of a copy of an `nbytes`
    float32 tensor (read + write: 2 x nbytes moved) and of its sum (nbytes read), the faster of the two."""
    n = max(1, nbytes // 4)
    x = torch.ones(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    y.copy_(x)  # touch every page before timing
    float(x.sum())

    def median_rate(fn, moved: int) -> float:
        rates = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            rates.append(moved / (time.perf_counter() - t0))
        return statistics.median(rates)

    copy = median_rate(lambda: y.copy_(x), 2 * n * 4)
    read = median_rate(lambda: float(x.sum()), n * 4)
    return max(copy, read)


def decode_weight_bytes(model: LoadedModel) -> int:
    """Bytes of weights one decode step reads: every parameter, except that only one row of an untied
    input embedding table is read."""
    hf = model.hf
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    emb = hf.get_input_embeddings().weight
    out = hf.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    if not tied:
        total -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()
    return total


def decode_floor_s(weight_bytes: int, kv_bytes: int, bandwidth: float) -> float:
    """The least time one decode token can take: bytes it must read over the memory bandwidth."""
    return (weight_bytes + kv_bytes) / bandwidth


def check_batch_sizes(batch_sizes, recipes, name: str = "batch_sizes") -> list[int]:
    """Distinct whole batch sizes >= 1; a batch above 1 needs recipes whose generation takes a batch
    (speculative decoding takes one prompt per call: lift this once it takes a batch, issue #28). `name`
    is what the caller calls the value (the argument, or a command-line flag)."""
    if isinstance(batch_sizes, (str, bytes)) or not list(batch_sizes):
        raise AttnkitError(f"{name} must be a non-empty list of whole numbers >= 1, got {batch_sizes!r}")
    sizes = list(batch_sizes)
    for b in sizes:
        validate.whole(f"every one of {name}", b, 1)
    if len(set(sizes)) != len(sizes):
        raise AttnkitError(f"{name} has duplicates: {sizes}")
    speculative = [r.label for r in recipes if r.decode is not None]
    if speculative and max(sizes) > 1:
        raise AttnkitError(f"{', '.join(speculative)} decode{'s' if len(speculative) == 1 else ''} speculatively, "
                           f"one prompt at a time; bench {'it' if len(speculative) == 1 else 'them'} with {name} 1")
    return sizes


def run_bench(model: LoadedModel, context: int, new_tokens: int, methods: list, repeats: int = 3,
              seed: int = 0, progress=None, bandwidth: float | None = None, batch_sizes=(1,)) -> list[dict]:
    """One row per method and batch size (batch sizes in the order given, methods within each): medians of
    FIELDS over `repeats` interleaved runs (:class:`BenchRun` says what they measure for a batch), and
    ratios to `full` at the same batch size. A batch of B holds B random prompts of `context` tokens (the
    first is the prompt of batch size 1). With `bandwidth` (bytes/s, :func:`measure_bandwidth`), each row
    also has the decode floor per generated token: one decode step reads the weights once and every
    sequence's kept KV, and yields `batch_size` tokens. `progress(repeat, method, run)` gets each
    :class:`BenchRun`."""
    check_benchmark_tokens(new_tokens)
    recipes = [as_recipe(m, "method") for m in methods]
    peers = [r.label for r in recipes if r.is_peer]
    if peers:
        raise AttnkitError(f"bench measures attnkit recipes; compare {', '.join(peers)} with "
                           f"benchmarks/compare_kvpress.py or in a sweep")
    sizes = check_batch_sizes(batch_sizes, recipes)
    methods = [r.label for r in recipes]
    low = 3 if model.geometry.vocab_size > 3 else 0
    ids = torch.randint(low, model.geometry.vocab_size, (max(sizes), context),
                        generator=torch.Generator().manual_seed(seed))
    samples: dict[tuple, list[dict]] = {(b, spec): [] for b in sizes for spec in methods}
    for r in range(repeats):
        for b in sizes:
            for spec, recipe in zip(methods, recipes):
                out = recipe.generate(model, ids[0] if b == 1 else ids[:b], max_new_tokens=new_tokens,
                                      stop_at_eos=False)
                run = BenchRun.of([out] if b == 1 else out)
                samples[b, spec].append(asdict(run))
                if progress:
                    progress(r, spec, run)
    weight_bytes = decode_weight_bytes(model) if bandwidth else None
    rows = []
    for b in sizes:
        batch_rows = []
        for spec, recipe in zip(methods, recipes):
            row = {"method": spec, "describe": recipe.method().describe(), "recipe": recipe.to_dict(),
                   "context": context, "new_tokens": new_tokens, "repeats": repeats, "batch_size": b}
            for f in FIELDS + ("peak_kv_bytes_total", "final_kv_bytes_total"):
                row[f] = statistics.median(s[f] for s in samples[b, spec])
            row["decode_ms_per_token"] = 1000.0 / row["decode_tokens_per_s"] if row["decode_tokens_per_s"] else None
            if bandwidth:
                floor = decode_floor_s(weight_bytes, row["final_kv_bytes_total"], bandwidth) / b
                row.update(bandwidth_bytes_per_s=bandwidth, weight_bytes=weight_bytes,
                           decode_floor_ms_per_token=1000.0 * floor)
            batch_rows.append(row)
        _ratios_to_full(batch_rows, recipes)
        rows += batch_rows
    return rows


def _ratios_to_full(rows: list[dict], recipes: list) -> None:
    """Each row's speed and KV against full attention's row of the same batch size."""
    full = next((r for r, recipe in zip(rows, recipes) if recipe.is_full), None)
    for row in rows:
        if full is None:
            row.update(prefill_speedup=None, decode_speedup=None, kv_ratio=None)
            continue
        row["prefill_speedup"] = full["prefill_s"] / row["prefill_s"] if row["prefill_s"] else None
        row["decode_speedup"] = (row["decode_tokens_per_s"] / full["decode_tokens_per_s"]
                                 if full["decode_tokens_per_s"] else None)
        row["kv_ratio"] = row["final_kv_bytes"] / full["final_kv_bytes"] if full["final_kv_bytes"] else None
        row["peak_kv_ratio"] = row["peak_kv_bytes"] / full["peak_kv_bytes"] if full["peak_kv_bytes"] else None


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def format_bench(rows: list[dict]) -> str:
    """The rows as a terminal table; with batches (any batch size but 1) a batch column, the batch's
    decode tok/s and KV per sequence and of the whole batch."""
    floor = any(r.get("decode_floor_ms_per_token") is not None for r in rows)
    batched = any(r.get("batch_size", 1) != 1 for r in rows)
    head = (f"{'method':<28} {'batch':>5} " if batched else f"{'method':<28} ") + (
        f"{'prefill s':>10} {'x full':>7} {'decode tok/s':>13} {'x full':>7} "
        f"{'peak KV MiB':>12} {'final KV MiB':>13} {'KV/full':>8}")
    if batched:
        head += f" {'batch KV MiB':>13}"
    if floor:
        head += f" {'ms/tok':>8} {'floor ms':>9} {'x floor':>8}"
    lines = [head, "-" * len(head)]

    def ratio(x):
        return f"{x:.2f}" if x is not None else "-"

    for r in rows:
        line = (f"{r['method'][:28]:<28} " + (f"{r.get('batch_size', 1):>5} " if batched else "")
                + f"{r['prefill_s']:>10.3f} {ratio(r.get('prefill_speedup')):>7} "
                f"{r['decode_tokens_per_s']:>13.1f} {ratio(r.get('decode_speedup')):>7} "
                f"{_mib(r['peak_kv_bytes']):>12} {_mib(r['final_kv_bytes']):>13} {ratio(r.get('kv_ratio')):>8}")
        if batched:
            line += f" {_mib(r.get('final_kv_bytes_total', r['final_kv_bytes'])):>13}"
        if floor:
            ms, fl = r.get("decode_ms_per_token"), r.get("decode_floor_ms_per_token")
            line += (f" {ms if ms is not None else float('nan'):>8.3f} {fl:>9.4f} "
                     f"{ratio(ms / fl if ms and fl else None):>8}")
        lines.append(line)
    lines.append("x full: prefill = full time / method time, decode = method tok/s / full tok/s (>1 is faster); "
                 "KV/full = KV bytes held at the end")
    if batched:
        lines.append("batch: prompts decoded side by side; prefill s = the batch's prefill, decode tok/s = tokens "
                     "of all its sequences per second, KV MiB per sequence (batch KV: all of them); x full at the "
                     "same batch size")
    if floor:
        r = rows[0]
        lines.append(f"floor: (weights {_mib(r['weight_bytes'])} MiB + kept KV) / memory bandwidth "
                     f"{r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s = the least time a decode token can take; "
                     f"x floor = measured / floor")
    return "\n".join(lines)


def check_benchmark_tokens(new_tokens: int, name: str = "new_tokens") -> None:
    """A benchmark times decoding over the tokens after the first: it needs at least two new tokens.
    `name` is what the caller calls the value (the argument, or a command-line flag)."""
    validate.whole(name, new_tokens, 2, what=" for a benchmark (decoding speed is timed over the tokens after the first)")
