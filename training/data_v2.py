"""Training rows of model v2: the mixing of attnkit.eval.data.retrieval_data's generators, the acceptance tasks
of attnkit.eval.data.tasks (training split), plain language-model windows and a copy warm-up.

A batch is a pure function of (config seed, step, phase), so a resumed run sees exactly the batches an
uninterrupted one would. Every row is (ids, weights, answer): seq_len + 1 ids starting with <s>, a loss
weight per target and which targets are answers (where the per-kind answer loss is measured).
"""

from __future__ import annotations

import random

import torch

from attnkit.eval.data import retrieval_data as R
from attnkit.eval.data import retrieval_templates as T
from attnkit.eval.data import tasks

BOS, PAD = 0, 2
_FIRST_PLAIN_ID = 16  # ids below are the special tokens (0-2) and single punctuation characters

# tasks.py draws training filler from every training standard-library file, the documentation topics
# file included, whose held-out topics are evaluation prose here: a window of that file has many lines
# ending in a backslash-n and a quote. Such samples are redrawn, so no held-out prose reaches training.
_TOPICS_MARK = "\\n'\n"
_NEXT_BOOST = 3.0  # mv_list: the loss weight of a listed value's first token, relative to the other answer tokens
_TASK_RESERVE = {"niah_multivalue": 34, "variable_tracking": 40}


def _appender(ids: list[int], answer: list[bool]):
    """add(piece, is_answer): extends a row's ids and its answer flags together."""
    def add(piece: list[int], is_answer: bool) -> None:
        ids.extend(piece)
        answer.extend([is_answer] * len(piece))
    return add


