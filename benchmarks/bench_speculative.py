"""Speculative decoding speed, side by side in one process: attnkit plain vs attnkit speculative vs
transformers' plain ``generate`` vs transformers' own assisted generation, on the same model and prompts.

    # prompt lookup on code completion (transformers: prompt_lookup_num_tokens), proposals sized from
    # the match length (results/bench_spec_prompt_lookup.txt)
    python benchmarks/bench_speculative.py prompt_lookup --model tiny --context 2048 --new-tokens 128 \
        --gamma 4 --adaptive-gamma --max-gamma 16
    # a draft model (transformers: assistant_model)
    python benchmarks/bench_speculative.py draft_model --model tiny --draft tiny-draft --context 2048
    # self-speculation with a compressed draft cache at long context (transformers has no equivalent:
    # its plain decoding is the reference); --gamma 4, 8, 16 at 16k and 16 at 32k in results/
    python benchmarks/bench_speculative.py self --model random:llama:layers=6,hidden=256,heads=8,kv_heads=2,\
head_dim=32,intermediate=768 --draft streaming:budget_tokens=512,sinks=4 --context 16384 --new-tokens 64 \
        --gamma 16 --no-hf
    # the same with a trained model: tiny with its RoPE extended by YaRN to 32k (results/*_yarn_*)
    python benchmarks/bench_speculative.py self --model tiny:yarn=8 --draft snapkv:budget_tokens=512 \
        --context 32000 --new-tokens 64 --gamma 8 --no-hf --prompts 2 --repeats 2 --threads 2
    # ... and with the draft verifying prompt-lookup guesses (add --draft-lookup; results/*_yarn_lookup_*)
    # ... and stopping a round after a token the draft is unsure of (results/*_yarn_lookup_conf_*:
    # --gamma 12 --draft-lookup --draft-confidence 0.3 --prompts 4; *_2prompts: --prompts 2)
    # ... and drafting with int8 copies of the weights (results/*_yarn_lookup_conf_int8_*: add
    # --draft-weights int8)

Each result's header line names the CPU and the settings it ran with. Prompt lookup's speed-up depends
strongly on the prompt, so it is measured over many prompts (``--prompts 64``), not a handful.

Greedy decoding throughout. Every decoder runs on every prompt in every repeat, in turn (interleaved,
so machine drifts hit all alike); figures are medians over prompts x repeats, and a last line gives the
spread of the per-run speed-ups (speculative / plain on the same prompt and repeat) and each prompt's
median (in the JSON: ``per_run_x_attnkit_plain``); for attnkit speculative, one more line says where a
round's time goes, in decoding steps of the paired plain run (``per_round``:
:func:`attnkit.bench.speculative.time_per_round`). Decode tok/s counts the
tokens after the first over the time after the first token (attnkit: its stats; transformers: a
streamer timestamps the first new token). Prompts are held-out standard-library code (LongBench lcc
style, :func:`attnkit.bench.speculative.code_prompt`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import attnkit
from attnkit.bench.speculative import code_prompt, format_time_per_round, time_per_round
from attnkit.bench.speed import check_benchmark_tokens
from attnkit.eval.run.provenance import cpu_name
from attnkit.speculative import make_draft, speculative_generate
from attnkit.speculative.int8_weights import DRAFT_WEIGHTS


class _Clock:
    """A transformers streamer that timestamps the first new token and counts the calls that bring
    new tokens (one per target forward in assisted generation)."""

    def __init__(self):
        self.first = None
        self.calls = 0
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:  # generate() first streams the prompt
            self._prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()
        self.calls += 1

    def end(self):
        pass


def hf_generate(model, ids: torch.Tensor, new_tokens: int, **assist) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Clock(_Clock, BaseStreamer):
        pass

    clock = Clock()
    inputs = ids[None]
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.hf.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=model.hf.generation_config.pad_token_id or 0, streamer=clock, **assist)
    end = time.perf_counter()
    tokens = out[0, ids.shape[0]:].tolist()
    decode_s = end - clock.first if clock.first else float("nan")
    return {"tokens": tokens, "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
            "tokens_per_s": len(tokens) / (end - t0), "tokens_per_target_forward": len(tokens) / max(1, clock.calls),
            "acceptance_rate": None}


def ours(result) -> dict:
    s = result.stats
    return {"tokens": result.token_ids, "decode_tokens_per_s": s.decode_tokens_per_s,
            "tokens_per_s": s.new_tokens / (s.prefill_s + s.decode_s),
            "tokens_per_target_forward": getattr(s, "tokens_per_target_forward", 1.0),
            "acceptance_rate": getattr(s, "acceptance_rate", None), "stats": s.as_dict()}


def load(spec: str, context: int):
    if spec.startswith("random:") and "context=" not in spec:
        return attnkit.load_model(spec, context=context)
    return attnkit.load_model(spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["prompt_lookup", "draft_model", "self"])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--draft", default=None, help="draft_model: model spec (default tiny-draft); self: draft cache "
                                                  "method (default streaming:budget_tokens=256,sinks=4); "
                                                  "prompt_lookup: max_ngram=N,min_ngram=M")
    ap.add_argument("--draft-lookup", action="store_true", help="draft_model/self: the draft verifies prompt-lookup "
                    "guesses several tokens per forward (TriForce's hierarchy)")
    ap.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                    help="draft_model/self: stop drafting after a token the draft gave less than probability P")
    ap.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default=None,
                    help="draft_model/self: int8 drafts with weight-only int8 copies of the linear layers")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--adaptive-gamma", action="store_true", help="gamma from the observed acceptance; prompt "
                    "lookup sizes each proposal from its match length (up to --max-gamma)")
    ap.add_argument("--max-gamma", type=int, default=None, help="cap of adaptive gamma (default max(2 gamma, 8))")
    ap.add_argument("--verify-cost", type=float, default=None,
                    help="extra cost of one more verified token relative to a 1-token target step, for "
                         "adaptive gamma (default attnkit.speculative.draft.DEFAULT_VERIFY_COST)")
    ap.add_argument("--prompts", type=int, default=3, help="different code prompts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    ap.add_argument("--hf-confidence-threshold", type=float, default=None,
                    help="transformers' assistant_confidence_threshold (default: transformers' own, 0.4)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args(argv)
    try:
        check_benchmark_tokens(args.new_tokens, name="--new-tokens")
    except attnkit.AttnkitError as e:
        ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load(args.model, args.context + args.new_tokens + 64)
    draft = make_draft(args.kind, model, draft=args.draft, draft_lookup=args.draft_lookup,
                       draft_confidence=args.draft_confidence, draft_weights=args.draft_weights or "same")
    prompts = [code_prompt(model, args.context, seed) for seed in range(args.prompts)]

    verify_cost = {} if args.verify_cost is None else {"verify_cost": args.verify_cost}
    decoders = {
        "attnkit plain": lambda ids: ours(attnkit.generate(model, ids, max_new_tokens=args.new_tokens,
                                                           stop_at_eos=False)),
        f"attnkit speculative {draft.describe()}": lambda ids: ours(speculative_generate(
            model, ids, draft, gamma=args.gamma, adaptive_gamma=args.adaptive_gamma, max_gamma=args.max_gamma,
            max_new_tokens=args.new_tokens, stop_at_eos=False, **verify_cost)),
    }
    if not args.no_hf:
        decoders["transformers plain"] = lambda ids: hf_generate(model, ids, args.new_tokens)
        if args.kind == "prompt_lookup":
            ngram = getattr(draft, "max_ngram", 2)
            decoders[f"transformers prompt_lookup_num_tokens={args.gamma}"] = lambda ids: hf_generate(
                model, ids, args.new_tokens, prompt_lookup_num_tokens=args.gamma, max_matching_ngram_size=ngram)
        elif args.kind == "draft_model":
            assistant = draft.model.hf
            # the same number of drafted tokens per round as ours, held constant; the assistant's early
            # stop on low confidence (transformers' default 0.4) stays as transformers ships it unless
            # --hf-confidence-threshold is given (0 = always draft gamma tokens)
            assistant.generation_config.num_assistant_tokens = args.gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            if args.hf_confidence_threshold is not None:
                assistant.generation_config.assistant_confidence_threshold = args.hf_confidence_threshold
            decoders[f"transformers assistant_model={draft.model.spec}"] = lambda ids: hf_generate(
                model, ids, args.new_tokens, assistant_model=assistant)

    # warm-up on a short prompt, outside the measurement
    for fn in decoders.values():
        fn(prompts[0][-64:])
    runs: dict[str, list[dict]] = {name: [] for name in decoders}
    for r in range(args.repeats):
        for p, ids in enumerate(prompts):
            for name, fn in decoders.items():
                res = fn(ids)
                runs[name].append(res)
                print(f"repeat {r + 1}/{args.repeats} prompt {p + 1}/{len(prompts)} {name}: "
                      f"{res['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)

    plain_name, spec_name = list(decoders)[:2]
    reference = [res["tokens"] for res in runs[plain_name]]
    rows = []
    for name, results in runs.items():
        acc = [r["acceptance_rate"] for r in results if r["acceptance_rate"] is not None]
        rows.append({
            "decoder": name, "model": model.spec, "context": args.context, "new_tokens": args.new_tokens,
            "gamma": args.gamma, "prompts": args.prompts, "repeats": args.repeats, "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in results),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "tokens_per_target_forward": statistics.median(r["tokens_per_target_forward"] for r in results),
            "acceptance_rate": statistics.median(acc) if acc else None,
            "same_tokens_as_attnkit_plain": sum(r["tokens"] == ref for r, ref in zip(results, reference)) / len(results),
        })
    by = {row["decoder"]: row for row in rows}
    for row in rows:
        row["x_attnkit_plain"] = row["decode_tokens_per_s"] / by[plain_name]["decode_tokens_per_s"]
        if "transformers plain" in by:
            row["x_transformers_plain"] = row["decode_tokens_per_s"] / by["transformers plain"]["decode_tokens_per_s"]

    head = (f"{'decoder':<64} {'decode tok/s':>12} {'x ak plain':>10} {'x hf plain':>10} {'e2e tok/s':>10} "
            f"{'accept':>7} {'tok/fwd':>8} {'same':>5}")
    adaptive = f" adaptive (max {args.max_gamma or max(2 * args.gamma, 8)})" if args.adaptive_gamma else ""
    print(f"{model.spec}: {args.kind}, {args.context}-token code prompts x{args.prompts}, {args.new_tokens} new "
          f"tokens, gamma {args.gamma}{adaptive}, {args.repeats} repeats, {torch.get_num_threads()} threads, "
          f"{cpu_name()}")
    print(f"draft: {draft.describe()}")  # the table cuts long decoder names
    print(head)
    print("-" * len(head))
    for row in rows:
        acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        xhf = f"{row['x_transformers_plain']:.2f}" if "x_transformers_plain" in row else "-"
        print(f"{row['decoder'][:64]:<64} {row['decode_tokens_per_s']:>12.1f} {row['x_attnkit_plain']:>10.2f} "
              f"{xhf:>10} {row['tokens_per_s']:>10.1f} {acc:>7} {row['tokens_per_target_forward']:>8.2f} "
              f"{row['same_tokens_as_attnkit_plain']:>5.2f}")
    hf_assist = [n for n in by if n.startswith("transformers ") and n != "transformers plain"]
    if hf_assist:
        ratio = by[spec_name]["decode_tokens_per_s"] / by[hf_assist[0]]["decode_tokens_per_s"]
        print(f"attnkit speculative / {hf_assist[0]}: {ratio:.2f}x decode tok/s")
    # each run's speed-up on its own prompt and repeat (the two ran back to back): their spread, and each
    # prompt's median over the repeats
    per_run = [s["decode_tokens_per_s"] / p["decode_tokens_per_s"] for s, p in zip(runs[spec_name], runs[plain_name])]
    per_prompt = [statistics.median(per_run[i::len(prompts)]) for i in range(len(prompts))]  # run = r * P + p
    spread = {"median": statistics.median(per_run), "min": min(per_run), "max": max(per_run),
              "per_prompt": per_prompt}
    by[spec_name]["per_run_x_attnkit_plain"] = spread
    print(f"attnkit speculative / attnkit plain per run ({len(per_run)} runs): median {spread['median']:.2f}, "
          f"range {spread['min']:.2f}-{spread['max']:.2f}; per prompt " + " ".join(f"{x:.2f}" for x in per_prompt))
    # where a round's time goes, in decoding steps of the plain run each speculative run was paired with
    split = time_per_round([(r["stats"], p["decode_tokens_per_s"]) for r, p in zip(runs[spec_name], runs[plain_name])])
    if split:
        by[spec_name]["per_round"] = split
        print(format_time_per_round(split))
    print("same: share of runs whose tokens equal attnkit plain greedy (attnkit speculative must be 1.00)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if by[spec_name]["same_tokens_as_attnkit_plain"] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
