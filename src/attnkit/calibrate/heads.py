"""Share-Attention calibration: which heads of a layer may share one softmax.

Taniguchi, Xiao, Dong, Oyamada, Onizuka: "Attention スコアの分布類似性を用いた大規模言語モデルの動作効率化および
省メモリ化" (efficient, memory-saving LLM inference from the similarity of attention score distributions),
sections 3.1 and 4.1; "the paper" below. Its three offline steps (section 4.1):

1. run calibration prompts and take every layer's per-head prefill attention maps ``A_h`` (N x N, causal);
2. the distance of eq. 9 between every pair of heads of a layer,
   ``distance(A, A') = sqrt(sum (A - A')^2) / sqrt(N)`` (N the input length), averaged over the prompts;
3. cluster heads whose distance is at most the layer's threshold ``th`` (the paper: "distance が th 以下であれば
   類似"), pick one essential head per cluster and write ``{"essential_heads": [...], "share_to": {...}}``.

The maps are never held whole: each layer's probabilities are formed a chunk of queries at a time (at most
:data:`attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` head x query x key entries) and only the pairwise sums of
squared differences (``heads x heads`` numbers, accumulated in float64 through a Gram matrix) survive a chunk.

Clustering (the paper does not spell it out): a leader rule that guarantees every shared head is within ``th``
of ITS essential head, the quantity the approximation depends on. Repeatedly, among the heads not yet assigned,
the head with the most unassigned heads within ``th`` (ties: the smaller summed distance to them, then the
lower index) becomes essential and those heads share to it. ``th = 0`` shares nothing (the paper's "th=0 として
共有しない" of section 5).

Thresholds are per layer, as the paper uses them (section 5, Fig. 6-7: sharing hurts in the early layers and the
last layers decide the answer's format, so ``th`` is low there and high in the middle): one value for all
layers, one per layer from a file, or a schedule ``LOW,HIGH[,A:B]`` giving HIGH to layers ``A .. B-1`` and LOW
to the others. The default band follows Fig. 6 on Llama3's 32 layers (15-28 tolerate sharing):
``A = n // 2 - 1``, ``B = n - max(1, round(3 n / 32))``.

Calibration prompts come from :mod:`attnkit.eval.data.tasks`, never an evaluation sample: split ``calibration``
uses the held-out haystack with seeds offset by :data:`attnkit.calibrate.samples.SEED_OFFSET` (as the pattern
search does), split ``train`` the training stream (slower: its haystack is 25x larger to tokenize). The same
arguments write the same file byte for byte; the ``date`` field is today's UTC date, or the date of
``SOURCE_DATE_EPOCH`` when that is set (reproducible builds).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.samples import calibration_samples
from attnkit.config_file import dumps_layered_config, write_config_file
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.base import Method
from attnkit.methods.scoring import block_elements_for
from attnkit.methods.share import CONFIG_FORMAT, LayerPlan, essential_probabilities, parse_share_config
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import new_session
from attnkit.version import __version__

DEFAULT_TASKS = ("passkey", "kv_retrieval", "code_completion")
DEFAULT_THRESHOLD = 0.18  # the paper's example (section 3.1, layer 13 of Llama3)


# ---- eq. 9 ---------------------------------------------------------------------------------------------
def eq9_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Eq. 9 of the paper for two N x N attention matrices: ``sqrt(sum (A - A')^2) / sqrt(N)``."""
    n = a.shape[-1]
    return float(((a.double() - b.double()) ** 2).sum().sqrt() / n ** 0.5)


