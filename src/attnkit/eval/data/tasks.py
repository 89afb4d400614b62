"""Seeded long-context tasks in the style of RULER and LongBench's lcc.

RULER: "RULER: What's the Real Context Size of Your Long-Context Language Models?", Hsieh et al. 2024,
arXiv 2404.06654. LongBench: "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", Bai et al. 2023, arXiv 2308.14508.

Each task makes a :class:`Sample` (prompt, reference answers) of a requested token length with its
needle at a requested depth, from a seed. Samples for evaluation (`split="eval"`) and for training
(`split="train"`) come from different random streams and from disjoint standard-library files, so an
evaluation sample is never a training sample.

Every sample says which suffix of its prompt is the question (:class:`~attnkit.eval.data.sample.Sample`), and the
retrieval tasks offer follow-up questions about the same context (other keys, another chain, rephrasings) for
the multi-query protocol; the task's own question comes first and its prompt is unchanged by them.

Retrieval tasks (`passkey`, `niah_multikey`, `niah_multivalue`, `kv_retrieval`, `variable_tracking`)
are scored by the fraction of reference strings found in the first line of the prediction (RULER's
string match). `code_completion` is scored by edit similarity of the first predicted line
(LongBench lcc). `perplexity` is not generated: see :mod:`attnkit.eval.data.items`.
"""

from __future__ import annotations

import functools
import random
import string

from attnkit.eval.data import corpus
from attnkit.eval.data.sample import Followup, Sample, Task

__all__ = ["Sample", "Task", "Followup", "TASKS", "NEEDLE_TASKS", "string_match_score", "code_score",
           "edit_similarity", "first_line", "first_code_line"]

SPLITS = ("eval", "train")

_WORDS = (
    "amber apple arrow aspen badge basil beacon birch bison bloom brass breeze cabin canal candle canyon "
    "cedar chalk cherry cliff clover cobalt comet coral crane crystal dagger daisy delta desert dune eagle "
    "ember falcon fern fjord flint forest fox frost galaxy garnet geyser ginger glacier granite gull harbor "
    "hazel heron hollow ivory jade jasper juniper kettle lagoon lantern lemon lilac linen lotus lynx maple "
    "marble meadow mesa mint moss nectar nickel oak ocean olive onyx opal orchid otter panther pearl pebble "
    "pepper pine planet plum prairie quartz raven reef river robin ruby saffron sage salmon sapphire shadow "
    "silver slate sparrow spruce storm summit thistle thunder tiger topaz tulip tundra velvet violet walnut "
    "willow winter wolf zephyr"
).split()


def first_line(prediction: str) -> str:
    text = prediction.lstrip("\n")
    return text.split("\n", 1)[0]


def string_match_score(prediction: str, sample: Sample) -> float:
    """Fraction of reference strings present in the first predicted line (RULER string_match_all)."""
    line = first_line(prediction)
    return sum(ans in line for ans in sample.answers) / len(sample.answers)


