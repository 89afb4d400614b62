"""The evaluation harness behind ``attnkit eval``: tasks x lengths x recipes (x budgets), one result row per cell.

    rows = run_eval(model, ["passkey", "perplexity"], [1024, 2048], ["full", "window:window=512"], samples=8)
    print(format_table(rows))

Every recipe of a (task, length) pair sees the same samples, under every protocol asked
(:mod:`attnkit.eval.data.protocols`: ``query-aware``, ``query-agnostic``, ``multi-query``; ``queries`` questions per
context). A stochastic method (Keyformer) runs once per seed of ``seeds`` (one row each; the table and the
report merge them). Sample ``i`` uses eval seed ``seed + i``;
its needle depth is ``(i + 0.5) / samples`` unless explicit depths are given (then every depth gets
``samples`` samples). Generation is greedy and stops at the first newline (every task's answer is on
the first line of the continuation); ``code_completion`` and LongBench-format items
(:mod:`attnkit.eval.data.longbench`) run to their own token limit, as their scorers skip leading blank and
comment lines. ``perplexity`` is bits per byte of held-out standard-library text (lower is better);
``continuation`` is bits per byte of `continuation_tokens` tokens of it fed one per decoding step after the prompt, and
``recall_after_stretch`` a pass key asked after `stretch_tokens` tokens of it (:mod:`attnkit.eval.data.long_output`).

This module checks a request and plans it; the pieces live beside it: :mod:`~attnkit.eval.data.items`
(samples and scoring), :mod:`~attnkit.eval.run.cells` (running cells), :mod:`~attnkit.eval.run.results` (the
results file), :mod:`~attnkit.eval.stats.table` (the score table), :mod:`~attnkit.eval.run.provenance` (versions,
commit, time).
"""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data.items import LONGBENCH_PREFIX, PERPLEXITY, task_items  # noqa: F401  (LONGBENCH_PREFIX: re-exported)
from attnkit.eval.data.long_output import DEFAULT_CONTINUATION_TOKENS, DEFAULT_STRETCH_TOKENS, LongOutput
from attnkit.eval.data.protocols import QUERY_AWARE, check_protocols, check_queries, check_refusals
from attnkit.eval.data.task_registry import ALL_TASKS, METHOD_ONLY_TASKS
from attnkit.eval.data.user_data import load_data
from attnkit.eval.run.cells import DEFAULT_BATCH_SIZE, Group, run_cells
from attnkit.eval.run.lock import results_lock
from attnkit.eval.run.results import RESULTS_FILE, TABLE_FILE, done_rows
from attnkit.eval.stats.table import format_table
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe, as_recipe
from attnkit.validate import is_number, is_whole, whole


def _check_list(label: str, values) -> None:
    if isinstance(values, (str, bytes)) or not list(values):
        raise AttnkitError(f"{label} must be a non-empty list, got {values!r}")


def check_tasks(tasks, data=None) -> None:
    """Known task names; ``longbench:DATASET``, ``ruler:TASK``, ``infinitebench:TASK`` need a data file holding
    them (:mod:`attnkit.eval.data.user_data`)."""
    _check_list("tasks", tasks)
    if len(set(tasks)) != len(tasks):
        raise AttnkitError(f"tasks has duplicates: {list(tasks)}")
    known = data.tasks() if data is not None else []
    unknown = [t for t in tasks if t not in ALL_TASKS and t not in known]
    if unknown:
        extra = ", ".join(known)
        hint = (f", {extra} (from {data.source})" if extra
                else "; LongBench, RULER and InfiniteBench tasks come from a --data FILE")
        raise AttnkitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"available: {', '.join(ALL_TASKS)}{hint}")


def check_lengths(model: LoadedModel | None, lengths) -> None:
    """Distinct whole token counts >= 2, each within the model's positions when a model is given."""
    _check_list("lengths", lengths)
    if len(set(lengths)) != len(lengths):
        raise AttnkitError(f"lengths has duplicates: {list(lengths)}")
    for length in lengths:
        if not is_whole(length) or length < 2:
            raise AttnkitError(f"lengths must be integers >= 2 (tokens), got {length!r}")
    if model is not None:
        limit = model.geometry.max_positions
        too_long = [n for n in lengths if n > limit]
        if too_long:
            raise AttnkitError(f"length {too_long[0]} exceeds the {limit} positions model {model.spec!r} allows")


def check_samples(samples) -> None:
    if not is_whole(samples) or samples < 1:
        raise AttnkitError(f"samples must be an integer >= 1, got {samples!r}")


def depth_list(samples: int, depths) -> list[float]:
    """The needle depth of every sample: ``(i + 0.5) / samples``, or each of `depths` `samples` times."""
    if depths is None:
        return [(i + 0.5) / samples for i in range(samples)]
    if isinstance(depths, (str, bytes)) or not list(depths):
        raise AttnkitError(f"depths must be a non-empty list of numbers in [0, 1], got {depths!r}")
    for d in depths:
        if not is_number(d) or not 0.0 <= d <= 1.0:
            raise AttnkitError(f"depths must be numbers in [0, 1], got {d!r}")
    return [float(d) for d in depths for _ in range(samples)]


