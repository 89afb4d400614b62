"""``qfilter``: score each key by its projection on a calibrated direction of its head's queries (Godey, Devoto, Xu,
Borgo, Clavel, Grave, 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression", arXiv
2503.02812; kvpress's ``QFilterPress``).

The paper observes that a head's queries and keys are anisotropic: the queries ``q`` concentrate along one direction
``u`` (the first right singular vector of the matrix of the head's queries, ``Q = U S V^T``, ``u = V[:, 0]``, its sign
chosen so that ``E[<q, u>] > 0``), and a query's component orthogonal to ``u`` is close to independent of the keys.
So the expected logit of a key ``k`` is, up to a positive factor, ``E_q[<q, k>] ~ E[<q, u>] <k, u>``, and the key's
projection on the *Q-Filter* ``u`` estimates the attention it will receive, without computing any attention: each kv
head keeps its ``B`` entries of highest ``<k, u>``. Keys are scored as the cache holds them (after RoPE), so the
filter is the direction of the queries as the attention sees them (after RoPE; after Qwen3's query norm). A kv head
shared by ``g`` query heads (GQA) has one filter, from the queries of its whole group.

**Filters.** ``config`` is a file written by ``attnkit calibrate qfilter`` (:mod:`attnkit.calibrate.qfilter`; the
paper and kvpress download the authors' filters from the Hugging Face hub): per layer and kv head the unit vector
``u``, with the model, its geometry (layers, query and kv heads, head dimension), its RoPE frequencies, the
calibration settings and the date. A model of another geometry or other RoPE frequencies is refused in one line
(two models alike in all of these cannot be told apart by the file).

Decoding appends generated tokens (``decode_every=0``), or re-compresses the layer to ``B`` every ``decode_every``
tokens by the same scores over everything it holds (:mod:`attnkit.methods.prompt_scorer`). kvpress's ``QFilterPress``
scores ``-<k, f>`` with the authors' published filters ``f``; given ``f = -u`` from the same file (as
``benchmarks/compare_kvpress.py`` hands it) it keeps the same positions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from attnkit.config_file import dumps_layered_config, read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import is_number, is_whole

FORMAT = "attnkit.qfilter/1"
HOW_TO_MAKE = "make one with `attnkit calibrate qfilter --model M --out FILE`"
FREQ_TOLERANCE = 1e-4  # relative difference of a RoPE frequency above which the file is another model's
UNCHECKED = object()  # QFilters.check: the model's RoPE is not known here


class QFilters:
    """A filter file's unit vectors ``[layers, kv heads, d]`` (float32, CPU) and the geometry they were made for."""

    def __init__(self, data: dict, source: str):
        self.source, self.model = source, data.get("model")
        self.n_layers, self.n_heads = data["n_layers"], data["n_heads"]
        self.n_kv_heads, self.head_dim = data["n_kv_heads"], data["head_dim"]
        self.inv_freq = None if data.get("inv_freq") is None else torch.tensor(data["inv_freq"], dtype=torch.float32)
        self.filters = torch.tensor([layer["filters"] for layer in data["layers"]], dtype=torch.float32)
        self._on: dict = {}

    def check(self, n_layers: int, n_heads: int | None, n_kv_heads: int | None, head_dim: int | None,
              inv_freq=UNCHECKED) -> None:
        """Refuse, in one line, a model of another geometry or other RoPE frequencies (`inv_freq` None: the model has
        no RoPE; a size None or `inv_freq` :data:`UNCHECKED`: not known here, not checked)."""
        got = {"layers": n_layers, "query heads": n_heads, "kv heads": n_kv_heads, "head_dim": head_dim}
        want = {"layers": self.n_layers, "query heads": self.n_heads, "kv heads": self.n_kv_heads,
                "head_dim": self.head_dim}
        bad = [f"{key} {got[key]} (file: {want[key]})" for key in got if got[key] is not None and got[key] != want[key]]
        if bad or inv_freq is UNCHECKED:
            pass
        elif (inv_freq is None) != (self.inv_freq is None):
            bad.append("rotary embedding (one has RoPE, the other none)")
        elif inv_freq is not None:
            freq = inv_freq.detach().float().cpu()
            if freq.shape != self.inv_freq.shape or not torch.allclose(freq, self.inv_freq, rtol=FREQ_TOLERANCE,
                                                                       atol=0):
                bad.append("RoPE frequencies (another rope_theta or scaling)")
        if bad:
            raise AttnkitError(f"{self.source} was calibrated for {self.model!r}, not this model: {', '.join(bad)}; "
                               f"{HOW_TO_MAKE}")

    def layer(self, index: int, device) -> torch.Tensor:
        """Layer `index`'s filters ``[kv heads, d]`` on `device`."""
        key = (index, str(device))
        if key not in self._on:
            self._on[key] = self.filters[index].to(device)
        return self._on[key]


