"""TriAttention's offline query statistics and its trigonometric score of a cached key (Mao, Lin, Huang, Xie, Fu,
Zhuang, Han, Chen, 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
arXiv 2604.04921; the authors' code: github.com/WeianMao/triattention, ``triattention/methods/pruning_utils.py``).

**Frequency bands.** RoPE rotates the pairs ``(x_f, x_{f + d/2})`` of a head's ``d`` dimensions (transformers'
half-split convention), band ``f`` by the angle ``omega_f p`` at position ``p``. Written as complex numbers
``x_f + i x_{f + d/2}``, a query ``q`` at position ``t`` and a key ``k`` at position ``p``, both before RoPE, have
the logit (times the attention scaling)

    q_rot . k_rot = sum_f Re( q_f conj(k_f) e^{i omega_f (t - p)} )
                  = sum_f |q_f| |k_f| cos( omega_f (t - p) + phi_f ),   phi_f = arg(q_f conj(k_f))

a trigonometric series in the distance ``t - p``.

**Statistics** (``attnkit calibrate triattention``): the paper observes that a head's pre-RoPE queries concentrate
around a fixed centre, so it replaces ``q`` by its calibration statistics, per layer, query head and band: the
centre ``E[q_f]`` (a complex mean) and the mean norm ``E|q_f|``.

**Score** of a key of kv head ``g`` held at position ``p``, for query head ``h`` of ``g``'s group, when the next
query sits at ``t0`` (the "round start"):

    S_h(k) = agg_{o in O} sum_f |E[q_f]| |k_f| cos( omega_f (t0 + o - p) + arg(E[q_f] conj(k_f)) )
             + sum_f (E|q_f| - |E[q_f]|) |k_f|

The first term is the series at the future distances ``t0 + o - p`` for the offsets ``O = 1, 2, 4, ..., 2^m <=
offset_max_length`` (the authors' geometric offsets), aggregated by their mean (or maximum); the second, position-
free term credits the part of the queries' norm the centre does not capture (the authors' "MLR" term: what the
spread of the queries adds to the expected logit of a long key). The key enters before RoPE, but it need not be
rotated back: RoPE turns band ``f`` of the key at ``p`` by ``e^{i omega_f p}``, so for the cached key ``k~``,
``conj(k_f) e^{i omega_f (t0 + o - p)} = conj(k~_f) e^{i omega_f (t0 + o)}``, and ``|k_f| = |k~_f|``. The series
term is then a dot product of the cached key with one real vector per query head and offset, whatever the key's
position (:func:`trig_scores`). The model's ``attention_scaling`` (yarn's magnitude factor) stays inside cached keys
and recorded queries alike, so it is the authors' ``freq_scale_sq`` factor per band. Those vectors are computed in
float64 (``omega_f (t0 + o)`` reaches tens of thousands of radians at the largest offsets), the products in float32.

**File.** JSON, one line per layer (:func:`dumps_stats`): the model, its geometry (layers, query and kv heads, head
dimension), the RoPE frequencies ``omega``, the calibration settings and date, and per layer ``center_real``,
``center_imag`` and ``abs_mean`` (``[query heads][d/2]`` each). :meth:`QueryStats.check` refuses a model whose
geometry or frequencies differ, in one line.
"""

from __future__ import annotations

import json
import math

import torch

from attnkit.config_file import dumps_layered_config, read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.scoring import block_elements_for
from attnkit.validate import is_number, is_whole

FORMAT = "attnkit.triattention-stats/1"
AGGREGATIONS = ("mean", "max")
HOW_TO_MAKE = "make one with `attnkit calibrate triattention --model M --out FILE`"
FREQ_TOLERANCE = 1e-4  # relative difference of a RoPE frequency above which the file is another model's
STD_EPS = 1e-8  # a head whose scores spread less than this is left unscaled by the normalisation (the authors')


def geometric_offsets(max_length: int) -> list[int]:
    """The future distances scored: ``1, 2, 4, ...`` up to `max_length` (the authors' geometric offsets)."""
    out, value = [], 1
    while value <= max_length:
        out.append(value)
        value *= 2
    return out


