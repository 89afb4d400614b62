"""The evaluation harness behind ``attnkit eval``: tasks x lengths x recipes (x budgets), one result row per cell.

    rows = run_eval(model, ["passkey", "perplexity"], [1024, 2048], ["full", "window:window=512"], samples=8)
    print(format_table(rows))

Every recipe of a (task, length) pair sees the same samples. Sample ``i`` uses eval seed ``seed + i``;
its needle depth is ``(i + 0.5) / samples`` unless explicit depths are given (then every depth gets
``samples`` samples). Generation is greedy and stops at the first newline (every task's answer is on
the first line of the continuation; LongBench-format items, :mod:`attnkit.eval.longbench`, run to their
own token limit). ``perplexity`` is bits per byte of held-out standard-library text (lower is better).
``full`` runs first in each (task, length) pair so that every row can carry its score relative to full.

:func:`run_cells` is the one loop behind :func:`run_eval` and the resumable sweeps of
:mod:`attnkit.eval.sweep`: it takes a plan (groups of cells sharing their samples), skips cells whose
rows it is handed, and appends each finished row to ``results.jsonl`` as one line, flushed and fsynced
(:func:`append_row`), so an interruption never leaves a half-written row that counts.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import platform
import random
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.eval import corpus
from attnkit.eval.tasks import ALL_TASKS, NEEDLE_TASKS, TASKS, Sample
from attnkit.methods.base import Method
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe, as_recipe, format_budget
from attnkit.runner import token_nll

PERPLEXITY = "perplexity"
LONGBENCH_PREFIX = "longbench:"
RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.txt"
# the version of the row format; rows without one are version 1 (before recipes, budgets and depth scores)
SCHEMA = 2

ROW_FIELDS = (
    "schema", "run_id", "cell", "model", "task", "length", "method", "method_params", "method_spec", "recipe",
    "recipe_name", "budget", "samples", "depths", "seeds", "score", "scores", "depth_scores", "higher_is_better",
    "score_rel_full", "prefill_s", "decode_tokens_per_s", "peak_kv_bytes", "final_kv_bytes", "kept_fraction", "wall_s", "versions",
    "git_commit", "timestamp", "predictions",
)
# fields that differ between two runs of the same cell (timings and provenance of the run)
VOLATILE_FIELDS = ("run_id", "timestamp", "prefill_s", "decode_tokens_per_s", "wall_s")


# --------------------------------------------------------------------------------------------------
# provenance


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """Versions of attnkit, torch, transformers and Python."""
    import transformers

    import attnkit

    return {"attnkit": attnkit.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; else what :mod:`platform` says) and its core
    count: speed ratios change with the machine (the Python overhead of a step against its arithmetic)."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine() or 'unknown CPU'}, {os.cpu_count()} cores"


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the git checkout attnkit is imported from, or None (not a checkout, no git, no commits)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


# --------------------------------------------------------------------------------------------------
# checking the request


def _check_list(label: str, values) -> None:
    if isinstance(values, (str, bytes)) or not list(values):
        raise AttnkitError(f"{label} must be a non-empty list, got {values!r}")


def check_tasks(tasks, data=None) -> None:
    """Known task names; ``longbench:DATASET`` needs a LongBench-format file holding DATASET."""
    _check_list("tasks", tasks)
    if len(set(tasks)) != len(tasks):
        raise AttnkitError(f"tasks has duplicates: {list(tasks)}")
    datasets = data.datasets() if data is not None else []
    unknown = [t for t in tasks if t not in ALL_TASKS
               and not (t.startswith(LONGBENCH_PREFIX) and t[len(LONGBENCH_PREFIX):] in datasets)]
    if unknown:
        extra = ", ".join(LONGBENCH_PREFIX + d for d in datasets)
        hint = f", {extra} (from {data.source})" if extra else "; LongBench tasks come from a --data FILE"
        raise AttnkitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"available: {', '.join(ALL_TASKS)}{hint}")


def check_lengths(model: LoadedModel | None, lengths) -> None:
    _check_list("lengths", lengths)
    if len(set(lengths)) != len(lengths):
        raise AttnkitError(f"lengths has duplicates: {list(lengths)}")
    for length in lengths:
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            raise AttnkitError(f"lengths must be integers >= 2 (tokens), got {length!r}")
    if model is not None:
        limit = model.geometry.max_positions
        too_long = [n for n in lengths if n > limit]
        if too_long:
            raise AttnkitError(f"length {too_long[0]} exceeds the {limit} positions model {model.spec!r} allows")


def check_samples(samples) -> None:
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise AttnkitError(f"samples must be an integer >= 1, got {samples!r}")


def depth_list(samples: int, depths) -> list[float]:
    """The needle depth of every sample: ``(i + 0.5) / samples``, or each of `depths` `samples` times."""
    if depths is None:
        return [(i + 0.5) / samples for i in range(samples)]
    if isinstance(depths, (str, bytes)) or not list(depths):
        raise AttnkitError(f"depths must be a non-empty list of numbers in [0, 1], got {depths!r}")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise AttnkitError(f"depths must be numbers in [0, 1], got {d!r}")
    return [float(d) for d in depths for _ in range(samples)]


def _check_request(model: LoadedModel, tasks, lengths, methods, samples, depths, data=None
                   ) -> tuple[list[Recipe], list[float]]:
    check_tasks(tasks, data)
    _check_list("methods", methods)
    if len(set(map(str, methods))) != len(methods):
        raise AttnkitError(f"methods has duplicates: {list(methods)}")
    check_lengths(None, lengths)
    check_samples(samples)
    depth_values = depth_list(samples, depths)
    recipes = [as_recipe(m, "method") for m in methods]
    open_budget = [r.label for r in recipes if r.takes_budget()]
    if open_budget:
        raise AttnkitError(f"{', '.join(open_budget)} need{'s' if len(open_budget) == 1 else ''} a KV budget: give "
                           f"one in the spec (e.g. 'snapkv:budget=0.3'), or run a sweep with budgets")
    check_lengths(model, lengths)
    check_peer_tasks(recipes, tasks)
    return recipes, depth_values


def check_peer_tasks(recipes: list[Recipe], tasks) -> None:
    peers = [r.label for r in recipes if r.is_peer]
    if peers and PERPLEXITY in tasks:
        raise AttnkitError(f"task 'perplexity' scores attnkit methods only; {', '.join(peers)} cannot run it")


def _make_samples(model: LoadedModel, task: str, length: int, seed: int, depths: list[float]) -> list[Sample]:
    out = []
    for i, depth in enumerate(depths):
        try:
            sample = TASKS[task].make(model.tokenizer, length, depth=depth, seed=seed + i, split="eval")
        except AttnkitError:
            raise
        except ValueError as exc:
            raise AttnkitError(f"task {task!r} at length {length}: {exc}") from None
        limit = model.geometry.max_positions
        if length + sample.max_new_tokens > limit:
            raise AttnkitError(f"task {task!r} at length {length} needs {length} + {sample.max_new_tokens} "
                               f"positions; model {model.spec!r} allows {limit}")
        out.append(sample)
    return out


def task_items(model: LoadedModel, task: str, length: int, seed: int, samples: int, depths: list[float],
               data=None) -> list:
    """The samples every recipe of a (task, length) pair sees."""
    if task == PERPLEXITY:
        return perplexity_windows(model, length, seed, samples)
    if task.startswith(LONGBENCH_PREFIX):
        return data.samples(model, task[len(LONGBENCH_PREFIX):], length, samples)
    return _make_samples(model, task, length, seed, depths)


def score_prediction(task: str, prediction: str, item: Sample) -> float:
    if task.startswith(LONGBENCH_PREFIX):
        from attnkit.eval.longbench import score_sample

        return score_sample(prediction, item)
    return float(TASKS[task].score(prediction, item))


# --------------------------------------------------------------------------------------------------
# perplexity


def _special_prefix(tokenizer) -> list[int]:
    """What the tokenizer puts before a text (BOS for Llama-style tokenizers, nothing for Qwen)."""
    return list(tokenizer("").input_ids)


@functools.lru_cache(maxsize=4)
def _heldout_ids(tokenizer) -> list[int]:
    return tokenizer.encode(corpus.haystack_text("heldout"), add_special_tokens=False)


def perplexity_windows(model: LoadedModel, length: int, seed: int, count: int) -> list[list[int]]:
    """`count` token windows of `length` tokens (BOS included) of held-out text; window i from seed + i."""
    prefix = _special_prefix(model.tokenizer)
    n = length - len(prefix)
    if n < 1:
        raise AttnkitError(f"task 'perplexity' at length {length}: needs at least {len(prefix) + 2} tokens")
    hay = _heldout_ids(model.tokenizer)
    if n > len(hay):
        raise AttnkitError(f"task 'perplexity' at length {length}: the held-out text has only "
                           f"{len(hay)} tokens")
    windows = []
    for i in range(count):
        rng = random.Random(f"eval|perplexity|{length}|{seed + i}")
        start = rng.randrange(0, len(hay) - n + 1)
        windows.append(prefix + hay[start : start + n])
    return windows


def bits_per_byte(model: LoadedModel, ids: list[int], method: Method) -> float:
    """Next-token NLL of ids[1:] under `method`'s prefill, in bits per UTF-8 byte of their text."""
    nll = token_nll(model, ids, method).sum().item()
    n_bytes = len(model.tokenizer.decode(ids[1:], skip_special_tokens=True).encode("utf-8"))
    if n_bytes == 0:
        raise AttnkitError("perplexity window decodes to no text")
    return nll / math.log(2) / n_bytes


