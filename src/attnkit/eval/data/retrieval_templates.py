"""The parts that compositional retrieval samples are built from, and their train/held-out split.

Why: a model trained on one fixed needle sentence ("The pass key is ...") can learn a lookup keyed on
that phrase instead of in-context retrieval. Issue #29 asks for data where no fixed phrase can be keyed
on: many phrasings of a fact and of its question, several key and value formats, several kinds of
filler, combined at random, with whole phrasings and whole filler sources held out for evaluation.

The split is at the template level, fixed by position (every fourth phrasing is held out), so it is
deterministic and the same on every machine. Held-out phrasings never appear in training samples; the
held-out filler is prose and code from sources training never reads: the held-out standard-library
files of :mod:`attnkit.eval.data.corpus` and a fixed set of topics of Python's own reference documentation
(``pydoc_data.topics``, shipped with every CPython), whose file is excluded from the training code filler.
The phrasings of :mod:`attnkit.eval.data.tasks` (the acceptance rows) are training phrasings.

Key formats (names, word pairs, UUID-like hex, numbered items, codes) and value formats (digits of
varied length, words, hex) are shared by both splits: a value is never a template.
"""

from __future__ import annotations

import functools
import random
import re

SPLITS = ("train", "eval")

# A fact: "{key}" is the key, "{value}" the value.
NEEDLES: tuple[str, ...] = (
    "The pass key for {key} is {value}.",
    "One of the special magic numbers for {key} is: {value}.",
    "Remember this: {key} goes with {value}.",
    "Record entry -- {key}: {value}",
    "The value of {key} is {value}.",
    "{key} => {value}",
    "Please note that the code for {key} is {value}.",
    "Somewhere it was written that {key} had been given {value}.",
    "Fact: {key} is paired with {value}.",
    "{key} was filed under {value}.",
    "Keep in mind: whenever {key} comes up, think of {value}.",
    "Our notes list {key} alongside {value}.",
    "The secret attached to {key} reads {value}.",
    "For {key}, the stored answer is {value}.",
    "Entry recorded: key {key}, value {value}.",
    "Mark it down: {key} corresponds to {value}.",
    "The label {key} points at {value}.",
    "In the ledger, {key} sits next to {value}.",
    "[{key}] = {value}",
    "It is known that the token of {key} equals {value}.",
    "The archive says {key} belongs with {value}.",
    "Whoever asks about {key} must hear {value}.",
    "The tag on {key} shows {value}.",
    "Write this down: {key} has the number {value}.",
    "Assignment: {key} receives {value}.",
    "A clerk stamped {key} with {value}.",
    "The register pairs {key} and {value}.",
    "Memo -- {key} is to be matched with {value}.",
    "The hidden value behind {key} is {value}.",
    "We agreed that {key} maps onto {value}.",
    "{key} ~ {value} (keep this)",
    "The witness linked {key} to {value}.",
    "Item {key} was catalogued as {value}.",
    "The answer for {key} happens to be {value}.",
    "Under {key}, the drawer holds {value}.",
    "The signal for {key} was {value}.",
    "Log line: set {key} to {value}.",
    "The badge of {key} carries {value}.",
    "Do not forget that {key} stands for {value}.",
    "The map shows {key} at {value}.",
)

# A question about one key; the value follows the question directly (after a space).
QUESTIONS: tuple[str, ...] = (
    "What is the pass key for {key}? The pass key for {key} is",
    "What is the special magic number for {key}? The special magic number for {key} is:",
    "What goes with {key}? Answer:",
    "Look up {key}. Value:",
    "Question: what is the value of {key}? Answer:",
    "{key} =>",
    "Which code was given for {key}? It was",
    "Recall the entry for {key}:",
    "Tell me what {key} is paired with. It is paired with",
    "What was {key} filed under? It was filed under",
    "Query {key} ->",
    "Find the answer stored for {key}. The stored answer is",
    "Name the value that {key} points at:",
    "Retrieve {key} from memory. Result:",
    "Q: {key}? A:",
    "Which value belongs to {key}? It is",
    "What did the notes attach to {key}? They attached",
    "Report the number behind {key}:",
    "Give the value recorded for {key}. Recorded value:",
    "What was stamped on {key}? The stamp reads",
    "And {key}? That one is",
    "Search the text for {key}; its value is",
    "Complete the pair: {key} and",
    "Remind me, {key} corresponds to",
)

