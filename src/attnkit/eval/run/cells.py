"""Running the cells of an evaluation: (task, length, recipe) -> one result row, appended as soon as it is done.

:func:`run_cells` is the one loop behind :func:`attnkit.eval.run.harness.run_eval` and the resumable sweeps
of :mod:`attnkit.eval.run.sweep`: it takes a plan (groups of cells sharing their samples), skips cells whose
rows it is handed, and appends each finished row to ``results.jsonl``
(:func:`attnkit.eval.run.results.append_row`), so an interruption never leaves a half-written row that counts.
``full`` runs first in each group so that every row can carry its score relative to full. A cell's
samples go through :func:`attnkit.generate` ``batch_size`` at a time (:data:`DEFAULT_BATCH_SIZE`); the
scores are those of one sample at a time, and :func:`run_cell` says what the timings of a batch mean. A group
runs one protocol (:mod:`attnkit.eval.data.protocols`); its rows say which, how much prefill it took, and the 95 %
interval of the score (:mod:`attnkit.eval.stats.intervals`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from attnkit.eval.data.items import PERPLEXITY, bits_per_byte, score_prediction
from attnkit.eval.data.protocols import QUERY_AWARE, generate_protocol
from attnkit.eval.data.task_registry import BITS_PER_BYTE_TASKS, NEEDLE_TASKS, higher_is_better
from attnkit.eval.run import provenance
from attnkit.eval.run.long_output_cells import RUNS as LONG_OUTPUT_RUNS
from attnkit.eval.run.long_output_cells import Scored
from attnkit.eval.run.peers import KvpressRunner
from attnkit.eval.run.results import SCHEMA, append_row, cell_key
from attnkit.eval.stats.intervals import score_interval
from attnkit.eval.stats.table import column_label
from attnkit.methods.select import kept_fraction
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe
from attnkit.validate import whole

# samples per generate call unless told otherwise: enough to share each decoding forward, few enough that
# the KV cache of a batch of long prompts still fits (the runner refuses a batch that does not)
DEFAULT_BATCH_SIZE = 8


def mean_present(values: list) -> float | None:
    """Mean of the values that are not None (None when there are none)."""
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def rel_full(score: float | None, full: float | None, higher_is_better: bool) -> float | None:
    """`score` relative to full's, oriented so that below 1 is worse (full / score where lower is better)."""
    if score is None or full is None:
        return None
    num, den = (score, full) if higher_is_better else (full, score)
    return num / den if den else None


def depth_scores(task: str, items, scores: list[float]) -> list[list[float]] | None:
    """``[[depth, mean score], ...]`` sorted by depth, for needle tasks (None for the others); from each
    context's own question (a follow-up asks about another part of the context)."""
    if task not in NEEDLE_TASKS:
        return None
    by_depth: dict[float, list[float]] = {}
    for item, score in zip(items, scores):
        if getattr(item, "query", 0):
            continue
        by_depth.setdefault(round(float(item.depth), 6), []).append(score)
    return [[d, sum(v) / len(v)] for d, v in sorted(by_depth.items())]


class Peers:
    """The peers' worker processes a run needs, started on first use and stopped at the end."""

    def __init__(self, model: LoadedModel):
        self.model, self.kvpress = model, None

    def runner(self, recipe: Recipe) -> KvpressRunner:
        if self.kvpress is None:
            self.kvpress = KvpressRunner(self.model)
        return self.kvpress

    def close(self) -> None:
        if self.kvpress is not None:
            self.kvpress.close()
            self.kvpress = None


def batches_samples(recipe: Recipe) -> bool:
    """Whether a cell's samples are generated as batches (:func:`attnkit.generate`, or
    :func:`attnkit.speculative_generate` for a recipe's ``decode``): all but a peer, which runs in its own
    worker one prompt at a time."""
    return not recipe.is_peer


