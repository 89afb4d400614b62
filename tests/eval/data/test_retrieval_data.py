"""Compositional retrieval data (issue #29): the train/held-out split is at the template level, held-out
phrasings and filler never reach a training sample, and generation is deterministic and exact in length."""

import itertools
import json
import random
import re

import pytest

from attnkit.eval.data import corpus
from attnkit.eval.data import retrieval_data as R
from attnkit.eval.data import retrieval_templates as T
from attnkit.tokenizer import build_byte_tokenizer

TOK = build_byte_tokenizer()
QUESTION_TASKS = ("needle", "needle_multikey", "needle_multivalue", "kv_listing", "kv_multiquery", "variable_chain")


def test_pools_are_large_and_split_by_template():
    assert len(T.NEEDLES) >= 30 and len(T.QUESTIONS) >= 20
    for name, templates in T.ALL_POOLS.items():
        train, held = T.pool(templates, "train"), T.pool(templates, "eval")
        assert len(set(templates)) == len(templates), name
        assert held and train and not set(train) & set(held), name
        assert set(train) | set(held) == set(templates), name
        assert held == T.heldout(templates) == T.pool(templates, "eval")
    with pytest.raises(ValueError, match="split must be one of"):
        T.pool(T.NEEDLES, "test")


def test_heldout_filler_sources_are_disjoint_from_training():
    train_docs, eval_docs = T.doc_prose("train"), T.doc_prose("eval")
    assert len(eval_docs) > 50_000 and len(train_docs) > 2 * len(eval_docs)
    paragraphs = [p for p in eval_docs.split("\n\n") if len(p) > 200]
    # topics of the reference repeat whole sections of each other: none of a held-out one is trained on
    assert len(paragraphs) > 100 and not any(p in train_docs for p in paragraphs)
    # the documentation topics file (it holds the held-out prose) is not in the training code filler
    code = TOK.decode(list(R.filler_ids(TOK, "code", "train")))
    assert paragraphs[0][:120] not in code
    assert corpus.read_text(corpus.stdlib_files("heldout")[0])[:300] not in code
    with pytest.raises(ValueError, match="training-only"):
        R.filler(TOK, "grammar", "eval", 10, random.Random(0))


def _rendered(template: str, slots: dict) -> list[str]:
    names = re.findall(r"\{(\w+)\}", template)
    if not all(n in slots for n in names):
        return []
    out = []
    for combo in itertools.product(*(slots[n] for n in names)):
        out.append(template.format(**dict(zip(names, combo))))
    return out


@pytest.mark.parametrize("task", QUESTION_TASKS + ("needle_wild",))
def test_training_samples_never_hold_a_heldout_phrasing(task):
    held = [t for templates in T.ALL_POOLS.values() for t in T.heldout(templates)]
    # fragments of held-out phrasings that ordinary text never contains: looked for verbatim
    code, docs = corpus.haystack_text("train"), T.doc_prose("train")
    fragments = [f for t in held for f in [max(T.literal_parts(t), key=len)] if f not in code and f not in docs]
    assert len(fragments) >= 15
    rng = random.Random(7)
    for _ in range(25):
        ex = R.example(task, TOK, 900, rng, "train")
        text = TOK.decode(list(ex.ids))
        assert not set(ex.meta.get("templates", [])) & set(held)
        assert not any(f in text for f in fragments)
        # every held-out phrasing instantiated with this sample's own keys and values is absent
        for t in held:
            for s in _rendered(t, ex.meta["slots"]):
                assert s not in text, (t, s)
        # and the held-out questions were not used either: the question is a training one
        if "question" in ex.meta:
            assert not any(ex.meta["question"] in _rendered(t, ex.meta["slots"]) for t in held)


@pytest.mark.parametrize("task", QUESTION_TASKS)
def test_eval_samples_use_only_heldout_phrasings_and_filler(task):
    rng = random.Random(3)
    held = {t for templates in T.ALL_POOLS.values() for t in T.heldout(templates)}
    for _ in range(10):
        ex = R.example(task, TOK, 900, rng, "eval")
        assert set(ex.meta.get("templates", [])) <= held
        assert ex.meta.get("filler", "code") in R.FILLER_KINDS["eval"]
        text = TOK.decode(list(ex.ids))
        assert any(s in text for t in held for s in _rendered(t, ex.meta["slots"]))


@pytest.mark.parametrize("task", list(R.GENERATORS))
def test_generation_is_deterministic_and_exact_in_length(task):
    a = R.example(task, TOK, 700, random.Random("same"), "train", 0.3)
    b = R.example(task, TOK, 700, random.Random("same"), "train", 0.3)
    c = R.example(task, TOK, 700, random.Random("other"), "train", 0.3)
    assert a == b and a.ids != c.ids
    assert len(a.ids) == len(a.answer) == 700 and any(a.answer)
    if task != "induction":
        answer_text = TOK.decode([i for i, m in zip(a.ids, a.answer) if m])
        assert a.answers[0] in answer_text
        assert a.answer[a.prompt_len] and not any(a.answer[: a.prompt_len])


