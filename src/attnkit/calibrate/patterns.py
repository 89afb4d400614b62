"""Offline kernel-aware sparse pattern search: one pattern per head (MInference 1.0, Jiang et al., 2024,
seed 002, section 3.2 and Alg. 1; search space of Table 7).

For every head, each candidate of every pattern is first *scaled to the FLOPs budget* (Alg. 1, "build
kernel-aware search space"): its parameters are multiplied by a factor, found by bisection, until the
tiles the kernel really computes (:attr:`attnkit.sparse_attention.SparseLayout.tiles`, dynamic indices
estimated on the calibration prompts exactly as at inference) reach the budget, averaged over the prompts;
the largest setting within the budget wins. Table 7's candidates are ratios:

    a_shape        (n_init, n_local) = (1024, 4096)
    vertical_slash (k_v, k_s)        = (30, 2048), (100, 1800), (500, 1500), (3000, 200)
    block_sparse   k_b               = 100

Then each head keeps the candidate with the highest *attention recall* (Alg. 1, "search for optimal head
pattern", which compares the sparse attention with ``softmax(QK^T / sqrt(d))``): the dense attention mass
that falls inside the pattern, averaged over queries and prompts (1.0 = nothing lost). A head whose best
pattern is block-sparse stays block-sparse (no pattern is demoted or promoted afterwards).

The FLOPs budget is a fraction of dense causal attention: the pairs the sparse kernel computes (whole
tiles) over the ``n (n + 1) / 2`` pairs of causal attention at the calibration length. The paper's target
(the FLOPs of A-shape with 1024 initial tokens and a 4096 window) is the fraction
``(1024 + 4096) * n / (n (n + 1) / 2)`` roughly, 0.33 at 30k tokens. Parameters are token or line counts,
so a config searched at one length is used as is at every length (as in the paper): longer prompts are
sparser.

Calibration prompts come from the task generators (:mod:`attnkit.eval.tasks`), ``samples`` per task,
seeded: re-running with the same arguments writes the same file, byte for byte (no timestamps in it).
They use the held-out haystack (the training split's is 25x larger and takes ~25 s to tokenize) with
their seeds offset by :data:`SEED_OFFSET`, so a calibration prompt is never one of the evaluation
samples (whose seeds are ``seed .. seed + samples - 1``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from attnkit import sparse_attention as sa
from attnkit.calibrate import progress_to_stderr
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.minference import CONFIG_FORMAT, pattern_config_from_dict
from attnkit.model import LoadedModel

SEARCH_SPACE: dict[str, tuple[tuple[int, ...], ...]] = {
    "a_shape": ((1024, 4096),),
    "vertical_slash": ((30, 2048), (100, 1800), (500, 1500), (3000, 200)),
    "block_sparse": ((100,),),
}
DEFAULT_TASKS = ("passkey", "kv_retrieval", "code_completion")
SEED_OFFSET = 1_000_000
SPLITS = ("calibration", "train")  # calibration: held-out text, eval-split generators; train: training stream
_BISECTIONS = 24
_STATS_ELEMENTS = 1 << 24  # probabilities held at once by the dense pass


@dataclass(frozen=True)
class Candidate:
    pattern: str
    base: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.pattern}{self.base}"


def candidates(space: dict[str, Sequence[Sequence[int]]] = SEARCH_SPACE) -> list[Candidate]:
    out = []
    for pattern in sa.PATTERNS:
        for base in space.get(pattern, ()):
            base = tuple(int(x) for x in base)
            if len(base) != len(sa.PATTERN_PARAMS[pattern]) or min(base) < 1:
                raise AttnkitError(f"search space: {pattern} takes {len(sa.PATTERN_PARAMS[pattern])} positive "
                                   f"numbers ({', '.join(sa.PATTERN_PARAMS[pattern])}), got {base}")
            out.append(Candidate(pattern, base))
    if not out:
        raise AttnkitError("the search space is empty")
    return out


# ---- what a forward pass shows of each layer -------------------------------------------------------
class _Probe(Method):
    """Dense prefill (as ``full``) that hands every layer's queries and keys to `visit`."""

    name = "calibration-probe"

    def __init__(self, visit: Callable[[int, torch.Tensor, torch.Tensor, float], None]):
        self.visit = visit

    def prefill_output(self, ctx, q, keys, values, positions):
        self.visit(ctx.index, q, keys, ctx.scaling)
        return super().prefill_output(ctx, q, keys, values, positions)


