"""Calibration prompts: seeded samples of the task generators (:mod:`attnkit.eval.data.tasks`) that are never
evaluation samples.

They use the held-out haystack (the training split's is much larger and slow to tokenize) with their seeds
offset by :data:`SEED_OFFSET`, so a calibration prompt is never one of the evaluation samples (whose seeds
are ``seed .. seed + samples - 1``). Re-running with the same arguments gives the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnkit.errors import AttnkitError
from attnkit.eval.data.task_registry import TASKS
from attnkit.generation import encode_prompt
from attnkit.model import LoadedModel
from attnkit.validate import choice, whole

SEED_OFFSET = 1_000_000
SPLITS = ("calibration", "train")  # calibration: held-out text, eval-split generators; train: training stream


def check_length(model: LoadedModel, length) -> int:
    """A calibration length in tokens: at least 2, within the model's positions."""
    whole("length", length, 2, what=" tokens")
    if length > model.geometry.max_positions:
        raise AttnkitError(f"length {length} exceeds the {model.geometry.max_positions} positions model "
                           f"{model.spec!r} allows")
    return length


def calibration_samples(model: LoadedModel, length: int, tasks: Sequence[str], samples: int, seed: int,
                        split: str = "calibration"):
    """``samples`` seeded task samples per task as ``(info, Sample, ids)``; never an evaluation sample (see the
    module docstring for the two splits)."""
    choice("calibration split", split, SPLITS)
    whole("samples", samples, 1)
    check_length(model, length)
    out = []
    for task in tasks:
        if task not in TASKS:
            raise AttnkitError(f"unknown calibration task {task!r}; available: {', '.join(TASKS)}")
        for i in range(samples):
            depth = (i + 0.5) / samples
            task_seed = SEED_OFFSET + seed + i
            try:
                sample = TASKS[task].make(model.tokenizer, length, depth=depth, seed=task_seed,
                                          split="train" if split == "train" else "eval")
            except ValueError as exc:
                raise AttnkitError(f"calibration task {task!r} at length {length}: {exc}") from None
            ids = encode_prompt(model, sample.prompt)
            info = {"task": task, "split": split, "seed": task_seed, "depth": round(depth, 6),
                    "tokens": int(ids.shape[0])}
            out.append((info, sample, ids))
    return out


def calibration_prompts(model: LoadedModel, length: int, tasks: Sequence[str], samples: int, seed: int):
    """``samples`` seeded prompts per task, as ``(description, token ids)`` (seeds offset by SEED_OFFSET)."""
    return [({k: v for k, v in info.items() if k != "split"}, ids)
            for info, _sample, ids in calibration_samples(model, length, tasks, samples, seed)]
