"""Exploration, in one process: a `self` draft that also skips decoder layers (the cheaper-draft idea of
Draft & Verify, Zhang et al. 2024, and LayerSkip, Elhoushi et al. 2024, on top of the compressed cache)
against the `self` draft that runs every layer.

On this CPU a `self` draft forward of the bundled model costs 0.75-0.83 of a plain 16k decoding step
(the weights and the per-layer Python are the target's own), so skipping layers is the obvious way to
make it cheaper. Each repeat runs plain decoding, then the draft with each set of skipped layers (``-``:
none) on the same prompt; every run must give the plain greedy tokens (the target verifies with every
layer and the full cache, so the output stays lossless). Prints each run's speed-up over plain,
acceptance, tokens and draft forwards per round, then medians per set.

    OMP_NUM_THREADS=2 python scripts/explore_layer_skip_draft.py --context 16384 --prompts 4 --skip=-,5,4,3,45

Not adopted: see results/explore_layer_skip_draft_16k.txt (2026-11-23, AMD EPYC, 2 threads, the draft's
lookup guesses still sized by the verification cost then): medians 1.29x plain with every layer
(acceptance 0.89), 0.91x skipping layer 5 (0.55), 0.90x skipping 4 (0.56), 1.10x skipping 3 (0.72), 0.88x
skipping 4 and 5 (0.51). The bundled model has six layers; dropping any one of them costs far more
acceptance than it saves time.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ab_draft_lookup import self_draft_parser  # noqa: E402 (this directory's sibling script)
from attnkit.methods.base import Step  # noqa: E402
from attnkit.model import load_model_for_length  # noqa: E402
from attnkit.runner import generate, logits_of, run_decoder_layers  # noqa: E402
from attnkit.speculative import speculative_generate  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import ModelDraft, PromptLookupDraft  # noqa: E402


class LayerSkippingSelfDraft(ModelDraft):
    """The `self` draft (compressed cache, lookup guesses) running only the layers not in `skip`. The
    skipped layers' draft caches are released at the first proposal (the shared prompt pass filled them)."""

    def __init__(self, method: str, skip: tuple[int, ...], confidence: float):
        super().__init__(None, method, lookup=PromptLookupDraft(), confidence=confidence)
        self.skip = skip

    def describe(self) -> str:
        return f"{super().describe()} skipping layers {list(self.skip)}" if self.skip else super().describe()

    def _feed(self, tokens: list[int], start: int) -> torch.Tensor:
        model, session = self.drafter, self.session
        for i in self.skip:
            session.cache.layers[i] = None
        self.forwards += 1
        positions = torch.arange(start, start + len(tokens), device=model.device)
        base = model.hf.model
        hidden = base.embed_tokens(torch.tensor(tokens, device=model.device)[None])
        kept = [i for i in range(len(base.layers)) if i not in self.skip]
        hidden = run_decoder_layers(model, hidden, positions, Step(session, "decode", positions), kept)
        return logits_of(model, base.norm(hidden[0]))


def main(argv=None) -> int:
    ap = self_draft_parser(__doc__, repeats=1)
    ap.add_argument("--skip", default="-,5,4,3,45",
                    help="comma-separated sets of skipped layers, each written as its digits ('-': none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, args.context + args.new_tokens)
    n_layers = model.geometry.n_layers
    sets = [() if s == "-" else tuple(int(c) for c in s) for s in args.skip.split(",")]
    bad = [i for s in sets for i in s if not 0 <= i < n_layers]
    if bad:
        ap.error(f"layer {bad[0]} does not exist: the model has layers 0..{n_layers - 1}")
    kw = dict(gamma=args.gamma, max_new_tokens=args.new_tokens, stop_at_eos=False)
    prompts = [code_prompt(model, args.context, seed) for seed in range(args.prompts)]
    runs: dict[tuple, list[dict]] = {s: [] for s in sets}
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            plain = generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
            step = 1.0 / plain.stats.decode_tokens_per_s
            for skip in sets:
                spec = speculative_generate(model, ids, LayerSkippingSelfDraft(args.draft, skip, args.confidence), **kw)
                if spec.token_ids != plain.token_ids:
                    raise SystemExit(f"skipping {skip}: speculative tokens differ from plain greedy decoding")
                s = spec.stats
                row = {"speedup": s.decode_tokens_per_s * step, "acceptance": s.acceptance_rate,
                       "tokens": s.new_tokens / s.rounds, "forwards": s.draft_forwards / s.rounds,
                       "draft_steps": s.draft_s / s.rounds / step, "verify_steps": s.verify_s / s.rounds / step}
                runs[skip].append(row)
                print(f"repeat {r + 1} prompt {p + 1} skipping {list(skip)}: {row['speedup']:.2f}x plain, acceptance "
                      f"{row['acceptance']:.2f}, per round {row['tokens']:.2f} tokens, {row['forwards']:.2f} draft "
                      f"forwards = {row['draft_steps']:.2f} steps, verification {row['verify_steps']:.2f} steps",
                      flush=True)
    for skip, rows in runs.items():
        def med(key, rows=rows):
            return statistics.median(row[key] for row in rows)
        print(f"skipping {list(skip)}: median {med('speedup'):.2f}x plain, acceptance {med('acceptance'):.2f}, "
              f"{med('tokens'):.2f} tokens and {med('forwards'):.2f} draft forwards ({med('draft_steps'):.2f} steps) "
              f"per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
