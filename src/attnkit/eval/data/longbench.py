"""LongBench-format data: run the real benchmark, or your own data in its format.

LongBench: "LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding", Bai et al.
2023, arXiv 2308.14508.

A JSONL file, one item per line, with LongBench's fields::

    {"context": "...", "input": "the question", "answers": ["..."], "dataset": "hotpotqa",
     "all_classes": null, "length": 1234, "_id": "..."}

``attnkit eval --data FILE`` runs every dataset of the file as the task ``longbench:DATASET``; the
``--lengths`` are prompt token budgets: a longer prompt loses its middle (the first half and the last
half of the budget are kept, as LongBench does). The prompt is an instruction built from ``context``
and ``input`` (attnkit's own wording per kind of dataset), wrapped in the tokenizer's chat template when
it has one (not for the few-shot and code datasets, which are plain continuations, as in LongBench). What
follows the context (the instruction after it, ``input``, the template's end) is the question; items that share
a context are several questions about it (``queries`` > 1).

The metric follows the dataset's name (a LongBench-E name ``X_e`` is scored as ``X``), each item's score
being its best over the reference answers:

- QA (``narrativeqa``, ``qasper``, ``multifieldqa_en``, ``hotpotqa``, ``2wikimqa``, ``musique``,
  ``triviaqa``): token F1 after lower-casing and removing punctuation, articles and extra spaces;
  ``multifieldqa_zh``: F1 over characters.
- summarisation (``gov_report``, ``qmsum``, ``multi_news``, ``samsum``; Chinese ``vcsum``,
  ``dureader``): ROUGE-L F1 (the ``rouge-score`` package; characters for Chinese).
- classification (``trec``, ``lsht``): 1 / (number of classes named) when the right class is among
  them (a class named only as part of the right one does not count).
- ``passage_retrieval_en`` / ``_zh``: share of the numbers in the prediction that are the right
  paragraph; ``passage_count``: share of the numbers that are the right count.
- code (``lcc``, ``repobench-p``): edit similarity of the first line that is not a comment.

For ``trec``, ``triviaqa``, ``samsum`` and ``lsht`` only the first line of the prediction is scored.
Differences to LongBench's own scripts: Chinese text is split into characters (LongBench uses jieba
words), and English ROUGE uses rouge-score's tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.eval.data.metrics import normalize_answer, normalize_zh_answer, qa_f1, qa_f1_zh, rouge_l, token_f1
from attnkit.eval.data.prompting import check_positions, documents, prompt_ids, split_prompt, truncate_middle
from attnkit.eval.data.tasks import Sample, edit_similarity, first_code_line

__all__ = ["LongBenchData", "score", "score_sample", "prompt_ids", "truncate_middle", "normalize_answer",
           "normalize_zh_answer", "qa_f1", "qa_f1_zh", "rouge_l", "token_f1", "DATASETS"]

FIELDS = ("context", "input", "answers", "dataset")
OPTIONAL_FIELDS = ("all_classes", "length", "_id", "language")

# dataset -> (metric, kind of prompt, max new tokens)
DATASETS: dict[str, tuple[str, str, int]] = {
    "narrativeqa": ("qa_f1", "qa", 128),
    "qasper": ("qa_f1", "qa", 128),
    "multifieldqa_en": ("qa_f1", "qa", 64),
    "multifieldqa_zh": ("qa_f1_zh", "qa_zh", 64),
    "hotpotqa": ("qa_f1", "qa", 32),
    "2wikimqa": ("qa_f1", "qa", 32),
    "musique": ("qa_f1", "qa", 32),
    "dureader": ("rouge_l_zh", "qa_zh", 128),
    "gov_report": ("rouge_l", "summary", 512),
    "qmsum": ("rouge_l", "query_summary", 512),
    "multi_news": ("rouge_l", "summary", 512),
    "vcsum": ("rouge_l_zh", "summary_zh", 512),
    "trec": ("classification", "fewshot", 64),
    "triviaqa": ("qa_f1", "fewshot", 32),
    "samsum": ("rouge_l", "fewshot", 128),
    "lsht": ("classification", "fewshot", 64),
    "passage_count": ("count", "count", 32),
    "passage_retrieval_en": ("retrieval", "retrieval", 32),
    "passage_retrieval_zh": ("retrieval_zh", "retrieval_zh", 32),
    "lcc": ("code_sim", "code", 64),
    "repobench-p": ("code_sim", "code", 64),
}
FIRST_LINE_ONLY = ("trec", "triviaqa", "samsum", "lsht")
NO_CHAT_TEMPLATE = ("fewshot", "code")  # prompt kinds that are plain continuations

# attnkit's own prompt wording per kind; {context} and {input} are the item's fields
PROMPTS = {
    "qa": "Read the text below and answer the question after it with as few words as possible.\n\n"
          "{context}\n\nAnswer briefly, without explanation.\nQuestion: {input}\nAnswer:",
    "qa_zh": "阅读下面的文本，然后简要回答文本后的问题。\n\n{context}\n\n问题：{input}\n回答：",
    "summary": "Summarise the text below.\n\n{context}\n\nSummary:",
    "query_summary": "Read the transcript below and answer the query about it in a few sentences.\n\n{context}\n\n"
                     "Query: {input}\nAnswer:",
    "summary_zh": "总结下面的文本。\n\n{context}\n\n总结：",
    "fewshot": "{context}\n{input}",
    "count": "The paragraphs below may repeat. Count how many distinct paragraphs there are.\n\n{context}\n\n"
             "Write only the number of distinct paragraphs.\nNumber:",
    "retrieval": "Below are numbered paragraphs, then a summary of one of them. Say which paragraph it "
                 "summarises.\n\n{context}\n\nSummary: {input}\n\nWrite the paragraph's number as "
                 "\"Paragraph N\".\nAnswer:",
    "retrieval_zh": "下面是编号的段落和其中一段的摘要。请指出摘要对应的段落。\n\n{context}\n\n摘要：{input}\n\n"
                    "请按“段落N”的格式回答。\n答案：",
    "code": "{context}{input}",
}


def base_dataset(name: str) -> str:
    """The LongBench dataset a name is scored as (``hotpotqa_e`` -> ``hotpotqa``)."""
    return name[:-2] if name.endswith("_e") and name[:-2] in DATASETS else name


def dataset_info(name: str) -> tuple[str, str, int]:
    base = base_dataset(name)
    if base not in DATASETS:
        raise AttnkitError(f"LongBench dataset {name!r} has no known metric; known datasets (also with the "
                           f"LongBench-E suffix _e): {', '.join(DATASETS)}")
    return DATASETS[base]


# --------------------------------------------------------------------------------------------------
# metrics


def classification_score(prediction: str, reference: str, all_classes) -> float:
    """1 / (classes named) if the right class is among the classes the prediction names, else 0; a class
    that is only a part of the right one's name does not count as named."""
    if not all_classes:
        raise AttnkitError("classification items need 'all_classes' (the list of class names)")
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in reference and c != reference)]
    return 1.0 / len(named) if reference in named else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, reference: str, chinese: bool = False) -> float:
    found = re.findall(r"段落(\d+)" if chinese else r"Paragraph (\d+)", reference)
    if not found:
        raise AttnkitError(f"retrieval answer {reference!r} names no paragraph "
                           f"({'段落N' if chinese else 'Paragraph N'})")
    return _share_equal(prediction, found[0])


