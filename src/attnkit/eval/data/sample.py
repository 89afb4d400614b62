"""What a task instance is (:class:`Sample`), which part of its prompt is the context and which the question, and
the further questions it can ask about the same context (:class:`Followup`).

Every generator says where its question starts (``Sample.question``, a suffix of the prompt), so that an
evaluation can compress the context before the question is seen (the query-agnostic protocol) or answer several
questions from one compressed context (multi-query; :mod:`attnkit.eval.data.protocols`). A sample whose question is
unknown (``question=None``) runs under the query-aware protocol only; an empty question means the whole prompt is
context (code completion, LongBench's lcc: nothing is asked after it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Followup:
    """Another question about a sample's context: it replaces the sample's question (same form: text for a text
    prompt, token ids for an id prompt), with its own reference answers."""

    question: str | tuple[int, ...]
    answers: tuple[str, ...]
    target: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """One task instance. `prompt` is text (the runner adds BOS) or token ids; `answers` are the reference
    strings. `question` is the suffix of `prompt` that asks (None: not known); `followups` are further questions
    about the same context; `query` is which question of its context this sample asks (0: the task's own)."""

    task: str
    prompt: str | list[int]
    answers: tuple[str, ...]
    target: str  # the exact continuation a perfect model writes (used for training)
    length: int  # requested prompt length in tokens, BOS included
    depth: float | None
    seed: int
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    question: str | tuple[int, ...] | None = None
    followups: tuple[Followup, ...] = ()
    query: int = 0

    def __post_init__(self):
        q = self.question
        if q is not None and (len(q) > len(self.prompt) or tuple(self.prompt[len(self.prompt) - len(q):]) != tuple(q)):
            raise ValueError(f"{self.task}: the question {q!r:.60} is not the end of the prompt")

    @property
    def context(self) -> str | list[int]:
        """The prompt before the question (the whole prompt when the question is unknown or empty)."""
        n = len(self.question or ())
        return self.prompt[:len(self.prompt) - n]

    def ask(self, j: int) -> Sample:
        """The sample asking its `j`-th question about the same context (0: itself; j >= 1: ``followups[j - 1]``)."""
        if j == 0:
            return self
        f = self.followups[j - 1]
        context = self.context
        prompt = context + f.question if isinstance(context, str) else list(context) + list(f.question)
        return dataclasses.replace(self, prompt=prompt, answers=f.answers, target=f.target, question=f.question,
                                   followups=(), query=j, meta={**self.meta, **f.meta})

    def questions(self, k: int) -> list[Sample]:
        """Up to `k` samples sharing this context: this one, then its follow-ups in order."""
        return [self.ask(j) for j in range(min(k, 1 + len(self.followups)))]


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[..., Sample]
    score: Callable[[str, Sample], float]
    description: str


def common_prefix(a, b) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_ids(tokenizer, sample: Sample) -> tuple[list[int], list[int]]:
    """The prompt's token ids (exactly what :func:`attnkit.generate` feeds) cut into context and question.

    For a text prompt the cut is where the tokens of the whole prompt stop agreeing with the tokens of the context
    alone: at the question's first token, or before it when a subword tokenizer merges across the boundary (the
    context then never holds a question token)."""
    if sample.question is None:
        raise ValueError(f"{sample.task}: the sample does not say which part of its prompt is the question")
    if not isinstance(sample.prompt, str):
        ids = list(sample.prompt)
        cut = len(ids) - len(sample.question)
    else:
        ids = list(tokenizer(sample.prompt).input_ids)
        cut = len(ids) if not sample.question else common_prefix(ids, tokenizer(sample.context).input_ids)
    cut = min(cut, len(ids))
    if cut < 1:
        raise ValueError(f"{sample.task}: the prompt has no context before its question")
    return ids[:cut], ids[cut:]
