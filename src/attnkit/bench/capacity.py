"""Batches under a KV memory cap: how many sequences fit, and how many tokens per second come out, per method.

The reason to compress a KV cache is throughput: fewer bytes per sequence, more sequences per decoding
step. For a cap on the KV cache's bytes, each method's per-sequence peak (measured on one sequence of the
same length, prefill included: an eviction method holds one layer's whole prompt until it compresses
it) says how many sequences fit; a batch of that many then decodes, and its tokens per second
(every sequence's decoded tokens over the batch's decoding time) are compared with full attention's
under the same cap. Methods run in turn within each repeat (interleaved) and figures are medians.
"""

from __future__ import annotations

import statistics

import torch

from attnkit.bench.speed import BenchRun
from attnkit.methods.base import Method, resolve_method
from attnkit.methods.spec import parse_method_spec
from attnkit.model import LoadedModel
from attnkit.runner import generate


def prompts_of(model: LoadedModel, length: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` token-id prompts of `length` tokens (random ids; meant for random-weight timing models)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.geometry.vocab_size
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


def batch_run(model: LoadedModel, method: Method, prompts: list[list[int]], new_tokens: int) -> BenchRun:
    """Decode `new_tokens` after each of `prompts` (one batch, EOS ignored) and measure the batch."""
    return BenchRun.of(generate(model, prompts, method, max_new_tokens=new_tokens, stop_at_eos=False))


def _method(spec: str | Method) -> Method:
    return resolve_method(spec) if isinstance(spec, Method) else parse_method_spec(spec)


def warm_up(model: LoadedModel, built: list[tuple[str, Method]], length: int) -> None:
    """One untimed sequence of `length` tokens per method before the timed runs, so that what a process
    pays once (Keyformer's noise table, allocator growth, lazily built kernels) is not charged to the
    first timed run of a method; the timed runs are then medians of comparable runs."""
    for _, method in built:
        batch_run(model, method, prompts_of(model, length, 1, seed=999), 2)


def capacity_rows(model: LoadedModel, methods: list[str], length: int, new_tokens: int, kv_cap_bytes: int,
                  max_batch: int = 64, repeats: int = 3) -> list[dict]:
    """Per method: sequences of `length` tokens (+ `new_tokens`) that fit in `kv_cap_bytes` of KV cache
    (at most `max_batch`), and the batch's decoding tokens/s, with both relative to ``full``'s row (the
    first method must be ``full`` for the ratios)."""
    built = [(spec, _method(spec)) for spec in methods]
    fits = {}
    for spec, method in built:  # one sequence's peak, measured (also the runs' warm-up)
        one = batch_run(model, method, prompts_of(model, length, 1), new_tokens)
        fits[spec] = (one.peak_kv_bytes, min(max_batch, kv_cap_bytes // max(1, one.peak_kv_bytes)))
    runs: dict[str, list[BenchRun]] = {spec: [] for spec, _ in built}
    for r in range(repeats):
        for spec, method in built:
            batch = fits[spec][1]
            if batch > 0:
                runs[spec].append(batch_run(model, method, prompts_of(model, length, batch, seed=r), new_tokens))
    rows = []
    for spec, method in built:
        per_seq, batch = fits[spec]
        tps = statistics.median(run.decode_tokens_per_s for run in runs[spec]) if runs[spec] else 0.0
        rows.append({"method": method.describe(), "spec": spec, "length": length, "new_tokens": new_tokens,
                     "kv_cap_bytes": kv_cap_bytes, "kv_bytes_per_sequence": per_seq, "sequences": batch,
                     "tokens_per_s": tps, "repeats": len(runs[spec])})
    base = rows[0]
    for row in rows:
        row["sequences_vs_full"] = row["sequences"] / base["sequences"] if base["sequences"] else None
        row["tokens_per_s_vs_full"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    return rows


def fixed_batch_rows(model: LoadedModel, methods: list[str], length: int, batch: int, new_tokens: int,
                     repeats: int = 3) -> list[dict]:
    """Per method, one batch of `batch` prompts of `length` tokens: decoding tokens/s and KV bytes, with
    ratios to the first method's (``full``)."""
    built = [(spec, _method(spec)) for spec in methods]
    warm_up(model, built, length)
    runs: dict[str, list[BenchRun]] = {spec: [] for spec, _ in built}
    for r in range(repeats):
        for spec, method in built:
            runs[spec].append(batch_run(model, method, prompts_of(model, length, batch, seed=r), new_tokens))
    rows = []
    for spec, method in built:
        last = runs[spec][-1]
        rows.append({"method": method.describe(), "spec": spec, "length": length, "batch": batch,
                     "new_tokens": new_tokens,
                     "tokens_per_s": statistics.median(x.decode_tokens_per_s for x in runs[spec]),
                     "peak_kv_bytes_per_sequence": last.peak_kv_bytes, "peak_kv_bytes_total": last.peak_kv_bytes_total,
                     "held_kv_bytes_total": last.final_kv_bytes_total, "repeats": repeats})
    base = rows[0]
    for row in rows:
        row["tokens_per_s_vs_full"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
        row["peak_kv_vs_full"] = row["peak_kv_bytes_total"] / base["peak_kv_bytes_total"]
        row["held_kv_vs_full"] = row["held_kv_bytes_total"] / base["held_kv_bytes_total"]
    return rows


def scaling_rows(model: LoadedModel, methods: list[str], length: int, batches: list[int], new_tokens: int,
                 repeats: int = 3) -> list[dict]:
    """Per method, decoding tokens/s at each batch size (prompts of `length` tokens), relative to the same
    method at the first batch size: whether batching pays."""
    built = [(spec, _method(spec)) for spec in methods]
    warm_up(model, built, length)
    runs: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for spec, method in built:
            for b in batches:
                run = batch_run(model, method, prompts_of(model, length, b, seed=r), new_tokens)
                runs.setdefault((spec, b), []).append(run.decode_tokens_per_s)
    rows = []
    for spec, method in built:
        first = statistics.median(runs[(spec, batches[0])])
        for b in batches:
            tps = statistics.median(runs[(spec, b)])
            rows.append({"method": method.describe(), "spec": spec, "length": length, "batch": b,
                         "tokens_per_s": tps, "vs_first_batch": tps / first if first else None, "repeats": repeats})
    return rows


def format_rows(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of `rows` with (field, heading) `columns`; floats to 3 significant digits."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