def check_peer_tasks(recipes: list[Recipe], tasks) -> None:
    peers = [r.label for r in recipes if r.is_peer]
    own = [t for t in tasks if t in METHOD_ONLY_TASKS]
    if peers and own:
        raise AttnkitError(f"task {own[0]!r} scores attnkit methods only; {', '.join(peers)} cannot run it")


def with_seeds(recipes: list[Recipe], seeds) -> list[Recipe]:
    """Every recipe, a stochastic one (:meth:`Recipe.takes_seeds`) once per seed of `seeds` (None: as it is)."""
    if seeds is None:
        return list(recipes)
    if isinstance(seeds, (str, bytes)) or not list(seeds) or not all(is_whole(s) and s >= 0 for s in seeds):
        raise AttnkitError(f"seeds must be a non-empty list of whole numbers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise AttnkitError(f"seeds has duplicates: {list(seeds)}")
    return [r.with_method_seed(s) if r.takes_seeds() else r for r in recipes
            for s in (seeds if r.takes_seeds() else seeds[:1])]


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


def full_first(recipes: list[Recipe]) -> list[Recipe]:
    """`recipes` with plain full attention first (stable otherwise)."""
    return sorted(recipes, key=lambda r: not r.is_full)


def run_eval(model: LoadedModel, tasks: list[str], lengths: list[int], methods: list, samples: int,
             seed: int = 0, out_dir: Path | str | None = None, progress: bool = True,
             depths: list[float] | None = None, data=None, batch_size: int = DEFAULT_BATCH_SIZE,
             protocols=QUERY_AWARE, queries: int = 1, seeds: list[int] | None = None,
             continuation_tokens: int = DEFAULT_CONTINUATION_TOKENS,
             stretch_tokens: int = DEFAULT_STRETCH_TOKENS) -> list[dict]:
    """Evaluate every (task, length, method) cell on `samples` seeded eval samples; one row per cell.

    `methods` are specs such as ``"full"`` or ``"window:window=512"``, recipes (:class:`attnkit.recipe.Recipe`
    or mappings) or method instances. `data` (:class:`attnkit.eval.data.longbench.LongBenchData` or a path)
    provides ``longbench:DATASET`` tasks (or any path :func:`attnkit.eval.data.user_data.load_data` reads: RULER's
    and InfiniteBench's too). `protocols` is one protocol or a list (each runs every cell), `queries` the questions
    per context, `seeds` the seeds a stochastic method runs with (one row each); `continuation_tokens` and
    `stretch_tokens` how long ``continuation`` and ``recall_after_stretch`` decode. With `out_dir`, each row is
    appended to ``out_dir/results.jsonl`` as its cell finishes and ``out_dir/table.txt`` is written at the end; a
    cell already in that file is not run again (its row is returned, as a resumed sweep's: run twice, the file
    holds each cell once), and the directory is locked while the cells run (another run writing into it is
    refused: :mod:`attnkit.eval.run.lock`).
    Rows come in run order (tasks, then lengths, then methods with ``full`` first). A cell's samples are
    generated `batch_size` at a time (the same scores as one at a time; what the timings of a batch mean:
    :func:`attnkit.eval.run.cells.run_cell`); each row records its ``batch_size``.
    """
    if data is not None:
        data = load_data(data)
    tasks, lengths, methods = list(tasks), list(lengths), list(methods)
    recipes, depth_values = _check_request(model, tasks, lengths, methods, samples, depths, data)
    long_output = LongOutput(continuation_tokens, stretch_tokens)
    whole("batch_size", batch_size, minimum=1)
    protocols = check_protocols(protocols)
    queries = check_queries(queries, protocols)
    recipes = full_first(with_seeds(recipes, seeds))
    check_refusals(recipes, protocols)
    # build every sample before running anything: a bad length fails at once, not an hour in
    groups = []
    for task in tasks:
        for length in lengths:
            items = task_items(model, task, length, seed, samples, depth_values, data, queries, long_output)
            check_refusals(recipes, protocols, task, items)
            groups += [Group(task, length, items, recipes, protocol, queries, long_output.options(task))
                       for protocol in protocols]
    if out_dir is None:
        return run_cells(model, groups, seed=seed, progress=progress, batch_size=batch_size)
    out_dir = Path(out_dir)
    with results_lock(out_dir):
        out_path = out_dir / RESULTS_FILE
        rows = run_cells(model, groups, seed=seed, out_path=out_path, progress=progress, done=done_rows(out_path),
                         batch_size=batch_size)
        (out_dir / TABLE_FILE).write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows
