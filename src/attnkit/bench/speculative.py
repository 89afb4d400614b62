"""Speed of speculative decoding against plain decoding, interleaved in one process (``attnkit bench
--speculate KIND``, :func:`bench_speculative`; ``benchmarks/bench_speculative.py`` adds transformers' own assisted generation).

Each repeat runs plain greedy decoding and speculative decoding on the same prompt, in turn, so drifts
of the machine hit both alike; figures are medians over repeats. In greedy mode the two outputs must
be identical, and the row says whether they were.
"""

from __future__ import annotations

import statistics
import sys

import torch

from attnkit.bench.speed import check_benchmark_tokens
from attnkit.errors import AttnkitError
from attnkit.eval.data import corpus
from attnkit.eval.data.tasks import make_code_completion
from attnkit.generation import encode_prompt
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.runner import generate
from attnkit.speculative.config import SpeculativeConfig, speculative_config
from attnkit.speculative.draft import DraftSource
from attnkit.speculative.factory import make_draft
from attnkit.speculative.generate import speculative_generate
from attnkit.validate import whole


def code_prompt(model: LoadedModel, length: int, seed: int = 0) -> torch.Tensor:
    """A code-completion prompt of `length` tokens (held-out standard-library source, LongBench lcc
    style); for lengths beyond one held-out file, a window of the held-out files joined together."""
    try:
        return encode_prompt(model, make_code_completion(model.tokenizer, length, seed=seed).prompt)[-length:]
    except ValueError:
        ids = model.tokenizer(corpus.haystack_text("heldout")).input_ids
        if len(ids) < length:
            raise AttnkitError(f"the held-out code has only {len(ids)} tokens, fewer than {length}") from None
        start = torch.Generator().manual_seed(seed)
        offset = int(torch.randint(0, len(ids) - length + 1, (1,), generator=start))
        return torch.tensor(ids[offset:offset + length], dtype=torch.long, device=model.device)


def run_speculative_bench(model: LoadedModel, prompt_ids: torch.Tensor, new_tokens: int,
                          config: SpeculativeConfig | str | DraftSource = "prompt_lookup", *, repeats: int = 3,
                          progress=None, **options) -> list[dict]:
    """Rows for plain decoding and speculative decoding (greedy) under `config` (a config, a source name
    or a DraftSource, with `options`: SpeculativeConfig field names): medians of decode tok/s, end-to-end
    tok/s and prefill s, acceptance and tokens per target forward, speedups over plain. `progress`, if
    given, is called after each repeat with ``(repeat, plain stats, speculative stats)``."""
    check_benchmark_tokens(new_tokens)
    whole("repeats", repeats, 1)
    config = speculative_config(config, **options)
    loop = config.drafting_with(make_draft(config, model))  # one draft source for every repeat
    gamma, adaptive_gamma = config.gamma, config.adaptive_gamma
    kw = dict(max_new_tokens=new_tokens, stop_at_eos=False)
    # warm-up (lazy initialisation, allocator) outside the measurement
    generate(model, prompt_ids[-64:], **{**kw, "max_new_tokens": 4})
    speculative_generate(model, prompt_ids[-64:], loop, **{**kw, "max_new_tokens": 4})
    plain_runs, spec_runs, same = [], [], True
    for r in range(repeats):
        plain = generate(model, prompt_ids, "full", **kw)
        spec = speculative_generate(model, prompt_ids, loop, **kw)
        same &= plain.token_ids == spec.token_ids
        plain_runs.append(plain.stats.as_dict())
        spec_runs.append(spec.stats.as_dict())
        if progress:
            progress(r, plain.stats, spec.stats)

    def med(runs, key):
        return statistics.median(run[key] for run in runs)

    def end_to_end(run):
        return run["new_tokens"] / (run["prefill_s"] + run["decode_s"])

    base = {"model": model.spec, "context": int(prompt_ids.shape[0]), "new_tokens": new_tokens, "repeats": repeats}
    plain_row = dict(base, decoder="plain", decode_tokens_per_s=med(plain_runs, "decode_tokens_per_s"),
                     tokens_per_s=statistics.median(end_to_end(r) for r in plain_runs),
                     prefill_s=med(plain_runs, "prefill_s"), acceptance_rate=None, tokens_per_target_forward=1.0)
    decoder = f"speculative {loop.source.describe()} gamma={gamma}{' adaptive' if adaptive_gamma else ''}"
    spec_row = dict(base, decoder=decoder,
                    decode_tokens_per_s=med(spec_runs, "decode_tokens_per_s"),
                    tokens_per_s=statistics.median(end_to_end(r) for r in spec_runs),
                    prefill_s=med(spec_runs, "prefill_s"), acceptance_rate=med(spec_runs, "acceptance_rate"),
                    tokens_per_target_forward=med(spec_runs, "tokens_per_target_forward"),
                    mean_gamma=med(spec_runs, "mean_gamma"), same_output_as_plain=same,
                    per_round=time_per_round([(s, p["decode_tokens_per_s"]) for s, p in zip(spec_runs, plain_runs)]))
    for row in (plain_row, spec_row):
        row["decode_speedup"] = row["decode_tokens_per_s"] / plain_row["decode_tokens_per_s"]
        row["end_to_end_speedup"] = row["tokens_per_s"] / plain_row["tokens_per_s"]
    return [plain_row, spec_row]


