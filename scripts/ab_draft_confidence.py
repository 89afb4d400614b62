"""Side by side, in one process: the lookup-guessing self-draft with several confidence thresholds
(``--draft-confidence``: a round's drafting stops after the first token the draft gives less than the
threshold, :meth:`attnkit.speculative.drafts.ModelDraft._unsure`) and draft weights (``--draft-weights``:
the model's own, or int8 copies, :mod:`attnkit.speculative.int8_weights`): every threshold with every
kind of weights.

Each repeat runs plain decoding on a prompt, then every variant on the same prompt, in an order that
rotates from run to run. Every run must give the plain greedy tokens. Prints each run's speed-up over
the plain run it follows, then per variant: the ratio of the median speeds (the benchmark's headline
measure), the median of the per-run ratios, the pooled ratio (all tokens over all time; every run
decodes the same number of tokens) and the tokens and draft forwards per round.

    OMP_NUM_THREADS=2 python scripts/ab_draft_confidence.py --confidences 0.2,0.3,0.45,0.6
    OMP_NUM_THREADS=2 python scripts/ab_draft_confidence.py --confidences 0.3 --weights same,int8

Measured 2026-11-25 (AMD EPYC, 2 threads, 16k, the four prompts, two repeats): see the README
("Where the CPU changes the seed's picture"), results/ab_draft_confidence_16k.txt and
results/ab_draft_weights_16k.txt.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ab_draft_lookup import self_draft_parser  # noqa: E402 (this directory's sibling script)
from attnkit.errors import AttnkitError  # noqa: E402
from attnkit.model import load_model_for_length  # noqa: E402
from attnkit.runner import generate  # noqa: E402
from attnkit.speculative import make_draft, speculative_generate  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import check_confidence  # noqa: E402
from attnkit.speculative.int8_weights import check_draft_weights  # noqa: E402


def main(argv=None) -> int:
    ap = self_draft_parser(__doc__, repeats=2, confidence=False)
    ap.add_argument("--confidences", default="0.2,0.3,0.45,0.6",
                    help="comma-separated thresholds, each a probability in (0, 1)")
    ap.add_argument("--weights", default="same", help="comma-separated draft weights (same, int8)")
    args = ap.parse_args(argv)
    try:
        thresholds = [check_confidence(float(c)) for c in args.confidences.split(",")]
        weights = [check_draft_weights(w.strip()) for w in args.weights.split(",")]
    except (ValueError, AttnkitError) as e:
        ap.error(f"--confidences / --weights: {e}")
    torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, args.context + args.new_tokens)
    drafts = {(f"{c}" if len(weights) == 1 else f"{c}/{w}"): make_draft("self", args.draft, model, lookup=True,
                                                                          confidence=c, weights=w)
              for c in thresholds for w in weights}
    variants = list(drafts)
    prompts = [code_prompt(model, args.context, seed) for seed in range(args.prompts)]
    plain_speed: list[float] = []
    speed: dict[str, list[float]] = {v: [] for v in variants}
    tokens_per_round: dict[str, list[float]] = {v: [] for v in variants}
    forwards_per_round: dict[str, list[float]] = {v: [] for v in variants}
    run = 0
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            plain = generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
            plain_speed.append(plain.stats.decode_tokens_per_s)
            order = variants[run % len(variants):] + variants[:run % len(variants)]
            run += 1
            line = []
            for c in order:
                s = speculative_generate(model, ids, drafts[c], gamma=args.gamma, max_new_tokens=args.new_tokens,
                                         stop_at_eos=False)
                if s.token_ids != plain.token_ids:
                    raise SystemExit(f"{c}: speculative tokens differ from plain greedy decoding")
                speed[c].append(s.stats.decode_tokens_per_s)
                tokens_per_round[c].append(s.stats.tokens_per_target_forward)
                forwards_per_round[c].append(s.stats.draft_forwards / s.stats.rounds)
                line.append(f"{c}: {speed[c][-1] / plain_speed[-1]:.2f}x")
            print(f"repeat {r + 1} prompt {p + 1} (plain {plain_speed[-1]:.1f} tok/s): {', '.join(line)}", flush=True)
    plain_median = statistics.median(plain_speed)
    for c in variants:
        per_run = [a / b for a, b in zip(speed[c], plain_speed)]
        pooled = sum(1 / b for b in plain_speed) / sum(1 / a for a in speed[c])
        print(f"{c}: ratio of medians {statistics.median(speed[c]) / plain_median:.2f}, "
              f"median per run {statistics.median(per_run):.2f} ({min(per_run):.2f}-{max(per_run):.2f}), "
              f"pooled {pooled:.2f}; {statistics.mean(tokens_per_round[c]):.2f} tokens and "
              f"{statistics.mean(forwards_per_round[c]):.2f} draft forwards per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