def stop_of(item) -> str:
    """Where a sample's answer ends: its own stop string, or the end of the first line."""
    return item.meta.get("stop", "\n")


def generation_calls(items, batch_size: int) -> list[list[int]]:
    """The samples of each generate call, by index: samples that share their token limit and stop string
    (every sample of a task, as a rule), `batch_size` at a time, in order."""
    by_setting: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        by_setting.setdefault((item.max_new_tokens, stop_of(item)), []).append(i)
    return [idx[s:s + batch_size] for idx in by_setting.values() for s in range(0, len(idx), batch_size)]


def _generate(model: LoadedModel, recipe: Recipe, items, batch_size: int, progress_bar, peers: Peers) -> list[list]:
    """Every sample's generation, grouped by the call that made it (the calls in order)."""
    calls = []
    batched = batches_samples(recipe)
    for idx in generation_calls(items, batch_size if batched else 1):
        first = items[idx[0]]
        stop = stop_of(first)
        if recipe.is_peer:
            gens = [peers.runner(recipe).generate(first.prompt, recipe.peer, first.max_new_tokens, stop)]
        elif batched:
            gens = recipe.generate(model, [items[i].prompt for i in idx], max_new_tokens=first.max_new_tokens,
                                   stop=stop)
        else:
            gens = [recipe.generate(model, first.prompt, max_new_tokens=first.max_new_tokens, stop=stop)]
        calls.append(list(zip(idx, gens, strict=True)))
        if progress_bar is not None:
            progress_bar.update(len(idx))
    return calls


def run_cell(model: LoadedModel, task: str, recipe: Recipe, items, progress_bar, peers: Peers,
             batch_size: int = 1, protocol: str = QUERY_AWARE) -> dict:
    """Scores, predictions and statistics of one (task, length, recipe) cell; its samples are generated
    `batch_size` at a time (:func:`batches_samples`: where the recipe allows it; a sequence gets the same
    tokens in a batch as alone, so the scores do not depend on the batch size).

    Timings of a batched cell: ``prefill_s`` is the mean over samples of the prefill their sequence took
    part in (a batch's prompts of one length are prefilled together: what a sample waited before its
    first token); ``decode_tokens_per_s`` is the mean over samples of each sequence's own decode rate (what
    one request sees; it falls as the batch grows); ``throughput_tokens_per_s`` is the cell's: the decode
    tokens of all its sequences over the decode wall time of its calls (it rises with the batch size).
    Under the query-agnostic and multi-query protocols ``batch_size`` counts contexts, and ``prefill_s`` is the
    prefill of a sample's context (shared by a context's questions); ``context_prefills`` and ``prefill_tokens``
    count the prompt or context prefills the cell ran. The long-output tasks run through their own runs
    (:mod:`attnkit.eval.run.long_output_cells`), `batch_size` samples as rows."""
    n = len(items)
    scores, predictions, prefill, decode_tps = [None] * n, [None] * n, [None] * n, [None] * n
    peak_kv, final_kv, method_stats = [], [], []
    steps = decode_wall = 0.0
    calls = []
    work = None
    if task == PERPLEXITY:  # scored by a prefill each: nothing to batch
        for i, item in enumerate(items):
            t0 = time.perf_counter()
            scores[i] = bits_per_byte(model, item, recipe.method())
            prefill[i] = time.perf_counter() - t0
            if progress_bar is not None:
                progress_bar.update(1)
        work = {"context_prefills": len(items), "prefill_tokens": sum(len(item) for item in items)}
    elif task in LONG_OUTPUT_RUNS:  # under the query-aware protocol only (refused otherwise)
        calls, work = LONG_OUTPUT_RUNS[task](model, recipe, items, batch_size, progress_bar)
    elif protocol == QUERY_AWARE:
        calls = _generate(model, recipe, items, batch_size, progress_bar, peers)
    else:
        calls, work = generate_protocol(model, recipe, items, protocol, batch_size, stop_of, progress_bar)
    for call in calls:
        for i, gen in call:
            scores[i] = gen.score if isinstance(gen, Scored) else score_prediction(task, gen.text, items[i])
            predictions[i] = gen.text
            st = gen.stats
            prefill[i] = st.prefill_s
            # a generation of one token has no decode rate; it does not count towards the mean
            decode_tps[i] = st.decode_tokens_per_s if st.decode_tokens_per_s > 0 else None
            steps += round(st.decode_tokens_per_s * st.decode_s)
            peak_kv.append(st.peak_kv_bytes)
            final_kv.append(st.final_kv_bytes)
            method_stats.append(st.method_stats)
        decode_wall += max(gen.stats.decode_s for _, gen in call)  # a batch's sequences decode side by side
    peak_kv = [v for v in peak_kv if v is not None]
    final_kv = [v for v in final_kv if v is not None]
    if work is None:  # every sample's whole prompt was prefilled
        work = {"context_prefills": len(items),
                "prefill_tokens": sum(gen.stats.prompt_tokens for call in calls for _, gen in call)}
    interval = score_interval(scores)
    return {
        **work, "score_interval": None if interval is None else list(interval[:2]),
        "interval": None if interval is None else interval[2],
        "score": mean_present(scores), "scores": scores, "depth_scores": depth_scores(task, items, scores),
        "prefill_s": mean_present(prefill), "decode_tokens_per_s": mean_present(decode_tps),
        "throughput_tokens_per_s": steps / decode_wall if steps and decode_wall > 0 else None,
        "batch_size": max((len(call) for call in calls), default=1),
        "peak_kv_bytes": max(peak_kv, default=None), "final_kv_bytes": max(final_kv, default=None),
        "predictions": None if task in BITS_PER_BYTE_TASKS else predictions,
        "kept_fraction": kept_fraction(*method_stats),
    }


