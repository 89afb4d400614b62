"""The evaluation harness behind ``attnkit eval``: tasks x lengths x methods, one result row per cell.

    rows = run_eval(model, ["passkey", "perplexity"], [1024, 2048], ["full", "window:window=512"], samples=8)
    print(format_table(rows))

Every method of a (task, length) pair sees the same samples. Sample ``i`` uses eval seed ``seed + i``;
its needle depth is ``(i + 0.5) / samples`` unless explicit depths are given (then every depth gets
``samples`` samples). Generation is greedy and stops at the first newline (every task's answer is on
the first line of the continuation). ``perplexity`` is bits per byte of held-out standard-library text
(lower is better). ``full`` runs first in each (task, length) pair so that every row can carry its
score relative to full.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import platform
import random
import subprocess
import time
from pathlib import Path

import torch

from attnkit.errors import AttnkitError
from attnkit.eval import corpus
from attnkit.eval.tasks import ALL_TASKS, TASKS, Sample
from attnkit.methods.base import Method, parse_method_spec
from attnkit.model import LoadedModel
from attnkit.runner import generate, token_nll

PERPLEXITY = "perplexity"
RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.txt"

ROW_FIELDS = (
    "run_id", "model", "task", "length", "method", "method_params", "method_spec", "samples", "depths", "seeds",
    "score", "scores", "higher_is_better", "score_rel_full", "prefill_s", "decode_tokens_per_s", "peak_kv_bytes",
    "final_kv_bytes", "wall_s", "versions", "git_commit", "timestamp", "predictions",
)


# --------------------------------------------------------------------------------------------------
# provenance


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """Versions of attnkit, torch, transformers and Python."""
    import transformers

    import attnkit

    return {"attnkit": attnkit.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the git checkout attnkit is imported from, or None (not a checkout, no git, no commits)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


# --------------------------------------------------------------------------------------------------
# checking the request


def _check_request(model: LoadedModel, tasks, lengths, methods, samples, depths) -> tuple[list[Method], list[float]]:
    for label, values in (("tasks", tasks), ("lengths", lengths), ("methods", methods)):
        if isinstance(values, (str, bytes)) or not list(values):
            raise AttnkitError(f"{label} must be a non-empty list, got {values!r}")
        if len(set(values)) != len(values):
            raise AttnkitError(f"{label} has duplicates: {list(values)}")
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown:
        raise AttnkitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                           f"available: {', '.join(ALL_TASKS)}")
    for length in lengths:
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            raise AttnkitError(f"lengths must be integers >= 2 (tokens), got {length!r}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise AttnkitError(f"samples must be an integer >= 1, got {samples!r}")
    if depths is None:
        depth_list = [(i + 0.5) / samples for i in range(samples)]
    else:
        depth_list = []
        if isinstance(depths, (str, bytes)) or not list(depths):
            raise AttnkitError(f"depths must be a non-empty list of numbers in [0, 1], got {depths!r}")
        for d in depths:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
                raise AttnkitError(f"depths must be numbers in [0, 1], got {d!r}")
        depth_list = [float(d) for d in depths for _ in range(samples)]
    parsed = []
    for spec in methods:
        if not isinstance(spec, str) or not spec.strip():
            raise AttnkitError(f"method specs must be non-empty strings like 'window:window=512', got {spec!r}")
        parsed.append(parse_method_spec(spec))
    limit = model.geometry.max_positions
    too_long = [n for n in lengths if n > limit]
    if too_long:
        raise AttnkitError(f"length {too_long[0]} exceeds the {limit} positions model {model.spec!r} allows")
    return parsed, depth_list


def _make_samples(model: LoadedModel, task: str, length: int, seed: int, depths: list[float]) -> list[Sample]:
    out = []
    for i, depth in enumerate(depths):
        try:
            sample = TASKS[task].make(model.tokenizer, length, depth=depth, seed=seed + i, split="eval")
        except AttnkitError:
            raise
        except ValueError as exc:
            raise AttnkitError(f"task {task!r} at length {length}: {exc}") from None
        limit = model.geometry.max_positions
        if length + sample.max_new_tokens > limit:
            raise AttnkitError(f"task {task!r} at length {length} needs {length} + {sample.max_new_tokens} "
                               f"positions; model {model.spec!r} allows {limit}")
        out.append(sample)
    return out


# --------------------------------------------------------------------------------------------------
# perplexity


def _special_prefix(tokenizer) -> list[int]:
    """What the tokenizer puts before a text (BOS for Llama-style tokenizers, nothing for Qwen)."""
    return list(tokenizer("").input_ids)


@functools.lru_cache(maxsize=4)
def _heldout_ids(tokenizer) -> list[int]:
    return tokenizer.encode(corpus.haystack_text("heldout"), add_special_tokens=False)


def perplexity_windows(model: LoadedModel, length: int, seed: int, count: int) -> list[list[int]]:
    """`count` token windows of `length` tokens (BOS included) of held-out text; window i from seed + i."""
    prefix = _special_prefix(model.tokenizer)
    n = length - len(prefix)
    if n < 1:
        raise AttnkitError(f"task 'perplexity' at length {length}: needs at least {len(prefix) + 2} tokens")
    hay = _heldout_ids(model.tokenizer)
    if n > len(hay):
        raise AttnkitError(f"task 'perplexity' at length {length}: the held-out text has only "
                           f"{len(hay)} tokens")
    windows = []
    for i in range(count):
        rng = random.Random(f"eval|perplexity|{length}|{seed + i}")
        start = rng.randrange(0, len(hay) - n + 1)
        windows.append(prefix + hay[start : start + n])
    return windows


def bits_per_byte(model: LoadedModel, ids: list[int], method: Method) -> float:
    """Next-token NLL of ids[1:] under `method`'s prefill, in bits per UTF-8 byte of their text."""
    nll = token_nll(model, ids, method).sum().item()
    n_bytes = len(model.tokenizer.decode(ids[1:], skip_special_tokens=True).encode("utf-8"))
    if n_bytes == 0:
        raise AttnkitError("perplexity window decodes to no text")
    return nll / math.log(2) / n_bytes