# --------------------------------------------------------------------------------------------------
# running


def mean_present(values: list) -> float | None:
    """Mean of the values that are not None (None when there are none)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _rel_full(score: float | None, full: float | None, higher_is_better: bool) -> float | None:
    if score is None or full is None:
        return None
    num, den = (score, full) if higher_is_better else (full, score)
    return num / den if den else None


def depth_scores(task: str, items, scores: list[float]) -> list[list[float]] | None:
    """``[[depth, mean score], ...]`` sorted by depth, for needle tasks (None for the others)."""
    if task not in NEEDLE_TASKS:
        return None
    by_depth: dict[float, list[float]] = {}
    for item, score in zip(items, scores):
        by_depth.setdefault(round(float(item.depth), 6), []).append(score)
    return [[d, sum(v) / len(v)] for d, v in sorted(by_depth.items())]


class _Peers:
    """The peers' worker processes a run needs, started on first use and stopped at the end."""

    def __init__(self, model: LoadedModel):
        self.model, self.kvpress = model, None

    def runner(self, recipe: Recipe):
        if self.kvpress is None:
            from attnkit.bench.peers import KvpressRunner

            self.kvpress = KvpressRunner(self.model)
        return self.kvpress

    def close(self) -> None:
        if self.kvpress is not None:
            self.kvpress.close()
            self.kvpress = None


