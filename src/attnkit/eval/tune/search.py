"""``attnkit tune``: the recipe for a model, a task mix and lengths that meets an accuracy floor at the least cost.

    settings = TuneSettings(model="tiny", tasks=["passkey", "code_completion"], lengths=[2048], floor=0.95,
                            target="kv")
    log = run_tune(settings, "results/tune")      # DIR/recipe.json, pareto.json, tune.json, report.html

The candidates are the recipes of a space (:mod:`attnkit.eval.tune.space`: prefill x cache x budget x allocation
x quantization x speculation). They are searched by successive halving (K. Jamieson and A. Talwalkar, 2016,
"Non-stochastic Best Arm Identification and Hyperparameter Optimization", arXiv 1502.07943; its budgets as in
Hyperband, L. Li et al., 2017, arXiv 1603.06560): round ``r`` runs ``samples * eta**r`` fresh samples per task and
length for every surviving candidate and for full attention (the reference, on the same samples), and the rules
of :mod:`attnkit.eval.tune.rules` eliminate the candidates shown below the floor, those that cannot win, and all
but the best ``1/eta`` of the rest. Cheap few-sample rounds sort out the many candidates; the few survivors get
the samples that make their intervals narrow. The winner is the cheapest candidate of the last round shown to
keep the floor on every task and length (else full attention). Round ``r``'s samples have the seeds that follow
round ``r - 1``'s, so each round's evidence is new and a candidate's evidence is all its rounds' samples.

Every cell is a row of ``DIR/results.jsonl``, with a sweep's keys (:func:`attnkit.eval.run.cells.group_key`): a
cell already there, from an interrupted tune or from a sweep with the same samples and seed, is reused, not run;
the decisions follow from the rows alone, so a rerun after an interruption takes the same ones and runs only what
is missing (:func:`attnkit.eval.run.cells.run_cells`, or on Ray :func:`attnkit.eval.run.ray_cells.run_groups`, which
runs the cells through :meth:`attnkit.eval.run.ray_cells.CellPool.run`). ``confirm`` runs the winner and full on
fresh samples once more and says whether it holds there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data.items import task_items
from attnkit.eval.data.long_output import LongOutput
from attnkit.eval.data.protocols import QUERY_AWARE, check_protocols, check_queries, check_refusals
from attnkit.eval.report.page import REPORT_FILE, write_report
from attnkit.eval.report.tune_section import (
    POOLED_FILE,
    TARGET_HEAD,
    cell_text,
    pooled_rows,
    standing,
    target_text,
    worst_text,
    write_pareto,
)
from attnkit.eval.run.cells import DEFAULT_BATCH_SIZE, Group, run_cells
from attnkit.eval.run.harness import check_lengths, check_samples, check_tasks, depth_list
from attnkit.eval.run.lock import results_lock
from attnkit.eval.run.ray_cells import CellPool, run_groups
from attnkit.eval.run.results import RESULTS_FILE, done_rows
from attnkit.eval.run.sweep import positions_for
from attnkit.eval.tune.rules import choose, eliminate, pareto, summarize
from attnkit.eval.tune.space import TARGET_TEXT, TARGETS, Candidate, Space, candidates, default_space, space_from_dict
from attnkit.model import load_model_for_length
from attnkit.recipe import as_recipe
from attnkit.validate import choice, fraction, whole

RECIPE_FILE, PARETO_FILE, TUNE_FILE = "recipe.json", "pareto.json", "tune.json"


@dataclass
class TuneSettings:
    """What to tune for (see :func:`run_tune`); `space` None: :func:`attnkit.eval.tune.space.default_space`."""

    tasks: list[str]
    lengths: list[int]
    model: str = "tiny"
    floor: float = 0.95
    target: str = "kv"
    samples: int = 2
    rounds: int = 3
    eta: int = 2
    seed: int = 0
    protocol: str = QUERY_AWARE
    queries: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE
    confirm: bool = False
    space: Space | None = None

    def check(self) -> None:
        """Every setting, one-line errors naming the bad value and what is allowed."""
        check_tasks(self.tasks)
        check_lengths(None, self.lengths)
        fraction("floor (a fraction of full's score)", self.floor)
        choice("target", self.target, TARGETS)
        check_samples(self.samples)
        whole("rounds", self.rounds, minimum=1)
        whole("eta (the fraction 1/eta of candidates kept per round)", self.eta, minimum=2)
        whole("seed", self.seed, minimum=0)
        (self.protocol,) = check_protocols(self.protocol, "protocol")
        self.queries = check_queries(self.queries, [self.protocol])
        whole("batch_size", self.batch_size, minimum=1)
        if self.space is None:
            self.space = space_from_dict(default_space(self.target, self.model), f"default space ({self.target})")

    def plan(self) -> list[tuple[int, int]]:
        """``(samples, seed)`` of every round, then of the confirmation: seeds never overlap, so each round's
        samples are fresh."""
        out, seed = [], self.seed
        for r in range(self.rounds):
            n = self.samples * self.eta ** r
            out.append((n, seed))
            seed += n
        return out + [(out[-1][0], seed)]

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "space"}
        return dict(d, space=self.space.to_dict() if self.space is not None else None)


class Runner:
    """Runs the cells of one round (a model here, or a Ray pool), reusing every row already in the results."""

    def __init__(self, settings: TuneSettings, out_dir: Path, model, pool: CellPool | None, progress: bool):
        self.s, self.model, self.pool, self.progress = settings, model, pool, progress
        self.results = out_dir / RESULTS_FILE
        self.done = done_rows(self.results)

    def run(self, recipes_of, samples: int, seed: int, desc: str) -> dict[tuple, list[dict]]:
        """Full attention and ``recipes_of(length)`` on `samples` samples from `seed`, on every task and
        length; the rows by (task, length), full's first."""
        s = self.s
        depths = depth_list(samples, None)
        groups = []
        for task in s.tasks:
            for length in s.lengths:
                if self.pool is None:
                    items = task_items(self.model, task, length, seed, samples, depths, None, s.queries)
                else:
                    items = self.pool.items(task, length, seed, samples, depths, None, s.queries)
                recipes = [as_recipe("full"), *recipes_of(length)]
                check_refusals(recipes, [s.protocol], task, items)
                groups.append(Group(task, length, items, recipes, s.protocol, s.queries,
                                    LongOutput().options(task)))  # the long-output tasks at their defaults
        if self.pool is None:
            rows = run_cells(self.model, groups, seed=seed, out_path=self.results, progress=self.progress,
                             done=self.done, desc=desc, batch_size=s.batch_size)
        else:
            rows = run_groups(self.pool, groups, seed=seed, out_path=self.results, progress=self.progress,
                              done=self.done, desc=desc, batch_size=s.batch_size)
        self.done.update({row["cell"]: row for row in rows})
        out, i = {}, 0
        for g in groups:
            out[g.task, g.length] = rows[i:i + len(g.recipes)]
            i += len(g.recipes)
        return out


