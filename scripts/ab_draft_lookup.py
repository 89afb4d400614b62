"""A/B, in one process: attnkit's lookup-guessing self-draft against its behaviour before one change,
emulated by patching the lookup (``--compare``):

- ``ride-along``: a round's first guesses ride along with the draft's catch-up forward (since
  2026-11-23) against a first forward that takes only the catch-up (the round's first guesses then
  waited for the draft's own first token); the old way is emulated by withholding the lookup's guesses
  at the start of each round.
- ``sizing``: the guesses run to the round's cap (since 2026-11-23, later that day) against guesses
  sized from their match length by the target's verification cost (as prompt lookup sizes its own
  proposals); the old way is emulated by switching the lookup's sizing back on for each guess.

Each repeat runs plain decoding, then both variants on the same prompt, in an order that alternates. Every
run must give the plain greedy tokens. Prints each run's speed-up over plain and the draft forwards per
round, then medians.

    OMP_NUM_THREADS=2 python scripts/ab_draft_lookup.py --compare sizing --context 16384 --prompts 4 --repeats 2

Measured 2026-11-23 (AMD EPYC, 2 threads):
- ``ride-along`` (results/ab_lookup_ride_along_16k.txt, with sized guesses, the behaviour then): 3.33
  against 3.82 draft forwards per round (the same tokens); the new way faster in 6 runs of 8 (per run
  0.90-1.21x, median 1.02x), 1.36x against 1.27x plain (medians). A first run of the same comparison gave
  8 of 8 (1.02-1.23x, median 1.06x; 1.35x against 1.25x plain).
- ``sizing`` (results/ab_draft_lookup_sizing_16k.txt): 2.58 against 3.33 draft forwards per round (the
  same tokens); guesses to the cap faster in 8 runs of 8 (per run 1.03-1.30x, median 1.17x), 1.44x
  against 1.25x plain (medians).
"""


from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from attnkit.model import load_model_for_length  # noqa: E402
from attnkit.runner import generate  # noqa: E402
from attnkit.speculative import speculative_generate  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import PromptLookupDraft  # noqa: E402


def self_draft_parser(description: str, repeats: int, confidence: bool = True) -> argparse.ArgumentParser:
    """The options of a side-by-side run of `self` drafts (also scripts/explore_layer_skip_draft.py and
    scripts/ab_draft_confidence.py, which compares thresholds and so takes no single `--confidence`):
    the benchmark's 16k setting by default."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--model", default="tiny:yarn=8")
    ap.add_argument("--draft", default="snapkv:budget_tokens=512")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=12)
    if confidence:
        ap.add_argument("--confidence", type=float, default=0.3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv=None) -> int:
    ap = self_draft_parser(__doc__, repeats=2)
    ap.add_argument("--compare", choices=("ride-along", "sizing"), required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, args.context + args.new_tokens)

    lookup_after = PromptLookupDraft.lookup_after
    new, old = {"ride-along": ("ride along", "before"), "sizing": ("to the cap", "sized")}[args.compare]
    emulate_old = {"on": False}

    def patched_lookup(self, context, drafted, gamma):
        if not emulate_old["on"]:
            return lookup_after(self, context, drafted, gamma)
        if args.compare == "ride-along":
            return [] if not drafted else lookup_after(self, context, drafted, gamma)
        self.adaptive = True  # sized by the verification cost, from the match length
        try:
            return lookup_after(self, context, drafted, gamma)
        finally:
            self.adaptive = False

    PromptLookupDraft.lookup_after = patched_lookup
    kw = dict(draft_spec=args.draft, draft_lookup=True, draft_confidence=args.confidence, gamma=args.gamma,
              max_new_tokens=args.new_tokens, stop_at_eos=False)
    prompts = [code_prompt(model, args.context, seed) for seed in range(args.prompts)]
    speedup: dict[str, list[float]] = {new: [], old: []}
    forwards: dict[str, list[float]] = {new: [], old: []}
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            plain = generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
            order = [new, old] if (r + p) % 2 == 0 else [old, new]
            for name in order:
                emulate_old["on"] = name == old
                s = speculative_generate(model, ids, "self", **kw)
                if s.token_ids != plain.token_ids:
                    raise SystemExit(f"{name}: speculative tokens differ from plain greedy decoding")
                speedup[name].append(s.stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s)
                forwards[name].append(s.stats.draft_forwards / s.stats.rounds)
            print(f"repeat {r + 1} prompt {p + 1}: {new} {speedup[new][-1]:.2f}x plain "
                  f"({forwards[new][-1]:.2f} draft forwards per round), {old} {speedup[old][-1]:.2f}x "
                  f"({forwards[old][-1]:.2f})", flush=True)
    for name in speedup:
        print(f"{name}: median {statistics.median(speedup[name]):.2f}x plain, "
              f"{statistics.mean(forwards[name]):.2f} draft forwards per round")
    ratio = [a / b for a, b in zip(speedup[new], speedup[old])]
    print(f"{new} / {old} per run: median {statistics.median(ratio):.2f}, range {min(ratio):.2f}-{max(ratio):.2f}, "
          f"faster in {sum(x > 1 for x in ratio)} of {len(ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