def _run_cell(model: LoadedModel, task: str, recipe: Recipe, items, progress_bar, peers: _Peers) -> dict:
    """Scores, predictions and statistics of one (task, length, recipe) cell."""
    scores, predictions, prefill, decode_tps, peak_kv, final_kv = [], [], [], [], [], []
    # token-selecting methods (select) count what they kept; the cell's share is the change of the counts
    counts = None if recipe.is_peer else getattr(recipe.method(), "selection", None)
    before = dict(counts) if counts else None
    for item in items:
        if task == PERPLEXITY:
            t0 = time.perf_counter()
            scores.append(bits_per_byte(model, item, recipe.method()))
            prefill.append(time.perf_counter() - t0)
            predictions.append(None)
        else:
            stop = item.meta.get("stop", "\n")
            if recipe.is_peer:
                gen = peers.runner(recipe).generate(item.prompt, recipe.peer, item.max_new_tokens, stop)
            else:
                gen = recipe.generate(model, item.prompt, max_new_tokens=item.max_new_tokens, stop=stop)
            scores.append(score_prediction(task, gen.text, item))
            predictions.append(gen.text)
            st = gen.stats
            prefill.append(st.prefill_s)
            # a generation of one token has no decode rate; it does not count towards the mean
            decode_tps.append(st.decode_tokens_per_s if st.decode_tokens_per_s > 0 else None)
            peak_kv.append(st.peak_kv_bytes)
            final_kv.append(st.final_kv_bytes)
        if progress_bar is not None:
            progress_bar.update(1)
    peak_kv = [v for v in peak_kv if v is not None]
    final_kv = [v for v in final_kv if v is not None]
    return {
        "score": mean_present(scores), "scores": scores, "depth_scores": depth_scores(task, items, scores),
        "prefill_s": mean_present(prefill), "decode_tokens_per_s": mean_present(decode_tps),
        "peak_kv_bytes": max(peak_kv, default=None), "final_kv_bytes": max(final_kv, default=None),
        "predictions": None if task == PERPLEXITY else predictions,
        "kept_fraction": _kept_share(before, counts),
    }


def _kept_share(before: dict | None, after: dict | None) -> float | None:
    """Kept tokens / context tokens over the selections made since `before` (None: no selection made)."""
    if not before or not after:
        return None
    context = after["context"] - before["context"]
    return (after["kept"] - before["kept"]) / context if context else None