def bands(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> complex64 ``[..., d/2]``: band ``f`` is ``x_f + i x_{f + d/2}`` (RoPE's half-split pairs)."""
    half = x.shape[-1] // 2
    x = x.float()
    return torch.complex(x[..., :half], x[..., half:])


def trig_scores(keys: torch.Tensor, center: torch.Tensor, abs_mean: torch.Tensor, inv_freq: torch.Tensor,
                round_start: int, offsets: list[int], aggregation: str = "mean",
                block_elements: int | None = None) -> torch.Tensor:
    """``S_h`` (see the module docstring) ``[b, kv, g, L]`` (float32) of the cached keys `keys` ``[b, kv, L, d]``
    (after RoPE, each at its own position), for the ``g`` query heads of each kv head: `center` (complex) and
    `abs_mean` ``[kv, g, d/2]``, RoPE frequencies `inv_freq` ``[d/2]``, the next query at `round_start`.

    With ``w_f = E[q_f] e^{i omega_f (t0 + o)}``, the series term ``Re(sum_f w_f conj(k~_f))`` is ``sum_f Re(w_f)
    k~_f + Im(w_f) k~_{f + d/2}``: a product of the cached key with one real vector per query head and offset (their
    mean, for ``aggregation="mean"``: the series is linear in them), computed in float64 once per call. Keys are
    taken in blocks of at most `block_elements` (key x query head x offset) values
    (:data:`~attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` by device type)."""
    b, kv, length, d = keys.shape
    half = d // 2
    omega = inv_freq.to(device=keys.device, dtype=torch.float64)
    angles = (round_start + torch.tensor(offsets, device=keys.device, dtype=torch.float64))[:, None] * omega  # [O, F]
    turns = torch.polar(torch.ones_like(angles), angles)  # e^{i omega (t0 + o)}
    if aggregation == "mean":
        turns = turns.mean(dim=0, keepdim=True)
    w = center.to(keys.device, torch.complex128)[:, :, None, :] * turns  # [kv, g, O, F]
    weights = torch.cat([w.real, w.imag], dim=-1).float()  # [kv, g, O, d]: the cached key's halves, band by band
    spread = abs_mean.to(keys.device).float() - center.to(keys.device).abs().float()  # E|q_f| - |E[q_f]|
    g, turns_n = weights.shape[1], weights.shape[2]
    out = torch.empty(b, kv, g, length, dtype=torch.float32, device=keys.device)
    rows = max(1, (block_elements or block_elements_for(keys.device)) // max(1, b * kv * g * turns_n))
    for s in range(0, length, rows):
        k = keys[:, :, s:s + rows].float()  # [b, kv, l, d]
        series = torch.einsum("kgod,bkld->bkgol", weights, k)
        trig = series[:, :, :, 0] if turns_n == 1 else series.amax(dim=3)
        norms = torch.hypot(k[..., :half], k[..., half:])  # |k_f|, RoPE keeps it
        out[..., s:s + rows] = trig + torch.einsum("kgf,bklf->bkgl", spread, norms)
    return out


def standardize(scores: torch.Tensor) -> torch.Tensor:
    """Each row of `scores` ``[..., L]`` minus its mean over ``L``, over its standard deviation (Bessel-corrected;
    one below :data:`STD_EPS`, or undefined, counts as 1): the authors' ``normalize_scores``, so that the query heads
    of a group compare on one scale before their maximum."""
    std = scores.std(dim=-1, keepdim=True)
    std = torch.where(std >= STD_EPS, std, torch.ones_like(std))
    return (scores - scores.mean(dim=-1, keepdim=True)) / std


class QueryStats:
    """A calibration file's statistics (float32 on the CPU; :meth:`layer` hands them out per device, grouped by kv
    head) and the geometry they were recorded for."""

    def __init__(self, data: dict, source: str):
        self.source = source
        self.model = data.get("model")
        self.n_layers, self.n_heads = data["n_layers"], data["n_heads"]
        self.n_kv_heads, self.head_dim = data["n_kv_heads"], data["head_dim"]
        self.inv_freq = torch.tensor(data["inv_freq"], dtype=torch.float32)
        self.center = [torch.complex(torch.tensor(x["center_real"], dtype=torch.float32),
                                     torch.tensor(x["center_imag"], dtype=torch.float32)) for x in data["layers"]]
        self.abs_mean = [torch.tensor(x["abs_mean"], dtype=torch.float32) for x in data["layers"]]
        self._on: dict = {}

    def check(self, n_layers: int, n_heads: int | None, n_kv_heads: int | None, head_dim: int | None,
              inv_freq) -> None:
        """Refuse, in one line, a model of another geometry or other RoPE frequencies than the file's (None: not
        known yet, not checked)."""
        got = {"layers": n_layers, "query heads": n_heads, "kv heads": n_kv_heads, "head_dim": head_dim}
        want = {"layers": self.n_layers, "query heads": self.n_heads, "kv heads": self.n_kv_heads,
                "head_dim": self.head_dim}
        bad = [f"{key} {got[key]} (file: {want[key]})" for key in got if got[key] is not None and got[key] != want[key]]
        if not bad and inv_freq is not None:
            freq = inv_freq.detach().float().cpu()
            if freq.shape != self.inv_freq.shape or not torch.allclose(freq, self.inv_freq, rtol=FREQ_TOLERANCE,
                                                                       atol=0):
                bad.append("RoPE frequencies (another rope_theta or scaling)")
        if bad:
            raise AttnkitError(f"{self.source} was calibrated for {self.model!r}, not this model: {', '.join(bad)}; "
                               f"{HOW_TO_MAKE}")

    def layer(self, index: int, device, heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s centres (complex) and mean norms, ``[kv, g, d/2]`` each, on `device`: of the model's kv
        heads `heads` (all by default; a tensor-parallel shard's)."""
        key = (index, str(device), heads.start, heads.stop)
        if key not in self._on:
            shape = (self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim // 2)
            self._on[key] = (self.center[index].reshape(shape)[heads].to(device),
                             self.abs_mean[index].reshape(shape)[heads].to(device))
        return self._on[key]


def _matrix(value, rows: int, cols: int) -> bool:
    return isinstance(value, list) and len(value) == rows and all(
        isinstance(r, list) and len(r) == cols and all(is_number(x) and math.isfinite(x) for x in r) for r in value)


def stats_from_dict(data, source: str = "the triattention statistics") -> QueryStats:
    """Check a statistics file's structure (format, geometry, frequencies, per layer the three matrices)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("layers"), list):
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise AttnkitError(f"{source}: not a triattention statistics file (format {got!r}, expected {FORMAT!r}); "
                           f"{HOW_TO_MAKE}")
    geo = {key: data.get(key) for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}
    if not all(is_whole(v) and v >= 1 for v in geo.values()) or geo["n_heads"] % geo["n_kv_heads"] \
            or geo["head_dim"] % 2 or geo["n_layers"] != len(data["layers"]):
        raise AttnkitError(f"{source}: bad geometry {geo} for {len(data['layers'])} layers (kv heads must divide the "
                           f"query heads, head_dim be even, one entry per layer)")
    bands_ = geo["head_dim"] // 2
    freq = data.get("inv_freq")
    if not isinstance(freq, list) or len(freq) != bands_ or not all(is_number(x) and x > 0 for x in freq):
        raise AttnkitError(f"{source}: 'inv_freq' must list {bands_} positive RoPE frequencies, got {freq!r:.80}")
    for i, layer in enumerate(data["layers"]):
        for key in ("center_real", "center_imag", "abs_mean"):
            if not isinstance(layer, dict) or not _matrix(layer.get(key), geo["n_heads"], bands_):
                raise AttnkitError(f"{source}: layer {i} needs '{key}', {geo['n_heads']} rows (query heads) of "
                                   f"{bands_} finite numbers (frequency bands)")
    return QueryStats(data, source)


def load_stats(path) -> QueryStats:
    """The statistics of a file written by ``attnkit calibrate triattention``."""
    data = read_config_file(path, "triattention statistics file", f" ({HOW_TO_MAKE})")
    return stats_from_dict(data, f"triattention statistics {str(path)!r}")


def dumps_stats(config: dict) -> str:
    """JSON text of a statistics file: metadata one key per line, then one line per layer."""
    return dumps_layered_config(config, lambda layer: "    " + json.dumps(layer))
