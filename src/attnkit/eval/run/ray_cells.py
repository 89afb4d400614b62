"""Cells on Ray: actors that load the model once and keep it, each running one cell at a time.

    with CellPool("tiny", workers=2) as pool:             # a local Ray, or address= an existing cluster
        for job, out in pool.run(jobs):                   # each (job, its outcome) as it finishes
            ...

An actor (:class:`CellWorker`) loads the model when it starts, one per GPU where the cluster has GPUs (Ray gives
each its own), ``workers`` CPU actors otherwise, and answers :func:`attnkit.eval.run.cells.run_cell` for every
:class:`CellJob` it is handed. Ray's ActorPool hands jobs to idle actors. An actor whose process dies is
restarted by Ray (``max_restarts``: the model is loaded again) and the call it was running is retried on it
(``max_task_retries``), so every job's outcome arrives exactly once however many workers die; a job that fails
in the same way more than :data:`RETRIES` times is an error. Nothing is written here: the caller is the single
writer of its results (:func:`run_groups` for a sweep). ``attnkit tune`` can run its candidates through
:meth:`CellPool.run` the same way.

Ray is an optional dependency (``pip install 'attnkit[ray]'``); asking for it without it is a one-line error.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnkit.errors import AttnkitError
from attnkit.eval.data.items import task_items
from attnkit.eval.data.protocols import QUERY_AWARE
from attnkit.eval.run.cells import (
    DEFAULT_BATCH_SIZE,
    Group,
    Peers,
    cell_row,
    finish_row,
    group_key,
    run_cell,
    run_provenance,
)
from attnkit.eval.stats.table import column_label
from attnkit.model import load_model_for_length
from attnkit.recipe import Recipe
from attnkit.validate import whole

INSTALL_HINT = "pip install 'attnkit[ray]'"
RETRIES = 3  # restarts of a dead actor, and retries of the call it was running
LOCAL_OBJECT_STORE = 256 * 2**20  # a local Ray's object store: prompts and result rows are small


def require_ray():
    """The ``ray`` module; a one-line error saying how to install it when it is missing."""
    if importlib.util.find_spec("ray") is None:
        raise AttnkitError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}")
    import ray

    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """A ``host:port`` (or ``ray://host:port``) Ray address that accepts connections; Ray itself retries an
    unreachable one for minutes. ``auto`` and other forms are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise AttnkitError(f"could not reach the Ray cluster at {address!r}: {exc.strerror or exc}; give the "
                           f"address of a running Ray head (host:port), or no address for a local Ray") from None


@dataclass(frozen=True)
class CellJob:
    """One cell to run: a recipe on the samples of a (task, length) group under its protocol (`items`: a Ray
    object reference shared by the cells of the (task, length)'s groups, resolved on the actor)."""

    task: str
    length: int
    recipe: Recipe
    items: object
    batch_size: int
    protocol: str = QUERY_AWARE


class CellWorker:
    """A Ray actor's state: the model (loaded once), its kvpress peers, and the cells it runs."""

    def __init__(self, model_spec: str, positions: int, device: str, threads: int):
        torch.set_num_threads(threads)
        self.model = load_model_for_length(model_spec, positions, device=device)
        self.peers = Peers(self.model)

    def describe(self) -> dict:
        return {"spec": self.model.spec, "geometry": self.model.geometry, "pid": os.getpid(),
                "device": str(self.model.device)}

    def items(self, task: str, length: int, seed: int, samples: int, depths: list[float], data,
              queries: int = 1, long_output=None) -> list:
        return task_items(self.model, task, length, seed, samples, depths, data, queries, long_output)

    def run(self, index: int, job: CellJob, items: list) -> dict:
        """Job `index`'s :func:`run_cell` result, its wall time, when it started and ended (wall clock), and
        which process ran it."""
        started = time.time()
        t0 = time.perf_counter()
        result = run_cell(self.model, job.task, job.recipe, items, None, self.peers, job.batch_size, job.protocol)
        return {"index": index, "result": result, "wall_s": time.perf_counter() - t0, "started": started,
                "ended": time.time(), "pid": os.getpid()}


class CellPool:
    """Ray actors holding model `model_spec` (a ``random:`` spec gets `positions` positions), started on a
    local Ray or on the cluster at `address`: one per GPU, or `workers` CPU actors, each with `threads` CPUs and
    torch threads (default: an equal share of the free CPUs). A context manager that stops the actors (and a
    Ray it started)."""

    def __init__(self, model_spec: str, *, positions: int = 4096, workers: int | None = None,
                 address: str | None = None, threads: int | None = None):
        ray = require_ray()
        if workers is not None:
            whole("workers", workers, minimum=1)
        if threads is not None:
            whole("threads", threads, minimum=1)
        if address is not None:
            check_reachable(address)
        self._ray = ray
        self.requested = model_spec
        self._own = not ray.is_initialized()
        if self._own:
            self._start(address, workers or 1)
        self.actors = []
        try:
            self._start_actors(model_spec, positions, workers, threads)
        except BaseException:
            self.close()
            raise

    def _start(self, address: str | None, workers: int) -> None:
        options = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        if address is None:  # a local Ray with a CPU for each worker (logical CPUs: Ray only counts them)
            options.update(num_cpus=max(workers, os.cpu_count() or 1), object_store_memory=LOCAL_OBJECT_STORE)
        try:
            self._ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = f"the Ray cluster at {address!r}" if address else "a local Ray"
            raise AttnkitError(f"could not start or reach {where}: {str(exc).splitlines()[0]}") from None

    def _start_actors(self, model_spec: str, positions: int, workers: int | None, threads: int | None) -> None:
        from ray.util.actor_pool import ActorPool

        total, free = self._ray.cluster_resources(), self._ray.available_resources()
        kind, device = ("GPU", "cuda") if total.get("GPU", 0) else ("CPU", "cpu")
        have, idle = int(total.get(kind, 0)), int(free.get(kind, 0))
        count = workers or idle
        if count > idle or count < 1:  # more would wait for resources that never come
            raise AttnkitError(f"--workers {count} needs {count} {kind}s; the Ray cluster has {have}, {idle} free")
        gpu = kind == "GPU"
        # a CPU worker reserves its share of the free CPUs (or `threads` of them) and runs that many torch threads
        threads = threads or (1 if gpu else max(1, idle // count))
        if not gpu and count * threads > idle:
            raise AttnkitError(f"{count} workers x {threads} threads need {count * threads} CPUs; the Ray cluster has "
                               f"{idle} free")
        worker = self._ray.remote(num_cpus=0 if gpu else threads, num_gpus=1 if gpu else 0, max_restarts=RETRIES,
                                  max_task_retries=RETRIES)(CellWorker)
        self.actors = [worker.remote(model_spec, positions, device, threads) for _ in range(count)]
        info = self._get([a.describe.remote() for a in self.actors])  # waits for the models: a bad spec fails here
        self.spec, self.geometry = info[0]["spec"], info[0]["geometry"]
        self.device = info[0]["device"]
        self._pool = ActorPool(self.actors)

    def _get(self, refs):
        """``ray.get``, errors made one line (:meth:`_error`)."""
        try:
            return self._ray.get(refs)
        except (self._ray.exceptions.RayTaskError, self._ray.exceptions.RayActorError) as exc:
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> Exception:
        """An error raised inside an actor that is attnkit's own (a bad recipe, a bad model spec) as itself; an
        actor that died once too often in one line; anything else as Ray raised it."""
        cause = getattr(exc, "cause", None)
        if isinstance(cause, AttnkitError):
            return AttnkitError(str(cause))
        if getattr(exc, "actor_init_failed", False):  # the worker could not start: its error is in the message
            lines = [line for line in str(exc).splitlines() if line.strip()]
            mine = [line.split("AttnkitError: ", 1)[1] for line in lines if "AttnkitError: " in line]
            return AttnkitError(mine[-1] if mine else f"a Ray worker could not start: {lines[-1] if lines else exc}")
        if isinstance(exc, self._ray.exceptions.RayActorError):
            return AttnkitError(f"a Ray worker died {RETRIES + 1} times running the same call; giving up "
                                f"({str(exc).splitlines()[0]})")
        return exc

    def pids(self) -> list[int]:
        """The process id of each actor now (a restarted actor has a new one)."""
        return [info["pid"] for info in self._get([a.describe.remote() for a in self.actors])]

    def put(self, value):
        """`value` in Ray's object store (a group's samples, shared by its cells and sent once per actor)."""
        return self._ray.put(value)

    def items(self, task: str, length: int, seed: int, samples: int, depths: list[float], data=None,
              queries: int = 1, long_output=None) -> list:
        """The samples of a (task, length) group (up to `queries` questions per context), built by an actor
        (:func:`attnkit.eval.data.items.task_items`; the driver needs no model)."""
        return self._get(self.actors[0].items.remote(task, length, seed, samples, depths, data, queries, long_output))

    def run(self, jobs: Iterable[CellJob], follow: Callable[[CellJob, dict], Iterable[CellJob]] | None = None
            ) -> Iterator[tuple[CellJob, dict]]:
        """Run `jobs` on the actors, yielding ``(job, outcome)`` as each finishes (:meth:`CellWorker.run`'s
        outcome); ``follow(job, outcome)`` may return jobs that could not start before this one finished."""
        pool = self._pool
        pending: dict[int, CellJob] = {}
        numbers = itertools.count()

        def submit(job: CellJob) -> None:
            index = next(numbers)
            pending[index] = job
            pool.submit(lambda actor, entry: actor.run.remote(entry[0], entry[1], entry[1].items), (index, job))

        for job in jobs:
            submit(job)
        while pool.has_next():
            try:
                outcome = pool.get_next_unordered()
            except (self._ray.exceptions.RayTaskError, self._ray.exceptions.RayActorError) as exc:
                raise self._error(exc) from None
            job = pending.pop(outcome["index"])
            yield job, outcome
            for more in follow(job, outcome) if follow is not None else ():
                submit(more)

    def close(self) -> None:
        """Stop the actors, and the local Ray this pool started."""
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []
        if self._own and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> CellPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_groups(pool: CellPool, groups: list[Group], *, seed: int, out_path: Path | None = None,
               done: dict[str, dict] | None = None, progress: bool = True, desc: str = "sweep",
               batch_size: int = DEFAULT_BATCH_SIZE, run_id: str | None = None) -> list[dict]:
    """:func:`attnkit.eval.run.cells.run_cells` on the pool's actors, with the same rows (timings aside).

    A group's full runs first: its other cells are handed out once it has finished, so that their rows carry
    their score relative to it, and the actors start on every group's reference at once. The driver (this
    process) appends each row to `out_path` as it arrives, flushed and fsynced, and nothing else writes there:
    a worker that dies loses only its running cell, which Ray runs again; a killed driver loses nothing
    written, and a rerun skips it (`done`). Returns the rows in plan order."""
    whole("batch_size", batch_size, minimum=1)
    done = done or {}
    run = run_provenance(run_id)
    rows: dict[tuple[int, int], dict] = {}
    where: dict[int, tuple[int, int]] = {}  # id(job) -> (group, recipe) indices
    waiting: dict[int, list[CellJob]] = {}  # group -> cells waiting for its full
    full_score: dict[int, float | None] = {}
    first: list[CellJob] = []
    shared: dict[int, object] = {}  # id(samples) -> their object reference: a (task, length)'s protocols share them
    todo = 0
    for g, group in enumerate(groups):
        reference = group.recipes[0].is_full if group.recipes else False
        for r, recipe in enumerate(group.recipes):
            key = group_key(pool.spec, group, recipe, seed)
            if key in done:
                rows[g, r] = done[key]
                if r == 0 and reference:
                    full_score[g] = done[key]["score"]
                continue
            if id(group.items) not in shared:
                shared[id(group.items)] = pool.put(group.items)
            job = CellJob(group.task, group.length, recipe, shared[id(group.items)], batch_size, group.protocol)
            where[id(job)] = (g, r)
            todo += len(group.items)
            if reference and r > 0 and g not in full_score:
                waiting.setdefault(g, []).append(job)
            else:
                first.append(job)

    def follow(job: CellJob, outcome: dict) -> list[CellJob]:
        g, r = where[id(job)]
        return waiting.pop(g, []) if r == 0 else []

    bar = tqdm(total=todo, desc=desc, unit="sample", dynamic_ncols=True) if progress and todo else None
    try:
        for job, outcome in pool.run(first, follow):
            g, r = where[id(job)]
            group, recipe = groups[g], groups[g].recipes[r]
            row = cell_row(pool.spec, group, recipe, outcome["result"], outcome["wall_s"], seed=seed,
                           key=group_key(pool.spec, group, recipe, seed), run=run)
            if r == 0 and recipe.is_full:
                full_score[g] = row["score"]
            rows[g, r] = finish_row(row, full_score.get(g), out_path)
            if bar is not None:
                bar.set_postfix_str(f"{group.task} {group.length} {column_label(recipe.label, recipe.budget)}",
                                    refresh=False)
                bar.update(len(group.items))
    finally:
        if bar is not None:
            bar.close()
    return [rows[g, r] for g, group in enumerate(groups) for r in range(len(group.recipes))]
