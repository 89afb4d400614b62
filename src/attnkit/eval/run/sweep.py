"""Resumable sweeps: recipes x budgets x tasks x lengths from one file (``attnkit eval --sweep FILE --out DIR``).

A sweep file (YAML or JSON)::

    model: tiny
    samples: 20
    seed: 0
    tasks: [passkey, niah_multikey]
    lengths: [2048, 4096]
    budgets: [0.1, 0.25, 0.5]          # fractions of the prompt, or whole token counts
    recipes:
      - snapkv                          # a method spec
      - {name: sparse+snap, prefill: minference, cache: snapkv}
      - kvpress:SnapKVPress             # a peer (needs kvpress, see attnkit.eval.run.peers)
    data: longbench.jsonl               # optional: LongBench/RULER/InfiniteBench items (a path or a list); task
                                        # "longbench" (or "ruler", "infinitebench") = all its tasks
    batch_size: 8                       # optional: samples per generate call (the scores do not depend on it)
    protocols: [query-aware, query-agnostic]   # optional (or protocol: NAME): attnkit.eval.data.protocols
    queries: 1                          # optional: questions per context (>= 2 with multi-query)
    seeds: [0, 1, 2]                    # optional: a stochastic method (Keyformer) runs once per seed
    continuation_tokens: 1024           # optional: tokens task continuation decodes after its prompt
    stretch_tokens: 512                 # optional: tokens recall_after_stretch decodes before its question

Every recipe that leaves its budget open runs once per budget; one that sets its own (or takes none)
runs once. ``full`` runs once per (task, length, protocol) as the reference, first. The cells run in order
(tasks, lengths, protocols, recipes, budgets, seeds) through :func:`attnkit.eval.run.cells.run_cells`, each finished row
appended to ``DIR/results.jsonl`` at once (flushed and fsynced). Run it again after an interruption and
the cells already in the results are skipped; the one that was interrupted is run again (a row cut off
mid-write is removed first). The results file of an interrupted and resumed sweep holds the same rows as
that of an uninterrupted one (timings aside).

With a :class:`attnkit.eval.run.ray_cells.CellPool` (``--ray``) the cells run as Ray tasks on workers that keep the
model loaded, several at once; this process builds the plan (the samples come from a worker), stays the single
writer of ``results.jsonl`` and resumes the same way: the rows are those of a run without Ray.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.eval.data.items import task_items
from attnkit.eval.data.long_output import (
    CONTINUATION,
    DEFAULT_CONTINUATION_TOKENS,
    DEFAULT_STRETCH_TOKENS,
    RECALL,
    LongOutput,
)
from attnkit.eval.data.protocols import QUERY_AWARE, check_protocols, check_queries, check_refusals
from attnkit.eval.data.task_registry import METHOD_ONLY_TASKS
from attnkit.eval.data.user_data import load_data
from attnkit.eval.run.cells import DEFAULT_BATCH_SIZE, Group, run_cells
from attnkit.eval.run.harness import check_lengths, check_peer_tasks, check_samples, check_tasks, depth_list, with_seeds
from attnkit.eval.run.lock import results_lock
from attnkit.eval.run.ray_cells import CellPool, run_groups
from attnkit.eval.run.results import RESULTS_FILE, TABLE_FILE, done_rows
from attnkit.eval.stats.table import format_table
from attnkit.model import load_model_for_length
from attnkit.recipe import Recipe, as_recipe, check_budget_value
from attnkit.validate import is_whole, text, whole

SWEEP_KEYS = ("model", "recipes", "budgets", "tasks", "lengths", "samples", "seed", "depths", "data", "name",
              "description", "batch_size", "protocol", "protocols", "queries", "seeds", "continuation_tokens",
              "stretch_tokens")
SWEEP_FILE = "sweep.json"


@dataclass
class Sweep:
    recipes: list[Recipe]
    tasks: list[str]
    lengths: list[int]
    samples: int
    model: str = "tiny"
    budgets: list[float | int] = field(default_factory=list)
    seed: int = 0
    depths: list[float] | None = None
    data: str | list[str] | None = None
    name: str | None = None
    description: str | None = None
    source: str = "sweep"
    batch_size: int = DEFAULT_BATCH_SIZE
    protocols: list[str] = field(default_factory=lambda: [QUERY_AWARE])
    queries: int = 1
    seeds: list[int] | None = None
    long_output: LongOutput = field(default_factory=LongOutput)  # how long the long-output tasks decode

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "model": self.model, "samples": self.samples,
                "seed": self.seed, "tasks": self.tasks, "lengths": self.lengths, "budgets": self.budgets,
                "depths": self.depths, "data": self.data, "batch_size": self.batch_size,
                "protocols": self.protocols, "queries": self.queries, "seeds": self.seeds,
                **dataclasses.asdict(self.long_output),
                "recipes": [r.to_dict() for r in self.recipes]}

    def entries(self, length: int) -> list[Recipe]:
        """The recipes of one (task, length) pair, budgets and seeds applied, ``full`` first and once."""
        out = [as_recipe("full")]
        for recipe in self.recipes:
            if recipe.is_full:
                continue
            if recipe.takes_budget():
                out.extend(recipe.with_budget(b, length) for b in self.budgets)
            else:
                out.append(recipe)
        return with_seeds(out, self.seeds)

    def cell_count(self) -> int:
        return len(self.tasks) * len(self.protocols) * sum(len(self.entries(n)) for n in self.lengths)


def _int_list(value, what: str, source: str, minimum: int) -> list[int]:
    if is_whole(value):
        value = [value]
    if not isinstance(value, list) or not value or any(not is_whole(v) or v < minimum for v in value):
        raise AttnkitError(f"{source}: {what} must be a non-empty list of whole numbers >= {minimum}, got {value!r}")
    return value


def sweep_from_dict(data, source: str = "sweep", base_dir: Path | None = None) -> Sweep:
    """Validate a sweep mapping (see the module docstring); `base_dir` resolves a relative ``data`` path."""
    if not isinstance(data, dict):
        raise AttnkitError(f"{source}: a sweep must be a mapping with recipes, tasks, lengths and samples")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise AttnkitError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SWEEP_KEYS)}")
    missing = [k for k in ("recipes", "lengths", "samples") if data.get(k) is None]
    if data.get("tasks") is None and data.get("data") is None:
        missing.append("tasks")
    if missing:
        raise AttnkitError(f"{source}: missing {', '.join(missing)}")
    recipes_raw = data["recipes"]
    if not isinstance(recipes_raw, list) or not recipes_raw:
        raise AttnkitError(f"{source}: recipes must be a non-empty list of method specs or recipe mappings")
    recipes = [as_recipe(r, f"{source}: recipes[{i}]") for i, r in enumerate(recipes_raw)]
    labels = [r.label for r in recipes]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise AttnkitError(f"{source}: recipe names must differ; {', '.join(dup)} appear more than once "
                           f"(give each a 'name')")
    budgets_raw = data.get("budgets") or []
    if not isinstance(budgets_raw, list):
        raise AttnkitError(f"{source}: budgets must be a list of fractions (0 < f <= 1) or token counts")
    budgets = [check_budget_value(b, f"{source}: budgets") for b in budgets_raw]
    if len(set(budgets)) != len(budgets):
        raise AttnkitError(f"{source}: budgets has duplicates: {budgets}")
    needs = [r.label for r in recipes if r.takes_budget()]
    if needs and not budgets:
        raise AttnkitError(f"{source}: {', '.join(needs)} take a KV budget; give budgets: [...] or set one in "
                           f"each recipe")
    model = text(f"{source}: model (a model spec)", data.get("model", "tiny"))
    samples = data["samples"]
    check_samples(samples)
    seed = whole(f"{source}: seed", data.get("seed", 0), minimum=None)
    batch_size = whole(f"{source}: batch_size", data.get("batch_size", DEFAULT_BATCH_SIZE), minimum=1)
    lengths = _int_list(data["lengths"], "lengths", source, 2)
    data_path = data.get("data")
    lb = None
    if data_path is not None:
        paths = [data_path] if isinstance(data_path, str) else data_path
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise AttnkitError(f"{source}: data must be the path (or a list of paths) of LongBench, RULER or "
                               f"InfiniteBench JSONL files")
        resolved = []
        for p in paths:
            path = Path(p)
            if not path.is_absolute() and base_dir is not None and not path.exists():
                path = base_dir / path
            resolved.append(str(path))
        data_path = resolved[0] if isinstance(data_path, str) else resolved
        lb = load_data(resolved)
    tasks = data.get("tasks") or ["data"]
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
        raise AttnkitError(f"{source}: tasks must be a list of task names")
    expanded: list[str] = []
    for t in tasks:
        if t in ("longbench", "ruler", "infinitebench", "data"):
            found = [] if lb is None else (lb.tasks() if t == "data" else lb.expand(t))
            if not found:
                raise AttnkitError(f"{source}: task {t!r} needs data: FILE holding {t if t != 'data' else 'items'} "
                                   f"(LongBench, RULER or InfiniteBench JSONL)")
            expanded.extend(found)
        else:
            expanded.append(t)
    check_tasks(expanded, lb)
    check_lengths(None, lengths)
    check_peer_tasks(recipes, expanded)
    if data.get("protocol") is not None and data.get("protocols") is not None:
        raise AttnkitError(f"{source}: give protocol or protocols, not both")
    protocols = check_protocols(data.get("protocols", data.get("protocol", QUERY_AWARE)), f"{source}: protocols")
    queries = check_queries(data.get("queries", 1), protocols, f"{source}: queries")
    seeds = data.get("seeds")
    if seeds is not None:
        with_seeds(recipes, seeds)
    check_refusals(recipes, protocols, None)
    for t in expanded:
        if t in METHOD_ONLY_TASKS:  # no question to hold back; the long-output tasks refuse what cannot decode them
            check_refusals([as_recipe("full"), *recipes], protocols, t)
    long_output = LongOutput(whole(f"{source}: continuation_tokens",
                                   data.get("continuation_tokens", DEFAULT_CONTINUATION_TOKENS), minimum=1),
                             whole(f"{source}: stretch_tokens", data.get("stretch_tokens", DEFAULT_STRETCH_TOKENS),
                                   minimum=0))
    depths = data.get("depths")
    if depths is not None:
        depth_list(samples, depths)
    for key in ("name", "description"):
        if data.get(key) is not None:
            text(f"{source}: {key}", data[key], empty=True)
    sweep = Sweep(recipes, expanded, lengths, samples, model, budgets, seed, depths, data_path, data.get("name"),
                  data.get("description"), source, batch_size, protocols, queries, seeds, long_output)
    for n in lengths:  # budgets that do not fit a recipe fail now, not an hour in
        sweep.entries(n)
    return sweep


def load_sweep(path: str | Path) -> Sweep:
    path = Path(path)
    return sweep_from_dict(read_config_file(path, "sweep file"), f"sweep file {str(path)!r}", path.parent)


def run_sweep(sweep: Sweep | str | Path, out_dir: str | Path, *, model=None, progress: bool = True,
              pool: CellPool | None = None) -> list[dict]:
    """Run every cell of `sweep` not yet in ``out_dir/results.jsonl``; returns the sweep's rows (done
    before and now) in cell order and writes ``out_dir/table.txt``. `model` overrides the sweep's. With
    `pool` (a :class:`attnkit.eval.run.ray_cells.CellPool` holding the sweep's model) the cells run on its Ray
    actors, this process the single writer of the results (:func:`attnkit.eval.run.ray_cells.run_groups`). The directory
    is locked while the sweep runs (:func:`attnkit.eval.run.lock.results_lock`): another run writing into it is refused."""
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    if pool is not None and model is not None:
        raise AttnkitError("run_sweep takes a model or a pool of Ray workers holding one, not both")
    if pool is not None and pool.requested != sweep.model:
        raise AttnkitError(f"the Ray workers hold model {pool.requested!r}, the sweep names {sweep.model!r}")
    out_dir = Path(out_dir)
    with results_lock(out_dir):
        return _run_locked(sweep, out_dir, model, progress, pool)


def _run_locked(sweep: Sweep, out_dir: Path, model, progress: bool, pool: CellPool | None) -> list[dict]:
    results = out_dir / RESULTS_FILE
    done = done_rows(results)
    data = load_data(sweep.data) if sweep.data is not None else None
    if model is None and pool is None:
        model = load_model_for_length(sweep.model, sweep_positions(sweep))
    planner = model if pool is None else pool  # the pool's actors build the samples: the driver needs no model
    check_lengths(planner, sweep.lengths)
    depths = depth_list(sweep.samples, sweep.depths)
    groups = []
    for task in sweep.tasks:
        for length in sweep.lengths:
            args = (task, length, sweep.seed, sweep.samples, depths, data, sweep.queries, sweep.long_output)
            items = task_items(model, *args) if pool is None else pool.items(*args)
            check_refusals(sweep.entries(length), sweep.protocols, task, items)
            groups += [Group(task, length, items, sweep.entries(length), p, sweep.queries,
                             sweep.long_output.options(task)) for p in sweep.protocols]
    (out_dir / SWEEP_FILE).write_text(json.dumps(sweep.to_dict(), indent=1, default=str) + "\n", encoding="utf-8")
    if pool is None:
        rows = run_cells(model, groups, seed=sweep.seed, out_path=results, progress=progress, done=done,
                         desc="sweep", batch_size=sweep.batch_size)
    else:
        rows = run_groups(pool, groups, seed=sweep.seed, out_path=results, progress=progress, done=done,
                          batch_size=sweep.batch_size)
    (out_dir / TABLE_FILE).write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows


def sweep_positions(sweep: Sweep) -> int:
    """Positions a ``random:`` model needs for the sweep's longest prompt and its answer (and what its long-output
    tasks decode after it)."""
    extra = max([sweep.long_output.continuation_tokens] * (CONTINUATION in sweep.tasks)
                + [sweep.long_output.stretch_tokens + 64] * (RECALL in sweep.tasks), default=0)  # 64: the question, the answer
    return positions_for(sweep.lengths) + extra


def positions_for(lengths: list[int]) -> int:
    """Positions a ``random:`` model needs for the longest of `lengths` and its answer."""
    return max(lengths) + 512