def test_too_short_is_refused_with_the_needed_length():
    with pytest.raises(ValueError, match=r"needle_multikey: length 40 is too short; this sample needs at least \d+"):
        R.example("needle_multikey", TOK, 40, random.Random(0))
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        R.example("nope", TOK, 100, random.Random(0))


@pytest.mark.parametrize("name", list(R.EVAL_TASKS))
def test_eval_tasks_make_exact_deterministic_samples(name):
    task = R.EVAL_TASKS[name]
    s = task.make(TOK, 1024, 0.25, 3)
    assert s == task.make(TOK, 1024, 0.25, 3)
    assert s != task.make(TOK, 1024, 0.25, 4)
    assert len(TOK.encode(s.prompt)) == 1024  # BOS included, as attnkit.eval.data.tasks counts
    assert task.score(s.target, s) == 1.0 and task.score(" nothing\n", s) == 0.0
    assert s.target.startswith(" ") and s.target.endswith("\n")


def test_heldout_tasks_run_in_attnkit_eval(tmp_path, capsys):
    """`attnkit eval` knows the held-out-template tasks: a needle cell and a key-value cell with the bundled
    model, per-depth scores included (the answer sits at the sample's depth)."""
    from attnkit.cli import main
    out = tmp_path / "run"
    assert main(["eval", "--model", "tiny", "--tasks", "needle_heldout,kv_listing_heldout", "--lengths", "256",
                 "--samples", "2", "--methods", "full", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rows) == ["kv_listing_heldout", "needle_heldout"]
    assert all(r["samples"] == 2 and 0.0 <= r["score"] <= 1.0 for r in rows)
    assert "needle_heldout" in capsys.readouterr().out


def test_wild_phrasings_are_training_only_and_share_nothing_with_heldout_phrasings():
    held_words = {w for templates in T.ALL_POOLS.values() for t in T.heldout(templates)
                  for w in re.findall(r"[a-z]+", t.lower())}
    rng = random.Random(11)
    for _ in range(200):
        for template in (T.wild_needle(rng), T.wild_question(rng)):
            words = set(re.findall(r"[a-z]+", template.lower())) - {"key", "value"}
            assert words and not words & held_words, template
    ex = R.example("needle_wild", TOK, 900, rng, "train")
    assert ex.meta["key"] in ex.meta["question"] and len(set(ex.meta["slots"]["key"])) == 3
    with pytest.raises(ValueError, match="training-only"):
        R.example("needle_wild", TOK, 900, rng, "eval")


def _bigrams(templates) -> set[tuple[str, str]]:
    out = set()
    for t in templates:
        for part in T.literal_parts(t):
            words = re.findall(r"[a-z]+", part.lower())
            out |= set(zip(words, words[1:]))
    return out


def test_open_phrasings_vary_over_thousands_of_words_and_carry_no_heldout_phrase():
    """Open wordings carry no two consecutive words of a held-out template; stated questions (open words, then
    an open or training fact wording) none that no training template has either."""
    held = _bigrams(t for templates in T.ALL_POOLS.values() for t in T.heldout(templates))
    trained = _bigrams(t for templates in T.ALL_POOLS.values() for t in T.pool(templates, "train"))
    rng = random.Random(5)
    vocabulary = set()
    for _ in range(400):
        for template, slots, banned in ((T.open_needle(rng), ("{key}", "{value}"), held),
                                        (T.open_question(rng), ("{key}",), held),
                                        (T.stated_question(rng), ("{key}",), held - trained)):
            assert all(template.count(s) == 1 for s in slots) and template.count("{value}") == ("{value}" in slots)
            for part in T.literal_parts(template):
                words = re.findall(r"[a-z]+", part.lower())
                assert not set(zip(words, words[1:])) & banned, template
                vocabulary |= set(words)
    assert len(vocabulary) > 500  # the wild words are 50


def test_encoded_text_is_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    """corpus.encoded: the tokenizer's ids, written once under the cache directory and then read back (a second
    call encodes nothing); another text or tokenizer gets its own file."""
    from attnkit.tokenizer import build_byte_tokenizer

    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    tok = build_byte_tokenizer()
    text = "def f(x):\n    return x + 1\n" * 50
    ids = corpus.encoded(tok, text)
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    assert len(list((tmp_path / "encoded").iterdir())) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("encoded again")

    monkeypatch.setattr(tok, "encode", refuse)
    assert corpus.encoded(tok, text) == ids
    monkeypatch.undo()
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    corpus.encoded(build_byte_tokenizer(), text + "#")
    assert len(list((tmp_path / "encoded").iterdir())) == 2
