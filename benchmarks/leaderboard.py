"""Which methods keep full attention's score, and from which budget: a leaderboard from sweep tables.

    python benchmarks/leaderboard.py docs/results/eviction_budgets_tiny_v2.txt [more tables ...] > leaderboard.md

Reads the plain-text tables that ``attnkit eval --sweep`` prints (one line per task, length and protocol when several
ran; one column per ``method@budget``, each cell ``score [interval] (ratio x full)``, ``~`` marking a difference from
full inside the noise) and prints one Markdown table per protocol: a row per method, a column per task, each cell the
smallest budget from which the method keeps full's score at that budget and every larger one ("keeps": the
difference is inside the noise, or the score is above full's), ``-`` where no budget of the sweep keeps it, ``n/r``
where the method did not run on that task, ``all`` where a method without a budget (``simlayerkv``) keeps it. Rows
sort by the mean of their measured cells (``-`` counting as 1). Several tables (e.g. the sweep's first methods and those added later, run with
``--only``) merge; a column measured twice keeps the first table's cell.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CELL = re.compile(r"\(([0-9.]+)x(~?)\)")
SPLIT = re.compile(r"\s{2,}")


def read_table(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """``{(task, protocol): {column: cell}}`` of one ``attnkit eval`` table (the first block whose header starts with
    ``task``)."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("task ")), None)
    if head is None:
        raise SystemExit("no 'task ...' header line: not an attnkit eval table")
    header = SPLIT.split(lines[head].strip())
    fixed = 3 if header[2] == "protocol" else 2
    table: dict[tuple[str, str], dict[str, str]] = {}
    for line in lines[head + 2:]:
        if not line.strip():
            break
        cells = SPLIT.split(line.strip())
        if len(cells) != len(header):
            raise SystemExit(f"a row of {len(cells)} cells under a header of {len(header)}: {line[:60]!r}")
        protocol = cells[2] if fixed == 3 else "query-aware"
        table.setdefault((cells[0], protocol), {}).update(zip(header[fixed:], cells[fixed:]))
    return table


def keeps(cell: str) -> bool:
    """A cell keeps full's score: inside the noise of full (``~``), or above it."""
    found = CELL.search(cell)
    return found is not None and (found.group(2) == "~" or float(found.group(1)) >= 1.0)


def measured(columns: dict[str, str], method: str) -> bool:
    """Whether the table holds every score of `method` for this task (a sweep cut short, or run with ``--only`` on
    some tasks, leaves ``-`` where nothing ran)."""
    cells = [cell for c, cell in columns.items() if c.split("@")[0] == method]
    return bool(cells) and all(CELL.search(cell) for cell in cells)


def smallest_keeping(columns: dict[str, str], method: str) -> float | None:
    """The smallest budget of `method` from which every larger budget keeps full's score (a method without a budget,
    ``simlayerkv``: 1 when it keeps it)."""
    if method in columns:
        return 1.0 if keeps(columns[method]) else None
    budgets = sorted((float(c.split("@")[1]), cell) for c, cell in columns.items()
                     if "@" in c and c.split("@")[0] == method)
    first = None
    for budget, cell in reversed(budgets):
        if not keeps(cell):
            break
        first = budget
    return first


def leaderboard(tables: list[dict]) -> str:
    merged: dict[tuple[str, str], dict[str, str]] = {}
    for table in tables:
        for key, columns in table.items():
            row = merged.setdefault(key, {})
            row.update({c: v for c, v in columns.items() if c not in row})
    out = []
    for protocol in dict.fromkeys(p for _, p in merged):
        tasks = [t for t, p in merged if p == protocol]
        methods = list(dict.fromkeys(c.split("@")[0] for t in tasks for c in merged[t, protocol] if c != "full"))
        rows = []
        for method in methods:
            ran = [measured(merged[t, protocol], method) for t in tasks]
            if not any(ran):
                continue
            firsts = [smallest_keeping(merged[t, protocol], method) if r else None for t, r in zip(tasks, ran)]
            rank = sum(1.0 if f is None else f for f, r in zip(firsts, ran) if r) / sum(ran)
            rows.append((rank, method, ["n/r" if not r else "-" if f is None else "all" if method in merged[t, protocol]
                                        else f"{f:g}" for t, f, r in zip(tasks, firsts, ran)]))
        out += [f"{protocol}: the smallest budget (fraction of the prompt) keeping full's score at it and above", "",
                "| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        out += [f"| {m} | " + " | ".join(cells) + " |" for _, m, cells in sorted(rows, key=lambda r: (r[0], r[1]))]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tables", nargs="+", help="attnkit eval table files (the text an `attnkit eval --sweep` prints)")
    args = p.parse_args(argv)
    print(leaderboard([read_table(Path(f).read_text()) for f in args.tables]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