def filters_from_dict(data, source: str = "the q-filters") -> QFilters:
    """Check a filter file's structure (format, geometry, one unit vector per layer and kv head)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("layers"), list):
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise AttnkitError(f"{source}: not a q-filter file (format {got!r}, expected {FORMAT!r}); {HOW_TO_MAKE}")
    geo = {key: data.get(key) for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}
    if not all(is_whole(v) and v >= 1 for v in geo.values()) or geo["n_heads"] % geo["n_kv_heads"] \
            or geo["n_layers"] != len(data["layers"]):
        raise AttnkitError(f"{source}: bad geometry {geo} for {len(data['layers'])} layers (kv heads must divide the "
                           f"query heads, one entry per layer)")
    freq = data.get("inv_freq")
    if freq is not None and (not isinstance(freq, list) or not all(is_number(x) and x > 0 for x in freq)):
        raise AttnkitError(f"{source}: 'inv_freq' must list positive RoPE frequencies (or be null), got {freq!r:.80}")
    for i, layer in enumerate(data["layers"]):
        rows = layer.get("filters") if isinstance(layer, dict) else None
        if not isinstance(rows, list) or len(rows) != geo["n_kv_heads"] or not all(
                isinstance(r, list) and len(r) == geo["head_dim"] and all(is_number(x) and math.isfinite(x) for x in r)
                for r in rows):
            raise AttnkitError(f"{source}: layer {i} needs 'filters', {geo['n_kv_heads']} rows (kv heads) of "
                               f"{geo['head_dim']} finite numbers")
    return QFilters(data, source)


def load_filters(path) -> QFilters:
    """The filters of a file written by ``attnkit calibrate qfilter``."""
    data = read_config_file(path, "q-filter file", f" ({HOW_TO_MAKE})")
    return filters_from_dict(data, f"q-filter file {str(path)!r}")


def dumps_filters(config: dict) -> str:
    """JSON text of a filter file: metadata one key per line, then one line per layer."""
    return dumps_layered_config(config, lambda layer: "    " + json.dumps(layer))


@dataclass
class QFilterState(PromptScorerState):
    """Per layer: whether the file was checked against it."""

    checked: bool = False


@register
@dataclass(frozen=True)
class QFilter(PromptScorer):
    """Per kv head, the keys of largest projection on the head's calibrated query direction (Q-Filters); decode
    appends (or re-compresses every ``decode_every`` tokens)."""

    config: str | None = None

    name = "qfilter"
    layer_state_type = QFilterState
    summary = "keep the keys of largest projection on a calibrated query direction (Q-Filters, Godey et al. 2025)"
    kvpress = "QFilterPress"

    def __post_init__(self):
        if not isinstance(self.config, str) or not self.config:
            raise AttnkitError(f"qfilter needs config=FILE, the model's query directions; {HOW_TO_MAKE} "
                               f"(got config={self.config!r})")
        super().__post_init__()
        object.__setattr__(self, "_filters", load_filters(self.config))

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        self._filters.check(s.n_layers, None, None, None, None if s.rope is None else s.rope.inv_freq)

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if not ctx.state.checked:
            self._filters.check(ctx.session.n_layers, *ctx.session.model_heads(q.shape[1], k.shape[1]), k.shape[-1])
            ctx.state.checked = True
        return super().prefill_attention(ctx, q, k, v)

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        keys = ctx.kv.view()[0]
        u = self._filters.layer(ctx.index, keys.device)
        kv_heads = ctx.session.model_heads(None, keys.shape[1])[1]  # a tensor-parallel shard's: the whole model's
        if u.shape != (kv_heads, keys.shape[-1]):  # a host that skipped the prefill check (decode only)
            self._filters.check(ctx.session.n_layers, None, kv_heads, keys.shape[-1])
        u = u[ctx.session.held_heads(keys.shape[1], kv=True)]
        return torch.einsum("bkld,kd->bkl", keys.float(), u)
