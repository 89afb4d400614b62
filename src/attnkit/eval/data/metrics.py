"""Text metrics shared by the data formats users bring (LongBench, RULER, InfiniteBench): answer normalisation,
token F1 and ROUGE-L, as the benchmarks' own scorers define them (SQuAD's normalisation: Rajpurkar et al. 2016,
"SQuAD: 100,000+ Questions for Machine Comprehension of Text", arXiv 1606.05250); and bits per byte, the score of the
likelihood tasks (``perplexity``, ``continuation``)."""

from __future__ import annotations

import math
import re
import string
import unicodedata
from collections import Counter

from attnkit.errors import AttnkitError


def bits_per_byte(tokenizer, ids, nll_nats: float, what: str) -> float:
    """The negative log-likelihood `nll_nats` of the tokens `ids`, in bits per UTF-8 byte of their text (`what`
    names them in the error raised when they decode to no text)."""
    n_bytes = len(tokenizer.decode(list(ids), skip_special_tokens=True).encode("utf-8"))
    if n_bytes == 0:
        raise AttnkitError(f"{what} decodes to no text")
    return nll_nats / math.log(2) / n_bytes


def normalize_answer(text: str) -> str:
    """Lower case; no ASCII punctuation, no articles (a, an, the), single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _is_punctuation(ch: str) -> bool:
    return ch in string.punctuation or unicodedata.category(ch).startswith("P")


def normalize_zh_answer(text: str) -> str:
    """Lower case; no punctuation (ASCII or CJK), no whitespace."""
    return "".join(ch for ch in text.lower() if not ch.isspace() and not _is_punctuation(ch))


def token_f1(prediction: list[str], reference: list[str]) -> float:
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str) -> float:
    return token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


class _CharTokenizer:
    """rouge-score tokenizer for Chinese: every non-space, non-punctuation character is a token."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return list(normalize_zh_answer(text))


_SCORERS: dict[tuple[str, bool], object] = {}


def rouge_l(prediction: str, reference: str, chinese: bool = False, summary_level: bool = False) -> float:
    """ROUGE-L F1 (rouge-score's RougeScorer; characters as tokens for Chinese). `summary_level`: ROUGE-Lsum,
    the union of longest common subsequences over the reference's and prediction's lines (Lin 2004, "ROUGE: A
    Package for Automatic Evaluation of Summaries", sec. 3.2)."""
    kind = "rougeLsum" if summary_level else "rougeL"
    if (kind, chinese) not in _SCORERS:
        from rouge_score import rouge_scorer

        _SCORERS[kind, chinese] = rouge_scorer.RougeScorer([kind], tokenizer=_CharTokenizer() if chinese else None)
    return float(_SCORERS[kind, chinese].score(reference, prediction)[kind].fmeasure)
