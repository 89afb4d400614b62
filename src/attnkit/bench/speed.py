"""Prefill time, decode speed and KV memory of methods against `full`, interleaved in one process.

Each repeat runs every method once on the same random prompt, in turn, so drifts of the machine hit
all methods alike; the reported figure is the median over repeats, and ratios are taken to `full`.
Methods are method specs or recipes (:mod:`attnkit.recipe`, e.g. with speculative decoding).

**The decode floor.** Decoding one token reads every weight once (the input embedding table aside:
one row of it) and every kept KV entry once, so a token cannot take less than
``(weight bytes + kept KV bytes) / memory bandwidth``. :func:`measure_bandwidth` measures the
bandwidth of this machine (the median of repeated large copies and sums, the faster of the two);
:func:`run_bench` puts the floor beside the measured decode time per token.
"""

from __future__ import annotations

import statistics
import time

import torch

from attnkit import validate
from attnkit.errors import AttnkitError
from attnkit.generation import sync
from attnkit.model import LoadedModel
from attnkit.recipe import as_recipe

FIELDS = ("prefill_s", "decode_tokens_per_s", "peak_kv_bytes", "final_kv_bytes")


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


def run_bench(model: LoadedModel, context: int, new_tokens: int, methods: list, repeats: int = 3,
              seed: int = 0, progress=None, bandwidth: float | None = None) -> list[dict]:
    """One row per method: medians of FIELDS over `repeats` interleaved runs, and ratios to `full`.
    With `bandwidth` (bytes/s, :func:`measure_bandwidth`), each row also has the decode floor per token
    (weights + the KV kept at the end, read once per token) beside the measured time per token."""
    check_benchmark_tokens(new_tokens)
    recipes = [as_recipe(m, "method") for m in methods]
    peers = [r.label for r in recipes if r.is_peer]
    if peers:
        raise AttnkitError(f"bench measures attnkit recipes; compare {', '.join(peers)} with "
                           f"benchmarks/compare_kvpress.py or in a sweep")
    methods = [r.label for r in recipes]
    low = 3 if model.geometry.vocab_size > 3 else 0
    ids = torch.randint(low, model.geometry.vocab_size, (context,), generator=torch.Generator().manual_seed(seed))
    samples: dict[str, list[dict]] = {spec: [] for spec in methods}
    for r in range(repeats):
        for spec, recipe in zip(methods, recipes):
            out = recipe.generate(model, ids, max_new_tokens=new_tokens, stop_at_eos=False)
            samples[spec].append(out.stats.as_dict())
            if progress:
                progress(r, spec, out.stats)
    weight_bytes = decode_weight_bytes(model) if bandwidth else None
    rows = []
    for spec, recipe in zip(methods, recipes):
        row = {"method": spec, "describe": recipe.method().describe(), "recipe": recipe.to_dict(), "context": context,
               "new_tokens": new_tokens, "repeats": repeats}
        for f in FIELDS:
            row[f] = statistics.median(s[f] for s in samples[spec])
        row["decode_ms_per_token"] = 1000.0 / row["decode_tokens_per_s"] if row["decode_tokens_per_s"] else None
        if bandwidth:
            row.update(bandwidth_bytes_per_s=bandwidth, weight_bytes=weight_bytes,
                       decode_floor_ms_per_token=1000.0 * decode_floor_s(weight_bytes, row["final_kv_bytes"],
                                                                         bandwidth))
        rows.append(row)
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
    return rows


def _mib(n) -> str:
    return f"{n / 2**20:.2f}"


def format_bench(rows: list[dict]) -> str:
    floor = any(r.get("decode_floor_ms_per_token") is not None for r in rows)
    head = (f"{'method':<28} {'prefill s':>10} {'x full':>7} {'decode tok/s':>13} {'x full':>7} "
            f"{'peak KV MiB':>12} {'final KV MiB':>13} {'KV/full':>8}")
    if floor:
        head += f" {'ms/tok':>8} {'floor ms':>9} {'x floor':>8}"
    lines = [head, "-" * len(head)]

    def ratio(x):
        return f"{x:.2f}" if x is not None else "-"

    for r in rows:
        line = (f"{r['method'][:28]:<28} {r['prefill_s']:>10.3f} {ratio(r.get('prefill_speedup')):>7} "
                f"{r['decode_tokens_per_s']:>13.1f} {ratio(r.get('decode_speedup')):>7} "
                f"{_mib(r['peak_kv_bytes']):>12} {_mib(r['final_kv_bytes']):>13} {ratio(r.get('kv_ratio')):>8}")
        if floor:
            ms, fl = r.get("decode_ms_per_token"), r.get("decode_floor_ms_per_token")
            line += (f" {ms if ms is not None else float('nan'):>8.3f} {fl:>9.4f} "
                     f"{ratio(ms / fl if ms and fl else None):>8}")
        lines.append(line)
    lines.append("x full: prefill = full time / method time, decode = method tok/s / full tok/s (>1 is faster); "
                 "KV/full = KV bytes held at the end")
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