@dataclass
class Group:
    """Cells sharing one (task, length) and its samples, run under one protocol (a (task, length) gets a group
    per protocol, sharing the samples); the first recipe is the reference (full)."""

    task: str
    length: int
    items: list
    recipes: list[Recipe] = field(default_factory=list)
    protocol: str = QUERY_AWARE
    queries: int = 1  # questions asked per context (each context's first ones)
    # what the cells depend on beyond task and length (a long-output task's tokens): in their key and their rows
    options: dict = field(default_factory=dict)


def method_of(recipe: Recipe) -> tuple[str, dict]:
    """The method name and parameters a row records (``kvpress:PRESS`` and its parameters for a peer)."""
    if recipe.is_peer:
        return f"kvpress:{recipe.peer[0]}", dict(recipe.peer[1])
    method = recipe.method()
    return method.name, method.params()


def cell_row(model_spec: str, group: Group, recipe: Recipe, result: dict, wall: float, *, seed: int, key: str,
             run: dict) -> dict:
    """The results row of one finished cell (:func:`run_cell`'s `result`, `wall` seconds), without its score
    relative to full (:func:`finish_row` adds it once full's score is known); `run` is :func:`run_provenance`'s."""
    method_name, method_params = method_of(recipe)
    items, no_question = group.items, group.task in BITS_PER_BYTE_TASKS
    return {
        "schema": SCHEMA, "run_id": run["run_id"], "cell": key, "model": model_spec, "task": group.task,
        "length": group.length, "method": method_name, "method_params": method_params,
        "method_spec": column_label(recipe.label, recipe.budget), "recipe": recipe.to_dict(),
        "recipe_name": recipe.label, "budget": recipe.budget, "method_seed": recipe.method_seed,
        "protocol": group.protocol, "queries": group.queries,
        "questions": None if no_question else [s.query for s in items],
        "contexts": None if no_question else sum(s.query == 0 for s in items),
        "context_prefills": result["context_prefills"], "prefill_tokens": result["prefill_tokens"],
        "samples": len(items), "depths": None if no_question else [s.depth for s in items],
        "seeds": [seed + j for j in range(len(items))],
        "score": result["score"], "scores": result["scores"], "depth_scores": result["depth_scores"],
        "score_interval": result["score_interval"], "interval": result["interval"],
        "higher_is_better": higher_is_better(group.task), "score_rel_full": None,
        "prefill_s": result["prefill_s"], "decode_tokens_per_s": result["decode_tokens_per_s"],
        "throughput_tokens_per_s": result["throughput_tokens_per_s"], "batch_size": result["batch_size"],
        "peak_kv_bytes": result["peak_kv_bytes"], "final_kv_bytes": result["final_kv_bytes"],
        "kept_fraction": result["kept_fraction"], "wall_s": wall, "versions": run["versions"],
        "git_commit": run["git_commit"], "timestamp": provenance.now(), "predictions": result["predictions"],
        **group.options,
    }