# A question asking for every value of one key (multi-value needles); values follow, comma-separated.
MULTI_QUESTIONS: tuple[str, ...] = (
    "What are all the special magic numbers for {key}? The special magic numbers for {key} are:",
    "List every value given for {key}:",
    "Which values go with {key}? Answer:",
    "Name all entries filed under {key}. They are",
    "Collect the values of {key}, in order:",
    "All of the values for {key} are",
    "Gather each value paired with {key}. Values:",
    "Q: every value of {key}? A:",
)

# Instructions opening a sample.
INTROS: tuple[str, ...] = (
    "Special magic numbers are hidden in the text below. Memorize them.",
    "A pass key is hidden in the text below. Find it and remember it.",
    "Some facts are hidden in the text below. Remember them.",
    "Read the text and keep track of the entries it mentions.",
    "Pay attention to every pairing stated below.",
    "The following document contains a few records among other material.",
    "Below is a long text. A few labelled values are buried in it.",
    "Memorise the associations that appear in the passage.",
)

# Formats of one line of a key-value listing.
KV_FORMATS: tuple[str, ...] = (
    '"{key}": "{value}",',
    "{key}: {value}",
    "{key} = {value}",
    "{key} | {value}",
    "{key} -> {value}",
    "({key}, {value})",
    "{key}\t{value}",
    "<{key}> {value}",
)

# One step of a variable chain: "{src}" is a value or an earlier variable, "{dst}" the new variable.
ASSIGNMENTS: tuple[str, ...] = (
    "VAR {dst} = {src}",
    "{dst} = {src}",
    "let {dst} be {src}.",
    "{dst} := {src}",
    "set {dst} to {src}.",
    "{src} is assigned to {dst}.",
    "copy {src} into {dst}.",
    "{dst} takes the value of {src}.",
    "now {dst} equals {src}.",
    "{dst} <- {src}",
    "assign {src} to {dst}.",
    "{dst} becomes {src}.",
)

CHAIN_QUESTIONS: tuple[str, ...] = (
    "What is the value of {var}? Answer:",
    "Follow the assignments: {var} holds",
    "Q: {var}? A:",
    "Evaluate {var}:",
    "After all assignments, {var} equals",
    "Trace {var} back to its value. It is",
    "print({var}) prints",
    "Resolve {var} ->",
)

_FIRST = ("Ada Alma Bruno Cleo Dara Elio Fenna Gil Hana Ivo Juno Kato Lena Milo Nadia Oskar Pia Quin Rosa "
          "Sami Tove Ugo Vera Wim Xena Yara Zeno Arlo Bea Cyrus Dina Emil Freya Gus Ines Jonas Kira Leif "
          "Maren Nils").split()
_LAST = ("Abbot Brandt Calloway Dumas Eriksen Ferreira Grove Holt Ibarra Jansen Keller Lund Moreau Novak "
         "Okafor Price Quill Rios Sato Thorne Ueda Vance Wolfe Xu Young Zeller Ambrose Bishop Castro Duarte "
         "Ellis Fischer Garza Hale Iyer Jovanovic Kim Lowe Marsh Nakamura").split()
WORDS = ("acorn anchor anvil apricot atlas aurora bamboo banner barley beetle bellow biscuit blossom bonfire "
         "bramble bridge bucket buffalo button cactus camel carpet castle cinder citrus clock cloud cocoa "
         "compass copper cotton cricket crow cypress dahlia dolphin dragon drum ember fable feather fiddle "
         "fig flame flannel fountain gadget garden gecko ginseng goblet gourd grape gravel hammer harp "
         "hedge honey horizon iris island jacket jelly jigsaw kayak kelp kernel kiwi ladder lark lava lemur "
         "lily magnet mango marsh meteor mirror mitten monsoon mortar mustard needle nutmeg oasis orbit "
         "oyster paddle papaya parrot peach pepper pillow pistol plank pollen puzzle quill quiver radish "
         "ribbon rocket saddle satchel scarf shell shovel sleet spindle sprout squid stable stencil "
         "sugar swan tablet tango teapot thimble timber toffee torch tractor trumpet tunnel turnip umbrella "
         "valley vessel violin wagon walrus whistle wicker yarrow yeast zebra zinc").split()


def heldout(templates: tuple[str, ...]) -> tuple[str, ...]:
    """The held-out phrasings of a pool: every fourth one (positions 3, 7, 11, ...)."""
    return tuple(t for i, t in enumerate(templates) if i % 4 == 3)


