"""Calibrated query statistics for ``expected_attention:stats=FILE`` (Devoto, Jeblick, Jegou, 2025, "Expected
Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's
``ExpectedAttentionStatsPress``).

A file written by ``attnkit calibrate expected_attention`` (:mod:`attnkit.calibrate.expected_attention`) holds, per
layer and query head, the mean ``mu`` and covariance ``Sigma`` of the model's queries before RoPE on a calibration
text, as safetensors: ``query_mean`` ``[layers, heads, d]`` and ``query_cov`` ``[layers, heads, d, d]`` (float32; the
names and shapes of kvpress's ``ExpectedAttentionStats``), with metadata (JSON under ``attnkit``): the format, the
model, its geometry, its RoPE frequencies, the calibration settings and the date. :meth:`QueryMomentsFile.check`
refuses a model of another geometry or other RoPE frequencies in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnkit.errors import AttnkitError

FORMAT = "attnkit.expected-attention-stats/1"
HOW_TO_MAKE = "make one with `attnkit calibrate expected_attention --model M --out FILE`"
FREQ_TOLERANCE = 1e-4  # relative difference of a RoPE frequency above which the file is another model's


class QueryMomentsFile:
    """A statistics file's moments (float32, CPU; :meth:`layer` hands them out per device) and its geometry."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, meta: dict, source: str):
        self.mean, self.cov, self.meta, self.source = mean, cov, meta, source
        self.n_layers, self.n_heads, self.head_dim = mean.shape
        self.inv_freq = torch.tensor(meta["inv_freq"], dtype=torch.float32)
        self._on: dict = {}

    def check(self, n_layers: int, n_heads: int | None, head_dim: int | None, inv_freq) -> None:
        """Refuse, in one line, a model whose layers, query heads, head dimension or RoPE frequencies are not the
        file's (a size None: not known yet, not checked)."""
        got = {"layers": n_layers, "query heads": n_heads, "head_dim": head_dim}
        want = {"layers": self.n_layers, "query heads": self.n_heads, "head_dim": self.head_dim}
        bad = [f"{key} {got[key]} (file: {want[key]})" for key in got if got[key] is not None and got[key] != want[key]]
        if not bad:
            freq = inv_freq.detach().float().cpu()
            if freq.shape != self.inv_freq.shape or not torch.allclose(freq, self.inv_freq, rtol=FREQ_TOLERANCE,
                                                                       atol=0):
                bad.append("RoPE frequencies (another rope_theta or scaling)")
        if bad:
            raise AttnkitError(f"{self.source} was calibrated for {self.meta.get('model')!r}, not this model: "
                               f"{', '.join(bad)}; {HOW_TO_MAKE}")

    def layer(self, index: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s ``mu`` ``[heads, d]`` and ``Sigma`` ``[heads, d, d]`` (float64) on `device`."""
        key = (index, str(device))
        if key not in self._on:
            self._on[key] = (self.mean[index].to(device, torch.float64), self.cov[index].to(device, torch.float64))
        return self._on[key]


def save_moments(path, mean: torch.Tensor, cov: torch.Tensor, meta: dict) -> Path:
    """Write a statistics file (see the module docstring); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"query_mean": mean.float().contiguous().cpu(), "query_cov": cov.float().contiguous().cpu()}, str(path),
              metadata={"format": FORMAT, "attnkit": json.dumps(meta)})
    return path


def load_moments(path) -> QueryMomentsFile:
    """The statistics of a file written by ``attnkit calibrate expected_attention``."""
    source = f"expected_attention statistics {str(path)!r}"
    if not Path(path).is_file():
        raise AttnkitError(f"{source} does not exist ({HOW_TO_MAKE})")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors' own errors: not a safetensors file, truncated
        raise AttnkitError(f"{source} is not a safetensors file: {str(exc).splitlines()[0]}") from None
    if header.get("format") != FORMAT:
        raise AttnkitError(f"{source}: not an expected_attention statistics file (format {header.get('format')!r}, "
                           f"expected {FORMAT!r}); {HOW_TO_MAKE}")
    mean, cov = tensors.get("query_mean"), tensors.get("query_cov")
    if mean is None or cov is None or mean.dim() != 3 or cov.shape != mean.shape + mean.shape[-1:] \
            or not bool(torch.isfinite(mean).all() and torch.isfinite(cov).all()):
        raise AttnkitError(f"{source}: needs finite query_mean [layers, heads, d] and query_cov [layers, heads, d, d]")
    meta = json.loads(header.get("attnkit", "{}"))
    if not isinstance(meta.get("inv_freq"), list) or 2 * len(meta["inv_freq"]) != mean.shape[-1]:
        raise AttnkitError(f"{source}: its metadata must list the model's {mean.shape[-1] // 2} RoPE frequencies")
    return QueryMomentsFile(mean.float(), cov.float(), meta, source)
