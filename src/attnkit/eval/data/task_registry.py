"""Every generated task `attnkit eval` knows, by name: the RULER-style tasks of :mod:`attnkit.eval.data.tasks` and the
held-out-template retrieval tasks of :mod:`attnkit.eval.data.retrieval_data` (phrasings and filler never seen in
training, so a score separates retrieval from a memorised template).

It sits above both modules so neither imports the other's registry.
"""

from __future__ import annotations

from attnkit.eval.data import tasks
from attnkit.eval.data.retrieval_data import EVAL_TASKS
from attnkit.eval.data.tasks import Task

TASKS: dict[str, Task] = {**tasks.TASKS, **EVAL_TASKS}
GENERATED_TASKS = tuple(TASKS)
# tasks whose answer sits at the sample's depth in the prompt (per-depth scores, the needle heatmap)
NEEDLE_TASKS = tasks.NEEDLE_TASKS + tuple(EVAL_TASKS)
ALL_TASKS = GENERATED_TASKS + ("perplexity",)


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(ALL_TASKS)}") from None
