"""Running the cells of an evaluation: (task, length, recipe) -> one result row, appended as soon as it is done.

:func:`run_cells` is the one loop behind :func:`attnkit.eval.harness.run_eval` and the resumable sweeps
of :mod:`attnkit.eval.sweep`: it takes a plan (groups of cells sharing their samples), skips cells whose
rows it is handed, and appends each finished row to ``results.jsonl``
(:func:`attnkit.eval.results.append_row`), so an interruption never leaves a half-written row that counts.
``full`` runs first in each group so that every row can carry its score relative to full.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from attnkit.eval import provenance
from attnkit.eval.items import PERPLEXITY, bits_per_byte, score_prediction
from attnkit.eval.peers import KvpressRunner
from attnkit.eval.results import SCHEMA, append_row, cell_key
from attnkit.eval.table import column_label
from attnkit.eval.tasks import NEEDLE_TASKS
from attnkit.methods.select import kept_fraction
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe


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
    """``[[depth, mean score], ...]`` sorted by depth, for needle tasks (None for the others)."""
    if task not in NEEDLE_TASKS:
        return None
    by_depth: dict[float, list[float]] = {}
    for item, score in zip(items, scores):
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


def run_cell(model: LoadedModel, task: str, recipe: Recipe, items, progress_bar, peers: Peers) -> dict:
    """Scores, predictions and statistics of one (task, length, recipe) cell."""
    scores, predictions, prefill, decode_tps, peak_kv, final_kv = [], [], [], [], [], []
    method_stats = []
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
            method_stats.append(st.method_stats)
        if progress_bar is not None:
            progress_bar.update(1)
    peak_kv = [v for v in peak_kv if v is not None]
    final_kv = [v for v in final_kv if v is not None]
    return {
        "score": mean_present(scores), "scores": scores, "depth_scores": depth_scores(task, items, scores),
        "prefill_s": mean_present(prefill), "decode_tokens_per_s": mean_present(decode_tps),
        "peak_kv_bytes": max(peak_kv, default=None), "final_kv_bytes": max(final_kv, default=None),
        "predictions": None if task == PERPLEXITY else predictions,
        "kept_fraction": kept_fraction(*method_stats),
    }


@dataclass
class Group:
    """Cells sharing one (task, length) and its samples; the first recipe is the reference (full)."""

    task: str
    length: int
    items: list
    recipes: list[Recipe] = field(default_factory=list)


def method_of(recipe: Recipe) -> tuple[str, dict]:
    """The method name and parameters a row records (``kvpress:PRESS`` and its parameters for a peer)."""
    if recipe.is_peer:
        return f"kvpress:{recipe.peer[0]}", dict(recipe.peer[1])
    method = recipe.method()
    return method.name, method.params()


def run_cells(model: LoadedModel, groups: list[Group], *, seed: int, out_path: Path | None = None,
              progress: bool = True, done: dict[str, dict] | None = None, run_id: str | None = None,
              desc: str = "eval") -> list[dict]:
    """Run every cell of `groups` in order; a cell whose key is in `done` is not run again (its row is
    reused). Each new row is appended to `out_path` as soon as its cell finishes. Returns all rows."""
    done = done or {}

    def key(group: Group, recipe: Recipe) -> str:
        return cell_key(model.spec, group.task, group.length, recipe.label, recipe.budget, len(group.items), seed)

    todo = sum(len(g.items) for g in groups for r in g.recipes if key(g, r) not in done)
    bar = tqdm(total=todo, desc=desc, unit="sample", dynamic_ncols=True) if progress and todo else None
    run_id = run_id or provenance.now()
    run_versions, commit = provenance.versions(), provenance.git_commit()  # the same for every cell of this run
    peers = Peers(model)
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
                    result = run_cell(model, group.task, recipe, group.items, bar, peers)
                    wall = time.perf_counter() - t0
                    method_name, method_params = method_of(recipe)
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
                        "git_commit": commit, "timestamp": provenance.now(), "predictions": result["predictions"],
                    }
                if recipe.is_full and full_score is None:
                    full_score = row["score"]
                if k not in done:
                    row["score_rel_full"] = rel_full(row["score"], full_score, higher)
                    if out_path is not None:
                        append_row(out_path, json.loads(json.dumps(row, default=str)))
                rows.append(row)
    finally:
        peers.close()
        if bar is not None:
            bar.close()
    return rows
