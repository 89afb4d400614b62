"""``cur``: keep the entries of highest approximate leverage, from the keys' and values' own norms (Sengupta,
Chaudhary, Chakraborty, NeurIPS 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition"
(CurDKV), arXiv 2509.15038; kvpress's ``CURPress``).

CUR decomposition keeps the rows of a matrix with the highest leverage scores; CurDKV approximates a token's
leverage in ``K`` (and in ``V``, whose rows the attention output mixes) by its squared row norm, normalised over the
rows: ``l_k(i) = ||k_i||^2 / sum_j ||k_j||^2``, the length-squared sampling probability that CUR algorithms use in
place of the exact leverage ``k_i^T (K^T K)^+ k_i``. With ``local_window > 0`` the normalisation runs over windows
of that many consecutive entries instead of the whole layer (a local approximation, on by default as in kvpress,
which spreads the kept entries over the sequence). The score combines them by ``leverage``: ``key`` (``l_k``),
``value`` (``l_v``), ``kv_avg`` (their mean) or ``kv_product`` (``l_k l_v``, kvpress's default), normalised to sum
to one per kv head; the first ``sinks`` entries score 1 (kept first). With ``sketch > 0`` the keys and values are
first multiplied by a Gaussian matrix of ``sketch`` columns scaled by ``1 / sqrt(sketch)`` (the paper's random
projections; kvpress's ``use_random_leverage`` takes 20), drawn from a CPU generator seeded with ``sketch_seed``,
the same for every layer and host.

Decoding appends generated tokens (``decode_every=0``), or re-compresses the layer to ``B`` every ``decode_every``
tokens by the same scores over everything it holds. The scores follow kvpress's ``CURPress`` operation for
operation, so the kept positions are its own (kvpress draws its sketch from torch's global generator, unseeded:
that mode cannot be compared).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, whole

LEVERAGES = ("key", "value", "kv_avg", "kv_product")


def row_leverage(states: torch.Tensor, window: int) -> torch.Tensor:
    """``[b, kv, L]``: each row's squared norm over the sum of its window's (`window` consecutive rows; 0: all)."""
    norms = (states ** 2).sum(dim=-1)
    if not window:
        return norms
    b, kv, n = norms.shape
    padded = F.pad(norms, (0, (window - n % window) % window)).reshape(b, kv, -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).reshape(b, kv, -1)[:, :, :n]


def cur_rank(keys: torch.Tensor, values: torch.Tensor, leverage: str, sinks: int, window: int, sketch: int,
             seed: int) -> torch.Tensor:
    """CurDKV's score of every held entry ``[b, kv, L]`` (see the module docstring)."""
    if sketch:
        g = torch.randn(keys.shape[-1], sketch, generator=torch.Generator().manual_seed(seed)) / math.sqrt(sketch)
        g = g.to(device=keys.device, dtype=keys.dtype)
        keys, values = keys @ g, values @ g
    if leverage in ("key", "value"):
        score = row_leverage(keys if leverage == "key" else values, window)
    else:
        k2, v2 = row_leverage(keys, window), row_leverage(values, window)
        score = k2 * v2 if leverage == "kv_product" else (k2 + v2) / 2
    score = score / score.sum(dim=-1, keepdim=True)
    score[:, :, :sinks] = 1.0
    return score.float()


@register
@dataclass(frozen=True)
class CUR(PromptScorer):
    """Per kv head, the entries of highest approximate CUR leverage (CurDKV); decode appends (or re-compresses)."""

    leverage: str = "kv_product"
    sinks: int = 4
    local_window: int = 16
    sketch: int = 0
    sketch_seed: int = 0

    name = "cur"
    summary = "keep the entries of highest key x value leverage, CUR-style (CurDKV, Sengupta et al. 2025)"
    kvpress = "CURPress"

    def __post_init__(self):
        super().__post_init__()
        choice("leverage", self.leverage, LEVERAGES)
        whole("sinks", self.sinks, 0, what=" (first entries always kept)")
        whole("local_window", self.local_window, 0, what=" (entries per normalisation window; 0: the whole layer)")
        whole("sketch", self.sketch, 0, what=" (columns of the Gaussian sketch; 0: none)")
        whole("sketch_seed", self.sketch_seed, 0, what=" (the sketch's generator seed)")

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        keys, values, _ = ctx.kv.view()
        return cur_rank(keys, values, self.leverage, self.sinks, self.local_window, self.sketch, self.sketch_seed)
