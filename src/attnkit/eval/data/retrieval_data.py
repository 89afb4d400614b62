"""Compositional in-context retrieval samples, built in token space (the data of model v2, issue #29).

Every generator takes (tokenizer, length, rng, split, depth) and returns an :class:`Example`: token ids
(no BOS) of exactly `length` tokens, which of them are answer tokens (where a trainer puts the loss),
the reference answers of the first query and what was used (templates, filler kind). Phrasings and
filler come from :mod:`attnkit.eval.data.retrieval_templates` for the split, so `split="eval"` samples use
only held-out phrasings in held-out filler, and training samples never contain either.

Tasks: needles (one key, several keys of which one is asked: RULER niah_multikey; one key with several
values: niah_multivalue), key-value listings in varied formats with one or many queries (Liu et al. 2023,
"Lost in the Middle", arXiv 2307.03172), multi-query associative recall (Zoology MQAR, Arora et al. 2023,
arXiv 2312.04927), variable chains (RULER variable tracking, Hsieh et al. 2024, arXiv 2404.06654) and
induction copying of repeated spans of ordinary text (Olsson et al. 2022, "In-context Learning and
Induction Heads"). :data:`EVAL_TASKS` wraps the question-answer ones as `attnkit eval` tasks.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from attnkit.eval.data import corpus
from attnkit.eval.data import retrieval_templates as T
from attnkit.eval.data.tasks import Sample, Task, string_match_score

FILLER_KINDS = {"train": ("code", "docs", "grammar"), "eval": ("code", "docs")}
_TOPICS_FILE = "pydoc_data/topics.py"  # the doc prose: never part of the training code filler


@dataclass(frozen=True)
class Example:
    task: str
    ids: tuple[int, ...]
    answer: tuple[bool, ...]  # per id: part of an answer (loss here)
    answers: tuple[str, ...]  # reference strings of the first query
    prompt_len: int  # ids before the first answer token
    meta: dict = field(default_factory=dict)
    question_at: int | None = None  # where the first question starts (its ids up to prompt_len ask it)


_NOUNS = "river lantern farmer engine garden letter window teacher market valley signal harbor".split()
_ADJ = "quiet old narrow bright careful distant heavy patient small early wooden silent".split()
_VERBS = "crossed painted carried watched repaired followed opened measured described visited".split()
_PLACES = "the hill|the station|the old mill|the north road|the square|the library|the coast|the bridge".split("|")


def grammar_prose(rng: random.Random, n_sentences: int) -> str:
    """English-like sentences from a small generated grammar (a training-only filler kind)."""
    out = []
    for _ in range(n_sentences):
        s = (f"The {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
             f"{rng.choice(_NOUNS)} near {rng.choice(_PLACES)}")
        if rng.random() < 0.3:
            s += f" while the {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {rng.choice(_PLACES)}"
        out.append(s + ".")
        if rng.random() < 0.15:
            out.append("\n\n")
    return " ".join(out)


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=16)
def filler_ids(tok, kind: str, split: str) -> tuple[int, ...]:
    """The token ids of one filler source ("code" or "docs") of `split`; cached per tokenizer."""
    if kind == "code":
        if split == "eval":
            return corpus.encoded(tok, corpus.haystack_text("heldout"))
        root = corpus.stdlib_root()
        files = [p for p in corpus.stdlib_files("train") if p.relative_to(root).as_posix() != _TOPICS_FILE]
        return corpus.encoded(tok, "\n".join(corpus.read_text(p) for p in files))
    if kind == "docs":
        return corpus.encoded(tok, T.doc_prose(split))
    raise ValueError(f"unknown filler kind {kind!r}; available: code, docs, grammar")


@functools.lru_cache(maxsize=16)
def newline_ids(tok) -> frozenset[int]:
    """Ids of tokens whose text ends a line (where a needle may be inserted)."""
    return frozenset(i for i in range(len(tok)) if tok.decode([i]).endswith("\n"))


def filler(tok, kind: str, split: str, n: int, rng: random.Random) -> list[int]:
    if n <= 0:
        return []
    if kind == "grammar":
        if split != "train":
            raise ValueError("the grammar filler is a training-only kind")
        ids: list[int] = []
        while len(ids) < n:
            ids += _enc(tok, grammar_prose(rng, 40) + "\n")
        start = rng.randrange(0, len(ids) - n + 1)
        return ids[start : start + n]
    hay = filler_ids(tok, kind, split)
    if n > len(hay):
        return list((hay * (n // len(hay) + 1))[:n])
    start = rng.randrange(0, len(hay) - n + 1)
    return list(hay[start : start + n])


class _Builder:
    """Accumulates (ids, is_answer) pieces."""

    def __init__(self, tok):
        self.tok, self.ids, self.answer = tok, [], []
        self.question_at = None

    def ask(self, piece) -> None:
        """Add a question (the first one marks where the first question starts)."""
        if self.question_at is None:
            self.question_at = len(self.ids)
        self.add(piece)

    def add(self, piece, is_answer: bool = False) -> None:
        ids = _enc(self.tok, piece) if isinstance(piece, str) else list(piece)
        self.ids += ids
        self.answer += [is_answer] * len(ids)

    def example(self, task: str, length: int, answers, meta) -> Example:
        if len(self.ids) != length:
            raise ValueError(f"{task}: built {len(self.ids)} tokens, not the {length} asked")
        first = self.answer.index(True) if True in self.answer else length
        return Example(task, tuple(self.ids), tuple(self.answer), tuple(answers), first, meta, self.question_at)


@functools.lru_cache(maxsize=16)
def _space_id(tok) -> int:
    ids = _enc(tok, " ")
    if len(ids) != 1:
        raise ValueError("the tokenizer must encode a single space as one token")
    return ids[0]


def _too_short(task: str, length: int, need: int) -> ValueError:
    return ValueError(f"{task}: length {length} is too short; this sample needs at least {need} tokens")


def _with_needles(tok, split, rng, n_fill, kind, needles: list[tuple[float, list[int]]]) -> list[int]:
    """Filler of n_fill tokens with the needle ids inserted at their depths, each at a line start."""
    body = filler(tok, kind, split, n_fill, rng)
    ends = newline_ids(tok)
    for depth, ids in sorted(needles, key=lambda x: -x[0]):  # deepest first keeps earlier offsets valid
        at = int(round(depth * n_fill))
        for j in range(at, min(at + 200, n_fill)):
            if j == 0 or body[j - 1] in ends:
                at = j
                break
        body[at:at] = ids
    return body


def _pick_filler(rng, split) -> str:
    return rng.choice(FILLER_KINDS[split])


def make_needle(tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None,
                n_keys: int = 1, n_values: int = 1, wild: bool = False) -> Example:
    """Facts phrased with the split's needle templates, hidden in filler; a question about the first key.

    n_keys > 1: other keys are distractors (niah_multikey); n_values > 1: the asked key has several
    values, all wanted, in order of appearance (niah_multivalue). `wild` (training only): the facts and the
    question are phrased with random words (:func:`~attnkit.eval.data.retrieval_templates.wild_needle`), so only
    the key links the question to its fact."""
    task = "needle" if n_keys == 1 and n_values == 1 else "needle_multivalue" if n_values > 1 else "needle_multikey"
    if wild:
        if split != "train":
            raise ValueError("wild phrasings are training-only")
        task = "needle_wild"
    depth = rng.random() if depth is None else depth
    key_kind = rng.choice(("name", "words", "uuid", "item", "code"))
    value_kind = rng.choice(("digits", "digits", "word", "hex"))
    keys = T.distinct(lambda r: T.make_key(r, key_kind), n_keys, rng)
    values = T.distinct(lambda r: T.make_value(r, value_kind), n_values + n_keys - 1, rng)
    needles_pool = T.pool(T.NEEDLES, split) if not wild else [T.wild_needle(rng) for _ in range(n_keys + n_values)]
    one_template = rng.choice(needles_pool) if rng.random() < 0.5 else None
    facts = [(keys[0], v) for v in values[:n_values]] + list(zip(keys[1:], values[n_values:]))
    depths = sorted([depth] + [rng.random() for _ in range(n_values - 1)]) + [rng.random() for _ in keys[1:]]
    templates = [one_template or rng.choice(needles_pool) for _ in facts]
    needles = [(d, _enc(tok, t.format(key=k, value=v) + "\n")) for d, t, (k, v) in zip(depths, templates, facts)]
    intro = rng.choice(T.pool(T.INTROS, split))
    qpool = T.pool(T.MULTI_QUESTIONS if n_values > 1 else T.QUESTIONS, split) if not wild else [T.wild_question(rng)]
    question = rng.choice(qpool).format(key=keys[0])
    wanted = values[:n_values]
    answer = " " + ", ".join(wanted) + "\n"
    head, tail, ans = _enc(tok, intro + "\n"), _enc(tok, "\n" + question), _enc(tok, answer)
    fixed = len(head) + len(tail) + len(ans) + sum(len(ids) for _, ids in needles)
    if fixed > length:
        raise _too_short(task, length, fixed)
    kind = _pick_filler(rng, split)
    b = _Builder(tok)
    b.add(head)
    b.add(_with_needles(tok, split, rng, length - fixed, kind, needles))
    b.ask(tail)
    b.add(ans, True)
    meta = {"templates": sorted(set(templates)), "question": question, "intro": intro, "filler": kind,
            "key": keys[0], "depth": depth, "slots": {"key": keys, "value": values}}
    return b.example(task, length, wanted, meta)


def make_kv_listing(tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None,
                    n_queries: int = 1) -> Example:
    """A listing of key-value lines in one of several formats, then n_queries questions, each answered.
    The first query asks the pair at `depth`; with many queries this is multi-query recall."""
    fmt = rng.choice(T.KV_FORMATS)
    key_kind = rng.choice(("words", "uuid", "item", "code", "name"))
    value_kind = rng.choice(("digits", "word", "hex"))
    intro = _enc(tok, rng.choice(T.pool(T.INTROS, split)) + "\n")
    qpool = T.pool(T.QUESTIONS, split)
    state, reserve = rng.getstate(), len(intro) + n_queries * 24
    for _ in range(8):  # the questions' length is known only once the pairs are drawn: grow the reserve
        rng.setstate(state)
        lines, pairs, used, keys = [], [], 0, set()
        while True:
            k, v = T.make_key(rng, key_kind), T.make_value(rng, value_kind)
            if k in keys:
                continue
            ids = _enc(tok, fmt.format(key=k, value=v) + "\n")
            if reserve + used + len(ids) > length:
                break
            keys.add(k)
            lines.append(ids)
            pairs.append((k, v))
            used += len(ids)
        if len(pairs) < max(2, n_queries):
            raise _too_short("kv_listing", length, reserve + 2 * len(ids))
        where = rng.random() if depth is None else depth
        asked = [min(len(pairs) - 1, int(where * len(pairs)))]
        asked += rng.sample([i for i in range(len(pairs)) if i != asked[0]], n_queries - 1)
        tail = [(_enc(tok, "\n" + rng.choice(qpool).format(key=pairs[i][0])), _enc(tok, f" {pairs[i][1]}\n"))
                for i in asked]
        pad = length - len(intro) - used - sum(len(q) + len(a) for q, a in tail)
        if pad >= 0:
            break
        reserve += 16 - pad  # with a margin: fewer pairs may change which key is asked
    else:
        raise _too_short("kv_listing", length, length - pad)
    b = _Builder(tok)
    b.add(intro)
    for ids in lines:
        b.add(ids)
    b.add([_space_id(tok)] * pad)  # whitespace after the last line keeps the length exact
    for q, a in tail:
        b.ask(q)
        b.add(a, True)
    meta = {"format": fmt, "n_pairs": len(pairs), "depth": where, "slots": {"key": [pairs[i][0] for i in asked]}}
    return b.example("kv_listing", length, (pairs[asked[0]][1],), meta)


def make_assoc_recall(tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None,
                      n_pairs: int | None = None) -> Example:
    """Multi-query associative recall: "k1 v1 k2 v2 ..." then the keys again, each followed by its value
    (every value after the first query is an answer). Short keys keep it cheap to learn first."""
    n_pairs = n_pairs or rng.randint(4, 24)
    keys = T.distinct(lambda r: r.choice(T.WORDS), n_pairs, rng)
    values = [T.make_value(rng, "digits")[:rng.randint(1, 3)] for _ in keys]
    b = _Builder(tok)
    b.add(" ".join(f"{k} {v}" for k, v in zip(keys, values)) + "\n")
    queries = list(range(n_pairs))
    rng.shuffle(queries)
    if depth is not None:
        queries.remove(min(n_pairs - 1, int(depth * n_pairs)))
        queries.insert(0, min(n_pairs - 1, int(depth * n_pairs)))
    for i in queries:
        q, a = _enc(tok, f" {keys[i]}"), _enc(tok, f" {values[i]}")
        if len(b.ids) + len(q) + len(a) > length:
            break
        b.ask(q)
        b.add(a, True)
    if True not in b.answer:
        raise _too_short("assoc_recall", length, len(b.ids) + 8)
    b.add(_enc(tok, "\n"))
    b.add(filler(tok, _pick_filler(rng, split), split, length - len(b.ids), rng))
    b.ids, b.answer = b.ids[:length], b.answer[:length]
    return b.example("assoc_recall", length, (values[queries[0]],), {"n_pairs": n_pairs})


def make_variable_chain(tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None,
                        n_chains: int = 2, n_hops: int | None = None) -> Example:
    """Chains of assignments (value -> A -> B -> ...) hidden in filler; asks the value of one chain's last
    variable. The queried chain starts at `depth`; its hops follow in order."""
    n_hops = n_hops or rng.randint(1, 4)
    depth = rng.random() if depth is None else depth
    names = T.distinct(T.variable_name, n_chains * n_hops, rng)
    values = T.distinct(lambda r: T.make_value(r, "digits"), n_chains, rng)
    apool = T.pool(T.ASSIGNMENTS, split)
    template = rng.choice(apool)
    needles, used = [], [template]
    for c in range(n_chains):
        chain = names[c * n_hops : (c + 1) * n_hops]
        start = depth if c == 0 else rng.random() * 0.5
        hop_depths = sorted([start] + [start + (1 - start) * rng.random() for _ in chain[1:]])
        srcs = [values[c]] + chain[:-1]
        for d, src, dst in zip(hop_depths, srcs, chain):
            t = template if rng.random() < 0.7 else rng.choice(apool)
            used.append(t)
            needles.append((d, _enc(tok, t.format(src=src, dst=dst) + "\n")))
    question = rng.choice(T.pool(T.CHAIN_QUESTIONS, split)).format(var=names[n_hops - 1])
    head = _enc(tok, rng.choice(T.pool(T.INTROS, split)) + "\n")
    tail, ans = _enc(tok, "\n" + question), _enc(tok, f" {values[0]}\n")
    fixed = len(head) + len(tail) + len(ans) + sum(len(ids) for _, ids in needles)
    if fixed > length:
        raise _too_short("variable_chain", length, fixed)
    kind = _pick_filler(rng, split)
    b = _Builder(tok)
    b.add(head)
    b.add(_with_needles(tok, split, rng, length - fixed, kind, needles))
    b.ask(tail)
    b.add(ans, True)
    meta = {"templates": sorted(set(used)), "question": question, "filler": kind, "hops": n_hops, "depth": depth,
            "slots": {"var": names, "dst": names, "src": names + values}}
    return b.example("variable_chain", length, (values[0],), meta)


def make_induction(tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None) -> Example:
    """Ordinary text in which earlier spans recur verbatim; the recurring tokens (all but the first of
    each copy, which nothing predicts) are the answers: plain copying by an induction head."""
    kind = _pick_filler(rng, split)
    b = _Builder(tok)
    while len(b.ids) < length:
        b.add(filler(tok, kind, split, rng.randint(8, 120), rng))
        if len(b.ids) > 24 and rng.random() < 0.6:
            m = rng.randint(6, min(64, len(b.ids) // 2))
            start = rng.randrange(0, len(b.ids) - m)
            span = b.ids[start : start + m]
            b.add(span[:1])
            b.add(span[1:], True)
    b.ids, b.answer = b.ids[:length], b.answer[:length]
    return b.example("induction", length, (), {"filler": kind})


GENERATORS = {
    "needle": make_needle,
    "needle_multikey": functools.partial(make_needle, n_keys=4),
    "needle_multivalue": functools.partial(make_needle, n_values=4),
    "needle_wild": functools.partial(make_needle, n_keys=3, wild=True),
    "kv_listing": make_kv_listing,
    "kv_multiquery": functools.partial(make_kv_listing, n_queries=4),
    "assoc_recall": make_assoc_recall,
    "variable_chain": make_variable_chain,
    "induction": make_induction,
}


def example(task: str, tok, length: int, rng: random.Random, split: str = "train", depth: float | None = None):
    try:
        gen = GENERATORS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; available: {', '.join(GENERATORS)}") from None
    return gen(tok, length, rng, split, depth)


# --------------------------------------------------------------------------------------------------
# evaluation tasks: prompt = the text before the first answer, one query per sample (the question: from where
# the first query starts)


def _eval_maker(task: str, max_new_tokens: int):
    def make(tokenizer, length: int, depth: float = 0.5, seed: int = 0, split: str = "eval") -> Sample:
        """`length` counts the prompt with its BOS, as for attnkit.eval.data.tasks."""
        seed_text = f"{split}|v2-{task}|{length}|{depth:.6f}|{seed}"
        extra = 8  # the answer's length is not known before building: adjust until the prompt fits exactly
        for _ in range(6):
            ex = example(task, tokenizer, length - 1 + extra, random.Random(seed_text), split, depth)
            if ex.prompt_len == length - 1:
                break
            extra += length - 1 - ex.prompt_len
        prompt = tokenizer.decode(list(ex.ids[: ex.prompt_len]))
        n_target = next((i for i in range(ex.prompt_len, len(ex.ids)) if not ex.answer[i]), len(ex.ids))
        target = tokenizer.decode(list(ex.ids[ex.prompt_len : n_target]))
        question = None  # the text of the question's ids, when the prompt's text ends with it
        if ex.question_at is not None:
            question = tokenizer.decode(list(ex.ids[ex.question_at : ex.prompt_len]))
            question = question if question and prompt.endswith(question) else None
        return Sample(f"v2_{task}", prompt, ex.answers, target, length, depth, seed, max_new_tokens, ex.meta,
                      question)

    return make


EVAL_TASKS: dict[str, Task] = {
    "needle_heldout": Task("needle_heldout", _eval_maker("needle", 16), string_match_score,
                           "a fact phrased with held-out templates in held-out prose or code"),
    "needle_multikey_heldout": Task("needle_multikey_heldout", _eval_maker("needle_multikey", 16), string_match_score,
                                    "one of 4 keyed facts, held-out phrasings and filler"),
    "needle_multivalue_heldout": Task("needle_multivalue_heldout", _eval_maker("needle_multivalue", 48),
                                      string_match_score, "all 4 values of one key, held-out phrasings and filler"),
    "variable_chain_heldout": Task("variable_chain_heldout", _eval_maker("variable_chain", 16), string_match_score,
                                   "the value at the end of a chain of assignments, held-out phrasings"),
    "kv_listing_heldout": Task("kv_listing_heldout", _eval_maker("kv_listing", 16), string_match_score,
                               "one value from a key-value listing, held-out question phrasings"),
}
