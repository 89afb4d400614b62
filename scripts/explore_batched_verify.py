"""Exploration: what one forward costs that carries the target's verification rows (full cache) and the
`self` draft's rows (compressed cache) together, against the two forwards apart.

Self-speculation's draft is the target itself: the projections, MLPs and per-layer Python are the same,
only attention differs. A pipelined loop could verify the tokens drafted by the draft's previous forward
inside its next one (the target lagging one draft forward behind), paying the fixed cost of a forward
once for both. This times the three kinds of forward at one context length, each rolled back after it:
a plain one-token step, a draft forward (``--draft-rows`` tokens), a verification forward (N tokens),
and both in one forward (the rows split between the two sessions inside every layer's attention call).

    OMP_NUM_THREADS=2 python scripts/explore_batched_verify.py --context 16384

Measured 2026-11-23 (AMD EPYC, 2 threads, 16k, 5 draft rows, two passes;
results/explore_batched_verify_16k.txt), batched against apart, in plain steps: 1.29-1.30 against
1.63-1.66 for 1 target row, 1.47-1.53 against 2.07-2.12 for 3, 1.77-1.84 against 2.21 for 5, 2.10 against
2.52-2.58 for 8 (a first run: 1.37-1.46 against 1.69, 1.71-1.82 against 2.15-2.17, 2.15-2.20 against
2.81-2.82, 2.66 against 3.15-3.23). It saves 0.3-0.6 of a plain step per forward, because each target
row's attention over 16k keys (about 0.2 steps) stays. A loop built on it would save about one forward's
fixed cost per round (an estimated 6 % at 16k); scripts/explore_pipelined_self.py tries one (greedy) and
finds it slower than attnkit's loop. Not built into the library.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnkit.methods.base import Step, parse_method_spec  # noqa: E402
from attnkit.model import load_model_for_length  # noqa: E402
from attnkit.runner import logits_of, new_session, run_decoder_layers  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import drop_newest  # noqa: E402
from attnkit.speculative.generate import VerifyingFull, prefill_sessions  # noqa: E402


class RowSplit:
    """A step whose first `a` rows attend as the target's verification and the rest as the draft."""

    def __init__(self, a: int, target: Step, draft: Step):
        self.a, self.target, self.draft = a, target, draft

    def attention(self, layer, q, k, v, scaling, native_window):
        a = self.a
        out_target = self.target.attention(layer, q[:, :, :a], k[:, :, :a], v[:, :, :a], scaling, native_window)
        out_draft = self.draft.attention(layer, q[:, :, a:], k[:, :, a:], v[:, :, a:], scaling, native_window)
        return torch.cat([out_target, out_draft], 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:yarn=8")
    ap.add_argument("--draft", default="snapkv:budget_tokens=512")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--draft-rows", type=int, default=5)
    ap.add_argument("--target-rows", default="1,3,5,8")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, args.context + 64)
    ids = code_prompt(model, args.context, 0)
    target = new_session(model, VerifyingFull(), args.context, 64)
    draft = new_session(model, parse_method_spec(args.draft), args.context, 64)
    base = model.hf.model
    start = args.context - 1  # the target and the draft hold the prompt but its last token

    def forward(tokens: int, positions: torch.Tensor, step) -> torch.Tensor:
        hidden = base.embed_tokens(torch.randint(3, 250, (tokens,))[None])
        return logits_of(model, base.norm(run_decoder_layers(model, hidden, positions, step)[0]))

    def plain():
        pos = torch.tensor([start])
        forward(1, pos, Step(target, "decode", pos))
        drop_newest(target, 1)

    def drafting(nd):
        pos = torch.arange(start, start + nd)
        forward(nd, pos, Step(draft, "decode", pos))
        drop_newest(draft, nd)

    def verifying(nt):
        pos = torch.arange(start, start + nt)
        forward(nt, pos, Step(target, "prefill", pos, False))
        drop_newest(target, nt)

    def batched(nt, nd):
        pt, pd = torch.arange(start, start + nt), torch.arange(start + nt - 1, start + nt - 1 + nd)
        forward(nt + nd, torch.cat([pt, pd]), RowSplit(nt, Step(target, "prefill", pt, False), Step(draft, "decode", pd)))
        drop_newest(target, nt)
        drop_newest(draft, nd)

    def median_ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    with torch.inference_mode():
        prefill_sessions(model, [target, draft], ids[:-1])
        nd = args.draft_rows
        for _ in range(args.passes):
            step = median_ms(plain)
            print(f"plain step {step:.2f} ms")
            for nt in (int(x) for x in args.target_rows.split(",")):
                d, v = median_ms(lambda: drafting(nd)), median_ms(lambda nt=nt: verifying(nt))
                b = median_ms(lambda nt=nt: batched(nt, nd))
                print(f"{nt} target rows, {nd} draft rows: apart {d:.2f} + {v:.2f} = {d + v:.2f} ms "
                      f"({(d + v) / step:.2f} steps); batched {b:.2f} ms ({b / step:.2f} steps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
