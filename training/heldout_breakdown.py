"""needle_heldout by wording: how many held-out needles a model finds per held-out question phrasing, per
held-out fact phrasing, per filler and per kind of value (full attention, greedy), to tell a wording the model
never learnt from a distance it cannot reach.

    PYTHONPATH=src python training/heldout_breakdown.py MODEL_DIR [--length 1024] [--samples 40]
    PYTHONPATH=src python training/heldout_breakdown.py MODEL_DIR --results DIR/results.jsonl

With --results, the scores are those an `attnkit eval ... --tasks needle_heldout` run recorded (every length in the
file; the samples are rebuilt from their seeds and depths to read their wording), and nothing is generated.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnkit.eval.data.retrieval_data import EVAL_TASKS
from attnkit.eval.run.harness import depth_list


def value_kind(value: str) -> str:
    """digits, hex or word: the value formats of attnkit.eval.data.retrieval_templates.make_value."""
    return "digits" if value.isdigit() else "hex" if re.fullmatch(r"[0-9a-f]{4}|[0-9a-f]{6}|[0-9a-f]{8}", value) \
        else "word"


def _scored(args, tok):
    """(length, depth, seed, score) of every sample: from a results file, or generated here."""
    task = EVAL_TASKS["needle_heldout"]
    if args.results:
        for line in open(args.results):
            row = json.loads(line)
            if row["task"] == "needle_heldout" and row["method"] == "full":
                yield from ((row["length"], d, s, x) for d, s, x in zip(row["depths"], row["seeds"], row["scores"]))
        return
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    for seed, depth in enumerate(depth_list(args.samples, None)):  # the samples of `attnkit eval --samples N`
        sample = task.make(tok, args.length, depth, seed, "eval")
        ids = tok(sample.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=sample.max_new_tokens, do_sample=False)
        yield args.length, depth, seed, task.score(tok.decode(out[0, ids.shape[1] :]), sample)  # as `attnkit eval`


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", help="an attnkit eval results.jsonl with needle_heldout rows: read, not generated")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.model)
    found: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for length, depth, seed, score in _scored(args, tok):
        sample = EVAL_TASKS["needle_heldout"].make(tok, length, depth, seed, "eval")
        question = sample.meta["question"].replace(sample.meta["key"], "K")
        for row in (("question", question), ("fact", sample.meta["templates"][0]), ("filler", sample.meta["filler"]),
                    ("value", value_kind(sample.answers[0]))):
            found[row][0] += int(score)
            found[row][1] += 1
    for (what, text), (hit, n) in sorted(found.items()):
        print(f"{what:8s} {hit:3d} / {n:3d}  {text}")


if __name__ == "__main__":
    main()