class Rows:
    def __init__(self, tokenizer, config: dict):
        self.tok = tokenizer
        self.seed = config["seed"]
        self.answer_weight = config["answer_weight"]
        self.mixes = config.get("mixes", {})
        # the loss weight of each answer's first letter or digit, relative to the answer's other tokens: the token
        # that says which value was found (the rest of a value copies it); mv_list rows weigh theirs themselves
        self.value_boost = config.get("value_boost", 1.0)

    def mix(self, phase: dict) -> dict:
        return self.mixes[phase["mix"]] if isinstance(phase["mix"], str) else phase["mix"]

    def batch(self, phase: dict, step: int):
        rng = random.Random(f"v2|{self.seed}|{phase['name']}|{step}")
        mix = self.mix(phase)
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=phase["batch"])
        rows = [self.row(k, phase["seq_len"], phase["prompt_weight"], rng) for k in kinds]
        kinds = [r[3] for r in rows]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        weights = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        answer = torch.tensor([r[2] for r in rows], dtype=torch.bool)
        return ids, weights, answer, kinds

    def row(self, kind: str, seq_len: int, prompt_weight: float, rng: random.Random):
        """(ids, weights, answer, kind drawn): a row of `kind`, or a plain code window where that kind does not
        fit `seq_len` in 20 draws (then labelled "code", so its loss is not counted as the kind's)."""
        for _ in range(20):
            try:
                row = self._row(kind, seq_len, prompt_weight, rng)
            except ValueError:  # too short for this draw (or a rejected filler window): draw again
                continue
            if self.value_boost != 1.0 and kind not in ("code", "docs", "copy") and not kind.startswith("mv_list"):
                self._boost_first_tokens(*row)
            return (*row, kind)
        return (*self._row("code", seq_len, prompt_weight, rng), "code")

    def _alnum(self, token: int) -> bool:
        """Whether a token holds a letter or digit: the first such token of a value says which value it is."""
        return any(c.isalnum() for c in self.tok.decode([token]))

    def _boost_first_tokens(self, ids: list[int], weights: list[float], answer: list[bool]) -> None:
        """Multiplies, in place, the weight of the first target holding a letter or digit in every answer span
        (answer[i] flags target ids[i + 1]) by value_boost."""
        pending = False  # inside an answer span whose first letter or digit is still to come
        for i, a in enumerate(answer):
            pending = a and (pending or i == 0 or not answer[i - 1])
            if pending and self._alnum(ids[i + 1]):
                weights[i] *= self.value_boost
                pending = False

    def _row(self, kind: str, seq_len: int, prompt_weight: float, rng: random.Random):
        n = seq_len  # targets; ids are n + 1 with <s>
        if kind in ("code", "docs"):
            body = R.filler(self.tok, kind, "train", n, rng)
            return [BOS] + body, [1.0] * n, [True] * n
        if kind == "copy":
            return self._copy(n, rng)
        if kind in ("drill", "drill_mixed", "drill_open"):
            return self._drill(n, prompt_weight, rng, mixed_values=kind != "drill", open_words=kind == "drill_open")
        if kind in ("drill_far", "drill_far_open", "drill_far_stated"):
            return self._drill_far(n, prompt_weight, rng, open_words=kind != "drill_far",
                                   stated=kind == "drill_far_stated")
        if kind == "kv_drill":
            return self._kv_drill(n, prompt_weight, rng)
        if kind in ("mv_drill", "mv_drill_once"):
            return self._mv_drill(n, prompt_weight, rng, once=kind == "mv_drill_once")
        if kind == "vt_drill":
            return self._vt_drill(n, prompt_weight, rng)
        if kind in ("mv_list", "mv_list_far", "mv_list_wide"):
            return self._mv_list(n, prompt_weight, rng, far=kind != "mv_list", wide=kind == "mv_list_wide")
        if kind.startswith("task:"):
            return self._task(kind[5:], n, prompt_weight, rng)
        ex = R.example(kind, self.tok, n, rng, "train")
        ids = [BOS] + list(ex.ids)
        weights = [self.answer_weight if a else prompt_weight for a in ex.answer]
        return ids, weights, list(ex.answer)

    def _task(self, name: str, n: int, prompt_weight: float, rng: random.Random):
        sample = tasks.TASKS[name].make(self.tok, n + 1 - _TASK_RESERVE.get(name, 16), rng.random(),
                                  rng.randrange(2**31), "train")
        if _TOPICS_MARK in sample.prompt:
            raise ValueError("filler window from the documentation topics file")
        prompt = [BOS] + self._enc(sample.prompt)
        ids = (prompt + self._enc(sample.target))[: n + 1]
        n_answer = len(ids) - len(prompt)
        if n_answer <= 0:
            raise ValueError("no room for the answer")
        pad = n + 1 - len(ids)
        weights = [prompt_weight] * (len(prompt) - 1) + [self.answer_weight] * n_answer + [0.0] * pad
        answer = [False] * (len(prompt) - 1) + [True] * n_answer + [False] * pad
        return ids + [PAD] * pad, weights, answer

    def _copy(self, n: int, rng: random.Random):
        """A string of tokens drawn uniformly from the vocabulary, then a newline and the same string again, the
        pair at a random offset among other random tokens (which are not scored). Its length varies from row to
        row, so the distance back to the first copy varies too: no fixed-offset (positional) attention solves it,
        only matching the previous token's content, and uniform draws from thousands of ids make a one-token
        match unambiguous (the classic induction-head setting, Olsson et al. 2022)."""
        vocab = len(self.tok)

        def tokens(count: int) -> list[int]:
            return [rng.randrange(_FIRST_PLAIN_ID, vocab) for _ in range(count)]
        k = rng.randint(max(8, n // 8), (n - 1) // 2)
        half = tokens(k)
        prefix = tokens(rng.randint(0, n - 1 - 2 * k))
        sep = self._enc("\n")[:1]
        ids = [BOS] + prefix + half + sep + half
        lead = len(prefix) + k + 2  # targets up to and including the first copied token are not scored
        rest = n + 1 - len(ids)  # filled with more random tokens, not scored
        ids += tokens(rest)
        weights = [0.0] * lead + [self.answer_weight] * (k - 1) + [0.0] * rest
        answer = [False] * lead + [True] * (k - 1) + [False] * rest
        return ids, weights, answer

    def _drill(self, n: int, prompt_weight: float, rng: random.Random, mixed_values: bool = False,
               open_words: bool = False):
        """Dense recall of multi-token keys: 2-16 facts (one listing format, training needle phrasings or random
        "wild" phrasings; keys and values of every format), each maybe after a short filler snippet, then as
        many questions as fit, each followed by its value (the answers). Every sample asks every key, in
        shuffled rounds, so a row carries dozens of answers instead of one, and only matching the asked key
        against the facts' keys answers them: the phrasing of fact and question vary independently.
        `mixed_values`: digits, words and hex strings equally often (otherwise about three values in four are
        digits, the format of the acceptance tasks, and a model learns to answer with digits whatever it found).
        `open_words`: every fact and seven questions in ten worded with open text
        (:func:`~attnkit.eval.data.retrieval_templates.open_needle`), so the wording varies over thousands of words."""
        n_facts = rng.randint(2, 16)
        key_kind, value_kind = rng.choice((None, "name", "words", "uuid", "item", "code")), rng.choice((None, "digits"))
        keys = T.distinct(lambda r: T.make_key(r, key_kind), n_facts, rng)
        if mixed_values:
            values = [T.make_value(rng, rng.choice(("digits", "word", "hex"))) for _ in keys]
        else:
            values = [T.make_value(rng, value_kind) for _ in keys]
        style = "open" if open_words else rng.choice(("listing", "needles", "wild"))
        fmt = rng.choice(T.KV_FORMATS)
        filler_kind = rng.choice(R.FILLER_KINDS["train"])
        ids, answer = [BOS], []
        add = _appender(ids, answer)
        add(self._enc(rng.choice(T.pool(T.INTROS, "train")) + "\n"), False)
        for i, (k, v) in enumerate(zip(keys, values)):
            if len(ids) > 0.6 * n and i >= 2:  # the facts take at most about 60 % of the row: room for questions
                keys, values = keys[:i], values[:i]
                break
            if style != "listing" and rng.random() < 0.5:
                add(R.filler(self.tok, filler_kind, "train", rng.randint(4, 24), rng) + self._enc("\n"), False)
            if style == "listing":
                template = fmt
            elif style == "needles":
                template = rng.choice(T.pool(T.NEEDLES, "train"))
            else:
                template = T.wild_needle(rng) if style == "wild" else T.open_needle(rng)
            add(self._enc(template.format(key=k, value=v) + "\n"), False)
        self._ask_rounds(add, ids, keys, values, n, rng, self._open_ask if open_words else None)
        return self._finish(ids, answer, n, prompt_weight)

    def _enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _ask_rounds(self, add, ids: list[int], keys: list[str], values: list[str], n: int, rng: random.Random,
                    ask=None, rounds: int | None = None) -> None:
        """Every key asked, in shuffled rounds, until the row holds n + 1 ids (or after `rounds` rounds): a question
        (a training phrasing, or random words three times in ten) and then the key's value as the answer.
        `ask(key, value, rng)` may give (question, answer) texts of another format."""
        questions = T.pool(T.QUESTIONS, "train")
        done = 0
        while len(ids) < n + 1 and (rounds is None or done < rounds):
            done += 1
            order = list(range(len(keys)))
            rng.shuffle(order)
            for i in order:
                if ask is not None:
                    question, value = ask(keys[i], values[i], rng)
                else:
                    q = rng.choice(questions) if rng.random() < 0.7 else T.wild_question(rng)
                    question, value = "\n" + q.format(key=keys[i]), " " + values[i]
                add(self._enc(question), False)
                add(self._enc(value), True)

    @staticmethod
    def _open_ask(key: str, value: str, rng: random.Random) -> tuple[str, str]:
        """A question worded with open text seven times in ten, otherwise a training phrasing; then the value."""
        q = T.open_question(rng) if rng.random() < 0.7 else rng.choice(T.pool(T.QUESTIONS, "train"))
        return "\n" + q.format(key=key), " " + value

    def _finish(self, ids: list[int], answer: list[bool], n: int, prompt_weight: float):
        """The row cut to n + 1 ids, or padded to them (padding has no loss)."""
        answer = answer[:n]
        if not any(answer):
            raise ValueError("no answer fits")
        weights = [self.answer_weight if a else prompt_weight for a in answer]
        pad = n - len(answer)
        return ids[: n + 1] + [PAD] * pad, weights + [0.0] * pad, answer + [False] * pad

    def _drill_far(self, n: int, prompt_weight: float, rng: random.Random, open_words: bool = False,
                   stated: bool = False):
        """The drill's questions about facts spread through a whole row of filler: 2-12 facts (training needle
        phrasings or random words; keys of every format, values digits / words / hex) at uniform depths in
        the first 70-85 % of the row, then every key asked in shuffled rounds. The drill lists its facts at
        the start and a needle row carries one answer; this row carries dozens, each from anywhere up to the
        row's length back, which is what finding a needle far from the question needs. `open_words`: facts and
        questions worded with open text as in the drill. `stated`: half the questions worded as a fact with the
        value left out (:func:`~attnkit.eval.data.retrieval_templates.stated_question`): multi-value rows teach that a
        key stated again gets a new value, and these that a key restated at the end asks for the one it has."""
        n_facts = rng.randint(2, 12)
        keys = T.distinct(lambda r: T.make_key(r, rng.choice((None, "name", "words", "uuid", "item", "code"))),
                          n_facts, rng)
        values = [T.make_value(rng, rng.choice(("digits", "word", "hex"))) for _ in keys]
        one = rng.choice(T.pool(T.NEEDLES, "train")) if rng.random() < 0.3 else None
        if open_words:
            one = None

        def phrasing() -> str:
            if open_words:
                return T.open_needle(rng)
            return one or (rng.choice(T.pool(T.NEEDLES, "train")) if rng.random() < 0.6 else T.wild_needle(rng))
        facts = [self._enc(phrasing().format(key=k, value=v) + "\n") for k, v in zip(keys, values)]
        head = [BOS] + self._enc(rng.choice(T.pool(T.INTROS, "train")) + "\n")
        n_fill = int(rng.uniform(0.7, 0.85) * n) - len(head) - sum(map(len, facts))
        if n_fill < 16:
            raise ValueError("the facts do not fit")
        body = R._with_needles(self.tok, "train", rng, n_fill, rng.choice(R.FILLER_KINDS["train"]),
                               [(rng.random(), f) for f in facts])
        ids = head + body
        answer = [False] * (len(ids) - 1)
        ask = self._stated_ask if stated else self._open_ask if open_words else None
        self._ask_rounds(_appender(ids, answer), ids, keys, values, n, rng, ask)
        return self._finish(ids, answer, n, prompt_weight)

    def _stated_ask(self, key: str, value: str, rng: random.Random) -> tuple[str, str]:
        if rng.random() < 0.5:
            return "\n" + T.stated_question(rng).format(key=key), " " + value
        return self._open_ask(key, value, rng)

    def _kv_drill(self, n: int, prompt_weight: float, rng: random.Random):
        """kv_retrieval's JSON object of hex keys and values (training draws), over 60-80 % of the row, then its
        question ("Key: ... The value associated with the key is:") about every key in shuffled rounds, seven
        times in ten in the task's own wording and otherwise in another: dozens of answers per row where the
        task row has one, each found only by matching a key of eight hex digits among many alike."""

        def uuid_like(r: random.Random) -> str:
            return f"{T.hex_string(r, 4)}-{T.hex_string(r, 4)}"
        ids = [BOS] + self._enc("Extract the value for the given key from the JSON object below.\n{\n")
        keys: list[str] = []
        values: list[str] = []
        budget = rng.uniform(0.6, 0.8) * n
        while len(ids) < budget:
            k, v = uuid_like(rng), uuid_like(rng)
            if k in keys:
                continue
            keys.append(k)
            values.append(v)
            ids += self._enc(f'"{k}": "{v}",\n')
        ids += self._enc("}")
        answer = [False] * (len(ids) - 1)

        def ask(key: str, value: str, r: random.Random) -> tuple[str, str]:
            if r.random() < 0.7:
                return f'\nKey: "{key}"\nThe value associated with the key is: "', f'{value}"'
            return f'\nThe value of "{key}" in the object above is "', f'{value}"'
        self._ask_rounds(_appender(ids, answer), ids, keys, values, n, rng, ask)
        return self._finish(ids, answer, n, prompt_weight)

    def _grouped_facts(self, groups: list[list[str]], n: int, rng: random.Random, share: float = 0.6) -> list[int]:
        """The facts of several groups (each group's in its order, the groups interleaved at random), each on its own
        line and half of them after a short training filler snippet, within about `share` of the row; groups that
        do not fit are dropped from the end (ValueError when not even two fit)."""
        filler_kind = rng.choice(R.FILLER_KINDS["train"])
        encoded = [[self._enc("\n" + f + "\n") for f in g] for g in groups]
        while sum(len(ids) + 12 for g in encoded for ids in g) > share * n:
            encoded.pop()
            if len(encoded) < 2:
                raise ValueError("the facts do not fit")
        order = [i for i, g in enumerate(encoded) for _ in g]
        rng.shuffle(order)
        nxt = [0] * len(encoded)
        out: list[int] = []
        for i in order:
            if rng.random() < 0.5:
                out += R.filler(self.tok, filler_kind, "train", rng.randint(4, 24), rng)
            out += encoded[i][nxt[i]]
            nxt[i] += 1
        del groups[len(encoded):]
        return out

    def _mv_drill(self, n: int, prompt_weight: float, rng: random.Random, once: bool = False):
        """Dense multi-value recall: 2-6 keys with 2-5 values each, their facts interleaved (niah_multivalue's own
        wording six times in ten, otherwise training needle phrasings), then every key asked for all its values in
        order, in shuffled rounds. The task row carries one such answer; here a model learns to list every value of
        a key and to stop repeating one it has given. `once`: 2-8 keys, each asked once (the rest of the row is
        padding): a second round can copy the first round's answers, so only the first round needs the facts."""
        ruler = rng.random() < 0.6
        keys = T.distinct(lambda r: T.make_key(r, "words" if ruler else None), rng.randint(2, 8 if once else 6), rng)
        kind = "digits" if ruler or rng.random() < 0.5 else None
        flat = T.distinct(lambda r: T.make_value(r, kind), 5 * len(keys), rng)
        values = [flat[5 * i : 5 * i + rng.randint(2, 5)] for i in range(len(keys))]
        groups = [[(tasks.MAGIC_NEEDLE if ruler else rng.choice(T.pool(T.NEEDLES, "train"))).format(key=k, value=v)
                   for v in vs] for k, vs in zip(keys, values)]
        ids = [BOS] + self._enc(T.INTROS[0] if ruler else rng.choice(T.pool(T.INTROS, "train")))
        ids += self._grouped_facts(groups, n, rng, 0.75 if once else 0.6)
        keys, values = keys[: len(groups)], values[: len(groups)]
        questions = T.pool(T.MULTI_QUESTIONS, "train")

        def ask(key: str, vs: str, r: random.Random) -> tuple[str, str]:
            if ruler:
                return tasks.MULTIVALUE_QUESTION.format(key=key), f" {vs}."
            return "\n" + r.choice(questions).format(key=key), f" {vs}"
        answer = [False] * (len(ids) - 1)
        self._ask_rounds(_appender(ids, answer), ids, keys, [", ".join(vs) for vs in values], n, rng, ask,
                         1 if once else None)
        return self._finish(ids, answer, n, prompt_weight)

    def _mv_list(self, n: int, prompt_weight: float, rng: random.Random, far: bool = False, wide: bool = False):
        """One key's 2-6 values listed in order, in short episodes packed into the row (intro, the key's facts with
        no, short or long filler between them, the question, the list). niah_multivalue's answer turns on one
        token per value, its first: which fact comes next; the rest copies. Models that had learnt the other rows
        picked that token nearly at random among the key's values (their first and last value right), so here
        that token's loss counts `_NEXT_BOOST` times, and adjacent facts (where the next fact sits a few tokens
        after the one just listed) make the order easy to find before filler spreads it.
        `far`: also (three times in six) gaps from 160 tokens up to what lets the episode fill most of the row,
        as far apart as the task's facts at the row's length. `wide`: only such gaps (where they fit), so that
        finding the next fact by the few tokens after the last one no longer works."""
        ids, answer, boost, keys = [BOS], [], [], set()
        add = _appender(ids, answer)
        while len(ids) < n + 1:
            ruler = rng.random() < 0.6
            key = T.make_key(rng, "words" if ruler else None)
            if key in keys:  # an earlier episode's facts would belong to this key's list
                continue
            keys.add(key)
            kind = "digits" if ruler or rng.random() < 0.5 else None
            values = T.distinct((lambda r: str(r.randrange(100_000, 1_000_000))) if ruler
                                else (lambda r, k=kind: T.make_value(r, k)), rng.randint(2, 6), rng)
            fact = tasks.MAGIC_NEEDLE if ruler else rng.choice(T.pool(T.NEEDLES, "train"))
            widest = int(0.85 * n / len(values)) - 24
            if wide and widest > 200:
                gap = (160, widest)
            else:
                gap = rng.choice(((0, 0), (4, 24), (24, 160)) + (((160, widest),) * 3 if far and widest > 200 else ()))
            filler_kind = rng.choice(R.FILLER_KINDS["train"])
            add(self._enc((T.INTROS[0] if ruler else rng.choice(T.pool(T.INTROS, "train"))) + "\n"), False)
            for v in values:
                add(R.filler(self.tok, filler_kind, "train", rng.randint(*gap), rng), False)
                add(self._enc("\n" + fact.format(key=key, value=v) + "\n"), False)
            q = tasks.MULTIVALUE_QUESTION if ruler else "\n" + rng.choice(T.pool(T.MULTI_QUESTIONS, "train"))
            add(self._enc(q.format(key=key)), False)
            for i, v in enumerate(values):
                piece = self._enc((" " if i == 0 else ", ") + v)
                boost.append(len(answer) + next(j for j, t in enumerate(piece) if self._alnum(t)))
                add(piece, True)
            add(self._enc(".\n\n" if ruler else "\n\n"), True)
        ids, weights, answer = self._finish(ids, answer, n, prompt_weight)
        for i in boost:
            if i < n:
                weights[i] *= _NEXT_BOOST
        return ids, weights, answer

    def _vt_drill(self, n: int, prompt_weight: float, rng: random.Random):
        """Dense variable tracking in variable_tracking's own wording: 2-5 chains of 2-5 variables, each from a
        number through "VAR A is assigned to VAR B." hops, the chains' statements interleaved, then every chain's
        number asked ("which variables are assigned the value ...?") in shuffled rounds, answered with the chain's
        variables in order: each answer follows the hops one by one, many times per row."""
        names = T.distinct(lambda r: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), 25, rng)
        numbers = T.distinct(lambda r: str(r.randrange(10_000, 100_000)), 5, rng)
        chains = [names[5 * c : 5 * c + rng.randint(2, 5)] for c in range(rng.randint(2, 5))]
        groups = [[tasks.VT_FIRST.format(value=v, var=chain[0])] + [tasks.VT_HOP.format(src=a, dst=b)
                                                                    for a, b in zip(chain, chain[1:])]
                  for v, chain in zip(numbers, chains)]
        ids = [BOS] + self._enc(tasks.VT_INTRO)
        ids += self._grouped_facts(groups, n, rng)
        chains = chains[: len(groups)]

        def ask(value: str, chain: str, r: random.Random) -> tuple[str, str]:
            return tasks.VT_QUESTION.format(value=value), f" {chain}."
        answer = [False] * (len(ids) - 1)
        self._ask_rounds(_appender(ids, answer), ids, numbers[: len(chains)], [", VAR ".join(c) for c in chains], n,
                         rng, ask)
        return self._finish(ids, answer, n, prompt_weight)
