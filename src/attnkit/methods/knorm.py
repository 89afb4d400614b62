"""``knorm``: keep the keys of lowest L2 norm (Devoto, Zhao, Scardapane, Minervini, 2024, "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv 2406.11430).

The paper observes that a cached key's L2 norm and the attention it receives while decoding are
anti-correlated (a low ``||k_i||_2`` usually means a high attention score), so the norm alone, computed
without any query or attention score, ranks the cache. The rule: score ``s_i = -||k_i||_2`` and each kv
head keeps the ``B`` prompt entries of highest ``s_i`` (lowest norm), dropping the rest. The score reads only
the stored keys, so prefill runs at full attention's speed and any attention backend works.

Decoding appends generated tokens (``decode_every=0``), or re-compresses the layer to ``B`` every
``decode_every`` tokens by the same norm over everything it holds (:mod:`attnkit.methods.prompt_scorer`).
Matches kvpress's ``KnormPress`` (score ``-||k||``) position for position at the same number of kept keys, up
to ties: RoPE is a rotation, so in the first layer the same token at two positions has the same norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext


def key_norm_rank(keys: torch.Tensor) -> torch.Tensor:
    """``-||k_i||_2`` per entry, ``[b, kv, L]`` (float32): the lowest norms rank highest."""
    return keys.float().norm(dim=-1).neg_()


@register
@dataclass(frozen=True)
class KNorm(PromptScorer):
    """Per kv head, the prompt keys of lowest L2 norm; decode appends (or re-compresses, ``decode_every``)."""

    name = "knorm"
    summary = "keep the keys of lowest L2 norm (KNorm, Devoto et al. 2024)"
    kvpress = "KnormPress"
    scores_entries_alone = True  # a key's norm is its own: score_threshold's threshold_decode scores each new token

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return key_norm_rank(ctx.kv.view()[0])

    def entry_score(self, ctx: LayerContext, k: torch.Tensor) -> torch.Tensor:
        return key_norm_rank(k)