def squared_differences(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, window: int | None = None,
                        block_elements: int | None = None) -> torch.Tensor:
    """``S[i, j] = sum over (query, key) of (A_i - A_j)^2`` for every pair of query heads ``[h, h]`` (float64),
    the attention maps ``A`` (eq. 5 probabilities, causal by position) formed in query chunks."""
    b, hq, n_q, _ = q.shape
    if b != 1:
        raise AttnkitError(f"head calibration takes one prompt at a time, got a batch of {b}")
    n_k = keys.shape[2]
    plan = LayerPlan.identity(hq, keys.shape[1])
    if block_elements is None:
        block_elements = block_elements_for(q.device)
    block = max(1, block_elements // (hq * n_k))
    total = torch.zeros(hq, hq, dtype=torch.float64)
    for s in range(0, n_q, block):
        e = min(n_q, s + block)
        qp = q_pos[s:e]
        lim = int(torch.searchsorted(k_pos, qp.max(), right=True))
        probs = essential_probabilities(q[:, :, s:e], keys[:, :, :lim], scaling, qp, k_pos[:lim], window, plan)
        x = probs[0].reshape(len(plan.essential), -1).double()
        x = x[torch.tensor(plan.source, device=x.device)]  # back to head order
        gram = x @ x.T
        sq = gram.diagonal()
        total += (sq[:, None] + sq[None, :] - 2 * gram).clamp_(min=0).cpu()
    return total


def head_distances(q, keys, scaling, q_pos, k_pos, window=None, block_elements=None) -> torch.Tensor:
    """Eq. 9 distance between every pair of heads of one layer on one prompt, ``[h, h]``; N = keys."""
    return squared_differences(q, keys, scaling, q_pos, k_pos, window, block_elements).sqrt() / keys.shape[2] ** 0.5


# ---- clustering -----------------------------------------------------------------------------------------
def cluster_heads(distances: torch.Tensor, threshold: float) -> tuple[list[int], dict[int, int]]:
    """Essential heads (ascending) and ``share_to`` (shared head -> essential head) of one layer: the leader
    rule of the module docstring. Every shared head is within `threshold` of its essential head."""
    d = distances.double()
    h = d.shape[0]
    if threshold <= 0:
        return list(range(h)), {}
    close = d <= threshold
    close |= torch.eye(h, dtype=torch.bool)
    left = torch.ones(h, dtype=torch.bool)
    essential, share_to = [], {}
    while bool(left.any()):
        best, best_key = None, None
        for i in torch.nonzero(left).flatten().tolist():
            members = close[i] & left
            key = (-int(members.sum()), float(d[i][members].sum()), i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        members = close[best] & left
        essential.append(best)
        for j in torch.nonzero(members).flatten().tolist():
            if j != best:
                share_to[j] = best
        left &= ~members
    return sorted(essential), dict(sorted(share_to.items()))


# ---- thresholds ---------------------------------------------------------------------------------------------
def _number(x, what: str) -> float:
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise AttnkitError(f"{what} must be a number, got {x!r}") from None
    if not value >= 0:
        raise AttnkitError(f"{what} must be >= 0 (0 = no sharing), got {x!r}")
    return value


def schedule_thresholds(spec: str, n_layers: int) -> list[float]:
    """``LOW,HIGH[,A:B]`` -> per layer: HIGH for layers A..B-1, LOW elsewhere (defaults: module docstring)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) not in (2, 3):
        raise AttnkitError(f"threshold schedule {spec!r}: expected LOW,HIGH or LOW,HIGH,A:B (layers A..B-1 get HIGH)")
    low, high = _number(parts[0], "the schedule's LOW threshold"), _number(parts[1], "the schedule's HIGH threshold")
    a, b = max(0, n_layers // 2 - 1), n_layers - max(1, round(3 * n_layers / 32))
    if len(parts) == 3:
        lo, colon, hi = parts[2].partition(":")
        try:
            a, b = int(lo), int(hi)
        except ValueError:
            raise AttnkitError(f"threshold schedule {spec!r}: the band must be A:B (layer numbers), got {parts[2]!r}") from None
        if not colon or not 0 <= a < b <= n_layers:
            raise AttnkitError(f"threshold schedule {spec!r}: band {parts[2]!r} must satisfy 0 <= A < B <= {n_layers}")
    return [high if a <= i < b else low for i in range(n_layers)]


def read_thresholds(path: str | Path, n_layers: int) -> list[float]:
    """One threshold per layer from a file: a JSON list, ``{"thresholds": [...]}``, or numbers separated by
    whitespace / commas / newlines."""
    path = Path(path)
    if not path.is_file():
        raise AttnkitError(f"thresholds file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text)
        values = data.get("thresholds") if isinstance(data, dict) else data
    except json.JSONDecodeError:
        values = text.replace(",", " ").split()
    if not isinstance(values, list):
        raise AttnkitError(f"thresholds file {str(path)!r}: expected a list of numbers")
    if len(values) != n_layers:
        raise AttnkitError(f"thresholds file {str(path)!r} lists {len(values)} thresholds but the model has "
                           f"{n_layers} layers; give one per layer")
    return [_number(v, f"threshold of layer {i}") for i, v in enumerate(values)]


def resolve_thresholds(n_layers: int, threshold: float | None = None, thresholds: str | Path | Sequence | None = None,
                       schedule: str | None = None) -> tuple[list[float], str]:
    """Per-layer thresholds from exactly one of: a single value, a file / list, a schedule; and a description."""
    given = [x is not None for x in (threshold, thresholds, schedule)]
    if sum(given) > 1:
        raise AttnkitError("give one of --threshold, --thresholds FILE or --threshold-schedule LOW,HIGH[,A:B]")
    if schedule is not None:
        return schedule_thresholds(schedule, n_layers), f"schedule {schedule}"
    if thresholds is not None:
        if isinstance(thresholds, (str, Path)):
            return read_thresholds(thresholds, n_layers), f"file {Path(thresholds).name}"
        values = [_number(v, f"threshold of layer {i}") for i, v in enumerate(thresholds)]
        if len(values) != n_layers:
            raise AttnkitError(f"{len(values)} thresholds given but the model has {n_layers} layers")
        return values, "per layer"
    value = DEFAULT_THRESHOLD if threshold is None else _number(threshold, "threshold")
    return [value] * n_layers, f"uniform {value}"


# ---- prompts and the probe -------------------------------------------------------------------------------------
class _MapProbe(Method):
    """Dense prefill (as ``full``) that hands each layer's queries and stored keys to `visit`."""

    name = "heads-probe"

    def __init__(self, visit: Callable):
        self.visit = visit

    def prefill_output(self, ctx, q, keys, values, positions):
        self.visit(ctx, q, keys, positions)
        return super().prefill_output(ctx, q, keys, values, positions)


@torch.inference_mode()
def layer_distances(model: LoadedModel, prompts, progress: Callable[[str], None] | None = None) -> torch.Tensor:
    """Eq. 9 distances ``[layers, heads, heads]`` averaged over the prompts ``(info, sample, ids)``."""
    geo = model.geometry
    total = torch.zeros(geo.n_layers, geo.n_q_heads, geo.n_q_heads, dtype=torch.float64)

    def visit(ctx, q, keys, positions):
        pos = positions[0, 0]
        sq = squared_differences(q, keys, ctx.scaling, ctx.q_pos, pos, ctx.native_window)
        total[ctx.index] += sq.sqrt() / keys.shape[2] ** 0.5

    for p, (info, _sample, ids) in enumerate(prompts):
        if progress:
            progress(f"attention maps {p + 1}/{len(prompts)}: {info['task']} ({info['tokens']} tokens)")
        probe = _MapProbe(visit)
        prefill(model, new_session(model, probe, ids.shape[0], 0), ids)
    return total / len(prompts)


def today() -> str:
    """The date a calibration file carries (``SOURCE_DATE_EPOCH`` when set, for reproducible files)."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.datetime.fromtimestamp(int(epoch), datetime.UTC) if epoch else \
        datetime.datetime.now(datetime.UTC)
    return when.date().isoformat()


def calibrate_heads(model: LoadedModel, *, length: int = 1024, tasks: Sequence[str] = DEFAULT_TASKS, samples: int = 1,
                    seed: int = 0, split: str = "calibration", threshold: float | None = None,
                    thresholds: str | Path | Sequence | None = None, schedule: str | None = None,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Run the calibration and return the config (a JSON-ready dict; :func:`write_config` writes it)."""
    geo = model.geometry
    per_layer, rule = resolve_thresholds(geo.n_layers, threshold, thresholds, schedule)
    prompts = calibration_samples(model, length, list(tasks), samples, seed, split)
    dist = layer_distances(model, prompts, progress)
    layers = []
    for i in range(geo.n_layers):
        essential, share_to = cluster_heads(dist[i], per_layer[i])
        layers.append({
            "essential_heads": essential,
            "share_to": {str(h): e for h, e in share_to.items()},
            "retention_rate": round(len(essential) / geo.n_q_heads, 6),
            "threshold": per_layer[i],
            "distances": [[round(float(x), 6) for x in row] for row in dist[i]],
        })
    retention = [layer["retention_rate"] for layer in layers]

    config = {
        "format": CONFIG_FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": geo.n_layers, "n_heads": geo.n_q_heads, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "distance": "eq. 9 of Share-Attention (Taniguchi et al.): sqrt(sum (A - A')^2) / sqrt(N) between prefill attention maps, mean over prompts",
        "clustering": "leader rule: the head with most unassigned heads within the threshold becomes essential; "
                      "every shared head is within the threshold of its essential head; threshold 0 shares nothing",
        "threshold_rule": rule, "thresholds": per_layer,
        "retention_rate": retention,
        "mean_retention_rate": round(sum(retention) / len(retention), 6),
        "skipped_fraction": round(1 - sum(retention) / len(retention), 6),
        "length": length, "seed": seed, "split": split,
        "prompts": [info for info, _, _ in prompts],
        "date": today(), "attnkit_version": __version__,
        "layers": layers,
    }
    parse_share_config(json.loads(json.dumps(config)), "the calibrated config")  # it must load back
    return config


def dumps_config(config: dict) -> str:
    """JSON text: metadata one key per line, then one line per layer."""
    return dumps_layered_config(config, lambda layer: "    " + json.dumps(layer))


def write_config(config: dict, path: str | Path) -> Path:
    return write_config_file(path, dumps_config(config))


def summary(config: dict) -> str:
    rows = [f"{config['model']}: {config['n_layers']} layers x {config['n_heads']} heads "
            f"({config['n_kv_heads']} kv), thresholds {config['threshold_rule']}"]
    for i, layer in enumerate(config["layers"]):
        rows.append(f"  layer {i:>2}: th {layer['threshold']:.3f}, essential {len(layer['essential_heads'])}/"
                    f"{config['n_heads']} (retention {100 * layer['retention_rate']:.1f} %), "
                    f"shared {layer['share_to'] or '-'}")
    rows.append(f"  mean retention {100 * config['mean_retention_rate']:.1f} %; QK^T+softmax head-ops skipped "
                f"{100 * config['skipped_fraction']:.1f} %")
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate heads`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    config = calibrate_heads(model, length=args.length, tasks=args.tasks, samples=args.samples, seed=args.seed,
                             split=args.split, threshold=args.threshold, thresholds=args.thresholds,
                             schedule=args.threshold_schedule,
                             progress=progress_to_stderr)
    path = write_config(config, args.out)
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["eq9_distance", "squared_differences", "head_distances", "cluster_heads", "schedule_thresholds",
           "read_thresholds", "resolve_thresholds", "layer_distances", "calibrate_heads",
           "dumps_config", "write_config", "summary", "main"]
