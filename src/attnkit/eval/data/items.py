"""What a (task, length) cell is evaluated on, and how a prediction is scored.

The generated tasks (:mod:`attnkit.eval.data.tasks`, RULER-style: "RULER: What's the Real Context Size of
Your Long-Context Language Models?", Hsieh et al. 2024, arXiv 2404.06654) make one seeded sample per
needle depth; ``longbench:DATASET``, ``ruler:TASK`` and ``infinitebench:TASK`` items come from data files
(:mod:`attnkit.eval.data.user_data`); ``perplexity`` is a set of windows of held-out standard-library text, scored in
bits per UTF-8 byte (lower is better); ``continuation`` and ``recall_after_stretch`` decode a long stretch
(:mod:`attnkit.eval.data.long_output`). With ``queries`` K > 1 every context brings up to K questions (the
task's own first, then its follow-ups), consecutive in the list: the samples every protocol runs.
"""

from __future__ import annotations

import random

from attnkit.errors import AttnkitError
from attnkit.eval.data import metrics
from attnkit.eval.data.corpus import heldout_ids, special_prefix
from attnkit.eval.data.long_output import LONG_OUTPUT_TASKS, RECALL, LongOutput, long_output_items, recall_score
from attnkit.eval.data.prompting import check_positions
from attnkit.eval.data.sample import Sample
from attnkit.eval.data.task_registry import PERPLEXITY, TASKS
from attnkit.eval.data.user_data import PREFIXES, score_sample
from attnkit.methods.base import Method
from attnkit.model import LoadedModel
from attnkit.runner import token_nll

LONGBENCH_PREFIX = "longbench:"


def make_samples(model: LoadedModel, task: str, length: int, seed: int, depths: list[float],
                 queries: int = 1) -> list[Sample]:
    """One sample of a generated task per depth, sample ``i`` from seed ``seed + i``, each followed by its
    context's further questions up to `queries` questions in all."""
    out = []
    for i, depth in enumerate(depths):
        try:
            sample = TASKS[task].make(model.tokenizer, length, depth=depth, seed=seed + i, split="eval")
        except AttnkitError:
            raise
        except ValueError as exc:
            raise AttnkitError(f"task {task!r} at length {length}: {exc}") from None
        for asked in sample.questions(queries):
            n = len(model.tokenizer(asked.prompt).input_ids) if asked.query else length
            check_positions(model, task, length, sample.max_new_tokens, n)
            out.append(asked)
    return out


def task_items(model: LoadedModel, task: str, length: int, seed: int, samples: int, depths: list[float],
               data=None, queries: int = 1, long_output: LongOutput | None = None) -> list:
    """The samples every recipe of a (task, length) pair sees (with `queries` > 1, up to that many questions
    per context, consecutive); `long_output` sets how long the long-output tasks decode (None: the defaults)."""
    if task == PERPLEXITY:
        return perplexity_windows(model, length, seed, samples)
    if task in LONG_OUTPUT_TASKS:
        return long_output_items(model, task, length, seed, samples, depths, long_output)
    if task.startswith(PREFIXES):
        return data.samples(model, task, length, samples, queries)
    return make_samples(model, task, length, seed, depths, queries)


def is_data_task(task: str) -> bool:
    """Whether `task` comes from a data file (LongBench, RULER, InfiniteBench)."""
    return task.startswith(PREFIXES)


def score_prediction(task: str, prediction: str, item: Sample) -> float:
    """The score of one prediction: the task's own scorer, or its data format's metric."""
    if is_data_task(task):
        return score_sample(prediction, item)
    if task == RECALL:
        return recall_score(prediction, item)
    return float(TASKS[task].score(prediction, item))


# --------------------------------------------------------------------------------------------------
# perplexity


def perplexity_windows(model: LoadedModel, length: int, seed: int, count: int) -> list[list[int]]:
    """`count` token windows of `length` tokens (BOS included) of held-out text; window i from seed + i."""
    prefix = special_prefix(model.tokenizer)
    n = length - len(prefix)
    if n < 1:
        raise AttnkitError(f"task 'perplexity' at length {length}: needs at least {len(prefix) + 2} tokens")
    hay = heldout_ids(model.tokenizer)
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
    return metrics.bits_per_byte(model.tokenizer, ids[1:], token_nll(model, ids, method).sum().item(),
                                 "perplexity window")
