"""Training batches written ahead in worker processes.

Writing a batch's rows in Python (sampling filler, wording needles, tokenizing) likely costs about as much as a
whole step of a model this small on a GPU (docs/benchmarks.md, "Rebuilding model v2"), so a trainer that writes
them in line would leave the device idle much of the time. A `Rows.batch(phase, step)` depends on nothing but its
arguments (its random generator is seeded by the phase's name and the step), so batches written ahead by other
processes are exactly the batches written in line; only the phase of a step is not known ahead (a gate may end
a phase early or late), so work written for a phase the trainer has left is dropped. With no workers (a CPU,
whose cores train) batches are written in line.

The worker processes outlive one run: `training/chain_v2.py` trains 22 runs in one process, and a fresh worker
spends seconds importing and warming its caches before its first batch. A worker builds a run's rows from the
run's tokenizer directory and config the first time it is asked for one of its batches.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
from pathlib import Path

_POOL: list = [0, None]  # [workers, executor], kept from one run to the next
_ROWS: dict = {}  # in a worker: the current run's Rows, by (run directory, config)


def _batch(run_dir: str, config: str, phase: dict, step: int):
    key = (run_dir, config)
    if key not in _ROWS:
        import torch

        from data_v2 import Rows
        from tokenizer_v2 import load_tokenizer

        torch.set_num_threads(1)
        _ROWS.clear()
        settings = json.loads(config)
        _ROWS[key] = Rows(load_tokenizer(Path(run_dir), settings), settings)
    return _ROWS[key].batch(phase, step)


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    if _POOL[0] != workers:
        shutdown()
        # "spawn": fresh processes, since the trainer may hold a CUDA context, which a fork cannot share
        _POOL[:] = [workers, cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))]
    return _POOL[1]


def shutdown() -> None:
    """Ends the worker processes (they otherwise wait for the next run until the interpreter exits)."""
    if _POOL[1] is not None:
        _POOL[1].shutdown(cancel_futures=True)
    _POOL[:] = [0, None]


class Prefetcher:
    """`batch(phase, step)` as `rows.batch(phase, step)`, with the next `ahead` steps of the phase already under
    way in `workers` processes, which write them from `source`: the run directory holding the tokenizer, and the
    config that `rows` was made with."""

    def __init__(self, rows, workers: int, source: tuple[Path, dict] | None = None, ahead: int | None = None):
        if workers > 0 and source is None:
            raise ValueError("workers write batches from a source: (run directory, config)")
        self.rows, self.workers = rows, workers
        self.source = (str(source[0]), json.dumps(source[1])) if source else None
        self.ahead = ahead or 2 * workers
        self.pending: dict[tuple[str, int], cf.Future] = {}

    def batch(self, phase: dict, step: int):
        if self.workers == 0:
            return self.rows.batch(phase, step)
        for key in [k for k in self.pending if k[0] != phase["name"] or k[1] < step]:
            self.pending.pop(key).cancel()  # another phase's work: the trainer has left it
        for s in range(step, step + self.ahead):
            if (phase["name"], s) not in self.pending:
                self.pending[phase["name"], s] = _pool(self.workers).submit(_batch, *self.source, phase, s)
        return self.pending.pop((phase["name"], step)).result()

    def close(self) -> None:
        """Drops the work still under way; the processes stay for the next run."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