def pool(templates: tuple[str, ...], split: str) -> tuple[str, ...]:
    """The phrasings of `templates` that `split` draws from ("train": all but the held-out ones)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    held = set(heldout(templates))
    return tuple(t for t in templates if (t in held) == (split == "eval"))


ALL_POOLS = {"needle": NEEDLES, "question": QUESTIONS, "multi_question": MULTI_QUESTIONS, "intro": INTROS,
             "chain_question": CHAIN_QUESTIONS, "assignment": ASSIGNMENTS}
assert all(t.index("{key}") < t.index("{value}") for t in NEEDLES)  # stated_question cuts a fact at its value
# The acceptance tasks' own phrasings must stay on the training side.
assert NEEDLES[0] not in heldout(NEEDLES) and NEEDLES[1] not in heldout(NEEDLES)
assert not {QUESTIONS[0], QUESTIONS[1], MULTI_QUESTIONS[0], INTROS[0], INTROS[1]} & set(
    heldout(QUESTIONS) + heldout(MULTI_QUESTIONS) + heldout(INTROS))


def literal_parts(template: str) -> list[str]:
    """The fixed text of a template between its placeholders (what a leak test looks for)."""
    return [p for p in re.split(r"\{\w+\}", template) if p.strip()]


# --------------------------------------------------------------------------------------------------
# keys and values


def make_key(rng: random.Random, kind: str | None = None) -> str:
    kind = kind or rng.choice(("name", "words", "uuid", "item", "code"))
    if kind == "name":
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    if kind == "words":
        return f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
    if kind == "uuid":
        return f"{hex_string(rng, 4)}-{hex_string(rng, 4)}"
    if kind == "item":
        return f"item {rng.randrange(100, 10_000)}"
    if kind == "code":
        return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + f"-{rng.randrange(10, 1000)}"
    raise ValueError(f"unknown key kind {kind!r}")


def make_value(rng: random.Random, kind: str | None = None) -> str:
    kind = kind or rng.choice(("digits", "digits", "word", "hex"))
    if kind == "digits":
        n = rng.randint(3, 8)
        return str(rng.randrange(10 ** (n - 1), 10**n))
    if kind == "word":
        return rng.choice(WORDS)
    if kind == "hex":
        return hex_string(rng, rng.choice((4, 6, 8)))
    raise ValueError(f"unknown value kind {kind!r}")


def hex_string(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def distinct(make, n: int, rng: random.Random) -> list[str]:
    """n different results of make(rng)."""
    out: list[str] = []
    while len(out) < n:
        x = make(rng)
        if x not in out:
            out.append(x)
    return out


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.choice((3, 4, 5))))


# --------------------------------------------------------------------------------------------------
# filler


@functools.cache
def _doc_topics() -> tuple[tuple[str, str], ...]:
    from pydoc_data import topics  # stdlib; imported lazily so importing this module stays cheap

    return tuple(sorted(topics.topics.items()))


@functools.cache
def doc_prose(split: str) -> str:
    """Reference-documentation prose. The third of every five topics (sorted by name, about 23 % of the
    text) is held out for evaluation; topics repeat whole sections of each other, so the training prose
    also drops every paragraph that occurs in (or quotes a paragraph of) a held-out topic."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    topics = _doc_topics()
    held = [text for i, (_, text) in enumerate(topics) if i % 5 == 2]
    if split == "eval":
        return "\n\n".join(held)
    held_paragraphs = {p for text in held for p in text.split("\n\n")}
    long_held = [p for p in held_paragraphs if len(p) >= 80]

    def shared(p: str) -> bool:  # a held-out paragraph, or one quoted inside a longer training paragraph
        return p in held_paragraphs or (len(p) >= 80 and any(h in p for h in long_held))

    kept = ("\n\n".join(p for p in text.split("\n\n") if not shared(p))
            for i, (_, text) in enumerate(topics) if i % 5 != 2)
    return "\n\n".join(k for k in kept if k)


# Training-only phrasings drawn word by word: a fact or a question whose wording is a random run of ordinary words
# around the key (and the value), so that nothing but the key itself can be keyed on. Words of any held-out
# phrasing are left out, so no held-out phrasing (or a fragment of one) is ever drawn.
_WILD_WORDS = ("the a an of for with is was has had it this that then so also now here there please note value "
               "number code entry record item answer tag label stored kept given listed marked written holds shows "
               "gives goes maps links names means next first last new old main real final true known saved list "
               "book page card box file slot table sheet row line mark sign word term key keys data fact facts")