def column_label(recipe_name: str, budget) -> str:
    """How a (recipe, budget) is named in tables and plots: ``snapkv@0.25``, or the recipe's name."""
    return recipe_name if budget is None else f"{recipe_name}@{format_budget(budget)}"


def cell_key(model: str, task: str, length: int, recipe_name: str, budget, samples: int, seed: int) -> str:
    """What identifies a cell: a results row with the same key is the same measurement."""
    return json.dumps([model, task, length, recipe_name, budget, samples, seed])


@dataclass
class Group:
    """Cells sharing one (task, length) and its samples; the first recipe is the reference (full)."""

    task: str
    length: int
    items: list
    recipes: list[Recipe] = field(default_factory=list)


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


def run_cells(model: LoadedModel, groups: list[Group], *, seed: int, out_path: Path | None = None,
              progress: bool = True, done: dict[str, dict] | None = None, run_id: str | None = None,
              desc: str = "eval") -> list[dict]:
    """Run every cell of `groups` in order; a cell whose key is in `done` is not run again (its row is
    reused). Each new row is appended to `out_path` as soon as its cell finishes. Returns all rows."""
    done = done or {}

    def key(group: Group, recipe: Recipe) -> str:
        return cell_key(model.spec, group.task, group.length, recipe.label, recipe.budget, len(group.items), seed)

    todo = sum(len(g.items) for g in groups for r in g.recipes if key(g, r) not in done)
    bar = None
    if progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=todo, desc=desc, unit="sample", dynamic_ncols=True)
    run_id = run_id or _now()
    run_versions, commit = versions(), git_commit()  # the same for every cell of this run
    peers = _Peers(model)
    rows: list[dict] = []
    try:
        for group in groups:
            full_score = None
            for recipe in group.recipes:
                k = key(group, recipe)
                higher = group.task != PERPLEXITY
                if k in done:
                    row = done[k]
                else:
                    label = column_label(recipe.label, recipe.budget)
                    if bar is not None:
                        bar.set_postfix_str(f"{group.task} {group.length} {label}", refresh=False)
                    t0 = time.perf_counter()
                    result = _run_cell(model, group.task, recipe, group.items, bar, peers)
                    wall = time.perf_counter() - t0
                    if recipe.is_peer:
                        method_name, method_params = f"kvpress:{recipe.peer[0]}", dict(recipe.peer[1])
                    else:
                        method = recipe.method()
                        method_name, method_params = method.name, method.params()
                    items = group.items
                    row = {
                        "schema": SCHEMA, "run_id": run_id, "cell": k, "model": model.spec, "task": group.task,
                        "length": group.length, "method": method_name, "method_params": method_params,
                        "method_spec": label, "recipe": recipe.to_dict(), "recipe_name": recipe.label,
                        "budget": recipe.budget, "samples": len(items),
                        "depths": None if group.task == PERPLEXITY else [s.depth for s in items],
                        "seeds": [seed + j for j in range(len(items))],
                        "score": result["score"], "scores": result["scores"], "depth_scores": result["depth_scores"],
                        "higher_is_better": higher, "score_rel_full": None,
                        "prefill_s": result["prefill_s"], "decode_tokens_per_s": result["decode_tokens_per_s"],
                        "peak_kv_bytes": result["peak_kv_bytes"], "final_kv_bytes": result["final_kv_bytes"],
                        "kept_fraction": result["kept_fraction"], "wall_s": wall, "versions": run_versions,
                        "git_commit": commit, "timestamp": _now(), "predictions": result["predictions"],
                    }
                if recipe.is_full and full_score is None:
                    full_score = row["score"]
                if k not in done:
                    row["score_rel_full"] = _rel_full(row["score"], full_score, higher)
                    if out_path is not None:
                        append_row(out_path, json.loads(json.dumps(row, default=str)))
                rows.append(row)
    finally:
        peers.close()
        if bar is not None:
            bar.close()
    return rows


def full_first(recipes: list[Recipe]) -> list[Recipe]:
    """`recipes` with plain full attention first (stable otherwise)."""
    return sorted(recipes, key=lambda r: not r.is_full)


