"""``keydiff``: keep the keys most dissimilar to the layer's mean key (Park, Jones, Morse, Goel, Lee, Lott,
2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments", arXiv 2504.15364).

KeyDiff shows that geometrically distinctive keys (far from the others in direction) tend to receive high
attention, and relaxes "keep the subset of least pairwise cosine similarity" to a score against one anchor,
the mean of the normalised keys: ``a = (1/n) sum_j k_j / ||k_j||``, ``s_i = -cos(a, k_i)``; per kv head, the
``B`` entries of lowest similarity to the anchor (highest ``s_i``) are kept. The anchor is the mean of the
L2-normalised keys the layer holds, as kvpress's ``KeyDiffPress`` builds it, so the kept positions match
kvpress's at the same number of kept keys. Like ``knorm`` it needs no query and no attention score (prefill
at full attention's speed).

The paper compresses block by block as the prompt streams in (kvpress's ``BlockPress``); here the whole prompt
is scored at once after prefill, kvpress's default ``KeyDiffPress`` setting. Decoding appends generated
tokens (``decode_every=0``) or re-compresses the layer to ``B`` every ``decode_every`` tokens with the anchor
of everything then held (:mod:`attnkit.methods.prompt_scorer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext


def key_diff_rank(keys: torch.Tensor) -> torch.Tensor:
    """``-cos(k_i, anchor)`` per entry ``[b, kv, L]`` (float32), the anchor being the mean of the unit keys of
    each row and kv head: the keys least like the average direction rank highest."""
    k = keys.float()
    anchor = F.normalize(k, p=2, dim=-1).mean(dim=2, keepdim=True)
    return F.cosine_similarity(k, anchor, dim=-1).neg_()


@register
@dataclass(frozen=True)
class KeyDiff(PromptScorer):
    """Per kv head, the keys least similar (cosine) to the mean unit key; decode appends (or re-compresses)."""

    name = "keydiff"
    summary = "keep the keys least similar to the mean key (KeyDiff, Park et al. 2025)"
    kvpress = "KeyDiffPress"

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return key_diff_rank(ctx.kv.view()[0])