def time_per_round(pairs: list[tuple[dict, float]]) -> dict | None:
    """Where a speculative round's time goes, from ``(SpeculativeStats.as_dict(), plain tok/s)`` pairs,
    the second being the decoding speed of the plain run paired with that speculative run: per round,
    tokens emitted, tokens drafted, draft forwards, and the time spent drafting, verifying and in the
    rest of the loop, in plain decoding steps. Pooled over the runs (sums over all their rounds, so runs
    with more rounds weigh more); None when no run had a round and a timed plain pair. ``tokens /
    (draft_steps + verify_steps + other_steps)`` is then the pooled speed-up."""
    pairs = [(s, 1.0 / plain_tok_s) for s, plain_tok_s in pairs if s["rounds"] and plain_tok_s > 0]
    if not pairs:
        return None
    rounds = sum(s["rounds"] for s, _ in pairs)

    def pooled(value) -> float:
        return sum(value(s, step) for s, step in pairs) / rounds

    return {"tokens": pooled(lambda s, step: s["tokens_per_target_forward"] * s["rounds"]),
            "drafted": pooled(lambda s, step: s["drafted_tokens"]),
            "draft_forwards": pooled(lambda s, step: s["draft_forwards"]),
            "draft_steps": pooled(lambda s, step: s["draft_s"] / step),
            "verify_steps": pooled(lambda s, step: s["verify_s"] / step),
            "other_steps": pooled(lambda s, step: (s["decode_s"] - s["draft_s"] - s["verify_s"]) / step)}


def format_time_per_round(split: dict) -> str:
    each = f" ({split['draft_steps'] / split['draft_forwards']:.2f} each)" if split["draft_forwards"] else ""
    return (f"per round (time in decoding steps of the paired plain run, pooled over runs): {split['tokens']:.2f} "
            f"tokens out; {split['drafted']:.1f} drafted in {split['draft_forwards']:.1f} draft forwards = "
            f"{split['draft_steps']:.2f} steps{each}; verification {split['verify_steps']:.2f} steps; the rest of "
            f"the loop {split['other_steps']:.2f}")


def format_rows(rows: list[dict]) -> str:
    head = (f"{'decoder':<58} {'decode tok/s':>12} {'x plain':>8} {'e2e tok/s':>10} {'x plain':>8} "
            f"{'accept':>7} {'tok/fwd':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = "-" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}"
        tpf = "-" if r.get("tokens_per_target_forward") is None else f"{r['tokens_per_target_forward']:.2f}"
        lines.append(f"{r['decoder'][:58]:<58} {r['decode_tokens_per_s']:>12.1f} {r['decode_speedup']:>8.2f} "
                     f"{r['tokens_per_s']:>10.1f} {r['end_to_end_speedup']:>8.2f} {acc:>7} {tpf:>8}")
    lines += [format_time_per_round(r["per_round"]) for r in rows if r.get("per_round")]
    same = [r["same_output_as_plain"] for r in rows if "same_output_as_plain" in r]
    if same:
        lines.append(f"greedy output identical to plain decoding: {'yes' if all(same) else 'NO'}")
    return "\n".join(lines)


def bench_speculative(model: str | LoadedModel, config: SpeculativeConfig, *, context: int, new_tokens: int,
                      repeats: int = 3, seed: int = 0, log="stderr") -> list[dict]:
    """``attnkit bench --speculate ...``: a code prompt of `context` tokens (seeded by `seed`), `repeats`
    interleaved runs of plain and speculative greedy decoding of `new_tokens` tokens; the rows of
    :func:`run_speculative_bench` (print them with :func:`format_rows` or as JSON). `model` is a model spec
    (loaded for ``context + new_tokens`` positions) or a loaded model; progress goes to `log` (a file; the default "stderr" is the current sys.stderr; None: quiet)."""
    check_benchmark_tokens(new_tokens)
    whole("context", context, 1)
    if log == "stderr":  # the stream of the moment (not the one at import time, which may be closed since)
        log = sys.stderr
    if not isinstance(model, LoadedModel):
        model = load_model_for_length(model, context + new_tokens)
    prompt = code_prompt(model, context, seed)

    def progress(r, plain, spec_stats):
        print(f"  repeat {r + 1}/{repeats}: plain {plain.decode_tokens_per_s:.1f} tok/s, speculative "
              f"{spec_stats.decode_tokens_per_s:.1f} tok/s (acceptance {spec_stats.acceptance_rate:.2f})",
              file=log, flush=True)

    if log is not None:
        print(f"bench {model.spec}: {context}-token code prompt, {new_tokens} new tokens, greedy, "
              f"{repeats} interleaved repeats", file=log)
    return run_speculative_bench(model, prompt, new_tokens, config, repeats=repeats,
                                 progress=progress if log is not None else None)