def add_evidence(evidence: dict, cands: list[Candidate], by_cell: dict[tuple, list[dict]]) -> None:
    """Pair each candidate's rows of a round with full's (the first row of each (task, length))."""
    for key, rows in by_cell.items():
        full = rows[0]
        for cand, row in zip(cands, rows[1:], strict=True):
            evidence.setdefault(cand.id, {}).setdefault(key, []).append((row, full))


def run_tune(settings: TuneSettings, out_dir: str | Path, *, model=None, pool: CellPool | None = None,
             progress: bool = True, echo=None) -> dict:
    """Search the settings' space (module docstring) and write ``out_dir``'s ``recipe.json`` (the winner, a recipe
    file ``generate``/``eval``/``bench --recipe`` take), ``pareto.json`` and ``pareto.png``, ``tune.json`` (the log:
    every round's candidates, evidence and eliminations with their reasons), ``report.html`` and the cells in
    ``results.jsonl``. `model` (a loaded model) or `pool` (Ray workers holding the model) instead of loading
    ``settings.model``; `echo` gets a line per round. The directory is locked while the tune runs
    (:func:`attnkit.eval.run.lock.results_lock`): another run writing into it is refused. Returns the log."""
    settings.check()
    if pool is not None and model is not None:
        raise AttnkitError("run_tune takes a model or a pool of Ray workers holding one, not both")
    if pool is not None and pool.requested != settings.model:
        raise AttnkitError(f"the Ray workers hold model {pool.requested!r}, the tune names {settings.model!r}")
    echo = echo or (lambda line: None)
    cands, skipped = candidates(settings.space, settings.lengths, settings.protocol)
    if not cands:
        raise AttnkitError(f"{settings.space.source}: no candidate recipe can run "
                           f"({'; '.join(s['why'] for s in skipped[:3]) or 'the space names only full attention'})")
    with results_lock(out_dir):
        return _run_locked(settings, Path(out_dir), model, pool, progress, echo, cands, skipped)


