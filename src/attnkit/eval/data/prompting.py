"""Prompts of the data formats users bring (LongBench, RULER, InfiniteBench): fitting a prompt into a token budget,
the chat template, where the context ends and the question starts, and which items share a context.

A prompt longer than its budget loses its middle (the first and last halves of the budget are kept), as
LongBench and InfiniteBench do; the chat template goes around the text afterwards. The question is what follows
the context in the final token ids: the cut is where the ids of the whole prompt stop agreeing with the ids of
the text up to the question's start (so the context never holds a question token).
"""

from __future__ import annotations

from attnkit.errors import AttnkitError
from attnkit.eval.data.sample import common_prefix


def wrapped_text(tokenizer, text: str, chat: bool) -> tuple[str, bool]:
    """The string the model's tokenizer reads for `text`, and whether it adds its special tokens (BOS): the chat
    template around `text` (when asked and the tokenizer has one), else `text` itself with special tokens."""
    if chat and getattr(tokenizer, "chat_template", None):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        return templated, False
    return text, True


def wrap(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of `text` as the model sees it (see :func:`wrapped_text`)."""
    string, special = wrapped_text(tokenizer, text, chat)
    return list(tokenizer(string, add_special_tokens=special).input_ids)


def truncate_middle(ids: list[int], budget: int) -> list[int]:
    """`ids` if they fit in `budget`, else the first half and the last half of the budget."""
    if len(ids) <= budget:
        return list(ids)
    head = budget // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head):])


def fit_text(tokenizer, prompt: str, budget: int, chat: bool = True) -> str:
    """The prompt's text, its middle cut when its tokens (in the template) would pass `budget`."""
    overhead = len(wrap(tokenizer, "", chat))
    body = tokenizer.encode(prompt, add_special_tokens=False)
    room = budget - overhead
    if room < 2:
        raise AttnkitError(f"a prompt budget of {budget} tokens leaves no room for the text (the template "
                           f"takes {overhead})")
    for _ in range(8):  # decoding and encoding again can shift token boundaries: shrink until it fits
        text = prompt if len(body) <= room else tokenizer.decode(truncate_middle(body, room))
        n = len(wrap(tokenizer, text, chat))
        if n <= budget:
            return text
        room -= n - budget
    raise AttnkitError(f"could not fit the prompt into {budget} tokens")


def prompt_ids(tokenizer, prompt: str, budget: int, chat: bool = True) -> list[int]:
    """The prompt's token ids in at most `budget` tokens: its middle cut (first and last halves kept)
    before the chat template goes around it."""
    return wrap(tokenizer, fit_text(tokenizer, prompt, budget, chat), chat)


def split_prompt(tokenizer, context: str, question: str, budget: int, chat: bool = True
                 ) -> tuple[list[int], tuple[int, ...] | None]:
    """The ids of ``context + question`` fitted into `budget` (:func:`prompt_ids`), and the ids of the question
    at their end (with the template's tail); None for the question when the cut took part of it."""
    text = fit_text(tokenizer, context + question, budget, chat)
    ids = wrap(tokenizer, text, chat)
    if not text.endswith(question):
        return ids, None
    string, special = wrapped_text(tokenizer, text, chat)
    at = string.find(text)
    if at < 0:  # a template that rewrites its content: the question's start cannot be located
        return ids, None
    before = tokenizer(string[:at + len(text) - len(question)], add_special_tokens=special).input_ids
    cut = common_prefix(ids, before)
    return ids, tuple(ids[cut:])


def documents(items: list[dict], count: int, queries: int = 1, key: str = "context") -> list[tuple[int, int, dict]]:
    """``(item index, question index, item)`` of the items a cell runs: the first `count` items (`queries` 1), or
    the first `count` distinct contexts (``item[key]``), each with up to `queries` of its items in file order."""
    if queries <= 1:
        return [(i, 0, item) for i, item in enumerate(items[:count])]
    by_context: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_context.setdefault(item[key], []).append(i)
    return [(i, j, items[i]) for group in list(by_context.values())[:count] for j, i in enumerate(group[:queries])]


def check_positions(model, task: str, length: int, max_new: int, used: int | None = None) -> None:
    """Refuse a cell whose prompt (`used` tokens, `length` when not given) and `max_new` answer tokens do not fit
    the model's positions, naming the task and the model."""
    used = length if used is None else used
    limit = model.geometry.max_positions
    if used + max_new > limit:
        raise AttnkitError(f"task {task!r} at length {length} needs {used} + {max_new} positions; model "
                           f"{model.spec!r} allows {limit}")