def count_score(prediction: str, reference: str) -> float:
    return _share_equal(prediction, str(reference).strip())


def code_sim(prediction: str, reference: str) -> float:
    line = first_code_line(prediction, ("`", "#", "//"))
    return 0.0 if line is None else edit_similarity(line, reference)


def metric_score(metric: str, prediction: str, reference: str, all_classes=None) -> float:
    if metric == "qa_f1":
        return qa_f1(prediction, reference)
    if metric == "qa_f1_zh":
        return qa_f1_zh(prediction, reference)
    if metric in ("rouge_l", "rouge_l_zh"):
        return rouge_l(prediction, reference, chinese=metric.endswith("_zh"))
    if metric == "classification":
        return classification_score(prediction, reference, all_classes)
    if metric in ("retrieval", "retrieval_zh"):
        return retrieval_score(prediction, reference, chinese=metric.endswith("_zh"))
    if metric == "count":
        return count_score(prediction, reference)
    if metric == "code_sim":
        return code_sim(prediction, reference)
    raise AttnkitError(f"unknown LongBench metric {metric!r}")


def score(dataset: str, prediction: str, answers, all_classes=None) -> float:
    """An item's score in [0, 1]: its best over the reference `answers` with `dataset`'s metric."""
    metric = dataset_info(dataset)[0]
    if base_dataset(dataset) in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return max(metric_score(metric, prediction, str(a), all_classes) for a in answers)