# --------------------------------------------------------------------------------------------------
# running


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _rel_full(score: float | None, full: float | None, higher_is_better: bool) -> float | None:
    if score is None or full is None:
        return None
    num, den = (score, full) if higher_is_better else (full, score)
    return num / den if den else None


def _run_cell(model: LoadedModel, task: str, method: Method, samples, progress_bar) -> dict:
    """Scores, predictions and statistics of one (task, length, method) cell."""
    scores, predictions, prefill, decode_tps, peak_kv, final_kv = [], [], [], [], [], []
    for item in samples:
        if task == PERPLEXITY:
            t0 = time.perf_counter()
            scores.append(bits_per_byte(model, item, method))
            prefill.append(time.perf_counter() - t0)
            predictions.append(None)
        else:
            gen = generate(model, item.prompt, method, max_new_tokens=item.max_new_tokens, stop="\n")
            scores.append(float(TASKS[task].score(gen.text, item)))
            predictions.append(gen.text)
            st = gen.stats
            prefill.append(st.prefill_s)
            # a generation of one token has no decode rate; it does not count towards the mean
            decode_tps.append(st.decode_tokens_per_s if st.decode_tokens_per_s > 0 else None)
            peak_kv.append(st.peak_kv_bytes)
            final_kv.append(st.final_kv_bytes)
        if progress_bar is not None:
            progress_bar.update(1)
    return {
        "score": _mean(scores), "scores": scores, "prefill_s": _mean(prefill),
        "decode_tokens_per_s": _mean(decode_tps), "peak_kv_bytes": max(peak_kv, default=None),
        "final_kv_bytes": max(final_kv, default=None),
        "predictions": None if task == PERPLEXITY else predictions,
    }