def _run_locked(settings: TuneSettings, out_dir: Path, model, pool: CellPool | None, progress: bool, echo,
                cands: list[Candidate], skipped: list[dict]) -> dict:
    """:func:`run_tune` inside the directory's lock: the rounds, the winner, the confirmation and the files."""
    if model is None and pool is None:
        model = load_model_for_length(settings.model, positions_for(settings.lengths))
    check_lengths(model if pool is None else pool, settings.lengths)
    runner = Runner(settings, out_dir, model, pool, progress)
    plan = settings.plan()
    by_id = {c.id: c for c in cands}
    log = {"settings": settings.to_dict(), "candidates": [c.id for c in cands], "skipped": skipped, "rounds": [],
           "winner": None, "confirm": None, "complete": False}
    evidence: dict[str, dict] = {}
    summaries: dict[str, dict] = {}
    alive = list(cands)
    for r, (samples, seed) in enumerate(plan[:-1]):
        if not alive:
            break
        rows = runner.run(lambda n, cs=tuple(alive): [c.recipe(n) for c in cs], samples, seed,
                          f"tune round {r + 1}/{settings.rounds}")
        add_evidence(evidence, alive, rows)
        current = [summarize(c.id, evidence[c.id], settings.floor, settings.target) for c in alive]
        summaries.update({s["candidate"]: s for s in current})
        entry = {"round": r + 1, "samples": samples, "seed": seed, "candidates": [c.id for c in alive],
                 "summaries": current, "eliminated": [], "kept": [c.id for c in alive]}
        if r < settings.rounds - 1:
            kept, entry["eliminated"] = eliminate(current, settings.floor, settings.eta)
            entry["kept"] = kept
            alive = [by_id[c] for c in kept]
        log["rounds"].append(entry)
        echo(round_line(entry, settings))
        (out_dir / TUNE_FILE).write_text(json.dumps(log, indent=1, default=str) + "\n", encoding="utf-8")
    final = [summaries[c.id] for c in alive]
    best = choose(final)
    log["winner"] = winner_entry(best, final, settings, by_id)
    if settings.confirm and best is not None:
        log["confirm"] = confirm(runner, by_id[best["candidate"]], plan[-1], settings)
    write_outputs(out_dir, log, list(summaries.values()), evidence, settings, by_id)
    log["complete"] = True
    (out_dir / TUNE_FILE).write_text(json.dumps(log, indent=1, default=str) + "\n", encoding="utf-8")
    write_report(out_dir / POOLED_FILE, out=out_dir / REPORT_FILE)
    return log


def round_line(entry: dict, settings: TuneSettings) -> str:
    rules = {}
    for e in entry["eliminated"]:
        rules[e["rule"]] = rules.get(e["rule"], 0) + 1
    out = ", ".join(f"{n} {rule}" for rule, n in rules.items()) or "none eliminated"
    return (f"round {entry['round']}/{settings.rounds}: {plural(len(entry['candidates']), 'candidate')} x "
            f"{plural(entry['samples'], 'sample')} per task and length (seeds from {entry['seed']}): {out}; "
            f"{len(entry['kept'])} left")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_text(log: dict) -> str:
    """Every candidate's cost on the target, worst score / full and standing (the last round's first, cheapest
    first; then those out, latest first), the winner and why, and the confirmation when one ran."""
    target = log["settings"]["target"]
    last = {s["candidate"]: s for entry in log["rounds"] for s in entry["summaries"]}
    order, status = standing(log)
    table = [("candidate", "samples", TARGET_HEAD[target], "worst score / full [95 %]", "standing")]
    for c in order:
        short = status[c].split(":")[0]  # the rule, not the reason (tune.json and the report have it)
        table.append((c, str(last[c]["samples"]), target_text(last[c], target), worst_text(last[c]), short))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table]
    win = log["winner"]
    lines.append(f"winner: {win['candidate']}: {win['why']}")
    confirm = log.get("confirm")
    if confirm:
        cells = "; ".join(f"{c['task']}@{c['length']} {cell_text(c)}" for c in confirm["summary"]["cells"])
        lines.append(f"confirmed on {confirm['samples']} fresh samples per task and length: the floor "
                     f"{'holds' if confirm['holds'] else 'does not hold'} ({cells})")
    return "\n".join(lines)


