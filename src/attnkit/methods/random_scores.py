"""``random``: keep a random subset of the prompt's entries, the baseline every scorer has to beat (kvpress's
``RandomPress``; no paper proposes it: it is the control that eviction papers compare against, e.g. H2O, Zhang et
al. 2023, arXiv 2306.14048, section 5, and KNorm, Devoto et al. 2024, arXiv 2406.11430, figure 3).

Each kv head keeps the ``B`` entries of highest score, the scores uniform draws on [0, 1): for a layer holding
``L`` entries, ``torch.rand(kv_heads, L)`` from a CPU generator seeded with ``seed`` afresh for every row and every
compression, as kvpress draws them (``torch.rand(*keys.shape[:-1])`` from a generator seeded per call): the
``i``-th entry a layer holds gets draw ``i``. So the draws depend only on the seed and the number of entries held,
never on the keys, the batch, the layer, the device or how the prompt was cut into chunks: the same entries are
kept in every host, and with the same seed the kept prompt positions are kvpress's at batch 1. Three choices differ
from kvpress's by design: the draws are float32 whatever the model's dtype (kvpress draws in the keys' dtype, where
bfloat16's 256 values per octave tie most scores); ``seed`` defaults to 0 (kvpress's ``None`` draws differently on
every call, which no host could reproduce); and a re-compression (``decode_every``) draws over the entries in the
order attnkit holds them, where kvpress holds them in the order of the previous compression's scores.

Decoding appends generated tokens (``decode_every=0``), or re-compresses the layer to ``B`` every ``decode_every``
tokens by fresh draws over everything it holds (:mod:`attnkit.methods.prompt_scorer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import whole


def random_rank(rows: int, kv_heads: int, length: int, seed: int, device, held: slice = slice(None)) -> torch.Tensor:
    """``[rows, kv, length]`` uniform draws, each row ``torch.rand(kv_heads, length)[held]`` from a CPU generator
    seeded with `seed` (float32; drawn on the CPU, so the same on every device): the model's `kv_heads`, of which the
    layer holds `held` (a tensor-parallel shard's; all by default)."""
    draws = torch.rand(kv_heads, length, generator=torch.Generator().manual_seed(seed))[held]
    return draws.to(device).expand(rows, -1, length)


@register
@dataclass(frozen=True)
class Random(PromptScorer):
    """Per kv head, a random subset of the prompt's entries (seeded); decode appends (or re-compresses)."""

    seed: int = 0

    name = "random"
    summary = "keep a random subset of the entries: the baseline (kvpress's RandomPress)"
    kvpress = "RandomPress"

    def __post_init__(self):
        super().__post_init__()
        whole("seed", self.seed, 0, what=" (the draws' generator seed)")

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        keys = ctx.kv.view()[0]
        s = ctx.session
        return random_rank(keys.shape[0], s.model_heads(None, keys.shape[1])[1], keys.shape[2], self.seed, keys.device,
                           s.held_heads(keys.shape[1], kv=True))
