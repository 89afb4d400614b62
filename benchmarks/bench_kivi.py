"""Accuracy and KV bytes of KIVI quantization (``kivi``) against full attention on the bundled model.

    python benchmarks/bench_kivi.py --model tiny --lengths 1024,2048 --new-tokens 64 --out results/bench_kivi.json

For each prompt length (a held-out code prompt, as ``attnkit bench --speculative`` uses) full attention generates
``--new-tokens`` tokens greedily; every spec is then fed those same tokens (teacher forcing), and each step's
logits are compared with full's: the share of steps whose top-1 token agrees, the mean and largest absolute
logit difference (the largest over the vocabulary, averaged / maximised over steps). The spec's own greedy
generation gives the length of the prefix it shares with full's, and its KV bytes held at the end over full's.
Decoding speed is ``attnkit bench`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import attnkit
from attnkit.bench.speculative import code_prompt
from attnkit.forward import forward, logits_of, prefill
from attnkit.methods.spec import parse_method_spec, split_spec_list
from attnkit.session import Step, new_session

DEFAULT_SPECS = ("kivi:bits=8,kivi:bits=4,kivi:bits=2,kivi:bits=4,residual=32,kivi:bits=2,residual=32,"
                 "snapkv:budget=0.3,snapkv:budget=0.3+kivi:bits=4,snapkv:budget=0.3+kivi:bits=2")


@torch.inference_mode()
def teacher_forced(model, spec: str, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: the logits each step gives when `tokens` are fed after the prompt."""
    session = new_session(model, parse_method_spec(spec), len(ids), len(tokens))
    out = [logits_of(model, prefill(model, session, torch.tensor([ids], device=model.device))[:, -1])[0]]
    for i, token in enumerate(tokens[:-1]):
        hidden = forward(model, torch.tensor([[token]], device=model.device), len(ids) + i,
                         lambda pos: Step(session, "decode", pos))
        out.append(logits_of(model, hidden[:, -1])[0])
    return torch.stack(out).float()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--specs", default=DEFAULT_SPECS, help="comma-separated method specs (attnkit bench --methods)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = attnkit.load_model(args.model)
    rows = []
    print(f"{'length':>6} {'spec':<34} {'top-1':>6} {'mean err':>9} {'max err':>8} {'prefix':>7} {'KV/full':>8}")
    for length in (int(x) for x in args.lengths.split(",")):
        ids = code_prompt(model, length).tolist()
        full = attnkit.generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False,
                                keep_logits=True)
        ref = torch.stack(full.logits).float()
        for spec in split_spec_list(args.specs, "--specs"):
            logits = teacher_forced(model, spec, ids, full.token_ids)
            err = (logits - ref).abs().amax(-1)
            own = attnkit.generate(model, ids, parse_method_spec(spec), max_new_tokens=args.new_tokens,
                                   stop_at_eos=False)
            prefix = next((i for i, (a, b) in enumerate(zip(own.token_ids, full.token_ids)) if a != b),
                          len(full.token_ids))
            row = {"model": args.model, "length": length, "new_tokens": args.new_tokens, "spec": spec,
                   "top1": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                   "mean_err": err.mean().item(), "max_err": err.max().item(), "prefix": prefix,
                   "kv_over_full": own.stats.final_kv_bytes / full.stats.final_kv_bytes}
            rows.append(row)
            print(f"{length:>6} {spec[:34]:<34} {row['top1']:>6.3f} {row['mean_err']:>9.3f} {row['max_err']:>8.3f} "
                  f"{prefix:>3}/{args.new_tokens:<3} {row['kv_over_full']:>8.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