@functools.cache
def _wild_vocabulary() -> tuple[str, ...]:
    held = {w for templates in ALL_POOLS.values() for t in heldout(templates)
            for w in re.findall(r"[a-z]+", t.lower())}
    return tuple(w for w in _WILD_WORDS.split() if w not in held)


def _wild(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_wild_vocabulary()) for _ in range(rng.randint(lo, hi)))


def wild_needle(rng: random.Random) -> str:
    """A fact template (``{key}``, ``{value}``) of random words; training only."""
    words = [_wild(rng, 0, 3), "{key}", _wild(rng, 1, 3), "{value}"]
    text = " ".join(w for w in words if w) + rng.choice((".", "", ";", " .", ","))
    return text[:1].upper() + text[1:]


def wild_question(rng: random.Random) -> str:
    """A question template (``{key}``) of random words, after which the value is the answer; training only."""
    words = [_wild(rng, 1, 4), "{key}" + rng.choice(("?", ":", "", " -", ",")), _wild(rng, 0, 3)]
    text = " ".join(w for w in words if w)
    return text[:1].upper() + text[1:]


# Training-only phrasings from open text: the words around the key (and the value) are runs of consecutive words of
# a training documentation sentence, or wild words, so a model meets thousands of wordings (function words
# included) and learns that only the key links a question to its fact. A held-out phrasing stays held out as a
# phrase: no run carries two consecutive words of a held-out template's fixed text (single common words such as
# "the" or "is" occur in every filler anyway).


@functools.cache
def _heldout_bigrams() -> frozenset[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for templates in ALL_POOLS.values():
        for t in heldout(templates):
            for part in literal_parts(t):
                words = re.findall(r"[a-z]+", part.lower())
                out.update(zip(words, words[1:]))
    return frozenset(out)


@functools.cache
def _prose_sentences() -> tuple[tuple[str, ...], ...]:
    """The training documentation prose as sentences of words (letters only), six words or more."""
    sentences = (re.findall(r"[A-Za-z]+", s) for s in re.split(r"[.!?:;\n]", doc_prose("train")))
    return tuple(tuple(s) for s in sentences if len(s) >= 6)


def _prose_run(rng: random.Random, lo: int, hi: int) -> str:
    """lo..hi consecutive words of a training prose sentence, none two consecutive words of a held-out phrasing."""
    held = _heldout_bigrams()
    for _ in range(50):
        sentence = rng.choice(_prose_sentences())
        n = rng.randint(lo, min(hi, len(sentence)))
        i = rng.randint(0, len(sentence) - n)
        run = sentence[i : i + n]
        lower = [w.lower() for w in run]
        if not any(b in held for b in zip(lower, lower[1:])):
            return " ".join(run)
    return _wild(rng, lo, hi)


def _open(rng: random.Random, lo: int, hi: int) -> str:
    return _prose_run(rng, lo, hi) if rng.random() < 0.7 else _wild(rng, lo, hi)


def open_needle(rng: random.Random) -> str:
    """A fact template (``{key}``, ``{value}``) worded with open text; training only."""
    words = [_open(rng, 0, 5), "{key}" + rng.choice(("", "", ",", ":")), _open(rng, 1, 5), "{value}"]
    text = " ".join(w for w in words if w) + rng.choice((".", "", ";", " .", ","))
    return text[:1].upper() + text[1:]


def open_question(rng: random.Random) -> str:
    """A question template (``{key}``) worded with open text, after which the value is the answer; training only."""
    words = [_open(rng, 1, 6), "{key}" + rng.choice(("?", ":", "", " -", ",", ".")), _open(rng, 0, 5)]
    text = " ".join(w for w in words if w) + rng.choice(("", "", ":"))
    return text[:1].upper() + text[1:]


def stated_question(rng: random.Random) -> str:
    """A question worded as a fact with its value left out: a few open words, then an open or training fact
    wording up to ``{value}``. A known key restated so asks for the value it was given; training only."""
    fact = rng.choice((open_needle(rng), rng.choice(pool(NEEDLES, "train"))))  # the key before the value, always
    head, lead = fact[: fact.index("{value}")].rstrip(), _open(rng, 0, 3)
    text = f"{lead}, {head[:1].lower()}{head[1:]}" if lead else head
    return text[:1].upper() + text[1:]
