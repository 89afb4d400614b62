"""Exploration (greedy only): a pipelined self-speculation loop in which the target verifies, inside each
forward of the draft, the tokens the draft's previous forward drafted, against plain decoding and
against attnkit's loop (`speculative_generate`), side by side in one process.

Self-speculation's draft is the target itself with a compressed cache: every forward here carries the
target's rows (the tokens it has not yet seen, attending over its full cache) and the draft's rows (the
tokens it has not seen followed by prompt-lookup guesses, attending over its SnapKV cache); inside each
layer's attention call the rows are split between the two sessions (scripts/explore_batched_verify.py
times one such forward). After the forward the target's predictions check the drafted tokens in order
(greedy: a token passes when it is the target's argmax); the first miss ends the chain with the target's
token, and both caches drop what they hold beyond the kept tokens. The draft's chain stops after a
token it gives less than `--confidence` or at `--gamma` unverified tokens; a forward then carries the
target's rows only, and its last prediction is the next token. Every run must give the plain greedy
tokens.

    OMP_NUM_THREADS=2 python scripts/explore_pipelined_self.py --context 16384 --prompts 4 --repeats 2

Not part of the library: sampling, stop strings and the statistics of `speculative_generate` are not
handled here; it measures whether the pipeline is worth building.

Measured 2026-11-23 (AMD EPYC, 2 threads, 16k; results/explore_pipelined_self_16k.txt; every run gave the
plain tokens): negative. Pipelined against `speculative_generate`, per run, on four prompts x two
repeats in alternating order (the script as committed): median 0.88, slower in 7 runs of 8 (1.07x against
1.24x plain). Earlier runs with `speculative_generate` always first: median 1.13 on two prompts, 0.82 on
four prompts x two repeats; never stopping the chain (`--pipeline-confidence 0`): 0.94. The pipeline
takes fewer forwards than `speculative_generate` takes draft and verification forwards together (32, 36,
12 and 42 against 40, 40, 12 and 48 on the four prompts), but each carries target rows, most chains end
where the draft stops (confidence or gamma) so that a forward with the target's rows alone must still
give the next token, and a rejection is seen one forward late. Not built.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ab_draft_lookup import self_draft_parser  # noqa: E402 (this directory's sibling script)
from attnkit.methods.base import Step, parse_method_spec  # noqa: E402
from attnkit.model import load_model_for_length  # noqa: E402
from attnkit.runner import generate, logits_of, new_session, run_decoder_layers  # noqa: E402
from attnkit.speculative import speculative_generate  # noqa: E402
from attnkit.speculative.bench import code_prompt  # noqa: E402
from attnkit.speculative.drafts import DraftRun, PromptLookupDraft, drop_newest  # noqa: E402
from attnkit.speculative.generate import VerifyingFull, prefill_sessions  # noqa: E402
from explore_batched_verify import RowSplit  # noqa: E402


@torch.inference_mode()
def pipelined_generate(model, ids: torch.Tensor, new_tokens: int, draft_spec: str, gamma: int,
                       confidence: float) -> tuple[list[int], float, int]:
    """Greedy tokens, decoding seconds (after the first token) and forwards after the prompt."""
    n = ids.shape[0]
    target = new_session(model, VerifyingFull(), n, new_tokens + gamma + 2)
    draft = new_session(model, parse_method_spec(draft_spec), n, new_tokens + 2 * gamma + 2)
    lookup = PromptLookupDraft()
    lookup.start(DraftRun(model, ids, new_tokens, None, None, None, False, 0.0))
    base = model.hf.model
    hidden = prefill_sessions(model, [target, draft], ids)
    context = ids.tolist() + [int(logits_of(model, hidden)[-1].argmax())]
    fed_target = fed_draft = n  # tokens of context + chain each cache holds (a prefix)
    chain: list[int] = []  # drafted, not yet verified, after the context
    drafting = True
    forwards = 0
    t0 = time.perf_counter()
    while len(context) - n < new_tokens:
        seq = context + chain
        target_tokens = seq[fed_target:]
        draft_tokens: list[int] = []
        if drafting:
            guesses = lookup.lookup_after(context, chain, max(0, gamma - len(chain) - 1))
            draft_tokens = seq[fed_draft:] + guesses
        pt = torch.arange(fed_target, fed_target + len(target_tokens))
        pd = torch.arange(fed_draft, fed_draft + len(draft_tokens))
        target_step = Step(target, "prefill", pt, False)
        if draft_tokens:
            step = RowSplit(len(target_tokens), target_step, Step(draft, "decode", pd))
            positions = torch.cat([pt, pd])
        else:
            step, positions = target_step, pt
        hidden = base.embed_tokens(torch.tensor(target_tokens + draft_tokens)[None])
        logits = logits_of(model, base.norm(run_decoder_layers(model, hidden, positions, step)[0]))
        forwards += 1
        predicted = logits[:len(target_tokens)].argmax(-1).tolist()  # target's token after each target row
        fed_target += len(target_tokens)
        # the draft's new tokens: guesses while its argmax agrees, then its own token
        new_chain: list[int] = []
        if draft_tokens:
            rows = logits[len(target_tokens):]
            first = len(seq) - fed_draft - 1  # row of the last unseen token
            kept = 0
            for j in range(len(guesses) + 1):
                row = rows[first + j]
                tok = int(row.argmax())
                new_chain.append(tok)
                if float(row.softmax(-1)[tok]) < confidence or len(chain) + len(new_chain) >= gamma:
                    drafting = False
                if j == len(guesses) or tok != guesses[j] or not drafting:
                    break
                kept += 1
            drop_newest(draft, len(guesses) - kept)  # the guesses after the kept ones (and a kept last one)
            fed_draft = len(seq) + kept
        else:
            drafting = True  # the target caught up: draft again next forward
        # verify the chain (and the first new draft token) with the target's predictions, in order
        offset = len(seq) - len(target_tokens)  # index of the first target row in seq
        accepted, correction = 0, None
        for j, tok in enumerate(chain + new_chain[:1]):
            pred = predicted[len(context) - 1 + j - offset]
            if pred != tok:
                correction = pred
                break
            accepted += 1
        if correction is None and not new_chain:  # nothing left to check: the target's next token
            correction = predicted[-1]
        full = chain + new_chain
        context.extend(full[:accepted] + ([correction] if correction is not None else []))
        chain = full[accepted:] if correction is None else []
        keep = len(context) - 1 if correction is not None else len(context) + len(chain) - 1
        if fed_target > keep:
            drop_newest(target, fed_target - keep)
            fed_target = keep
        if fed_draft > len(context) + len(chain) - 1:
            drop_newest(draft, fed_draft - (len(context) + len(chain) - 1))
            fed_draft = len(context) + len(chain) - 1
        if correction is not None:
            drafting = True
    return context[n:n + new_tokens], time.perf_counter() - t0, forwards


def main(argv=None) -> int:
    ap = self_draft_parser(__doc__, repeats=2)
    ap.add_argument("--pipeline-confidence", type=float, default=None,
                    help="the pipelined loop's stopping threshold (default: --confidence; 0: never stop)")
    args = ap.parse_args(argv)
    pipe_confidence = args.confidence if args.pipeline_confidence is None else args.pipeline_confidence
    torch.set_num_threads(args.threads)
    model = load_model_for_length(args.model, args.context + args.new_tokens)
    prompts = [code_prompt(model, args.context, seed) for seed in range(args.prompts)]
    kw = dict(draft_spec=args.draft, draft_lookup=True, draft_confidence=args.confidence, gamma=args.gamma,
              max_new_tokens=args.new_tokens, stop_at_eos=False)
    pipelined_generate(model, prompts[0][-64:], 8, args.draft, args.gamma, pipe_confidence)  # warm-up
    ours, pipe = [], []
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            plain = generate(model, ids, "full", max_new_tokens=args.new_tokens, stop_at_eos=False)
            for which in ("spec", "pipe") if (r + p) % 2 == 0 else ("pipe", "spec"):  # alternating order
                if which == "spec":
                    spec = speculative_generate(model, ids, "self", **kw)
                else:
                    tokens, seconds, forwards = pipelined_generate(model, ids, args.new_tokens, args.draft,
                                                                   args.gamma, pipe_confidence)
            if spec.token_ids != plain.token_ids or tokens != plain.token_ids:
                raise SystemExit(f"prompt {p + 1}: tokens differ from plain greedy decoding")
            plain_s = (args.new_tokens - 1) / plain.stats.decode_tokens_per_s
            ours.append(spec.stats.decode_tokens_per_s / plain.stats.decode_tokens_per_s)
            pipe.append(plain_s / seconds)
            print(f"repeat {r + 1} prompt {p + 1}: speculative_generate {ours[-1]:.2f}x plain "
                  f"({spec.stats.rounds} rounds, {spec.stats.draft_forwards} draft forwards), pipelined "
                  f"{pipe[-1]:.2f}x ({forwards} forwards)", flush=True)
    print(f"speculative_generate: median {statistics.median(ours):.2f}x plain; pipelined: median "
          f"{statistics.median(pipe):.2f}x; pipelined / speculative_generate per run: median "
          f"{statistics.median(b / a for a, b in zip(ours, pipe)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
