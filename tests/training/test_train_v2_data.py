"""Model v2's training rows (training/data_v2.py): a batch is a pure function of (seed, phase, step), rows
have the phase's shape with the loss on answers, and no held-out documentation prose reaches training."""

import json
import random
import re
import sys

import pytest

from attnkit.eval.data import corpus
from attnkit.eval.data import retrieval_templates as T
from attnkit.tokenizer import build_byte_tokenizer
from helpers import ROOT

TRAINING = ROOT / "training"
sys.path.insert(0, str(TRAINING))
import data_v2  # noqa: E402
import train_v2  # noqa: E402

TOK = build_byte_tokenizer()
STAGES = {entry["config"]["name"]: entry for entry in train_v2.curriculum()}
CONFIG = STAGES["model_v2"]["config"]


def test_config_phases_are_well_formed():
    rows = data_v2.Rows(TOK, CONFIG)
    lengths = [p["seq_len"] for p in CONFIG["phases"]]
    assert lengths == sorted(lengths) and lengths[-1] == 4096  # trained at the longest evaluated length
    for phase in CONFIG["phases"]:
        mix = rows.mix(phase)
        for kind in mix:
            assert kind in ("code", "docs", "copy") or kind.startswith("task:") or kind in data_v2.R.GENERATORS
        if phase.get("gate"):
            assert phase["gate"][0] in mix


PHASES = {p["name"]: p for p in CONFIG["phases"]}


@pytest.mark.parametrize("phase", [PHASES["A0-copy-128"], PHASES["A-recall-256"], dict(PHASES["B-512"], batch=12)],
                         ids=["A0", "A", "B"])
def test_batches_are_deterministic_and_weighted_on_answers(phase):
    rows = data_v2.Rows(TOK, CONFIG)
    ids, weights, answer, kinds = rows.batch(phase, 17)
    again = rows.batch(phase, 17)
    assert (ids == again[0]).all() and (weights == again[1]).all() and kinds == again[3]
    assert not (ids == rows.batch(phase, 18)[0]).all()
    n = phase["seq_len"]
    assert ids.shape == (phase["batch"], n + 1) and weights.shape == answer.shape == (phase["batch"], n)
    assert (ids[:, 0] == data_v2.BOS).all()
    for r, kind in enumerate(kinds):
        assert answer[r].any(), kind
        if kind not in ("code", "docs"):
            # answers carry the answer weight; other targets at most the prompt weight
            assert (weights[r][answer[r]] == CONFIG["answer_weight"]).all(), kind
            assert (weights[r][~answer[r]] <= phase["prompt_weight"]).all(), kind


def test_task_rows_from_the_documentation_topics_file_are_redrawn():
    rows = data_v2.Rows(TOK, CONFIG)
    # the mark is on nearly every line of the topics file (which tasks.py's training filler includes)
    topics_source = (corpus.stdlib_root() / "pydoc_data" / "topics.py").read_text(encoding="utf-8")
    assert topics_source.count(data_v2._TOPICS_MARK) > 0.5 * topics_source.count("\n")
    held_paragraphs = [p for p in T.doc_prose("eval").split("\n\n") if len(p) > 200][:40]
    rng = random.Random(5)
    for _ in range(30):
        ids, _, _, kind = rows.row("task:passkey", 512, 1.0, rng)
        assert kind == "task:passkey"
        text = TOK.decode(ids[1:])
        assert data_v2._TOPICS_MARK not in text
        assert not any(p[:100] in text for p in held_paragraphs)


def test_copy_rows_need_content_matching_not_a_fixed_offset():
    rows = data_v2.Rows(TOK, CONFIG)
    rng = random.Random(3)
    offsets = set()
    for _ in range(40):
        ids, weights, answer = rows._copy(256, rng)
        assert len(ids) == 257 and len(weights) == len(answer) == 256
        scored = [t for t in range(256) if answer[t]]
        assert scored == list(range(scored[0], scored[-1] + 1))
        # the separator comes right before the first copied token (whose target is not scored)
        assert ids[scored[0] - 1] == TOK.encode("\n", add_special_tokens=False)[0]
        k = len(scored) + 1  # the copied string's length
        assert all(ids[t + 1] == ids[t + 1 - (k + 1)] for t in scored)
        offsets.add(k + 1)
    assert len(offsets) > 20  # the distance back varies: no positional shortcut


