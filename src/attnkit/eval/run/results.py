"""The results store: one JSON row per evaluated cell in ``results.jsonl``, written so that it survives a crash.

A row is appended as one line, flushed and fsynced (:func:`append_row`), so an interruption leaves
whole rows and at most one unterminated last line, which :func:`read_results` ignores and
:func:`repair_tail` removes before a run resumes. Rows carry a schema version; older rows are
upgraded on reading (:func:`upgrade_row`), newer ones refused.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.stats.intervals import score_interval
from attnkit.validate import is_whole

RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.txt"
# the version of the row format; rows without one are version 1 (before recipes, budgets and depth scores);
# version 2 rows are before protocols, intervals and method seeds
SCHEMA = 3

ROW_FIELDS = (
    "schema", "run_id", "cell", "model", "task", "length", "method", "method_params", "method_spec", "recipe",
    "recipe_name", "budget", "method_seed", "protocol", "queries", "questions", "contexts", "context_prefills",
    "prefill_tokens", "samples", "depths", "seeds", "score", "scores", "depth_scores", "score_interval", "interval",
    "higher_is_better",
    "score_rel_full", "prefill_s", "decode_tokens_per_s", "throughput_tokens_per_s", "batch_size", "peak_kv_bytes",
    "final_kv_bytes", "kept_fraction", "wall_s", "versions", "git_commit", "timestamp", "predictions",
)
# fields that differ between two runs of the same cell (timings, batch size and provenance of the run)
VOLATILE_FIELDS = ("run_id", "timestamp", "prefill_s", "decode_tokens_per_s", "throughput_tokens_per_s", "batch_size",
                   "wall_s")


def cell_key(model: str, task: str, length: int, recipe_name: str, budget, samples: int, seed: int,
             protocol: str = "query-aware", queries: int = 1, method_seed: int | None = None,
             options: dict | None = None) -> str:
    """What identifies a cell: a results row with the same key is the same measurement. A query-aware cell of
    one question per context and no method seed has the key it had before protocols existed; `options` (what a
    long-output task decodes, e.g. ``{"continuation_tokens": 1024}``) come last when there are any."""
    extra = [] if (protocol, queries, method_seed) == ("query-aware", 1, None) else [protocol, queries, method_seed]
    if options:
        extra = [protocol, queries, method_seed, dict(sorted(options.items()))]
    return json.dumps([model, task, length, recipe_name, budget, samples, seed, *extra])


def append_row(path: Path, row: dict) -> None:
    """Append `row` as one JSON line, flushed and fsynced: after a crash the file holds whole rows and at
    most one unterminated line, which :func:`read_results` ignores and :func:`repair_tail` removes."""
    line = json.dumps(row, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def repair_tail(path: Path) -> bool:
    """Cut an unterminated last line (a row interrupted while being written); True when one was cut."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return False
        fh.truncate(data.rfind(b"\n") + 1)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def upgrade_row(row: dict, where: str) -> dict:
    """A row of any schema this attnkit knows, in the current schema (missing fields filled in)."""
    schema = row.get("schema", 1)
    if not is_whole(schema):
        raise AttnkitError(f"{where}: 'schema' must be a whole number, got {schema!r}")
    if schema > SCHEMA:
        raise AttnkitError(f"{where}: results schema {schema} is newer than this attnkit reads (schema <= "
                           f"{SCHEMA}); upgrade attnkit to read it, or write the results again with this version")
    if schema < SCHEMA:
        row = dict(row)
        spec = row.get("method_spec") or row.get("method") or "?"
        row.setdefault("recipe_name", spec)
        row.setdefault("recipe", {"name": spec, "method": row.get("method"), "params": row.get("method_params") or {}})
        row.setdefault("budget", None)
        row.setdefault("depth_scores", None)
        row.setdefault("cell", None)
        for name, value in (("protocol", "query-aware"), ("queries", 1), ("method_seed", None), ("questions", None),
                            ("contexts", None), ("context_prefills", None), ("prefill_tokens", None)):
            row.setdefault(name, value)
        if "score_interval" not in row:
            interval = score_interval(row.get("scores") or [])
            row["score_interval"] = None if interval is None else list(interval[:2])
            row["interval"] = None if interval is None else interval[2]
        row["schema_read"] = schema
        row["schema"] = SCHEMA
    return row


def _read_text(path: Path) -> str:
    """The file's text; a file that is not UTF-8 (binary, another encoding) is a one-line error."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AttnkitError(f"{path} is not a results file: byte {exc.start} is not UTF-8 text "
                           f"(a results.jsonl holds one JSON row per line)") from None
    except OSError as exc:
        raise AttnkitError(f"cannot read the results file {path}: {exc.strerror or exc}") from None


def read_results(path: Path | str) -> list[dict]:
    """Rows of a results.jsonl file (or of the results.jsonl in a directory), upgraded to the current
    schema; rows of a newer schema are refused with a clear error. An unterminated last line (a row cut
    off by an interruption) is ignored with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise AttnkitError(f"no results file at {path}")
    lines = _read_text(path).split("\n")
    if lines and lines[-1].strip():
        warnings.warn(f"{path}: ignoring an unterminated last line (a row interrupted while being written)",
                      stacklevel=2)
    rows = []
    for n, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AttnkitError(f"{path} line {n} is not a JSON row: {exc}") from None
        if not isinstance(row, dict):
            raise AttnkitError(f"{path} line {n} is not a JSON object")
        rows.append(upgrade_row(row, f"{path} line {n}"))
    return rows


def done_rows(path: Path) -> dict[str, dict]:
    """The rows of the results file at `path` by cell key (a row cut off mid-write removed first; rows without a
    key, from before keys, are left out): the cells a resumed run does not run again."""
    if not path.is_file():
        return {}
    repair_tail(path)
    return {row["cell"]: row for row in read_results(path) if row.get("cell")}


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per cell (the last one written), in first-seen order: a cell run twice counts once."""
    out: dict = {}
    for row in rows:
        key = row.get("cell") or cell_key(row.get("model"), row.get("task"), row.get("length"),
                                          row.get("recipe_name") or row.get("method_spec"), row.get("budget"),
                                          row.get("samples"), (row.get("seeds") or [None])[0],
                                          row.get("protocol") or "query-aware", row.get("queries") or 1,
                                          row.get("method_seed"))
        out[key] = row
    return list(out.values())