def run_eval(model: LoadedModel, tasks: list[str], lengths: list[int], methods: list[str], samples: int,
             seed: int = 0, out_dir: Path | str | None = None, progress: bool = True,
             depths: list[float] | None = None) -> list[dict]:
    """Evaluate every (task, length, method) cell on `samples` seeded eval samples; one row per cell.

    `methods` are specs such as ``"full"`` or ``"window:window=512"``. With `out_dir`, each row is
    appended to ``out_dir/results.jsonl`` as its cell finishes and ``out_dir/table.txt`` is written at
    the end. Rows come in run order (tasks, then lengths, then methods with ``full`` first).
    """
    tasks, lengths, methods = list(tasks), list(lengths), list(methods)
    parsed, depth_list = _check_request(model, tasks, lengths, methods, samples, depths)
    # full first, so every other row of its (task, length) can be compared with it
    order = sorted(range(len(methods)), key=lambda i: parsed[i].name != "full" or bool(parsed[i].params()))
    # build every sample before running anything: a bad length fails at once, not an hour in
    work = []
    for task in tasks:
        for length in lengths:
            if task == PERPLEXITY:
                items = perplexity_windows(model, length, seed, samples)
            else:
                items = _make_samples(model, task, length, seed, depth_list)
            work.append((task, length, items))

    out_path = None
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / RESULTS_FILE

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(items) for _, _, items in work) * len(methods), desc="eval", unit="sample",
                   dynamic_ncols=True)
    run_id = _now()
    rows: list[dict] = []
    try:
        for task, length, items in work:
            full_score = None
            for i in order:
                method, spec = parsed[i], methods[i]
                if bar is not None:
                    bar.set_postfix_str(f"{task} {length} {spec}", refresh=False)
                t0 = time.perf_counter()
                result = _run_cell(model, task, method, items, bar)
                wall = time.perf_counter() - t0
                higher = task != PERPLEXITY
                is_full = method.name == "full" and not method.params()
                if is_full and full_score is None:
                    full_score = result["score"]
                row = {
                    "run_id": run_id, "model": model.spec, "task": task, "length": length, "method": method.name,
                    "method_params": method.params(), "method_spec": spec, "samples": len(items),
                    "depths": None if task == PERPLEXITY else [s.depth for s in items],
                    "seeds": [seed + j for j in range(len(items))],
                    "score": result["score"], "scores": result["scores"], "higher_is_better": higher,
                    "score_rel_full": _rel_full(result["score"], full_score, higher),
                    "prefill_s": result["prefill_s"], "decode_tokens_per_s": result["decode_tokens_per_s"],
                    "peak_kv_bytes": result["peak_kv_bytes"], "final_kv_bytes": result["final_kv_bytes"],
                    "wall_s": wall, "versions": versions(), "git_commit": git_commit(), "timestamp": _now(),
                    "predictions": result["predictions"],
                }
                rows.append(row)
                if out_path is not None:
                    with out_path.open("a", encoding="utf-8") as fh:
                        fh.write(json.dumps(row, default=str) + "\n")
                        fh.flush()
    finally:
        if bar is not None:
            bar.close()
    if out_dir is not None:
        (out_dir / TABLE_FILE).write_text(format_table(rows) + "\n", encoding="utf-8")
    return rows


def read_results(path: Path | str) -> list[dict]:
    """Rows of a results.jsonl file (or of the results.jsonl in a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise AttnkitError(f"no results file at {path}")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# the table


def _format_cell(row: dict) -> str:
    score = row.get("score")
    if score is None or (isinstance(score, float) and math.isnan(score)):
        text = "n/a"
    elif row.get("higher_is_better", True):
        text = f"{100 * score:.1f}%"
    else:
        text = f"{score:.3f}"
    rel = row.get("score_rel_full")
    if rel is not None and not (row.get("method") == "full" and not row.get("method_params")):
        text += f" ({rel:.2f}x)"
    return text


def format_table(rows: list[dict]) -> str:
    """Plain-text table: one line per (task, length), one column per method spec.

    Scores are percent for tasks where higher is better, bits per byte (3 decimals) for perplexity;
    ``(0.96x)`` is the score relative to full (below 1 is worse than full for every task).
    """
    if not rows:
        return "(no results)"
    columns: list[str] = []
    lines: dict[tuple, dict[str, str]] = {}
    for row in rows:
        spec = str(row.get("method_spec") or row.get("method") or "?")
        if spec not in columns:
            columns.append(spec)
        lines.setdefault((str(row.get("task", "?")), row.get("length", "?")), {})[spec] = _format_cell(row)
    header = ["task", "length", *columns]
    body = [[task, str(length), *(cells.get(c, "-") for c in columns)] for (task, length), cells in lines.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].rjust(widths[1])]
        return "  ".join(left + [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]).rstrip()

    out = [render(header), "  ".join("-" * w for w in widths)] + [render(r) for r in body]
    n = sorted({r.get("samples") for r in rows if r.get("samples") is not None})
    models = sorted({str(r.get("model")) for r in rows if r.get("model")})
    notes = []
    if models:
        notes.append(f"model: {', '.join(models)}")
    if n:
        notes.append(f"samples per cell: {', '.join(map(str, n))}")
    notes.append("retrieval/code: % score (higher is better); perplexity: bits per byte (lower is better); "
                 "(x) = relative to full, below 1 is worse")
    return "\n".join(out + [""] + notes)
