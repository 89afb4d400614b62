"""needle_heldout by wording: how many held-out needles a model finds per held-out question phrasing and per
held-out fact phrasing (full attention, greedy), to tell a wording the model never learnt from a distance it
cannot reach.

    PYTHONPATH=src python training/heldout_breakdown.py MODEL_DIR [--length 1024] [--samples 40]
"""

from __future__ import annotations

import argparse
import collections

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnkit.eval.harness import depth_list
from attnkit.eval.retrieval_data import EVAL_TASKS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    task = EVAL_TASKS["needle_heldout"]
    found: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for seed, depth in enumerate(depth_list(args.samples, None)):  # the samples of `attnkit eval --samples N`
        sample = task.make(tok, args.length, depth, seed, "eval")
        ids = tok(sample.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=sample.max_new_tokens, do_sample=False)
        ok = int(task.score(tok.decode(out[0, ids.shape[1] :]), sample))  # the score `attnkit eval` gives
        question = sample.meta["question"].replace(sample.meta["key"], "K")
        for row in (("question", question), ("fact", sample.meta["templates"][0]), ("filler", sample.meta["filler"])):
            found[row][0] += ok
            found[row][1] += 1
    for (what, text), (hit, n) in sorted(found.items()):
        print(f"{what:8s} {hit:3d} / {n:3d}  {text}")


if __name__ == "__main__":
    main()
