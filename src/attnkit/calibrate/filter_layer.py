"""Select-Attention's filter layer: sweep ``L`` on calibration tasks and pick the best.

Select-Attention is section 4.2 of Taniguchi, Xiao, Dong, Oyamada, Onizuka: "Attention スコアの分布類似性を用いた
大規模言語モデルの動作効率化および省メモリ化". The paper chose layer 15 of Llama3 "by validation on the benchmark" (section 4.2: "ベンチマークでの検証により
Llama3 では 15 層目が最も適切"). This tool does the same on attnkit's synthetic tasks: for every candidate ``L``
it generates the calibration samples (:func:`attnkit.calibrate.patterns.calibration_samples`, never an evaluation
sample) with ``select:filter_layer=L,p_decode=p`` and scores them with the task's own metric
(:mod:`attnkit.eval.data.tasks`), beside ``full`` on the same samples. The best ``L`` has the highest mean score;
on a tie the smaller ``L`` wins, since it keeps fewer cached layers (memory per token
``2 (L + 1) kv_heads head_dim + hidden`` elements, reported per row) and a smaller ``L`` is what the method
is for. The table also gives the mean fraction of the context the later layers saw while decoding.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import calibration_samples
from attnkit.errors import AttnkitError
from attnkit.eval.data.task_registry import TASKS
from attnkit.methods.select import Select, check_p, kept_fraction
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.runner import generate

DEFAULT_TASKS = ("passkey", "kv_retrieval")


def select_bytes_per_token(model: LoadedModel, layer: int) -> int:
    """Bytes per token ``select`` keeps with filter layer `layer`: K/V of layers 0..L + one hidden state."""
    geo = model.geometry
    size = model.dtype.itemsize
    if layer >= geo.n_layers - 1:
        return 2 * geo.n_layers * geo.n_kv_heads * geo.head_dim * size
    return 2 * (layer + 1) * geo.n_kv_heads * geo.head_dim * size + model.hf.config.hidden_size * size


def sweep_filter_layer(model: LoadedModel, *, tasks: Sequence[str] = DEFAULT_TASKS, length: int = 1024,
                       samples: int = 2, seed: int = 0, split: str = "calibration", p: float = 0.95,
                       layers: Sequence[int] | None = None, prefill_select: bool = False,
                       value_weighted: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """Score ``select`` at every filter layer in `layers` (default ``0 .. n_layers-2``) and ``full``; the result
    (JSON-ready) has one row per layer, the full score and the best layer."""
    try:
        check_p("p", p)
    except ValueError as exc:
        raise AttnkitError(str(exc)) from None
    n = model.geometry.n_layers
    candidates = list(range(max(1, n - 1))) if layers is None else list(layers)
    bad = [x for x in candidates if not isinstance(x, int) or not 0 <= x < n]
    if bad or not candidates:
        raise AttnkitError(f"filter layers {bad or candidates} are out of range; the model has {n} layers, "
                           f"allowed 0..{n - 1}")
    prompts = calibration_samples(model, length, list(tasks), samples, seed, split)
    say = progress or (lambda _msg: None)

    def run(method) -> tuple[list[float], float | None]:
        """Scores of the prompts, and the fraction of the context a select method kept over them."""
        scores, stats = [], []
        for _info, sample, _ids in prompts:
            out = generate(model, sample.prompt, method, max_new_tokens=sample.max_new_tokens, stop="\n")
            scores.append(float(TASKS[sample.task].score(out.text, sample)))
            stats.append(out.stats.method_stats)
        return scores, kept_fraction(*stats)

    say("full")
    full_scores, _ = run("full")
    full = sum(full_scores) / len(full_scores)
    rows = []
    for layer in candidates:
        say(f"filter layer {layer}")
        method = Select(filter_layer=layer, p_decode=p, p_prefill=p, prefill_select=prefill_select,
                        value_weighted=value_weighted)
        scores, kept = run(method)
        score = sum(scores) / len(scores)
        rows.append({"filter_layer": layer, "score": round(score, 6),
                     "score_rel_full": round(score / full, 6) if full else None,
                     "kept_fraction": None if kept is None else round(kept, 6),
                     "bytes_per_token": select_bytes_per_token(model, layer), "scores": scores})
    best = max(rows, key=lambda r: (r["score"], -r["filter_layer"]))
    return {
        "model": model.spec, "n_layers": n, "tasks": list(tasks), "length": length, "samples": samples, "seed": seed,
        "split": split, "p_decode": p, "prefill_select": prefill_select, "value_weighted": value_weighted,
        "prompts": [info for info, _, _ in prompts],
        "full_score": round(full, 6), "full_bytes_per_token": select_bytes_per_token(model, n - 1),
        "best_filter_layer": best["filter_layer"], "rows": rows,
    }


def format_table(result: dict) -> str:
    lines = [f"{result['model']}: select p_decode={result['p_decode']} on {','.join(result['tasks'])} at "
             f"{result['length']} tokens ({len(result['prompts'])} prompts); full scores {result['full_score']:.3f}, "
             f"{result['full_bytes_per_token']} B/token",
             f"{'layer':>5} {'score':>7} {'rel':>6} {'kept':>6} {'B/token':>8}"]
    for r in result["rows"]:
        rel = "-" if r["score_rel_full"] is None else f"{r['score_rel_full']:.2f}"
        kept = "-" if r["kept_fraction"] is None else f"{r['kept_fraction']:.3f}"
        mark = "  <- best" if r["filter_layer"] == result["best_filter_layer"] else ""
        lines.append(f"{r['filter_layer']:>5} {r['score']:>7.3f} {rel:>6} {kept:>6} {r['bytes_per_token']:>8}{mark}")
    return "\n".join(lines)


def main(args) -> int:
    """``attnkit calibrate filter-layer`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length + 64, 4096))
    result = sweep_filter_layer(model, tasks=args.tasks, length=args.length, samples=args.samples, seed=args.seed,
                                split=args.split, p=args.p, layers=args.layers, prefill_select=args.prefill_select,
                                value_weighted=args.value_weighted,
                                progress=progress_to_stderr)
    print(format_table(result))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["select_bytes_per_token", "sweep_filter_layer", "format_table", "main"]
