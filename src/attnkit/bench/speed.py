"""Prefill time, decode speed and KV memory of methods against `full`, interleaved in one process.

Each repeat runs every method once on the same random prompt, in turn, so drifts of the machine hit
all methods alike; the reported figure is the median over repeats, and ratios are taken to `full`.
"""

from __future__ import annotations

import statistics

import torch

from attnkit.methods.base import parse_method_spec
from attnkit.model import LoadedModel
from attnkit.runner import generate

FIELDS = ("prefill_s", "decode_tokens_per_s", "peak_kv_bytes", "final_kv_bytes")


def run_bench(model: LoadedModel, context: int, new_tokens: int, methods: list[str], repeats: int = 3,
              seed: int = 0, progress=None) -> list[dict]:
    """One row per method: medians of FIELDS over `repeats` interleaved runs, and ratios to `full`."""
    instances = [parse_method_spec(m) for m in methods]
    low = 3 if model.geometry.vocab_size > 3 else 0
    ids = torch.randint(low, model.geometry.vocab_size, (context,), generator=torch.Generator().manual_seed(seed))
    samples: dict[str, list[dict]] = {spec: [] for spec in methods}
    for r in range(repeats):
        for spec, method in zip(methods, instances):
            out = generate(model, ids, method, max_new_tokens=new_tokens, stop_at_eos=False)
            samples[spec].append(out.stats.as_dict())
            if progress:
                progress(r, spec, out.stats)
    rows = []
    for spec, method in zip(methods, instances):
        row = {"method": spec, "describe": method.describe(), "context": context, "new_tokens": new_tokens,
               "repeats": repeats}
        for f in FIELDS:
            row[f] = statistics.median(s[f] for s in samples[spec])
        row["decode_ms_per_token"] = 1000.0 / row["decode_tokens_per_s"] if row["decode_tokens_per_s"] else None
        rows.append(row)
    full = next((r for r in rows if r["method"] == "full"), None)
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
    head = (f"{'method':<28} {'prefill s':>10} {'x full':>7} {'decode tok/s':>13} {'x full':>7} "
            f"{'peak KV MiB':>12} {'final KV MiB':>13} {'KV/full':>8}")
    lines = [head, "-" * len(head)]

    def ratio(x):
        return f"{x:.2f}" if x is not None else "-"

    for r in rows:
        lines.append(f"{r['method']:<28} {r['prefill_s']:>10.3f} {ratio(r.get('prefill_speedup')):>7} "
                     f"{r['decode_tokens_per_s']:>13.1f} {ratio(r.get('decode_speedup')):>7} "
                     f"{_mib(r['peak_kv_bytes']):>12} {_mib(r['final_kv_bytes']):>13} {ratio(r.get('kv_ratio')):>8}")
    lines.append("x full: prefill = full time / method time, decode = method tok/s / full tok/s (>1 is faster); "
                 "KV/full = KV bytes held at the end")
    return "\n".join(lines)