def _run(model: LoadedModel, ids: torch.Tensor, visit) -> None:
    from attnkit.runner import new_session, prefill

    probe = _Probe(visit)
    prefill(model, new_session(model, probe, ids.shape[0], 0), ids)


@dataclass
class _Ranks:
    """Dynamic index estimates of one layer on one prompt, as ranks (0 = best), so that the top-k of any k
    is one comparison: vertical ``[h, n]`` (key tile 0 excluded), slash ``[h, n]``, blocks ``[h, nb, nb]``."""

    n: int
    vertical: torch.Tensor
    slash: torch.Tensor
    blocks: torch.Tensor


def _estimate(q, k, scaling, block: int, last_q: int) -> _Ranks:
    """Alg. 2 and 3 estimates of every head (kept on the CPU: the search runs there)."""
    vertical, slash = sa.estimate_vertical_slash(q, k, scaling, last_q)
    vertical[:, :block] = float("-inf")  # key tile 0 is always kept
    probs = sa.estimate_block_sparse(q, k, scaling, block)
    nb = probs.shape[-1]
    probs.masked_fill_(torch.ones(nb, nb, dtype=torch.bool, device=probs.device).triu(1), float("-inf"))
    return _Ranks(k.shape[2], sa.descending_rank(vertical).cpu(), sa.descending_rank(slash).cpu(),
                  sa.descending_rank(probs).cpu())


