"""The long-output tasks: quality over a long stretch of decoding, where a method's decode-time eviction and
selection act on every step (what a reasoning model needs, which writes thousands of tokens before it answers).
A prompt-only score (``perplexity``, the needle tasks) never sees that: their answers are a few tokens long.

- ``continuation``: a window of the held-out text ``perplexity`` reads (:func:`attnkit.eval.data.corpus.heldout_ids`),
  cut into a prompt of the cell's length and the next `continuation_tokens` tokens, its reference continuation.
  The continuation is fed one token per decoding step through the method's decode hooks (teacher forcing:
  :func:`attnkit.continuation.teacher_force`), each token fed as a generated token is. Score: bits per UTF-8 byte
  of the continuation, from each token's likelihood given everything before it under the method (lower is better).
- ``recall_after_stretch``: a pass key hidden in the prompt (the ``passkey`` generator of
  :mod:`attnkit.eval.data.tasks`), then `stretch_tokens` tokens of held-out text and then the question, both fed
  one token per decoding step (every method reads the same stretch), then a greedy answer. Score: the pass key
  task's string match. The prompt (the needle sample's context, prefilled and compressed as any prompt) is the
  cell's length; the stretch and the question come after it.

Both run under the query-aware protocol only (no question is held back from a compressed prompt: everything after
the prompt already goes through the decode path). Sample ``i`` comes from seed ``seed + i``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from attnkit.errors import AttnkitError
from attnkit.eval.data.corpus import heldout_ids, special_prefix
from attnkit.eval.data.metrics import bits_per_byte
from attnkit.eval.data.tasks import TASKS
from attnkit.validate import whole

CONTINUATION, RECALL = "continuation", "recall_after_stretch"
LONG_OUTPUT_TASKS = (CONTINUATION, RECALL)
DEFAULT_CONTINUATION_TOKENS, DEFAULT_STRETCH_TOKENS = 1024, 512
NEEDLE_TASK = "passkey"  # the needle generator and scorer of recall_after_stretch


@dataclass(frozen=True)
class LongOutput:
    """How long the long-output tasks decode: ``continuation``'s reference continuation and
    ``recall_after_stretch``'s stretch, in tokens."""

    continuation_tokens: int = DEFAULT_CONTINUATION_TOKENS
    stretch_tokens: int = DEFAULT_STRETCH_TOKENS

    def __post_init__(self):
        whole("continuation_tokens", self.continuation_tokens, minimum=1)
        whole("stretch_tokens", self.stretch_tokens, minimum=0)

    def options(self, task: str) -> dict:
        """What a cell of `task` depends on beyond its task and length (part of its results key and its row)."""
        if task == CONTINUATION:
            return {"continuation_tokens": self.continuation_tokens}
        if task == RECALL:
            return {"stretch_tokens": self.stretch_tokens}
        return {}


@dataclass(frozen=True)
class ContinuationItem:
    """A prompt (BOS included) and the reference continuation that follows it in the held-out text."""

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    seed: int


@dataclass(frozen=True)
class RecallItem:
    """A needle prompt (token ids, BOS included), the stretch fed after it, the question, and the answers."""

    prompt: tuple[int, ...]
    stretch: tuple[int, ...]
    question: tuple[int, ...]
    answers: tuple[str, ...]
    depth: float
    seed: int
    max_new_tokens: int
    meta: dict = field(default_factory=dict)
    query: int = 0  # the task's own question (one per context)


def _check_positions(model, task: str, length: int, total: int, what: str) -> None:
    limit = model.geometry.max_positions
    if total > limit:
        raise AttnkitError(f"task {task!r} at length {length}: the prompt and {what} take {total} positions; "
                           f"model {model.spec!r} allows {limit}")


def _heldout_slice(model, task: str, length: int, n: int, key: str) -> list[int]:
    """`n` consecutive held-out tokens from an offset drawn by `key`."""
    hay = heldout_ids(model.tokenizer)
    if n > len(hay):
        raise AttnkitError(f"task {task!r} at length {length}: needs {n} held-out tokens, the held-out text has "
                           f"{len(hay)}")
    start = random.Random(key).randrange(0, len(hay) - n + 1)
    return hay[start:start + n]


def continuation_items(model, length: int, seed: int, count: int, settings: LongOutput) -> list[ContinuationItem]:
    """`count` windows of held-out text: `length` prompt tokens (BOS included) and `continuation_tokens` after."""
    prefix = special_prefix(model.tokenizer)
    n, c = length - len(prefix), settings.continuation_tokens
    if n < 1:
        raise AttnkitError(f"task {CONTINUATION!r} at length {length}: needs at least {len(prefix) + 1} tokens")
    _check_positions(model, CONTINUATION, length, length + c, f"{c} continuation tokens")
    out = []
    for i in range(count):
        ids = _heldout_slice(model, CONTINUATION, length, n + c, f"eval|{CONTINUATION}|{length}|{c}|{seed + i}")
        out.append(ContinuationItem(tuple(prefix + ids[:n]), tuple(ids[n:]), seed + i))
    return out


def recall_items(model, length: int, seed: int, depths: list[float], settings: LongOutput) -> list[RecallItem]:
    """One item per depth: a pass key at that depth of a prompt of about `length` tokens (the needle sample's
    context: the sample is made `question` tokens longer, so that its context is the prompt), then the stretch
    and the question."""
    tok, needle, s = model.tokenizer, TASKS[NEEDLE_TASK], settings.stretch_tokens
    out = []
    for i, depth in enumerate(depths):
        try:
            probe = needle.make(tok, length, depth=depth, seed=seed + i, split="eval")
            question = tok.encode(probe.question, add_special_tokens=False)
            sample = needle.make(tok, length + len(question), depth=depth, seed=seed + i, split="eval")
        except ValueError as exc:
            raise AttnkitError(f"task {RECALL!r} at length {length}: {exc}") from None
        prompt = tok(sample.context).input_ids
        _check_positions(model, RECALL, length, len(prompt) + s + len(question) + sample.max_new_tokens,
                         f"{s} stretch tokens, the question and the answer")
        stretch = _heldout_slice(model, RECALL, length, s, f"eval|{RECALL}|{length}|{s}|{seed + i}") if s else []
        out.append(RecallItem(tuple(prompt), tuple(stretch), tuple(question), sample.answers, depth, seed + i,
                              sample.max_new_tokens, {"stop": sample.meta.get("stop", "\n")}))
    return out


def long_output_items(model, task: str, length: int, seed: int, samples: int, depths: list[float],
                      settings: LongOutput | None = None) -> list:
    """The samples of a long-output (task, length) cell (`settings`: the defaults when None)."""
    settings = settings or LongOutput()
    if task == CONTINUATION:
        return continuation_items(model, length, seed, samples, settings)
    return recall_items(model, length, seed, depths, settings)


def continuation_bits_per_byte(tokenizer, item: ContinuationItem, nll) -> float:
    """Bits per UTF-8 byte of `item`'s continuation, from its tokens' NLL (nats, one per token)."""
    return bits_per_byte(tokenizer, item.continuation, float(nll.sum()), "a continuation")


def recall_score(prediction: str, item: RecallItem) -> float:
    """The needle task's scorer (the share of the answers in the first line of the prediction)."""
    return float(TASKS[NEEDLE_TASK].score(prediction, item))