def edit_similarity(a: str, b: str) -> float:
    """1 - indel distance / total length, i.e. 2*LCS/(|a|+|b|) (the ratio LongBench lcc reports)."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ch in a:
        cur = [0]
        for j, other in enumerate(b):
            cur.append(prev[j] + 1 if ch == other else max(prev[j + 1], cur[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


def first_code_line(prediction: str, markers: tuple[str, ...] = ("#", "`")) -> str | None:
    """The first predicted line holding none of `markers` (comments, markdown fences), or None."""
    for line in prediction.lstrip("\n").split("\n"):
        if not any(m in line for m in markers):
            return line
    return None


def code_score(prediction: str, sample: Sample) -> float:
    """LongBench lcc: edit similarity of the first non-comment predicted line to the reference line."""
    line = first_code_line(prediction)
    return 0.0 if line is None else edit_similarity(line, sample.answers[0])


# --------------------------------------------------------------------------------------------------
# building prompts in token space


def _rng(task: str, split: str, length: int, depth: float, seed: int) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(f"{split}|{task}|{length}|{depth:.6f}|{seed}")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _haystack_ids(tokenizer, split: str) -> list[int]:
    # kept on disk (corpus.encoded): encoding the training haystack takes tens of seconds on a CPU, in every process
    return list(corpus.encoded(tokenizer, corpus.haystack_text("heldout" if split == "eval" else "train")))


def _filler(tokenizer, split: str, n: int, rng: random.Random) -> list[int]:
    hay = _haystack_ids(tokenizer, split)
    if n > len(hay):
        return (hay * (n // len(hay) + 1))[:n]
    start = rng.randrange(0, len(hay) - n + 1)
    return hay[start : start + n]


def _pad_to(tokenizer, head: str, tail: str, length: int) -> str:
    """Whitespace between `head` and `tail` that brings the prompt (BOS included) as close to `length` tokens as
    the tokenizer allows without passing it: spaces first (one token each for a byte tokenizer), then, for a
    subword tokenizer that merges runs of spaces, space-newline units added one at a time."""
    def count(pad: str) -> int:
        return 1 + len(_encode(tokenizer, head + pad + tail))

    pad = " " * max(0, length - count(""))
    if count(pad) == length:
        return pad
    pad = ""
    while True:
        longer = next((pad + unit for unit in (" \n", "\n", " ") if count(pad + unit) <= length), None)
        if longer is None or count(longer) == count(pad):
            return pad
        pad = longer


def _assemble(tokenizer, split, length, rng, prefix: str, needles: list[tuple[float, str]], suffix: str,
              task: str) -> str:
    """Fill `length` tokens (BOS included) with prefix, code filler holding needles at depths, suffix."""
    prefix_ids, suffix_ids = _encode(tokenizer, prefix), _encode(tokenizer, suffix)
    needle_ids = [(d, _encode(tokenizer, text)) for d, text in needles]
    fixed = 1 + len(prefix_ids) + len(suffix_ids) + sum(len(ids) for _, ids in needle_ids)
    n_fill = length - fixed
    if n_fill < 0:
        raise ValueError(f"{task}: length {length} is too short; this task needs at least {fixed} tokens")
    filler = _filler(tokenizer, split, n_fill, rng)
    newline = _encode(tokenizer, "\n")
    # insert from the deepest needle backwards so earlier offsets stay valid; snap to a line start
    pieces = list(filler)
    for depth, ids in sorted(needle_ids, key=lambda x: -x[0]):
        at = int(round(depth * len(filler)))
        if len(newline) == 1:
            window = filler[at : at + 120]
            if newline[0] in window:
                at += window.index(newline[0]) + 1
        pieces[at:at] = ids
    return tokenizer.decode(prefix_ids + pieces + suffix_ids)


def _needle_sample(task: str, tokenizer, split: str, length: int, depth: float, seed: int, rng: random.Random, *,
                   prefix: str, needles: list[tuple[float, str]], suffix: str, answers: tuple[str, ...], target: str,
                   max_new_tokens: int, meta: dict | None = None, followups: tuple[Followup, ...] = ()) -> Sample:
    """A needle task's sample: the prompt :func:`_assemble` builds, with its answers and target; the `suffix`
    is its question."""
    prompt = _assemble(tokenizer, split, length, rng, prefix, needles, suffix, task)
    return Sample(task, prompt, answers, target, length, depth, seed, max_new_tokens, meta or {}, suffix, followups)


def _asks(question: str, value: str, meta: dict | None = None) -> Followup:
    """A follow-up whose answer is `value`, written as the tasks' targets are (" value.")."""
    return Followup(question, (value,), f" {value}.\n", meta or {})


# RULER's wordings, shared with the training drills that rehearse these tasks (training/data_v2.py)
MAGIC_INTRO = "Special magic numbers are hidden in the text below. Memorize them."
MAGIC_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIVALUE_QUESTION = "\nWhat are all the special magic numbers for {key}? The special magic numbers for {key} are:"
VT_INTRO = "Variables are assigned in the text below. Track them."
VT_FIRST, VT_HOP = "{value} is assigned to VAR {var}.", "VAR {src} is assigned to VAR {dst}."
VT_QUESTION = "\nQuestion: which variables are assigned the value {value}? Answer: they are VAR"


def _number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"