def candidate_layout(pattern: str, params: torch.Tensor, ranks: _Ranks, block: int) -> sa.SparseLayout:
    """The layout every head would get with `pattern` and its per-head `params` ``[h, n_params]`` on the
    prompt the `ranks` came from (the same selection rule as at inference: top-k of the estimates)."""
    h, n = params.shape[0], ranks.n
    nb = -(-n // block)
    if pattern == "a_shape":
        return sa.build_layout(["a_shape"] * h, n, 0, block, init=params[:, 0], local=params[:, 1])
    if pattern == "vertical_slash":
        columns = ranks.vertical < params[:, :1]
        diagonals = sa.slash_diagonals(ranks.slash < params[:, 1:2], block, nb)
        return sa.build_layout(["vertical_slash"] * h, n, 0, block, diagonals=diagonals, columns=columns)
    tiles = ranks.blocks < params[:, :1, None]
    return sa.build_layout(["block_sparse"] * h, n, 0, block, tiles=tiles)


def _scaled(base: tuple[int, ...], alpha: torch.Tensor, n: int) -> torch.Tensor:
    """Parameters ``round(alpha * base)`` per head, capped at the length: ``[h, len(base)]``."""
    b = torch.tensor(base, dtype=torch.float64)
    return torch.round(alpha.double()[:, None] * b[None, :]).clamp(0, n).long()


def fit_to_budget(cand: Candidate, ranks: list[_Ranks], budget: float, block: int, n_heads: int) -> torch.Tensor:
    """Alg. 1, ``while |t_i - t| > eps: sigma_i <- ChangeSpace(sigma_i)``: per head, the largest multiple of
    the candidate's parameters whose kernel FLOPs (mean density over the prompts) stay within `budget`.
    Returns the parameters ``[h, n_params]``."""
    n_max = max(r.n for r in ranks)

    def density(alpha):
        return torch.stack([candidate_layout(cand.pattern, _scaled(cand.base, alpha, r.n), r, block).density
                            for r in ranks]).mean(0)

    lo = torch.zeros(n_heads, dtype=torch.float64)
    hi = torch.full((n_heads,), n_max / min(cand.base) + 1.0, dtype=torch.float64)
    fits = density(hi) <= budget
    lo = torch.where(fits, hi, lo)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        ok = density(mid) <= budget
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return _scaled(cand.base, lo, n_max)


# ---- recall: the dense attention mass a layout keeps ---------------------------------------------------
@dataclass
class _DenseStats:
    """Dense attention of one layer on one prompt, pooled: per query tile row, the mass on each key tile
    (``tile [h, rows, nb]``) and on each key (``column [h, rows, n]``), plus the exact mass an a_shape
    layout keeps (token rule inside its tiles)."""

    tile: torch.Tensor
    column: torch.Tensor
    a_shape: torch.Tensor | None


def _dense_stats(q, k, scaling: float, block: int, a_layout: sa.SparseLayout | None) -> _DenseStats:
    """One pass over the dense causal attention of a layer (in query chunks); results on the CPU. Memory:
    ``heads x n^2 / block`` floats for the per-key masses."""
    hq, n, dev = q.shape[1], k.shape[2], q.device
    nb = -(-n // block)
    tile = torch.zeros(hq, nb, nb)
    column = torch.zeros(hq, nb, n)
    a_mass = torch.zeros(hq, dtype=torch.float64) if a_layout is not None else None
    a_dev = None if a_layout is None else dataclasses.replace(
        a_layout, init=a_layout.init.to(dev), local=a_layout.local.to(dev), main=a_layout.main.to(dev),
        main_full=a_layout.main_full.to(dev))
    step = max(1, _STATS_ELEMENTS // (hq * n * block))
    for r0 in range(0, nb, step):
        r1 = min(nb, r0 + step)
        s, e = r0 * block, min(n, r1 * block)
        logits = sa._head_logits(q[0, :, s:e], k[0], None, scaling)
        pos = torch.arange(s, e, device=dev)[:, None]
        logits.masked_fill_(torch.arange(n, device=dev)[None, :] > pos, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        padded = probs.new_zeros(hq, (r1 - r0) * block, nb * block)
        padded[:, : e - s, :n] = probs
        tile[:, r0:r1] = padded.view(hq, r1 - r0, block, nb, block).sum((2, 4)).cpu()
        column[:, r0:r1] = padded[:, :, :n].reshape(hq, r1 - r0, block, n).sum(2).cpu()
        if a_dev is not None:
            a_mass += (probs * sa.dense_mask(a_dev, rows=slice(s, e))).sum((1, 2)).double().cpu()
    return _DenseStats(tile, column, a_mass)


def layout_recall(layout: sa.SparseLayout, stats: _DenseStats) -> torch.Tensor:
    """Mean over queries of the dense attention mass inside the layout, per head ``[h]`` (tile-level
    layouts: vertical_slash and block_sparse, whose main tiles keep every causal pair)."""
    n, B = layout.n_keys, layout.block
    kept = (layout.main * stats.tile).sum((1, 2))
    if layout.columns is not None:
        hq, rows, nb = layout.main.shape
        chosen = torch.zeros(hq, n + 1)
        chosen.scatter_(1, layout.columns.clamp(max=n), 1.0)
        on_columns = stats.column * chosen[:, None, :n]
        per_tile = torch.nn.functional.pad(on_columns, (0, nb * B - n)).view(hq, rows, nb, B).sum(-1)
        i, j = layout._grid()
        kept = kept + ((j < i) & ~layout.main).float().mul(per_tile).sum((1, 2))
    return kept / (n - layout.q_start)


# ---- the search -------------------------------------------------------------------------------------------
def calibration_samples(model: LoadedModel, length: int, tasks: Sequence[str], samples: int, seed: int,
                        split: str = "calibration"):
    """``samples`` seeded task samples per task as ``(info, Sample, ids)``; never an evaluation sample (see the
    module docstring for the two splits)."""
    from attnkit.eval.tasks import TASKS
    from attnkit.runner import encode_prompt

    if split not in SPLITS:
        raise AttnkitError(f"calibration split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise AttnkitError(f"samples must be a whole number >= 1, got {samples!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 2:
        raise AttnkitError(f"length must be a whole number of tokens >= 2, got {length!r}")
    if length > model.geometry.max_positions:
        raise AttnkitError(f"length {length} exceeds the {model.geometry.max_positions} positions model "
                           f"{model.spec!r} allows")
    out = []
    for task in tasks:
        if task not in TASKS:
            raise AttnkitError(f"unknown calibration task {task!r}; available: {', '.join(TASKS)}")
        for i in range(samples):
            depth = (i + 0.5) / samples
            task_seed = SEED_OFFSET + seed + i
            try:
                sample = TASKS[task].make(model.tokenizer, length, depth=depth, seed=task_seed,
                                          split="train" if split == "train" else "eval")
            except ValueError as exc:
                raise AttnkitError(f"calibration task {task!r} at length {length}: {exc}") from None
            ids = encode_prompt(model, sample.prompt)
            info = {"task": task, "split": split, "seed": task_seed, "depth": round(depth, 6),
                    "tokens": int(ids.shape[0])}
            out.append((info, sample, ids))
    return out


def calibration_prompts(model: LoadedModel, length: int, tasks: Sequence[str], samples: int, seed: int):
    """``samples`` seeded prompts per task, as ``(description, token ids)`` (seeds offset by SEED_OFFSET)."""
    return [({k: v for k, v in info.items() if k != "split"}, ids)
            for info, _sample, ids in calibration_samples(model, length, tasks, samples, seed)]


def _check_args(model: LoadedModel, length, budget, samples, block, last_q) -> None:
    if not isinstance(length, int) or isinstance(length, bool) or length < 2:
        raise AttnkitError(f"length must be a whole number of tokens >= 2, got {length!r}")
    if length > model.geometry.max_positions:
        raise AttnkitError(f"length {length} exceeds the {model.geometry.max_positions} positions model "
                           f"{model.spec!r} allows")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise AttnkitError(f"flops budget must be a fraction of dense causal attention FLOPs, 0 < f <= 1; got {budget!r}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise AttnkitError(f"samples must be a whole number >= 1, got {samples!r}")
    sa.check_block(block)
    if not isinstance(last_q, int) or isinstance(last_q, bool) or last_q < 1:
        raise AttnkitError(f"last_q must be a positive whole number, got {last_q!r}")


@torch.inference_mode()
def search_patterns(model: LoadedModel, length: int, flops_budget: float, *, tasks: Sequence[str] = DEFAULT_TASKS,
                    samples: int = 1, seed: int = 0, block_size: int = sa.DEFAULT_BLOCK,
                    last_q: int = sa.DEFAULT_LAST_Q, static: bool = False,
                    search_space: dict[str, Sequence[Sequence[int]]] = SEARCH_SPACE,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Alg. 1 for every head of `model` on seeded calibration prompts of `length` tokens; returns the config
    (a JSON-ready dict, see :func:`write_pattern_config`). `static` also stores each dynamic head's indices
    estimated on the first prompt (for ``minference_static``)."""
    _check_args(model, length, flops_budget, samples, block_size, last_q)
    say = progress or (lambda _msg: None)
    cands = candidates(search_space)
    if sum(c.pattern == "a_shape" for c in cands) > 1:
        raise AttnkitError("search space: at most one a_shape candidate (its exact recall is computed once)")
    geo = model.geometry
    hq, n_layers = geo.n_q_heads, geo.n_layers
    prompts = calibration_prompts(model, length, list(tasks), samples, seed)

    # pass 1: index estimates of every layer on every prompt; fit each candidate to the budget
    ranks: list[list[_Ranks]] = [[] for _ in range(n_layers)]
    for p, (info, ids) in enumerate(prompts):
        say(f"estimates {p + 1}/{len(prompts)}: {info['task']} ({info['tokens']} tokens)")
        _run(model, ids, lambda i, q, k, s: ranks[i].append(_estimate(q, k, s, block_size, last_q)))
    fitted = [[fit_to_budget(c, ranks[i], flops_budget, block_size, hq) for c in cands] for i in range(n_layers)]

    # pass 2: dense attention of every layer; recall of every fitted candidate
    recall = torch.zeros(n_layers, len(cands), hq, dtype=torch.float64)
    density = torch.zeros(n_layers, len(cands), hq, dtype=torch.float64)

    def score(i, q, k, s, p):
        r = ranks[i][p]
        layouts = [candidate_layout(c.pattern, fitted[i][ci], r, block_size) for ci, c in enumerate(cands)]
        a_idx = [ci for ci, c in enumerate(cands) if c.pattern == "a_shape"]
        stats = _dense_stats(q, k, s, block_size, layouts[a_idx[0]] if a_idx else None)
        for ci, c in enumerate(cands):
            if c.pattern == "a_shape":  # a_shape params do not depend on the prompt: one candidate at most per head
                kept = stats.a_shape / r.n
            else:
                kept = layout_recall(layouts[ci], stats)
            recall[i, ci] += kept.double()
            density[i, ci] += layouts[ci].density

    for p, (info, ids) in enumerate(prompts):
        say(f"dense attention {p + 1}/{len(prompts)}: {info['task']}")
        _run(model, ids, lambda i, q, k, s, p=p: score(i, q, k, s, p))
    recall /= len(prompts)
    density /= len(prompts)

    layers = []
    for i in range(n_layers):
        best = recall[i].argmax(0)  # first candidate on ties
        heads = []
        for h in range(hq):
            ci = int(best[h])
            c = cands[ci]
            params = [int(x) for x in fitted[i][ci][h]]
            entry = {"pattern": c.pattern, **dict(zip(sa.PATTERN_PARAMS[c.pattern], params)),
                     "recall": round(float(recall[i, ci, h]), 6), "density": round(float(density[i, ci, h]), 6)}
            if static and c.pattern != "a_shape":
                r = ranks[i][0]
                entry["static"] = _static_head(c.pattern, params, r, h)
            heads.append(entry)
        layers.append(heads)

    counts = {p: sum(e["pattern"] == p for layer in layers for e in layer) for p in sa.PATTERNS}
    from attnkit import __version__

    config = {
        "format": CONFIG_FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": n_layers, "n_heads": hq, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "length": length, "flops_budget": flops_budget,
        "flops_budget_unit": "fraction of dense causal attention FLOPs: pairs the kernel computes (whole "
                             "tiles) / (n (n + 1) / 2) at the calibration length",
        "block_size": block_size, "last_q": last_q,
        "metric": "attention recall: dense attention mass inside the pattern, mean over queries and prompts",
        "search_space": {p: [list(c.base) for c in cands if c.pattern == p] for p in sa.PATTERNS},
        "seed": seed, "prompts": [info for info, _ in prompts], "static": bool(static),
        "pattern_counts": counts,
        "mean_recall": round(float(sum(e["recall"] for layer in layers for e in layer) / (n_layers * hq)), 6),
        "mean_density": round(float(sum(e["density"] for layer in layers for e in layer) / (n_layers * hq)), 6),
        "attnkit_version": __version__,
        "layers": layers,
    }
    pattern_config_from_dict(json.loads(json.dumps(config)), "the searched config")  # it must load back
    return config


def _static_head(pattern: str, params: list[int], r: _Ranks, h: int) -> dict:
    if pattern == "vertical_slash":
        return {"vertical": torch.nonzero(r.vertical[h] < params[0]).flatten().tolist(),
                "slash": torch.nonzero(r.slash[h] < params[1]).flatten().tolist()}
    return {"blocks": [torch.nonzero(row < params[0]).flatten().tolist() for row in r.blocks[h]]}


def dumps_config(config: dict) -> str:
    """JSON text of a config: metadata one key per line, then one line per head (diff-friendly)."""
    lines = ["{"]
    keys = [k for k in config if k != "layers"]
    for k in keys:
        lines.append(f"  {json.dumps(k)}: {json.dumps(config[k], sort_keys=False)},")
    lines.append('  "layers": [')
    for li, layer in enumerate(config["layers"]):
        lines.append("    [")
        for hi, head in enumerate(layer):
            lines.append("      " + json.dumps(head) + ("," if hi < len(layer) - 1 else ""))
        lines.append("    ]" + ("," if li < len(config["layers"]) - 1 else ""))
    lines.append("  ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_pattern_config(config: dict, path: str | Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_config(config))
    return path


def summary(config: dict) -> str:
    """A few lines for the terminal: patterns per layer, mean recall and density."""
    rows = [f"{config['model']}: {config['n_layers']} layers x {config['n_heads']} heads, length {config['length']}, "
            f"FLOPs budget {config['flops_budget']}"]
    for i, layer in enumerate(config["layers"]):
        cnt = {p: sum(e["pattern"] == p for e in layer) for p in sa.PATTERNS}
        mean_r = sum(e["recall"] for e in layer) / len(layer)
        mean_d = sum(e["density"] for e in layer) / len(layer)
        rows.append(f"  layer {i:>2}: " + ", ".join(f"{p} {c}" for p, c in cnt.items())
                    + f"; recall {mean_r:.3f}, density {mean_d:.3f}")
    rows.append(f"  all: {config['pattern_counts']}; mean recall {config['mean_recall']:.3f}, "
                f"mean density {config['mean_density']:.3f}")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate patterns`` (arguments parsed by :mod:`attnkit.cli`)."""
    from attnkit.model import load_model_for_length

    model = load_model_for_length(args.model, max(args.length, 4096))
    config = search_patterns(model, args.length, args.flops_budget, tasks=args.tasks, samples=args.samples, seed=args.seed,
                             block_size=args.block_size, last_q=args.last_q, static=args.static,
                             progress=progress_to_stderr)
    path = write_pattern_config(config, args.out)
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["SEARCH_SPACE", "DEFAULT_TASKS", "Candidate", "candidates", "candidate_layout", "fit_to_budget",
           "layout_recall", "calibration_prompts", "search_patterns", "dumps_config", "write_pattern_config",
           "summary", "main"]
