"""Two recipes of a results file compared sample by sample: the mean per-sample difference of their scores and its
95 % bootstrap interval, per task, length and budget (both ran on the same prompts, so the difference is paired and
its interval far tighter than the gap between two cells' own intervals). Also each recipe against the other at the
budget where their peak KV bytes are nearest (methods with a re-compression buffer hold more than their budget).

    python benchmarks/paired_cells.py results/decode_time --a rkv --b h2o

A difference is ``a - b``; for a lower-is-better task (bits per byte) a negative difference favours ``a``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnkit.eval.run.results import latest_rows, read_results  # noqa: E402
from attnkit.eval.stats.intervals import paired_difference  # noqa: E402


def by_cell(rows: list[dict], recipe: str) -> dict[tuple, dict]:
    return {(r["task"], r["length"], r["budget"]): r for r in rows if r["recipe_name"] == recipe}


def line(task, length, label, a: dict, b: dict) -> str:
    d = paired_difference(a["scores"], b["scores"], seed=0)
    better = "a" if (d["diff"] < 0) != a["higher_is_better"] else "b"
    verdict = f"{better} better" if d["holds"] else "no difference"
    return (f"{task:22} {length:6} {label:22} {a['score']:8.3f} {b['score']:8.3f} {d['diff']:+8.3f} "
            f"[{d['low']:+.3f}, {d['high']:+.3f}]  {verdict}  (KV MB {a['peak_kv_bytes'] / 1e6:.2f} vs "
            f"{b['peak_kv_bytes'] / 1e6:.2f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a results directory (results.jsonl) or file")
    p.add_argument("--a", required=True, help="recipe name")
    p.add_argument("--b", required=True, help="recipe name")
    args = p.parse_args(argv)
    path = Path(args.results)
    rows = latest_rows(read_results(path / "results.jsonl" if path.is_dir() else path))
    a, b = by_cell(rows, args.a), by_cell(rows, args.b)
    print(f"a = {args.a}, b = {args.b}: mean of a - b per sample [95 % bootstrap interval]")
    print(f"{'task':22} {'length':>6} {'budget':22} {'a':>8} {'b':>8} {'a - b':>8}")
    for key in sorted(set(a) & set(b), key=str):
        print(line(key[0], key[1], f"{key[2]}", a[key], b[key]))
    print("\nat the nearest peak KV bytes:")
    for key, ra in sorted(a.items(), key=lambda kv: str(kv[0])):
        same = [rb for k, rb in b.items() if k[:2] == key[:2]]
        if same:
            rb = min(same, key=lambda r: abs(r["peak_kv_bytes"] - ra["peak_kv_bytes"]))
            print(line(key[0], key[1], f"{key[2]} vs {rb['budget']}", ra, rb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