def _hex(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


# --------------------------------------------------------------------------------------------------
# the tasks


def make_passkey(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval") -> Sample:
    rng = _rng("passkey", split, length, depth, seed)
    key = _number(rng)
    return _needle_sample(
        "passkey", tokenizer, split, length, depth, seed, rng,
        prefix="A pass key is hidden in the text below. Find it and remember it.\n",
        needles=[(depth, f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")],
        suffix="\nWhat is the pass key? The pass key is",
        answers=(key,), target=f" {key}.\n", max_new_tokens=8,
        followups=(_asks("\nWhich number was the pass key? The pass key is", key),
                   _asks("\nRepeat the pass key. The pass key is", key)),
    )


def make_niah_multikey(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval",
                       n_keys: int = 4) -> Sample:
    rng = _rng("niah_multikey", split, length, depth, seed)
    keys: list[str] = []
    while len(keys) < n_keys:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = [_number(rng, 6) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = [(d, "\n" + MAGIC_NEEDLE.format(key=k, value=v) + "\n") for d, k, v in zip(depths, keys, values)]
    target_key, target_value = keys[0], values[0]
    return _needle_sample(
        "niah_multikey", tokenizer, split, length, depth, seed, rng,
        prefix=MAGIC_INTRO + "\n",
        needles=needles,
        suffix=_multikey_question(target_key),
        answers=(target_value,), target=f" {target_value}.\n", max_new_tokens=10, meta={"key": target_key},
        followups=tuple(_asks(_multikey_question(k), v, {"key": k}) for k, v in zip(keys[1:], values[1:])),
    )


def _multikey_question(key: str) -> str:
    return f"\nWhat is the special magic number for {key}? The special magic number for {key} is:"


def make_niah_multivalue(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval",
                         n_values: int = 4) -> Sample:
    rng = _rng("niah_multivalue", split, length, depth, seed)
    key = _key(rng)
    values: list[str] = []
    while len(values) < n_values:
        v = _number(rng, 6)
        if v not in values:
            values.append(v)
    # the first value sits at the requested depth, the others spread over the rest of the text
    depths = sorted([depth] + [rng.random() for _ in range(n_values - 1)])
    needles = [(d, "\n" + MAGIC_NEEDLE.format(key=key, value=v) + "\n") for d, v in zip(depths, values)]
    return _needle_sample(
        "niah_multivalue", tokenizer, split, length, depth, seed, rng,
        prefix=MAGIC_INTRO + "\n",
        needles=needles,
        suffix=MULTIVALUE_QUESTION.format(key=key),
        answers=tuple(values), target=" " + ", ".join(values) + ".\n", max_new_tokens=36, meta={"key": key},
        followups=(Followup(f"\nList every special magic number for {key}. The special magic numbers for {key} are:",
                            tuple(values), " " + ", ".join(values) + ".\n"),),
    )


def make_kv_retrieval(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval") -> Sample:
    """Key-value retrieval over a JSON object of random UUID-like hex keys (Liu et al., 2023)."""
    rng = _rng("kv_retrieval", split, length, depth, seed)

    def uuid_like() -> str:
        return f"{_hex(rng, 4)}-{_hex(rng, 4)}"

    prefix = "Extract the value for the given key from the JSON object below.\n{\n"
    line_len = len(_encode(tokenizer, f'"{uuid_like()}": "{uuid_like()}",\n'))
    probe_key = uuid_like()
    suffix_template = '}}\nKey: "{k}"\nThe value associated with the key is: "'
    fixed = 1 + len(_encode(tokenizer, prefix)) + len(_encode(tokenizer, suffix_template.format(k=probe_key)))
    if length - fixed < 2 * line_len:
        raise ValueError(f"kv_retrieval: length {length} is too short; it needs at least {fixed + 2 * line_len} tokens")
    # pairs are added while their lines' measured tokens fit (a subword tokenizer gives lines different lengths)
    keys: set[str] = set()
    pairs, lines, used = [], [], fixed
    while True:
        k = uuid_like()
        if k in keys:
            continue
        v = uuid_like()
        line = f'"{k}": "{v}",\n'
        n = len(_encode(tokenizer, line))
        if used + n > length:
            break
        keys.add(k)
        pairs.append((k, v))
        lines.append(line)
        used += n
    n_pairs = len(pairs)
    target = min(n_pairs - 1, int(depth * n_pairs))
    key, value = pairs[target]
    head = prefix + "".join(lines)
    suffix = suffix_template.format(k=key)
    prompt = head + _pad_to(tokenizer, head, suffix, length) + suffix
    # the question starts after the object's closing brace; follow-ups ask the pairs a quarter of the way apart
    others = dict(pairs[(target + j * n_pairs // 4) % n_pairs] for j in (1, 2, 3))
    followups = tuple(Followup(suffix_template.format(k=k)[1:], (v,), f'{v}"\n', {"key": k})
                      for k, v in others.items() if k != key)
    return Sample("kv_retrieval", prompt, (value,), f'{value}"\n', length, depth, seed, 12, {"key": key}, suffix[1:],
                  followups)


def make_variable_tracking(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval",
                           n_vars: int = 4, n_chains: int = 2) -> Sample:
    """Variable tracking (RULER): follow a chain of assignments from a value to every variable that holds it."""
    rng = _rng("variable_tracking", split, length, depth, seed)
    names: set[str] = set()

    def name() -> str:
        while True:
            n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if n not in names:
                names.add(n)
                return n

    chains = []
    values: set[str] = set()
    for _ in range(n_chains):
        v = _number(rng)
        while v in values:
            v = _number(rng)
        values.add(v)
        chains.append((v, [name() for _ in range(n_vars)]))
    needles = []
    for c, (value, chain) in enumerate(chains):
        # the queried chain (c == 0) starts at the requested depth, hops follow in order
        start = depth if c == 0 else rng.random() * 0.5
        hop_depths = sorted([start] + [start + (1 - start) * rng.random() for _ in chain[1:]])
        statements = ["\n" + VT_FIRST.format(value=value, var=chain[0]) + "\n"]
        statements += ["\n" + VT_HOP.format(src=a, dst=b) + "\n" for a, b in zip(chain, chain[1:])]
        needles += list(zip(hop_depths, statements))
    value, chain = chains[0]

    def question(value: str) -> str:
        return VT_QUESTION.format(value=value)

    return _needle_sample(
        "variable_tracking", tokenizer, split, length, depth, seed, rng,
        prefix=VT_INTRO + "\n",
        needles=needles,
        suffix=question(value),
        answers=tuple(chain), target=" " + ", VAR ".join(chain) + ".\n", max_new_tokens=40,
        followups=tuple(Followup(question(v), tuple(c), " " + ", VAR ".join(c) + ".\n") for v, c in chains[1:]),
    )


def make_code_completion(tokenizer, length: int, depth: float = 1.0, seed: int = 0, split: str = "eval") -> Sample:
    """Next line of a standard-library file given the `length` tokens before it (LongBench lcc).

    `depth` is unused (the reference line is always at the end); it is kept for a uniform signature.
    """
    rng = _rng("code_completion", split, length, depth, seed)
    files = corpus.stdlib_files("heldout" if split == "eval" else "train")
    for _ in range(1000):
        lines = corpus.read_text(rng.choice(files)).split("\n")
        # reference lines without '#' or '`': the lcc scorer skips predicted lines holding either
        candidates = [i for i in range(1, len(lines)) if len(lines[i].strip()) >= 12
                      and "#" not in lines[i] and "`" not in lines[i]]
        if not candidates:
            continue
        i = rng.choice(candidates)
        context_ids = _encode(tokenizer, "\n".join(lines[:i]) + "\n")
        if len(context_ids) < length - 1:
            continue
        prompt = tokenizer.decode(context_ids[-(length - 1):])
        answer = lines[i]
        # nothing is asked after the code: the whole prompt is context (LongBench's lcc has no question either).
        # No stop string: as in lcc, blank and comment lines before the first code line are skipped by the scorer,
        # so generation must not end at the first newline.
        return Sample("code_completion", prompt, (answer,), answer + "\n", length, depth, seed,
                      min(128, len(_encode(tokenizer, answer)) + 16), {"stop": None}, question="")
    raise ValueError(f"code_completion: no held-out file has {length} tokens of context")


TASKS: dict[str, Task] = {
    "passkey": Task("passkey", make_passkey, string_match_score, "5-digit pass key hidden in code"),
    "niah_multikey": Task("niah_multikey", make_niah_multikey, string_match_score,
                          "one of 4 keyed magic numbers (RULER niah_multikey)"),
    "niah_multivalue": Task("niah_multivalue", make_niah_multivalue, string_match_score,
                            "all 4 magic numbers of one key (RULER niah_multivalue)"),
    "kv_retrieval": Task("kv_retrieval", make_kv_retrieval, string_match_score,
                         "value of a UUID-like key in a JSON object"),
    "variable_tracking": Task("variable_tracking", make_variable_tracking, string_match_score,
                              "every variable a chain of assignments reaches (RULER vt)"),
    "code_completion": Task("code_completion", make_code_completion, code_score,
                            "next line of held-out stdlib code, edit similarity (LongBench lcc)"),
}

# tasks whose answer sits at the sample's depth in the prompt (per-depth scores, the needle heatmap)
NEEDLE_TASKS = ("passkey", "niah_multikey", "niah_multivalue", "kv_retrieval", "variable_tracking")
