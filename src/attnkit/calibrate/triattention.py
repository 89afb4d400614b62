"""``attnkit calibrate triattention``: record the pre-RoPE query statistics TriAttention scores keys with (Mao, Lin,
Huang, Xie, Fu, Zhuang, Han, Chen, 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
arXiv 2604.04921; the authors' ``scripts/calibrate.py``).

1. **Text.** ``samples`` windows of ``length`` tokens (each starting with the model's BOS token) of the model's own
   text: the training split of attnkit's corpus (:mod:`attnkit.eval.data.corpus`, on which the bundled ``tiny`` was
   trained), drawn by seed (:func:`attnkit.calibrate.kvzap.text_windows`). The authors run one forward over a plain
   text of up to 32k tokens and find the statistics insensitive to its domain.
2. **Queries.** The windows are prefilled with full attention, in batches; every layer's queries, as the attention
   sees them (after RoPE, and after Qwen3's query norm), are rotated back by their positions
   (:meth:`attnkit.rope.Rope.rotate` by ``-t``), so they are the queries before RoPE.
3. **Statistics**, per layer, query head and frequency band ``f`` (the pairs ``(q_f, q_{f + d/2})`` as complex
   numbers, :func:`attnkit.methods.triattention_stats.bands`), over every query of every window: the centre
   ``E[q_f]`` and the mean norm ``E|q_f|``, summed in float64.

The file (:mod:`attnkit.methods.triattention_stats`) records the model, its geometry, its RoPE frequencies, the
settings and the date (today's UTC date, or that of ``SOURCE_DATE_EPOCH`` for reproducible files), so
``triattention:config=FILE`` refuses a model of another geometry. The same arguments give the same statistics.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.calibrate import progress_to_stderr
from attnkit.calibrate.heads import today
from attnkit.calibrate.kvzap import text_windows
from attnkit.calibrate.samples import check_length
from attnkit.config_file import write_config_file
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.full import Full
from attnkit.methods.triattention_stats import FORMAT, bands, dumps_stats, stats_from_dict
from attnkit.model import LoadedModel, load_model_for_length
from attnkit.session import new_session
from attnkit.validate import whole
from attnkit.version import __version__

BATCH_ROWS = 8  # windows prefilled together
DIGITS = 7  # significant digits kept in the file


@dataclass
class _Sums:
    """Per layer: the sums of the pre-RoPE query bands (complex) and of their norms ``[heads, d/2]``, and the count."""

    center: dict = field(default_factory=dict)
    norm: dict = field(default_factory=dict)
    count: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _QueryRecorder(Full):
    """``full`` attention that adds every layer's pre-RoPE queries to the run's sums."""

    def new_session_state(self) -> _Sums:
        return _Sums()

    def prefill_attention(self, ctx, q, k, v):
        rope = ctx.session.rope
        if rope is None or 2 * rope.inv_freq.numel() != q.shape[-1]:
            raise AttnkitError("calibrate triattention needs a model with RoPE over the whole head")
        z = bands(rope.rotate(q.float(), -ctx.q_pos)).to(torch.complex128)  # [b, h, n, d/2]
        sums, i = ctx.session_state, ctx.index
        sums.center[i] = sums.center.get(i, 0) + z.sum(dim=(0, 2)).cpu()
        sums.norm[i] = sums.norm.get(i, 0) + z.abs().sum(dim=(0, 2)).cpu()
        sums.count[i] = sums.count.get(i, 0) + z.shape[0] * z.shape[2]
        return super().prefill_attention(ctx, q, k, v)


def _rounded(t: torch.Tensor) -> list:
    return [[float(f"{x:.{DIGITS}g}") for x in row] for row in t.tolist()]


@torch.inference_mode()
def calibrate_triattention(model: LoadedModel, *, samples: int = 8, length: int = 1024, seed: int = 0,
                           progress: Callable[[str], None] | None = None) -> dict:
    """Record the statistics of `model` (see the module docstring) and return the file's contents (JSON-ready;
    :func:`attnkit.methods.triattention_stats.dumps_stats` writes them)."""
    say = progress or (lambda _msg: None)
    whole("samples", samples, 1)
    check_length(model, length)
    windows = text_windows(model, "train", samples, length, seed)
    sums = None
    for start in range(0, len(windows), BATCH_ROWS):
        ids = torch.tensor(windows[start:start + BATCH_ROWS], device=model.device)
        say(f"queries: windows {start + 1}-{start + ids.shape[0]} of {len(windows)}")
        session = new_session(model, _QueryRecorder(), ids.shape[1], 0, rows=ids.shape[0])
        prefill(model, session, ids)
        run = session.state
        if sums is None:
            sums = run
        else:
            for i in run.count:
                sums.center[i] += run.center[i]
                sums.norm[i] += run.norm[i]
                sums.count[i] += run.count[i]
    geo = model.geometry
    layers = []
    for i in range(geo.n_layers):
        center, norm = sums.center[i] / sums.count[i], sums.norm[i] / sums.count[i]
        layers.append({"center_real": _rounded(center.real), "center_imag": _rounded(center.imag),
                       "abs_mean": _rounded(norm)})
    inv_freq = session.rope.inv_freq.detach().float().cpu()
    config = {
        "format": FORMAT,
        "model": model.spec, "architecture": geo.architecture,
        "n_layers": geo.n_layers, "n_heads": geo.n_q_heads, "n_kv_heads": geo.n_kv_heads, "head_dim": geo.head_dim,
        "rope_theta": geo.rope_theta, "inv_freq": [float(f"{x:.{DIGITS + 2}g}") for x in inv_freq.tolist()],
        "statistics": "per layer, query head and frequency band f of the queries before RoPE (q_f + i q_{f+d/2}): "
                      "center = E[q_f] (center_real, center_imag), abs_mean = E|q_f|",
        "calibration": {"text": "attnkit corpus, train split", "samples": samples, "length": length, "seed": seed,
                        "queries_per_head": sums.count[0]},
        "date": today(),
        "attnkit_version": __version__,
        "layers": layers,
    }
    stats_from_dict(json.loads(json.dumps(config)), "the calibrated statistics")  # it must load back
    return config


def summary(config: dict) -> str:
    """A few lines for the terminal: per layer, how concentrated the queries are (|E[q]| / E|q|, 1 = one direction)."""
    rows = [f"{config['model']}: triattention query statistics, {config['n_layers']} layers x {config['n_heads']} "
            f"query heads x {config['head_dim'] // 2} bands, {config['calibration']['queries_per_head']} queries "
            f"per head"]
    for i, layer in enumerate(config["layers"]):
        center = torch.complex(torch.tensor(layer["center_real"]), torch.tensor(layer["center_imag"])).abs()
        ratio = (center.sum(-1) / torch.tensor(layer["abs_mean"]).sum(-1).clamp_min(1e-30)).tolist()
        rows.append(f"  layer {i:>2}: concentration per query head " + " ".join(f"{r:.2f}" for r in ratio))
    return "\n".join(rows)


def main(args) -> int:
    """``attnkit calibrate triattention`` (arguments parsed by :mod:`attnkit.cli`)."""
    model = load_model_for_length(args.model, max(args.length, 4096))
    config = calibrate_triattention(model, samples=args.samples, length=args.length, seed=args.seed,
                                    progress=progress_to_stderr)
    path = write_config_file(args.out, dumps_stats(config))
    print(summary(config))
    print(f"wrote {path}", file=sys.stderr)
    return 0


__all__ = ["calibrate_triattention", "summary", "main"]
