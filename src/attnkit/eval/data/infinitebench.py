"""InfiniteBench-format data, run as the tasks ``infinitebench:TASK``.

InfiniteBench: Zhang et al. 2024, "∞Bench: Extending Long Context Evaluation Beyond 100K Tokens", arXiv
2402.13718 (the repository OpenBMB/InfiniteBench; its data: one JSONL file per task, ``passkey.jsonl``,
``longbook_qa_eng.jsonl``, ...). One item per line::

    {"id": 0, "context": "...", "input": "What is the pass key?", "answer": ["71432"], "options": []}

The task is the line's ``task`` field, else the file's stem. The prompt is attnkit's own wording per task around
``context``, then the question: ``input`` (with the ``options`` as A-D for the multiple-choice tasks) and a cue
for the answer; it is wrapped in the tokenizer's chat template when it has one, and a prompt longer than the
cell's length (a token budget) loses its middle, as InfiniteBench's own scripts do. Items that share a
``context`` (a book asked several questions) are several questions about it (``queries`` > 1). Tokens generated
per task are InfiniteBench's.

Metrics follow InfiniteBench's scorer (``src/compute_scores.py``), per task: ``passkey`` and ``number_string``:
the first run of digits in the prediction equals the answer; ``kv_retrieval``: the answer is one of the
prediction's words (split at spaces and punctuation); ``math_find``: the first number equals the answer;
``code_run``: the last word is the answer's integer; ``math_calc``: the share of the answer's values predicted
in order before the first wrong one; ``longdialogue_qa_eng``: the answer's name is one of the prediction's words
(upper case); ``longbook_choice_eng`` and ``code_debug``: the option's letter (or, for code_debug, the function's
name) as the prediction's first letter or after an "answer" cue; ``longbook_qa_eng`` / ``_chn``: token F1 (of
characters for Chinese; InfiniteBench splits words with jieba); ``longbook_sum_eng``: ROUGE-Lsum.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data.metrics import qa_f1, qa_f1_zh, rouge_l
from attnkit.eval.data.prompting import check_positions, documents, split_prompt
from attnkit.eval.data.sample import Sample

PREFIX = "infinitebench:"
FIELDS = ("context", "input", "answer")
_HEAD = {
    "retrieve": "There is important information hidden in the text below. Find it and remember it.\n\n",
    "kv": "Find the value of the given key in the JSON object below.\n\n",
    "book": "Read the book below, then answer a question about it.\n\n",
    "choice": "Read the book below, then answer a multiple-choice question about it.\n\n",
    "book_zh": "阅读下面的书，然后回答问题。\n\n",
    "sum": "Summarise the book below.\n\n",
    "dialogue": "In the script below, one occurrence of a character's name was replaced by \"$$MASK$$\". Guess "
                "which character it is.\n\n",
    "math": "Answer the question about the list of numbers below.\n\n",
    "calc": "Compute the value after each operation of the expression below.\n\n",
    "code": "Read the Python code below.\n\n",
    "debug": "Exactly one function in the code below has a deliberate error.\n\n",
}
# task -> (head, question template, tokens to generate); {input} is the item's input, {options} its options
TASKS: dict[str, tuple[str, str, int]] = {
    "passkey": ("retrieve", "\n\n{input}\nThe pass key is", 6),
    "number_string": ("retrieve", "\n\n{input}\nThe sequence of digits is", 12),
    "kv_retrieval": ("kv", "\n\n{input}\nThe value is", 50),
    "longbook_qa_eng": ("book", "\n\nQuestion: {input}\nAnswer briefly:", 40),
    "longbook_qa_chn": ("book_zh", "\n\n问题：{input}\n简要回答：", 40),
    "longbook_choice_eng": ("choice", "\n\nQuestion: {input}\n{options}\nThe letter of the right option is", 40),
    "longbook_sum_eng": ("sum", "\n\nSummary:", 1200),
    "longdialogue_qa_eng": ("dialogue", "\n\n{input}\nThe name replaced by $$MASK$$ is", 40),
    "math_find": ("math", "\n\n{input}", 3),
    "math_calc": ("calc", "\n\nThe values are:", 30000),
    "code_run": ("code", "\n\n{input}\nThe return value is", 5),
    "code_debug": ("debug", "\n\nWhich function has the error?\n{options}\nThe letter of the right option is", 5),
}
LETTERS = "ABCD"
_PUNCT = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def _words(text: str, marks=_PUNCT) -> list[str]:
    for c in marks:
        text = text.replace(c, " ")
    return text.split()


def first_digits(prediction: str) -> str:
    """The first run of digits in the prediction ('' when there is none)."""
    found = re.search(r"\d+", prediction)
    return found.group(0) if found else ""


def _choice(prediction: str, label: list[str], debug: bool) -> bool:
    """InfiniteBench's multiple-choice rules. `label` is the right option's text (code_debug: the function's name)
    and letter. longbook_choice_eng: a leading letter, else what follows the first answer cue, else the first word
    that is a letter; code_debug: a leading "X." or "X:", else what follows the first answer cue."""
    text, letter = label
    pred = prediction.strip()
    if debug and pred[:2] in (f"{letter}.", f"{letter}:"):
        return True
    if not debug and pred and pred[0] in LETTERS:
        return pred[0] == letter
    marks = ["\n", "`", "'", '"', "-", "*", "Option", "option"] if debug else ["\n", '"', "'", ".", ",", "?", "!",
                                                                              "{", "}"]
    pred = " ".join(_words(pred, marks))
    cues = ("answer is:", "is:", "answer:") if debug else ("answer is:", "answer:", "answer is", "option is")
    for cue in cues:
        at = pred.find(cue)
        if at >= 0:
            after = pred[at + len(cue):].strip()
            return any(after.startswith(s) for s in (letter, text) if s)
    return False if debug else next((w == letter for w in pred.split() if w in LETTERS), False)


def score_one(task: str, prediction: str, answers: tuple[str, ...], meta: dict) -> float:
    """One prediction's score for `task` (see the module docstring)."""
    if task in ("passkey", "number_string"):
        return float(first_digits(prediction) in answers)
    if task == "kv_retrieval":
        return float(any(a in _words(prediction) for a in answers))
    if task == "math_find":
        found = re.search(r"\d+\.\d+|\d+", prediction)
        return float(found is not None and any(float(found.group(0)) == float(a) for a in answers))
    if task == "code_run":
        words = _words(prediction.strip(), ["\n", ".", "`", "'", '"', ":"])
        return float(bool(words) and re.fullmatch(r"-?\d+", words[-1]) is not None
                     and any(int(words[-1]) == int(a) for a in answers))
    if task == "math_calc":
        predicted = [int(x) for x in re.findall(r"\d+", prediction)]
        wanted = [int(a) for a in answers]
        good = next((i for i, (p, w) in enumerate(zip(predicted, wanted)) if p != w), min(len(predicted), len(wanted)))
        return good / len(wanted)
    if task == "longdialogue_qa_eng":
        return float(answers[0].upper() in [w.upper() for w in _words(prediction)])
    if task in ("longbook_choice_eng", "code_debug"):
        return float(_choice(prediction, meta["label"], task == "code_debug"))
    if task == "longbook_qa_eng":
        return max(qa_f1(prediction, a) for a in answers)
    if task == "longbook_qa_chn":
        return max(qa_f1_zh(prediction, a) for a in answers)
    if task == "longbook_sum_eng":
        return max(rouge_l(prediction, a, summary_level=True) for a in answers)
    raise AttnkitError(f"InfiniteBench task {task!r} has no known metric; known: {', '.join(TASKS)}")


def score_sample(prediction: str, sample: Sample) -> float:
    return score_one(sample.meta["task"], prediction, sample.answers, sample.meta)


def check_item(item, where: str, task: str) -> dict:
    if not isinstance(item, dict) or any(f not in item for f in FIELDS):
        raise AttnkitError(f"{where}: an InfiniteBench item is a JSON object with {', '.join(FIELDS)} (and options)")
    for f in ("context", "input"):
        if not isinstance(item[f], str):
            raise AttnkitError(f"{where}: {f!r} must be a string")
    answer = item["answer"]
    answers = answer if isinstance(answer, list) else [answer]
    if not answers or not all(isinstance(a, (str, int, float)) for a in answers):
        raise AttnkitError(f"{where}: 'answer' must be a value or a non-empty list of values, got {answer!r}")
    options = item.get("options") or []
    label = None
    if task in ("longbook_choice_eng", "code_debug"):
        if len(options) != 4:
            raise AttnkitError(f"{where}: task {task!r} needs 4 'options'")
        text = str(answers[0])
        letter = str(answers[1]) if len(answers) == 2 and answers[1] in tuple(LETTERS) else (
            LETTERS[options.index(text)] if text in options else None)
        if letter is None:
            raise AttnkitError(f"{where}: the answer {text!r} is none of the options")
        label = [text, letter]
    return dict(item, answers=[str(a) for a in answers], options=options, label=label)


@dataclass
class InfiniteBenchData:
    """InfiniteBench items by task (in file order)."""

    source: str
    items: dict[str, list[dict]]

    @classmethod
    def from_lines(cls, path: Path, lines: list[tuple[int, dict]]) -> InfiniteBenchData:
        items: dict[str, list[dict]] = {}
        for n, raw in lines:
            task = raw.get("task") if isinstance(raw, dict) and isinstance(raw.get("task"), str) else path.stem
            if task not in TASKS:
                raise AttnkitError(f"{path} line {n}: InfiniteBench task {task!r} is unknown (the file's stem or its "
                                   f"'task' field); known: {', '.join(TASKS)}")
            items.setdefault(task, []).append(check_item(raw, f"{path} line {n}", task))
        return cls(str(path), items)

    def tasks(self) -> list[str]:
        return [PREFIX + t for t in self.items]

    def samples(self, model, task: str, length: int, count: int, queries: int = 1) -> list[Sample]:
        """The first `count` items of `task` as prompts of at most `length` tokens (each context's first `queries`
        items when several share one)."""
        name = task[len(PREFIX):] if task.startswith(PREFIX) else task
        head, question, max_new = TASKS[name]
        check_positions(model, PREFIX + name, length, max_new)
        out = []
        for k, query, item in documents(self.items[name], count, queries):
            options = "\n".join(f"{x}. {o}" for x, o in zip(LETTERS, item["options"]))
            asked = question.format(input=item["input"], options=options)
            ids, q = split_prompt(model.tokenizer, _HEAD[head] + item["context"], asked, length)
            meta = {"task": name, "label": item["label"], "id": item.get("id", k), "stop": None}
            out.append(Sample(PREFIX + name, ids, tuple(item["answers"]), item["answers"][0], len(ids), None, k,
                              max_new, meta, q, query=query))
        return out