# the key formats of retrieval_templates.make_key, overlapping matches (a lookahead) so that a capitalised word
# before a name does not hide it
KEY = re.compile(r"(?=(item \d+|[0-9a-f]{4}-[0-9a-f]{4}|[a-z]+-[a-z]+|[A-Z]{2}-\d+|[A-Z][a-z]+ [A-Z][a-z]+))")


def test_drill_rows_answer_each_question_with_the_value_of_its_key():
    rows = data_v2.Rows(TOK, CONFIG)
    fact_counts = set()
    for seed in range(30):
        ids, weights, answer = rows._drill(1024, 0.1, random.Random(seed))
        assert len(ids) == 1025 and len(weights) == len(answer) == 1024
        assert rows._drill(1024, 0.1, random.Random(seed)) == (ids, weights, answer)  # a function of the draws
        spans = [t for t in range(1024) if answer[t] and (t == 0 or not answer[t - 1])]
        assert len(spans) >= 4  # several questions per row, not one
        first_question = TOK.decode(ids[1 : spans[0] + 1]).rsplit("\n", 1)[0]
        facts = first_question.split("\n")[1:]  # after the intro line
        for t in spans[:-1]:  # the last answer may be cut at the row's end
            e = next(e for e in range(t, 1024) if not answer[e])
            value = TOK.decode(ids[t + 1 : e + 1]).strip()
            question = TOK.decode(ids[1 : t + 1]).rsplit("\n", 1)[1]
            # the fact holding the value names the key that the question asks about
            holding = [f for f in facts if re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", f)]
            assert any(k in question for f in holding for k in KEY.findall(f)), (question, value, holding)
        assert all(w == CONFIG["answer_weight"] for w, a in zip(weights, answer) if a)
        assert all(w == 0.1 for w, a in zip(weights, answer) if not a)
        fact_counts.add(len(facts))
    assert len(fact_counts) > 5  # the number of facts varies


def test_the_drill_config_goes_from_short_dense_rows_to_the_longest_evaluated_length():
    drill = STAGES["model_v2_drill"]["config"]
    assert drill["model"] == CONFIG["model"] and drill["tokenizer"] == CONFIG["tokenizer"]  # v2's weights go on
    assert drill["name"] != CONFIG["name"]  # so --init-from starts the drill's own schedule
    lengths = [p["seq_len"] for p in drill["phases"]]
    assert lengths == sorted(lengths) and lengths[-1] == 4096
    rows = data_v2.Rows(TOK, drill)
    assert "drill" in rows.mix(drill["phases"][0]) and "drill_mixed" in rows.mix(drill["phases"][-1])
    for phase in drill["phases"]:  # every kind of every mix builds its own rows (no fallback to code windows)
        for kind in rows.mix(phase):
            assert rows.row(kind, 512, 1.0, random.Random(kind))[3] == kind


def test_mixed_drill_values_are_not_mostly_digits():
    rows = data_v2.Rows(TOK, CONFIG)
    digits = {False: [], True: []}
    for mixed in (False, True):
        for seed in range(40):
            ids, _, answer = rows._drill(1024, 0.1, random.Random(seed), mixed_values=mixed)
            starts = [t for t in range(1024) if answer[t] and not answer[t - 1]]
            for t in starts:
                e = next((e for e in range(t, 1024) if not answer[e]), 1024)
                digits[mixed].append(TOK.decode(ids[t + 1 : e + 1]).strip().isdigit())
    assert sum(digits[False]) / len(digits[False]) > 0.6
    assert 0.2 < sum(digits[True]) / len(digits[True]) < 0.5


def test_isolated_newlines_keep_the_vocabulary_and_cut_newlines_from_indentation():
    from tokenizer_v2 import pre_tokenizer, train_bpe

    code = corpus.haystack_text("train")[:60_000]
    tok = train_bpe(600, texts=[code])
    text = "def f(x):\n    return x\n\nclass A:\n        pass\n"
    merged = [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
    assert any(t.startswith("\n") and len(t) > 1 for t in merged)  # the byte-level regex joins them
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizer(True, isolated_newlines=True)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert "\n" in pieces and not any("\n" in t and t != "\n" for t in pieces)
    assert tok.decode(ids) == text and max(ids) < len(tok)  # the same vocabulary, lossless


@pytest.mark.parametrize("kind", ["drill_far", "drill_far_stated", "kv_drill"])
def test_far_drill_rows_answer_each_question_with_the_value_of_its_key(kind):
    """The facts of a drill_far row lie anywhere in its filler (some in its first quarter), the questions come
    after, and each answer is the value of the asked key; a kv_drill row asks the keys of its JSON object."""
    rows = data_v2.Rows(TOK, CONFIG)
    n, early, answers = 2048, 0, 0
    for seed in range(12):
        ids, weights, answer = rows._row(kind, n, 0.5, random.Random(seed))
        assert len(ids) == n + 1 and len(weights) == len(answer) == n
        assert rows._row(kind, n, 0.5, random.Random(seed)) == (ids, weights, answer)
        spans = [t for t in range(n) if answer[t] and not answer[t - 1]]
        assert len(spans) >= 4
        assert spans[0] > 0.55 * n  # facts (or the object) first, then the questions
        context = TOK.decode(ids[1 : spans[0] + 1])
        lines = context.split("\n")
        for t in spans[:-1]:
            e = next(e for e in range(t, n) if not answer[e])
            value = TOK.decode(ids[t + 1 : e + 1]).strip().strip('"')
            *_, before, question = TOK.decode(ids[1 : t + 1]).rsplit("\n", 2)
            holding = [f for f in lines if re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", f)]
            if kind == "kv_drill":  # 'Key: "K"' then 'The value associated...', or 'The value of "K" in ...'
                asked = re.search(r'"([0-9a-f]{4}-[0-9a-f]{4})"', question) or re.search(r'Key: "(.+)"', before)
                key = asked.group(1)
                assert f'"{key}": "{value}",' in holding, (question, value)
            else:
                assert any(k in question for f in holding for k in KEY.findall(f)), (question, value, holding)
            answers += 1
        assert all(w == CONFIG["answer_weight"] for w, a in zip(weights, answer) if a)
        if kind == "drill_far":
            first_fact = min(i for i, line in enumerate(lines) if KEY.search(line) and i > 0)
            early += len("\n".join(lines[:first_fact])) < 0.25 * len(context)
    assert answers > 12 * 5
    if kind == "drill_far":
        assert early >= 3


@pytest.mark.parametrize("name", [name for name in STAGES if name not in ("model_v2", "model_v2_drill", "model_v2_draft")])
def test_the_configs_continuing_the_drilled_weights_are_well_formed(name):
    config = STAGES[name]["config"]
    drill = STAGES["model_v2_drill"]["config"]
    # the same weights' shapes; a continuation may raise the RoPE base (the weights carry, the rotations change)
    geometry = {k: v for k, v in config["model"].items() if k != "rope_theta"}
    assert geometry == {k: v for k, v in drill["model"].items() if k != "rope_theta"}
    assert config["model"]["rope_theta"] in (drill["model"]["rope_theta"], 500000.0)
    assert config["tokenizer"]["vocab_size"] == drill["tokenizer"]["vocab_size"]
    assert config["name"] != drill["name"]  # --init-from starts the config's own schedule
    rows = data_v2.Rows(TOK, config)
    for phase in config["phases"]:
        for kind in rows.mix(phase):
            assert rows.row(kind, 512, 1.0, random.Random(kind))[3] == kind
    assert config["tokenizer"].get("isolated_newlines", False) == (name != "model_v2_drill_more")


def test_the_chain_lists_a_lineage_that_can_carry_its_weights_from_stage_to_stage():
    chain = [entry for entry in STAGES.values() if entry["chain"]]
    configs = [entry["config"] for entry in chain]
    assert configs[0]["name"] == "model_v2" and configs[-1]["name"] == "model_v2_stated_long"  # the best weights
    assert len({c["name"] for c in configs}) == len(configs)  # one run directory per stage
    assert [bool(s.get("fp32")) for s in chain] == [True] + [False] * (len(chain) - 1)  # copying forms in float32
    for before, after in zip(configs, configs[1:]):
        assert {k: v for k, v in after["model"].items() if k != "rope_theta"} == \
            {k: v for k, v in before["model"].items() if k != "rope_theta"}, after["name"]
        assert after["model"]["rope_theta"] >= before["model"]["rope_theta"], after["name"]  # raised once, kept
        assert after["tokenizer"]["vocab_size"] == before["tokenizer"]["vocab_size"]
    for stage, config in zip(chain, configs):
        if "max_steps" in stage:  # a stage stopped early stops inside its schedule
            assert 0 < stage["max_steps"] < sum(p["steps"] for p in config["phases"]), config["name"]
    draft = STAGES["model_v2_draft"]["config"]
    assert STAGES["model_v2_draft"].get("draft") and not STAGES["model_v2_draft"]["chain"]
    assert draft["tokenizer"] == configs[-1]["tokenizer"]  # the draft takes the final model's tokenizer


@pytest.mark.parametrize("kind", ["mv_drill", "mv_drill_once", "mv_list", "mv_list_far", "mv_list_wide", "vt_drill"])
def test_multi_answer_drills_list_every_value_of_the_asked_key_in_order(kind):
    """mv_drill, mv_list: each answer lists the values of the asked key's facts in the order they appear (mv_list:
    the facts before its question, several lists per row); vt_drill: each answer is the whole chain of variables
    from the asked number, hop by hop, to its last variable."""
    rows = data_v2.Rows(TOK, CONFIG)
    n, answers, padded = 2048, 0, 0
    for seed in range(8):
        ids, weights, answer, drawn = rows.row(kind, n, 0.5, random.Random(seed))
        assert drawn == kind  # the facts fit within a few draws
        assert len(ids) == n + 1 and len(weights) == len(answer) == n
        spans = [t for t in range(n) if answer[t] and not answer[t - 1]]
        context = TOK.decode(ids[1 : spans[0] + 1]).rsplit("\n", 1)[0]
        lines = context.split("\n")
        questions = []
        for t in spans:
            e = next((e for e in range(t, n) if not answer[e]), None)
            if e is None:  # cut off by the row's end
                continue
            said = TOK.decode(ids[t + 1 : e + 1]).strip().rstrip(".")
            question = TOK.decode(ids[1 : t + 1]).rsplit("\n", 1)[1]
            questions.append(question)
            if kind.startswith("mv_list"):
                lines = TOK.decode(ids[1 : t + 1]).rsplit("\n", 1)[0].split("\n")
            if kind.startswith("mv_"):
                asked = re.escape(max(KEY.findall(question), key=len))
                facts = [line for line in lines if re.search(rf"(?<![\w-]){asked}(?![\w-])", line)]
                values = said.split(", ")
                assert len(values) == len(facts) >= 2, (question, said, facts)
                assert all(v in f for v, f in zip(values, facts)), (question, said, facts)
            else:
                number = re.search(r"value (\d+)\?", question).group(1)
                chain = said.split(", VAR ")
                assert f"{number} is assigned to VAR {chain[0]}." in lines
                assert all(f"VAR {a} is assigned to VAR {b}." in lines for a, b in zip(chain, chain[1:]))
                assert not any(line.startswith(f"VAR {chain[-1]} is assigned") for line in lines)
            answers += 1
        if kind == "mv_drill_once":  # one round: every key asked once, then padding without loss
            assert len(set(questions)) == len(questions) == len(spans) >= 2
            pads = [t for t in range(n) if ids[t + 1] == data_v2.PAD]
            assert not any(weights[t] for t in pads) and pads == list(range(pads[0] if pads else n, n))
            padded += bool(pads)
    assert answers >= 8 * {"mv_drill_once": 2, "mv_list": 2}.get(kind, 1 if kind.startswith("mv_list") else 4)
    assert padded >= (4 if kind == "mv_drill_once" else 0)


def test_mv_list_weighs_the_first_token_of_every_listed_value_more():
    """The token that decides which value comes next (the first of each listed value) carries _NEXT_BOOST times
    the answer weight; every other answer token the answer weight."""
    rows = data_v2.Rows(TOK, CONFIG)
    w = CONFIG["answer_weight"]
    for seed in range(6):
        ids, weights, answer, _ = rows.row("mv_list", 1024, 0.5, random.Random(seed))
        spans = [t for t in range(1024) if answer[t] and not answer[t - 1]]
        for t in spans:
            e = next((e for e in range(t, 1024) if not answer[e]), None)
            if e is None:
                continue
            values = TOK.decode(ids[t + 1 : e + 1]).strip().rstrip(".").split(", ")
            boosted = [u for u in range(t, e) if weights[u] == w * data_v2._NEXT_BOOST]
            assert all(v.startswith(TOK.decode([ids[u + 1]]).strip()) for u, v in zip(boosted, values))
            assert len(boosted) == len(values) and all(weights[u] == w for u in range(t, e) if u not in boosted)


@pytest.mark.parametrize("kind", ["drill_far_open", "kv_drill", "task:passkey", "task:variable_tracking",
                                  "mv_list", "code"])
def test_value_boost_weighs_the_first_letter_or_digit_of_every_answer_more(kind):
    """With value_boost, the first target holding a letter or digit of every answer span weighs value_boost times
    the answer weight; the rows and every other weight are those drawn without it. mv_list rows weigh their own
    first tokens, and plain windows have no answers: both unchanged."""
    n, w = 1024, CONFIG["answer_weight"]
    plain = data_v2.Rows(TOK, CONFIG).row(kind, n, 1.0, random.Random(kind))
    ids, weights, answer, _ = data_v2.Rows(TOK, dict(CONFIG, value_boost=3.0)).row(kind, n, 1.0, random.Random(kind))
    assert ids == plain[0] and answer == plain[2]
    changed = [i for i in range(n) if weights[i] != plain[1][i]]
    if kind in ("mv_list", "code"):
        assert not changed
        return
    spans = [t for t in range(n) if answer[t] and (t == 0 or not answer[t - 1])]
    assert len(spans) >= 1 and len(changed) == len(spans)
    for t, i in zip(spans, changed):
        assert weights[i] == 3.0 * w and all(answer[t : i + 1])
        texts = [TOK.decode([ids[u + 1]]) for u in range(t, i + 1)]
        assert any(c.isalnum() for c in texts[-1]) and not any(c.isalnum() for x in texts[:-1] for c in x)


def _sublist_at(ids: list[int], piece: list[int], end: int) -> int:
    """The last start of `piece` in ids[:end]."""
    return max(i for i in range(end - len(piece) + 1) if ids[i : i + len(piece)] == piece)


@pytest.mark.parametrize("kind", ["mv_list", "mv_list_far", "mv_list_wide"])
def test_mv_list_far_spreads_a_list_over_the_row_where_mv_list_keeps_it_close(kind):
    """mv_list's facts are at most 160 filler tokens apart; mv_list_far's and mv_list_wide's lists (numbers) also
    reach hundreds of tokens between consecutive facts at 2048 tokens (mv_list_wide's never closer than 160)."""
    rows = data_v2.Rows(TOK, CONFIG)
    widest, closest = 0, 2048
    for seed in range(16):
        ids, _, answer, _ = rows.row(kind, 2048, 1.0, random.Random(seed))
        for t in [t for t in range(2048) if answer[t] and not answer[t - 1]]:
            e = next((e for e in range(t, 2048) if not answer[e]), None)
            values = TOK.decode(ids[t + 1 : e + 1] if e else []).strip().rstrip(".").split(", ")
            if e is None or not all(v.isdigit() for v in values):
                continue
            starts = [_sublist_at(ids, TOK.encode(" " + v, add_special_tokens=False), t) for v in values]
            assert starts == sorted(starts)
            widest = max(widest, max(b - a for a, b in zip(starts, starts[1:])))
            closest = min(closest, min(b - a for a, b in zip(starts, starts[1:])))
    assert closest > 160 if kind == "mv_list_wide" else closest < 40
    assert widest <= 160 + 80 if kind == "mv_list" else widest > 300, widest  # filler + a fact line at most


def test_a_stage_is_read_by_name_and_an_unknown_one_is_one_line(tmp_path):
    assert train_v2.load_config(train_v2.CURRICULUM, "model_v2_drill") == STAGES["model_v2_drill"]["config"]
    with pytest.raises(SystemExit, match=r"--stage model_v3: not a stage of .*; the stages are model_v2, "):
        train_v2.load_config(train_v2.CURRICULUM, "model_v3")
    one = tmp_path / "one.json"
    one.write_text(json.dumps(CONFIG))
    assert train_v2.load_config(one, None) == CONFIG
    with pytest.raises(SystemExit, match=r"holds one config \(model_v2\), not a curriculum"):
        train_v2.load_config(one, "model_v2")
