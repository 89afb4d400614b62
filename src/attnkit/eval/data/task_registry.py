"""Every generated task `attnkit eval` knows, by name: the RULER-style tasks of :mod:`attnkit.eval.data.tasks`, the
held-out-template retrieval tasks of :mod:`attnkit.eval.data.retrieval_data` (phrasings and filler never seen in
training, so a score separates retrieval from a memorised template), ``perplexity`` and the long-output tasks of
:mod:`attnkit.eval.data.long_output`; which of them score in bits per byte (lower is better).

It sits above both modules so neither imports the other's registry.
"""

from __future__ import annotations

from attnkit.eval.data import tasks
from attnkit.eval.data.long_output import CONTINUATION, LONG_OUTPUT_TASKS, RECALL
from attnkit.eval.data.retrieval_data import EVAL_TASKS
from attnkit.eval.data.tasks import Task

TASKS: dict[str, Task] = {**tasks.TASKS, **EVAL_TASKS}
GENERATED_TASKS = tuple(TASKS)
# tasks whose answer sits at the sample's depth in the prompt (per-depth scores, the needle heatmap)
NEEDLE_TASKS = tasks.NEEDLE_TASKS + tuple(EVAL_TASKS) + (RECALL,)
PERPLEXITY = "perplexity"
ALL_TASKS = GENERATED_TASKS + (PERPLEXITY,) + LONG_OUTPUT_TASKS
# scored in bits per byte of held-out text from the method's likelihoods, lower is better; they ask no question
BITS_PER_BYTE_TASKS = frozenset({PERPLEXITY, CONTINUATION})
# scored from the model's likelihoods or its own decode path: attnkit's methods only (no peer, no speculation)
METHOD_ONLY_TASKS = (PERPLEXITY,) + LONG_OUTPUT_TASKS


def higher_is_better(task: str) -> bool:
    """Whether a higher score of `task` is better (all but the bits-per-byte tasks)."""
    return task not in BITS_PER_BYTE_TASKS


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(ALL_TASKS)}") from None
