"""Running the long-output tasks' cells (:mod:`attnkit.eval.data.long_output`): what :func:`attnkit.eval.run.cells.run_cell`
calls for ``continuation`` and ``recall_after_stretch``.

Both feed their tokens through the method's own decode path one token per step, batched as rows of one session
where the method allows it (a cell's prompts share their length): ``continuation`` with
:func:`attnkit.continuation.teacher_force` (the reference continuation, scored by its likelihood),
``recall_after_stretch`` with :func:`attnkit.continuation.generate_after` fed stepwise (the stretch and the question
after the needle prompt, then a greedy answer; its decode rate counts every token after the prompt). Each returns
the cell's calls (``(sample index, generation)`` per sample of a call, as :func:`attnkit.eval.run.cells.run_cell`
reads them) and its prefill work.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from attnkit.continuation import generate_after, teacher_force
from attnkit.eval.data.long_output import CONTINUATION, RECALL, continuation_bits_per_byte
from attnkit.model import LoadedModel
from attnkit.recipe import Recipe
from attnkit.runner import Generation, GenerationStats


@dataclass
class Scored:
    """A sample scored from its likelihoods rather than a generated text: its score and its run's statistics."""

    score: float
    stats: GenerationStats
    text: str = ""


def _work(items) -> dict:
    return {"context_prefills": len(items), "prefill_tokens": sum(len(item.prompt) for item in items)}


def run_continuation(model: LoadedModel, recipe: Recipe, items, batch_size: int, progress_bar=None
                     ) -> tuple[list[list], dict]:
    """Every continuation's bits per byte under `recipe`, `batch_size` samples per teacher-forced batch."""
    method, calls = recipe.method(), []
    for s in range(0, len(items), batch_size):
        part = items[s:s + batch_size]
        forced = teacher_force(model, [it.prompt for it in part], [it.continuation for it in part], method)
        calls.append([(s + k, Scored(continuation_bits_per_byte(model.tokenizer, it, f.nll), f.stats))
                      for k, (it, f) in enumerate(zip(part, forced, strict=True))])
        if progress_bar is not None:
            progress_bar.update(len(part))
    return calls, _work(items)


def run_recall(model: LoadedModel, recipe: Recipe, items, batch_size: int, progress_bar=None
               ) -> tuple[list[list], dict]:
    """Every recall item's greedy answer under `recipe` after its stretch and question, fed one token per step."""
    method, calls = recipe.method(), []
    by_setting: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        by_setting.setdefault((item.max_new_tokens, item.meta.get("stop", "\n")), []).append(i)
    for (max_new, stop), idx in by_setting.items():
        for s in range(0, len(idx), batch_size):
            part = idx[s:s + batch_size]
            t0 = time.perf_counter()
            gens = generate_after(model, [list(items[i].prompt) for i in part],
                                  [[list(items[i].stretch) + list(items[i].question)] for i in part], method,
                                  max_new_tokens=max_new, stop=stop, stepwise=True)
            # the call's decoding: its time less the prefills of its sessions (one per prompt length, or per prompt
            # where the method keeps one sequence per session), which run one after another
            prefills = {len(items[i].prompt) if method.batches else i: g[0].stats.prefill_s
                        for i, g in zip(part, gens, strict=True)}
            decode_s = time.perf_counter() - t0 - sum(prefills.values())
            calls.append([(i, _with_decode_rate(g[0], items[i], decode_s)) for i, g in zip(part, gens, strict=True)])
            if progress_bar is not None:
                progress_bar.update(len(part))
    return calls, _work(items)


def _with_decode_rate(gen: Generation, item, decode_s: float) -> Generation:
    """`gen` with its decoding counted from the end of the prompt's prefill: the stretch and the question fed and
    the answer generated, one token per step, over the call's `decode_s` (a call's rows decode side by side), rather
    than the answer's few tokens alone."""
    steps = len(item.stretch) + len(item.question) + len(gen.token_ids) - 1
    stats = dataclasses.replace(gen.stats, decode_s=decode_s,
                                decode_tokens_per_s=steps / decode_s if steps > 0 and decode_s > 0 else 0.0)
    return dataclasses.replace(gen, stats=stats)


RUNS = {CONTINUATION: run_continuation, RECALL: run_recall}