def score_sample(prediction: str, sample: Sample) -> float:
    return score(sample.meta["dataset"], prediction, sample.answers, sample.meta.get("all_classes"))


# --------------------------------------------------------------------------------------------------
# data and prompts


def _check_item(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise AttnkitError(f"{where}: an item must be a JSON object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in item]
    if missing:
        raise AttnkitError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                           f"(LongBench items have {', '.join(FIELDS)}, optionally {', '.join(OPTIONAL_FIELDS)})")
    for f in ("context", "input", "dataset"):
        if not isinstance(item[f], str):
            raise AttnkitError(f"{where}: {f!r} must be a string, got {type(item[f]).__name__}")
    if not item["dataset"]:
        raise AttnkitError(f"{where}: 'dataset' is empty")
    answers = item["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, (str, int)) for a in answers):
        raise AttnkitError(f"{where}: 'answers' must be a non-empty list of strings, got {item['answers']!r}")
    classes = item.get("all_classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        raise AttnkitError(f"{where}: 'all_classes' must be a list of strings or null")
    metric = dataset_info(item["dataset"])[0]
    if metric == "classification" and not classes:
        raise AttnkitError(f"{where}: dataset {item['dataset']!r} is scored by classification and needs "
                           f"'all_classes'")
    return dict(item, answers=[str(a) for a in answers])


@dataclass
class LongBenchData:
    """The items of a LongBench-format JSONL file, by dataset (in file order)."""

    source: str
    items: dict[str, list[dict]]

    @classmethod
    def load(cls, path: str | Path) -> LongBenchData:
        path = Path(path)
        if not path.is_file():
            raise AttnkitError(f"LongBench data file {str(path)!r} does not exist")
        items: dict[str, list[dict]] = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AttnkitError(f"{where} is not JSON: {exc}") from None
            item = _check_item(raw, where)
            items.setdefault(item["dataset"], []).append(item)
        if not items:
            raise AttnkitError(f"LongBench data file {str(path)!r} holds no items")
        return cls(str(path), items)

    def datasets(self) -> list[str]:
        return list(self.items)

    def tasks(self) -> list[str]:
        return [PREFIX + d for d in self.items]

    def samples(self, model, dataset: str, length: int, count: int, queries: int = 1) -> list[Sample]:
        """The first `count` items of `dataset` as prompts of at most `length` tokens; with `queries` > 1, the
        first `count` contexts, each with up to `queries` of the items that share it (in file order)."""
        if dataset.startswith(PREFIX):
            dataset = dataset[len(PREFIX):]
        if dataset not in self.items:
            raise AttnkitError(f"{self.source} has no dataset {dataset!r}; it has {', '.join(self.items)}")
        out = []
        metric, kind, max_new = dataset_info(dataset)
        check_positions(model, PREFIX + dataset, length, max_new)
        for i, query, item in documents(self.items[dataset], count, queries):
            context, question = build_prompt_parts(item, kind)
            ids, asked = split_prompt(model.tokenizer, context, question, length, kind not in NO_CHAT_TEMPLATE)
            meta = {"dataset": dataset, "all_classes": item.get("all_classes"), "stop": None, "metric": metric,
                    "id": item.get("_id", i)}
            out.append(Sample(PREFIX + dataset, ids, tuple(item["answers"]), item["answers"][0], len(ids),
                              None, i, max_new, meta, asked, query=query))
        return out


PREFIX = "longbench:"


def as_longbench_data(data) -> LongBenchData:
    return data if isinstance(data, LongBenchData) else LongBenchData.load(data)


def build_prompt_parts(item: dict, kind: str) -> tuple[str, str]:
    """The prompt's text before the question (the instruction and the item's context) and from it on."""
    head, tail = PROMPTS[kind].split("{context}")
    return head + item["context"], tail.format(input=item["input"])


def build_prompt(item: dict, kind: str) -> str:
    return "".join(build_prompt_parts(item, kind))
