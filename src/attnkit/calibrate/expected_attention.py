"""``attnkit calibrate expected_attention``: the query statistics ``expected_attention:stats=FILE`` scores keys with
(Devoto, Jeblick, Jegou, 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", arXiv 2510.00636; kvpress's ``ExpectedAttentionStatsPress`` and the script beside it).

1. **Queries.** The model's queries before RoPE (rotated back by their positions; after Qwen3's query norm) on
   ``samples`` windows of ``length`` tokens of the training split of attnkit's corpus (:mod:`attnkit.calibrate.queries`),
   the first ``n_sink`` positions of every window left out (kvpress's script drops them too: attention sinks, whose
   queries are outliers). kvpress's script reads the first 100 chapters of ``kmfoda/booksum`` cut to 1000 characters.
2. **Statistics**, per layer and query head, over every query of every window: the mean ``mu`` and the covariance
   ``Sigma = scatter / (N - 1)`` (the unbiased estimate, as kvpress's script), folded in float64.

The file (:mod:`attnkit.methods.expected_attention_stats`: safetensors, kvpress's tensor names) records the model,
its geometry, its RoPE frequencies, the settings and the date (today's UTC date, or that of ``SOURCE_DATE_EPOCH``),
so ``expected_attention:stats=FILE`` refuses a model of another geometry. The same arguments give the same file.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.heads import today
from attnkit.calibrate.queries import query_moments
from attnkit.errors import AttnkitError
from attnkit.methods.expected_attention_stats import load_moments, save_moments
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.rope import Rope
from attnkit.version import __version__


@torch.inference_mode()
def calibrate_expected_attention(model: LoadedModel, *, samples: int = 8, length: int = 1024, seed: int = 0,
                                 n_sink: int = 4, progress: Callable[[str], None] | None = None):
    """``(mean [layers, heads, d], cov [layers, heads, d, d], metadata)`` of `model`'s queries before RoPE (see the
    module docstring); :func:`attnkit.methods.expected_attention_stats.save_moments` writes them."""
    rope = Rope.from_model(model)
    if rope is None:
        raise AttnkitError("calibrate expected_attention needs a model with RoPE (to recover the queries before it)")
    moments = query_moments(model, samples=samples, length=length, seed=seed, before_rope=True, skip=n_sink,
                            progress=progress)
    geo = model.geometry
    count = moments.count[0]
    if count < 2:
        raise AttnkitError(f"calibrate expected_attention: {count} query per head is too few for a covariance; raise "
                           f"--samples or --length")
    mean = torch.stack([moments.mean[i] for i in range(geo.n_layers)])
    cov = torch.stack([moments.scatter[i] / (moments.count[i] - 1) for i in range(geo.n_layers)])
    meta = {"model": model.spec, "architecture": geo.architecture, "n_layers": geo.n_layers,
            "n_heads": geo.n_q_heads, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
            "inv_freq": [float(f"{x:.9g}") for x in rope.inv_freq.float().tolist()],
            "statistics": "per layer and query head, the mean and unbiased covariance of the queries before RoPE",
            "calibration": {"text": "attnkit corpus, train split", "samples": samples, "length": length, "seed": seed,
                            "n_sink": n_sink, "queries_per_head": count},
            "date": today(), "attnkit_version": __version__}
    return mean.float(), cov.float(), meta


def summary(mean: torch.Tensor, cov: torch.Tensor, meta: dict) -> str:
    """A few lines for the terminal: per layer, how far the mean query stands out of its spread."""
    rows = [f"{meta['model']}: expected_attention query statistics, {meta['n_layers']} layers x {meta['n_heads']} "
            f"query heads, {meta['calibration']['queries_per_head']} queries per head"]
    for i in range(mean.shape[0]):
        spread = cov[i].diagonal(dim1=-2, dim2=-1).sum(-1).sqrt()
        ratio = (mean[i].norm(dim=-1) / spread.clamp_min(1e-30)).tolist()
        rows.append(f"  layer {i:>2}: |mu| / sqrt(trace Sigma) per query head " + " ".join(f"{r:.2f}" for r in ratio))
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate expected_attention`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    mean, cov, meta = calibrate_expected_attention(model, samples=args.samples, length=args.length, seed=args.seed,
                                                   n_sink=args.n_sink, progress=progress_to_stderr)
    path = save_moments(Path(args.out), mean, cov, meta)
    load_moments(path)  # it must load back
    print(summary(mean, cov, meta))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_expected_attention", "summary", "main"]