def run_eval(model: LoadedModel, tasks: list[str], lengths: list[int], methods: list, samples: int,
             seed: int = 0, out_dir: Path | str | None = None, progress: bool = True,
             depths: list[float] | None = None, data=None) -> list[dict]:
    """Evaluate every (task, length, method) cell on `samples` seeded eval samples; one row per cell.

    `methods` are specs such as ``"full"`` or ``"window:window=512"``, recipes (:class:`attnkit.recipe.Recipe`
    or mappings) or method instances. `data` (:class:`attnkit.eval.longbench.LongBenchData` or a path)
    provides ``longbench:DATASET`` tasks. With `out_dir`, each row is appended to
    ``out_dir/results.jsonl`` as its cell finishes and ``out_dir/table.txt`` is written at the end.
    Rows come in run order (tasks, then lengths, then methods with ``full`` first).
    """
    if data is not None:
        from attnkit.eval.longbench import as_longbench_data

        data = as_longbench_data(data)
    tasks, lengths, methods = list(tasks), list(lengths), list(methods)
    recipes, depth_values = _check_request(model, tasks, lengths, methods, samples, depths, data)
    recipes = full_first(recipes)
    # build every sample before running anything: a bad length fails at once, not an hour in
    groups = [Group(task, length, task_items(model, task, length, seed, samples, depth_values, data), recipes)
              for task in tasks for length in lengths]
    out_path = None
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / RESULTS_FILE
        repair_tail(out_path)
    rows = run_cells(model, groups, seed=seed, out_path=out_path, progress=progress)
    if out_dir is not None:
        (out_dir / TABLE_FILE).write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows


# --------------------------------------------------------------------------------------------------
# reading results


def upgrade_row(row: dict, where: str) -> dict:
    """A row of any schema this attnkit knows, in the current schema (missing fields filled in)."""
    schema = row.get("schema", 1)
    if not isinstance(schema, int) or isinstance(schema, bool):
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
        row["schema_read"] = schema
        row["schema"] = SCHEMA
    return row


def read_results(path: Path | str) -> list[dict]:
    """Rows of a results.jsonl file (or of the results.jsonl in a directory), upgraded to the current
    schema; rows of a newer schema are refused with a clear error. An unterminated last line (a row cut
    off by an interruption) is ignored with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise AttnkitError(f"no results file at {path}")
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
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


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per cell (the last one written), in first-seen order: a cell run twice counts once."""
    out: dict = {}
    for row in rows:
        key = row.get("cell") or cell_key(row.get("model"), row.get("task"), row.get("length"),
                                          row.get("recipe_name") or row.get("method_spec"), row.get("budget"),
                                          row.get("samples"), (row.get("seeds") or [None])[0])
        out[key] = row
    return list(out.values())


# --------------------------------------------------------------------------------------------------
# the table


def _format_cell(row: dict) -> str:
    score = row.get("score")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        text = "n/a"
    elif row.get("higher_is_better", True):
        text = f"{100 * score:.1f}%"
    else:
        text = f"{score:.3f}"
    rel = row.get("score_rel_full")
    reference = (row.get("method") == "full" and not row.get("method_params")
                 and (row.get("recipe_name") or row.get("method_spec")) == "full")
    if rel is not None and not reference:
        text += f" ({rel:.2f}x)"
    return text


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per (task, length), one column per method spec.

    Scores are percent for tasks where higher is better, bits per byte (3 decimals) for perplexity;
    ``(0.96x)`` is the score relative to full (below 1 is worse than full for every task).
    """
    if not rows:
        return "(no results)"
    columns: list[str] = []
    lines: dict[tuple, dict[str, str]] = {}
    for row in rows:
        spec = str(row.get("method_spec") or row.get("method") or "?")
        if spec not in columns:
            columns.append(spec)
        lines.setdefault((str(row.get("task", "?")), row.get("length", "?")), {})[spec] = _format_cell(row)
    header = ["task", "length", *columns]
    body = [[task, str(length), *(cells.get(c, "-") for c in columns)] for (task, length), cells in lines.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])]
        return "  ".join(left + [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]).rstrip()

    out = [render(header), "  ".join("-" * w for w in widths)] + [render(r) for r in body]
    n = sorted({r.get("samples") for r in rows if r.get("samples") is not None})
    models = sorted({str(r.get("model")) for r in rows if r.get("model")})
    notes = []
    if models:
        notes.append(f"model: {', '.join(models)}")
    if n:
        notes.append(f"samples per cell: {', '.join(map(str, n))}")
    notes.append("retrieval/code: % score (higher is better); perplexity: bits per byte (lower is better); "
                 "(x) = relative to full, below 1 is worse")
    return "\n".join(out + [""] + notes)
