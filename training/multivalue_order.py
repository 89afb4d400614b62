"""niah_multivalue step by step: with the right values so far given (teacher forcing), which of the key's values a
model lists next (full attention, greedy), to tell a model that cannot find the next fact from one that cannot
copy a value or stop. Prints a row per step: how often the model gave each value (by order of appearance in the
text; "other" for a string that is none of them), and in how many samples every step was right. `--gap N`:
the same samples' keys and values with the four facts N tokens of held-out filler apart (the task's intro and
question, 40 filler tokens before the first fact and after the last), to see how far apart a model still finds
the next fact.

    PYTHONPATH=src python training/multivalue_order.py MODEL_DIR [--length 1024] [--samples 20] [--gap N]
"""

from __future__ import annotations

import argparse
import collections
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnkit.eval.data import retrieval_data as R
from attnkit.eval.data import tasks
from attnkit.eval.run.harness import depth_list


def spaced(tok, gap: int, seed: int, length: int = 1024) -> tuple[list[int], list[str]]:
    """The key and values of niah_multivalue's sample `seed` at `length` tokens, its four facts `gap` tokens of
    held-out documentation apart: (ids, values)."""
    rng = random.Random(f"multivalue_order|{gap}|{seed}")
    sample = tasks.make_niah_multivalue(tok, length, 0.5, seed, "eval")
    key, values = sample.meta["key"], list(sample.answers)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)
    ids = tok(tasks.MAGIC_INTRO + "\n").input_ids
    ids += R.filler(tok, "docs", "eval", 40, rng)
    for i, v in enumerate(values):
        ids += R.filler(tok, "docs", "eval", gap if i else 0, rng)
        ids += enc("\n" + tasks.MAGIC_NEEDLE.format(key=key, value=v) + "\n")
    return ids + R.filler(tok, "docs", "eval", 40, rng) + enc(tasks.MULTIVALUE_QUESTION.format(key=key)), values


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gap", type=int, default=None, help="facts this many filler tokens apart")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    given: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    n_values = in_order = 0
    for seed, depth in enumerate(depth_list(args.samples, None)):  # the samples of `attnkit eval --samples N`
        if args.gap is None:
            sample = tasks.make_niah_multivalue(tok, args.length, depth, seed, "eval")
            ids, values = tok(sample.prompt).input_ids, list(sample.answers)  # values in order of appearance
        else:
            ids, values = spaced(tok, args.gap, seed, args.length)
        n_values, right = len(values), 0
        for step, value in enumerate(values):
            ids = ids + tok.encode(" " if step == 0 else ", ", add_special_tokens=False)
            value_ids = tok.encode(value, add_special_tokens=False)
            x = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(value_ids) + 1,
                                     do_sample=False)
            text = tok.decode(out[0, len(ids):]).strip().rstrip(",.")
            given[step][values.index(text) + 1 if text in values else "other"] += 1
            right += text == value
            ids = ids + value_ids
        in_order += right == n_values
    columns = list(range(1, n_values + 1)) + ["other"]
    where = f"at {args.length} tokens" if args.gap is None else f"with facts {args.gap} tokens apart"
    print(f"{args.samples} samples {where}; row: the value listed at that step, columns: which value it was")
    print("step  " + "  ".join(f"{c!s:>5}" for c in columns))
    for step in range(n_values):
        print(f"{step + 1:4d}  " + "  ".join(f"{given[step][c]:5d}" for c in columns))
    print(f"every step right: {in_order} of {args.samples}")


if __name__ == "__main__":
    main()