def winner_entry(best: dict | None, final: list[dict], settings: TuneSettings, by_id: dict) -> dict:
    """The winner's recipe and why (full attention, with the reason, when no candidate holds)."""
    goal = f"{TARGET_TEXT[settings.target]} with score / full >= {settings.floor:g} on every task and length"
    if best is None:
        maybe = [s["candidate"] for s in final if s["point_met"]]
        why = (f"no candidate of the last round is shown to meet the floor and beat full on the target ({goal}); "
               f"full attention it is" if final else
               f"every candidate was eliminated ({goal}: tune.json says why); full attention it is")
        if maybe:
            why += f". {', '.join(maybe[:3])} meet it on the point estimate: run more samples (--samples, --rounds)"
        return {"candidate": "full", "fallback": True, "why": why, "recipe": as_recipe("full").to_dict(),
                "summary": None}
    cand = by_id[best["candidate"]]
    recipe = cand.to_file(max(settings.lengths))
    recipe["description"] = (f"attnkit tune: {goal} ({', '.join(settings.tasks)} at "
                             f"{', '.join(map(str, settings.lengths))} tokens, model {settings.model})")
    why = (f"the cheapest of the last round's {len(final)} candidates shown to meet the floor: {best['cost']:.2f}x "
           f"full's cost on the target; its lowest score / full: {describe_best(best)}")
    return {"candidate": cand.id, "fallback": False, "why": why, "recipe": recipe, "summary": best}


def describe_best(s: dict) -> str:
    return "; ".join(f"{c['task']}@{c['length']} " + ("full scores 0" if c["rel"] is None else
                     f"{c['rel']:.2f} [{c['low']:.2f}-{c['high']:.2f}] n={c['samples']}") for c in s["cells"])


def confirm(runner: Runner, cand: Candidate, plan: tuple[int, int], settings: TuneSettings) -> dict:
    """The winner and full on fresh samples (the seeds after the last round's): does the floor hold there?"""
    samples, seed = plan
    evidence: dict = {}
    add_evidence(evidence, [cand], runner.run(lambda n: [cand.recipe(n)], samples, seed, "tune confirm"))
    s = summarize(cand.id, evidence[cand.id], settings.floor, settings.target)
    return {"samples": samples, "seed": seed, "summary": s, "holds": s["point_met"], "shown": s["shown"]}


def write_outputs(out_dir: Path, log: dict, summaries: list[dict], evidence: dict, settings: TuneSettings,
                  by_id: dict) -> None:
    """recipe.json, pareto.json and its plot, and the pooled rows the report reads."""
    (out_dir / RECIPE_FILE).write_text(json.dumps(log["winner"]["recipe"], indent=1) + "\n", encoding="utf-8")
    front = set(pareto(summaries))
    points = []
    for s in summaries:
        cells = [c for c in s["cells"] if c["rel"] is not None]
        worst = min(cells, key=lambda c: c["rel"]) if cells else {}
        points.append({"candidate": s["candidate"], "cost": s["cost"], "worst_rel": s["worst_rel"],
                       "low": worst.get("low"), "high": worst.get("high"), "samples": s["samples"],
                       "shown": s["shown"], "pareto": s["candidate"] in front})
    points.append({"candidate": "full", "cost": 1.0, "worst_rel": 1.0, "low": None, "high": None, "samples": None,
                   "shown": True, "pareto": "full" in front})
    write_pareto(out_dir, points, settings.target, settings.floor, log["winner"]["candidate"])
    finalists = log["rounds"][-1]["kept"] if log["rounds"] else []
    rows = pooled_rows(evidence, finalists)
    (out_dir / POOLED_FILE).write_text("".join(json.dumps(r, default=str) + "\n" for r in rows), encoding="utf-8")
