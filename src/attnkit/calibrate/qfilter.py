"""``attnkit calibrate qfilter``: the Q-Filters of a model, one query direction per layer and kv head (Godey, Devoto,
Xu, Borgo, Clavel, Grave, 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression", arXiv
2503.02812, section 3).

1. **Queries.** The model's queries on its own text, as its attention sees them (after RoPE), over ``samples``
   windows of ``length`` tokens of the training split of attnkit's corpus (:mod:`attnkit.calibrate.queries`).
2. **Direction.** Per layer and kv head, the queries of the head's group (its ``g`` query heads, GQA) stacked into
   one matrix ``Q`` ``[N, d]``; its first right singular vector ``u`` (the top eigenvector of ``Q^T Q``, which is
   summed in float64 over the windows, so no query matrix is held), signed so that ``sum_i <q_i, u> > 0``: the
   direction the queries point along, on which a key's projection estimates its attention. The paper's filters are
   the same SVD of queries on a pretraining corpus; its authors publish them on the Hugging Face hub, which kvpress
   downloads.
3. **Fit**, per layer: the share of the queries' second moment ``E[<q, u>^2] / E[|q|^2]`` the direction carries (1:
   the queries lie on one line), in the file and the summary.

The file (:mod:`attnkit.methods.qfilter`) records the model, its geometry, its RoPE frequencies, the settings and the
date (today's UTC date, or that of ``SOURCE_DATE_EPOCH``), so ``qfilter:config=FILE`` refuses a model of another
geometry. The same arguments give the same filters.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.heads import today
from attnkit.calibrate.queries import query_moments
from attnkit.config_file import write_config_file
from attnkit.methods.qfilter import FORMAT, dumps_filters, filters_from_dict
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.rope import Rope
from attnkit.version import __version__

DIGITS = 7  # significant digits kept in the file


def q_filter(second_moment: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The unit vector ``u`` maximising ``u^T M u`` for the uncentred second moment `second_moment` ``M = Q^T Q``
    (``[d, d]``, float64), signed so that ``<total, u> >= 0`` for the sum of the queries `total`; and the share of
    ``trace(M)`` it carries."""
    values, vectors = torch.linalg.eigh(second_moment)  # ascending
    u = vectors[:, -1]
    if float(total @ u) < 0:
        u = -u
    return u, float(values[-1] / second_moment.trace().clamp_min(1e-300))


@torch.inference_mode()
def calibrate_qfilter(model: LoadedModel, *, samples: int = 8, length: int = 1024, seed: int = 0,
                      progress: Callable[[str], None] | None = None) -> dict:
    """The Q-Filters of `model` (see the module docstring) as the file's contents (JSON-ready;
    :func:`attnkit.methods.qfilter.dumps_filters` writes them)."""
    moments = query_moments(model, samples=samples, length=length, seed=seed, before_rope=False, progress=progress)
    geo = model.geometry
    group = geo.n_q_heads // geo.n_kv_heads
    layers = []
    for i in range(geo.n_layers):
        second = moments.second_moment(i).view(geo.n_kv_heads, group, geo.head_dim, geo.head_dim).sum(1)
        total = (moments.mean[i] * moments.count[i]).view(geo.n_kv_heads, group, geo.head_dim).sum(1)
        fitted = [q_filter(second[h], total[h]) for h in range(geo.n_kv_heads)]
        layers.append({"filters": [[float(f"{x:.{DIGITS}g}") for x in u.tolist()] for u, _ in fitted],
                       "explained": [round(share, 4) for _, share in fitted]})
    rope = Rope.from_model(model)
    config = {
        "format": FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": geo.n_layers, "n_heads": geo.n_q_heads, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "inv_freq": None if rope is None else [float(f"{x:.{DIGITS + 2}g}") for x in rope.inv_freq.float().tolist()],
        "filters": "per layer and kv head, the unit first right singular vector u of the group's queries after RoPE, "
                   "signed so that sum <q, u> > 0; explained = E[<q, u>^2] / E[|q|^2]",
        "calibration": {"text": "attnkit corpus, train split", "samples": samples, "length": length, "seed": seed,
                        "queries_per_kv_head": moments.count[0] * group},
        "date": today(),
        "attnkit_version": __version__,
        "layers": layers,
    }
    filters_from_dict(json.loads(json.dumps(config)), "the calibrated q-filters")  # it must load back
    return config


def summary(config: dict) -> str:
    """A few lines for the terminal: per layer, the share of the queries' second moment each kv head's filter carries."""
    rows = [f"{config['model']}: q-filters, {config['n_layers']} layers x {config['n_kv_heads']} kv heads, "
            f"{config['calibration']['queries_per_kv_head']} queries per kv head"]
    for i, layer in enumerate(config["layers"]):
        rows.append(f"  layer {i:>2}: explained per kv head " + " ".join(f"{x:.2f}" for x in layer["explained"]))
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate qfilter`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    config = calibrate_qfilter(model, samples=args.samples, length=args.length, seed=args.seed,
                               progress=progress_to_stderr)
    path = write_config_file(args.out, dumps_filters(config))
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_qfilter", "q_filter", "summary", "main"]