def run_provenance(run_id: str | None = None) -> dict:
    """What every row of one run records about it: its id, the package versions and the git commit."""
    return {"run_id": run_id or provenance.now(), "versions": provenance.versions(), "git_commit": provenance.git_commit()}


def finish_row(row: dict, full_score: float | None, out_path: Path | None) -> dict:
    """`row` with its score relative to its group's full score, appended to `out_path` (fsynced) when given."""
    row["score_rel_full"] = rel_full(row["score"], full_score, row["higher_is_better"])
    if out_path is not None:
        append_row(out_path, json.loads(json.dumps(row, default=str)))
    return row


def group_key(model_spec: str, group: Group, recipe: Recipe, seed: int) -> str:
    """The :func:`attnkit.eval.run.results.cell_key` of one cell of `group` (its protocol, questions per context and
    method seed included; a query-aware cell of one question and no method seed keeps its old key)."""
    return cell_key(model_spec, group.task, group.length, recipe.label, recipe.budget, len(group.items), seed,
                    group.protocol, group.queries, recipe.method_seed, group.options)


def run_cells(model: LoadedModel, groups: list[Group], *, seed: int, out_path: Path | None = None,
              progress: bool = True, done: dict[str, dict] | None = None, run_id: str | None = None,
              desc: str = "eval", batch_size: int = DEFAULT_BATCH_SIZE) -> list[dict]:
    """Run every cell of `groups` in order, generating `batch_size` samples at a time; a cell whose key is
    in `done` is not run again (its row is reused: the batch size changes timings, not scores). Each new row
    is appended to `out_path` as soon as its cell finishes. Returns all rows."""
    whole("batch_size", batch_size, minimum=1)
    done = done or {}
    todo = sum(len(g.items) for g in groups for r in g.recipes if group_key(model.spec, g, r, seed) not in done)
    bar = tqdm(total=todo, desc=desc, unit="sample", dynamic_ncols=True) if progress and todo else None
    run = run_provenance(run_id)  # the same for every cell of this run
    peers = Peers(model)
    rows: list[dict] = []
    try:
        for group in groups:
            full_score = None
            for recipe in group.recipes:
                k = group_key(model.spec, group, recipe, seed)
                if k in done:
                    row = done[k]
                else:
                    if bar is not None:
                        bar.set_postfix_str(f"{group.task} {group.length} {column_label(recipe.label, recipe.budget)}",
                                            refresh=False)
                    t0 = time.perf_counter()
                    result = run_cell(model, group.task, recipe, group.items, bar, peers, batch_size, group.protocol)
                    row = cell_row(model.spec, group, recipe, result, time.perf_counter() - t0, seed=seed, key=k,
                                   run=run)
                if recipe.is_full and full_score is None:
                    full_score = row["score"]
                if k not in done:
                    finish_row(row, full_score, out_path)
                rows.append(row)
    finally:
        peers.close()
        if bar is not None:
            bar.close()
    return rows
