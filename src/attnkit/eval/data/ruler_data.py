"""RULER-format data: the JSONL files RULER's data preparation writes, run as the tasks ``ruler:TASK``.

RULER: Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv
2404.06654 (the repository NVIDIA/RULER, whose ``scripts/data/prepare.py`` writes ``{save_dir}/{task}/
{subset}.jsonl``). One item per line::

    {"index": 0, "input": "Some special magic numbers are hidden ... What is the special magic number for
     wise-owl mentioned in the provided text?", "outputs": ["8421937"], "length": 4031,
     "answer_prefix": " The special magic number for wise-owl mentioned in the provided text is"}

(``length_w_model_temp``, ``token_position_answer`` and other fields may be present; older RULER versions leave
the answer prefix inside ``input`` and write no ``answer_prefix``.) The task is the line's ``task`` field, else
the folder RULER wrote the file into (``niah_single_1/validation.jsonl``), else the file's stem.

The prompt is ``input + answer_prefix``, as RULER feeds it (``input`` already holds the model's template, chosen
when the data was prepared); the runner adds BOS. The question is what follows the context: from the last
occurrence of the task template's question in ``input`` (``\\nWhat `` for the needle tasks, ``\\nQuestion:``
for variable tracking and the word-frequency tasks, ``\\n\\nAnswer the question based on the given documents``
for QA), answer prefix included. RULER makes its data for one length, so a prompt longer than the cell's
length (``--lengths``, a token budget) is refused, not cut (a cut haystack would be another task).

Metrics, RULER's: ``string_match_part`` for ``qa_*`` (1 when any reference is in the prediction), otherwise
``string_match_all`` (the fraction of references in the prediction); both ignore case, after RULER's
post-processing (control characters become line breaks, the ends are stripped). Tokens generated per task are
RULER's (needles 128, variable tracking 30, common words 120, frequent words 50, QA 32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data.prompting import check_positions, documents
from attnkit.eval.data.sample import Sample

PREFIX = "ruler:"
FIELDS = ("input", "outputs")
# task family -> (question marker in the template, tokens to generate, metric)
FAMILIES = {
    "niah": ("\nWhat ", 128, "string_match_all"),
    "vt": ("\nQuestion:", 30, "string_match_all"),
    "cwe": ("\nQuestion:", 120, "string_match_all"),
    "fwe": ("\nQuestion:", 50, "string_match_all"),
    "qa": ("\n\nAnswer the question based on the given documents", 32, "string_match_part"),
}
ALIASES = {"variable_tracking": "vt", "common_words_extraction": "cwe", "freq_words_extraction": "fwe"}


def family(task: str) -> str:
    """The RULER task family of a task name (``niah_multikey_2`` -> ``niah``, ``qa_1`` -> ``qa``)."""
    base = ALIASES.get(task, task)
    for name in FAMILIES:
        if base == name or base.startswith(name + "_"):
            return name
    raise AttnkitError(f"RULER task {task!r} has no known metric; RULER's tasks are niah_*, vt, cwe, fwe and qa_* "
                       f"(name the file's folder or its 'task' field after one)")


def postprocess(prediction: str) -> str:
    """RULER's post-processing: control characters become line breaks; the ends are stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references) -> float:
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references) -> float:
    pred = postprocess(prediction).lower()
    return float(max(r.lower() in pred for r in references))


def score_sample(prediction: str, sample: Sample) -> float:
    metric = string_match_part if sample.meta["metric"] == "string_match_part" else string_match_all
    return metric(prediction, sample.answers)


def _task_name(item: dict, path: Path) -> str:
    if isinstance(item.get("task"), str) and item["task"]:
        return item["task"]
    for name in (path.parent.name, path.stem):
        try:
            family(name)
            return name
        except AttnkitError:
            continue
    return path.stem


def check_item(item, where: str) -> dict:
    if not isinstance(item, dict) or any(f not in item for f in FIELDS):
        raise AttnkitError(f"{where}: a RULER item is a JSON object with {', '.join(FIELDS)}")
    if not isinstance(item["input"], str) or not item["input"]:
        raise AttnkitError(f"{where}: 'input' must be a non-empty string")
    outputs = item["outputs"]
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, list) or not outputs or not all(isinstance(o, (str, int)) for o in outputs):
        raise AttnkitError(f"{where}: 'outputs' must be a non-empty list of strings, got {item['outputs']!r}")
    prefix = item.get("answer_prefix") or ""
    if not isinstance(prefix, str):
        raise AttnkitError(f"{where}: 'answer_prefix' must be a string")
    return dict(item, outputs=[str(o) for o in outputs], answer_prefix=prefix)


@dataclass
class RulerData:
    """RULER items by task (in file order)."""

    source: str
    items: dict[str, list[dict]]

    @classmethod
    def from_lines(cls, path: Path, lines: list[tuple[int, dict]]) -> RulerData:
        items: dict[str, list[dict]] = {}
        for n, raw in lines:
            item = check_item(raw, f"{path} line {n}")
            task = _task_name(item, path)
            family(task)
            items.setdefault(task, []).append(item)
        return cls(str(path), items)

    def tasks(self) -> list[str]:
        return [PREFIX + t for t in self.items]

    def samples(self, model, task: str, length: int, count: int, queries: int = 1) -> list[Sample]:
        """The first `count` items of `task` (each context's first `queries` items when several share one)."""
        name = task[len(PREFIX):] if task.startswith(PREFIX) else task
        marker, max_new, metric = FAMILIES[family(name)]
        check_positions(model, PREFIX + name, length, max_new)
        out = []
        for k, query, item in documents(self.items[name], count, queries, key="input"):
            text, prefix = item["input"], item["answer_prefix"]
            prompt = text + prefix
            n = len(model.tokenizer(prompt).input_ids)
            if n > length:
                raise AttnkitError(f"ruler:{name} item {item.get('index', k)} has {n} tokens, over the length budget "
                                   f"{length}; RULER data is made for one length: prepare it for this model and length")
            at = text.rfind(marker)
            question = text[at:] + prefix if at > 0 else None
            depth = item.get("token_position_answer")
            depth = depth / n if isinstance(depth, int) and n else None
            meta = {"metric": metric, "id": item.get("index", k), "stop": None}
            out.append(Sample(PREFIX + name, prompt, tuple(item["outputs"]), " " + ", ".join(item["outputs"]), n,
                              depth, k, max_new, meta, question, query=query))
        return out
