"""``attnkit calibrate patterns``: MInference's offline kernel-aware search of one sparse pattern per head
(MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic Sparse Attention, Jiang et al.
2024, arXiv 2407.02490, section 3.2 and Alg. 1; search space of Table 7).

For every head, each candidate of every pattern is first *scaled to the FLOPs budget* (Alg. 1, "build
kernel-aware search space"): its parameters are multiplied by a factor, found by bisection, until the
tiles the kernel really computes (:attr:`attnkit.sparse.layout.SparseLayout.tiles`, dynamic indices
estimated on the calibration prompts exactly as at inference) reach the budget, averaged over the prompts;
the largest setting within the budget wins. Table 7's candidates are ratios:

    a_shape        (n_init, n_local) = (1024, 4096)
    vertical_slash (k_v, k_s)        = (30, 2048), (100, 1800), (500, 1500), (3000, 200)
    block_sparse   k_b               = 100

Then each head keeps the candidate with the highest *attention recall* (Alg. 1, "search for optimal head
pattern", which compares the sparse attention with ``softmax(QK^T / sqrt(d))``): the dense attention mass
that falls inside the pattern, averaged over queries and prompts (1.0 = nothing lost). A head whose best
pattern is block-sparse stays block-sparse (no pattern is demoted or promoted afterwards). The statistics
live in :mod:`attnkit.calibrate.pattern_stats`; this module runs the model, picks the patterns and writes
the config.

The FLOPs budget is a fraction of dense causal attention: the pairs the sparse kernel computes (whole
tiles) over the ``n (n + 1) / 2`` pairs of causal attention at the calibration length. The paper's target
(the FLOPs of A-shape with 1024 initial tokens and a 4096 window) is the fraction
``(1024 + 4096) * n / (n (n + 1) / 2)`` roughly. Parameters are token or line counts, so a config searched
at one length is used as is at every length (as in the paper): longer prompts are sparser.

Calibration prompts come from the task generators, ``samples`` per task, seeded
(:mod:`attnkit.calibrate.samples`): re-running with the same arguments writes the same file, byte for byte
(no timestamps in it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.pattern_stats import (
    SEARCH_SPACE,
    Ranks,
    candidate_layout,
    candidates,
    dense_stats,
    estimate_ranks,
    fit_to_budget,
    layout_recall,
)
from attnkit.calibrate.samples import calibration_prompts, check_length
from attnkit.config_file import dumps_layered_config, write_config_file
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.base import Method
from attnkit.methods.minference import CONFIG_FORMAT, pattern_config_from_dict
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import new_session
from attnkit.sparse.patterns import DEFAULT_BLOCK, DEFAULT_LAST_Q, PATTERN_PARAMS, PATTERNS, check_block
from attnkit.validate import number, whole
from attnkit.version import __version__

DEFAULT_TASKS = ("passkey", "kv_retrieval", "code_completion")


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
    probe = _Probe(visit)
    prefill(model, new_session(model, probe, ids.shape[0], 0), ids)


def _check_args(model: LoadedModel, length, budget, samples, block, last_q) -> None:
    check_length(model, length)
    number("flops budget (a fraction of dense causal attention FLOPs)", budget, 0, 1, low_open=True)
    whole("samples", samples, 1)
    check_block(block)
    whole("last_q", last_q, 1)


@torch.inference_mode()
def search_patterns(model: LoadedModel, length: int, flops_budget: float, *, tasks: Sequence[str] = DEFAULT_TASKS,
                    samples: int = 1, seed: int = 0, block_size: int = DEFAULT_BLOCK,
                    last_q: int = DEFAULT_LAST_Q, static: bool = False,
                    search_space: dict[str, Sequence[Sequence[int]]] = SEARCH_SPACE,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Alg. 1 for every head of `model` on seeded calibration prompts of `length` tokens; returns the config
    (a JSON-ready dict, written by :func:`dumps_config`). `static` also stores each dynamic head's indices
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
    ranks: list[list[Ranks]] = [[] for _ in range(n_layers)]
    for p, (info, ids) in enumerate(prompts):
        say(f"estimates {p + 1}/{len(prompts)}: {info['task']} ({info['tokens']} tokens)")
        _run(model, ids, lambda i, q, k, s: ranks[i].append(estimate_ranks(q, k, s, block_size, last_q)))
    fitted = [[fit_to_budget(c, ranks[i], flops_budget, block_size, hq) for c in cands] for i in range(n_layers)]

    # pass 2: dense attention of every layer; recall of every fitted candidate
    recall = torch.zeros(n_layers, len(cands), hq, dtype=torch.float64)
    density = torch.zeros(n_layers, len(cands), hq, dtype=torch.float64)

    def score(i, q, k, s, p):
        r = ranks[i][p]
        layouts = [candidate_layout(c.pattern, fitted[i][ci], r, block_size) for ci, c in enumerate(cands)]
        a_idx = [ci for ci, c in enumerate(cands) if c.pattern == "a_shape"]
        stats = dense_stats(q, k, s, block_size, layouts[a_idx[0]] if a_idx else None)
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
            entry = {"pattern": c.pattern, **dict(zip(PATTERN_PARAMS[c.pattern], params)),
                     "recall": round(float(recall[i, ci, h]), 6), "density": round(float(density[i, ci, h]), 6)}
            if static and c.pattern != "a_shape":
                r = ranks[i][0]
                entry["static"] = _static_head(c.pattern, params, r, h)
            heads.append(entry)
        layers.append(heads)

    counts = {p: sum(e["pattern"] == p for layer in layers for e in layer) for p in PATTERNS}

    config = {
        "format": CONFIG_FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": n_layers, "n_heads": hq, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "length": length, "flops_budget": flops_budget,
        "flops_budget_unit": "fraction of dense causal attention FLOPs: pairs the kernel computes (whole "
                             "tiles) / (n (n + 1) / 2) at the calibration length",
        "block_size": block_size, "last_q": last_q,
        "metric": "attention recall: dense attention mass inside the pattern, mean over queries and prompts",
        "search_space": {p: [list(c.base) for c in cands if c.pattern == p] for p in PATTERNS},
        "seed": seed, "prompts": [info for info, _ in prompts], "static": bool(static),
        "pattern_counts": counts,
        "mean_recall": round(float(sum(e["recall"] for layer in layers for e in layer) / (n_layers * hq)), 6),
        "mean_density": round(float(sum(e["density"] for layer in layers for e in layer) / (n_layers * hq)), 6),
        "attnkit_version": __version__,
        "layers": layers,
    }
    pattern_config_from_dict(json.loads(json.dumps(config)), "the searched config")  # it must load back
    return config


def _static_head(pattern: str, params: list[int], r: Ranks, h: int) -> dict:
    if pattern == "vertical_slash":
        return {"vertical": torch.nonzero(r.vertical[h] < params[0]).flatten().tolist(),
                "slash": torch.nonzero(r.slash[h] < params[1]).flatten().tolist()}
    return {"blocks": [torch.nonzero(row < params[0]).flatten().tolist() for row in r.blocks[h]]}


def dumps_config(config: dict) -> str:
    """JSON text of a config: metadata one key per line, then one line per head (diff-friendly)."""
    return dumps_layered_config(
        config, lambda layer: "    [\n" + ",\n".join("      " + json.dumps(head) for head in layer) + "\n    ]")


def summary(config: dict) -> str:
    """A few lines for the terminal: patterns per layer, mean recall and density."""
    rows = [f"{config['model']}: {config['n_layers']} layers x {config['n_heads']} heads, length {config['length']}, "
            f"FLOPs budget {config['flops_budget']}"]
    for i, layer in enumerate(config["layers"]):
        cnt = {p: sum(e["pattern"] == p for e in layer) for p in PATTERNS}
        mean_r = sum(e["recall"] for e in layer) / len(layer)
        mean_d = sum(e["density"] for e in layer) / len(layer)
        rows.append(f"  layer {i:>2}: " + ", ".join(f"{p} {c}" for p, c in cnt.items())
                    + f"; recall {mean_r:.3f}, density {mean_d:.3f}")
    rows.append(f"  all: {config['pattern_counts']}; mean recall {config['mean_recall']:.3f}, "
                f"mean density {config['mean_density']:.3f}")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate patterns`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    config = search_patterns(model, args.length, args.flops_budget, tasks=args.tasks, samples=args.samples, seed=args.seed,
                             block_size=args.block_size, last_q=args.last_q, static=args.static,
                             progress=progress_to_stderr)
    path = write_config_file(args.out, dumps_config(config))
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["DEFAULT_TASKS", "search_patterns", "dumps_config", "summary", "main"]
