"""``merge=true`` on a prompt scorer: evicted entries' values are folded into kept ones instead of being dropped
(kvpress's ``MergingPress`` around a ``ScorerPress``).

kvpress credits the idea to Token Merging (Bolya, Fu, Dai, Zhang, Feichtenhofer, Hoffman, ICLR 2023, "Token
Merging: Your ViT But Faster", arXiv 2210.09461: similar tokens are averaged, weighted by their sizes) and D2O (Wan,
Wu, Zhang, Chen, Huang, Wang, Zhang, 2024, "D2O: Dynamic Discriminative Operations for Efficient Long-Context
Inference of Large Language Models", arXiv 2406.13035: an evicted entry is merged into its most similar kept
entry when the similarity passes a threshold). The rule itself is kvpress's own, neither paper's; per kv head, at
a compression that keeps the set ``K`` and evicts the set ``E``:

1. every evicted entry ``e`` picks the kept entry ``t(e) = argmax_{j in K} cos(k_e, k_j)`` of most similar key
   (keys normalised with their norm clamped at ``1e-6``), with similarity ``s_e``;
2. it merges when ``s_e >= similarity_threshold`` and, with ``merge_fraction < 1``, when ``s_e`` is at least
   the ``(1 - merge_fraction)``-quantile (linear interpolation, ``torch.quantile``) of the ``s`` of the evicted
   entries that passed the threshold (the others counted as ``-inf``);
3. its weight is ``w_e = max(s_e, 0) ||v_e|| / (||v_e|| + ||v_t(e)|| + 1e-6)``, and every kept entry ``j`` that
   received merges takes the value ``(v_j + sum_{t(e)=j} w_e v_e) / (1 + sum_{t(e)=j} w_e)``, computed in float32.

Keys and positions never change (a key is stored after RoPE at its position; a merged key would sit nowhere), so
which entries are kept is the scorer's choice exactly, and only the kept values change. Nothing evicted, nothing
merged: an unlimited budget is full attention. attnkit merges at every compression the scorer makes (the prompt's
and, with ``decode_every``, each re-compression's; ChunkKV's ``chunk_length`` too); kvpress's ``MergingPress`` runs
at the prompt only (its ``DecodingPress`` takes a ``ScorerPress``, which ``MergingPress`` is not). SnapKV's
``decode_budget`` evicts one generated token per step without merging. Refused with ``head_budgets=adaptive`` and kvzap's
``threshold``, whose flat layouts keep a count per kv head that the scores decide.

The host applies the instruction (:meth:`attnkit.methods.base.Method.merged_values`): attnkit's cache
writes the merged values into the kept slots before compacting (:meth:`attnkit.cache.LayerKV.write_values`), and
vLLM's host writes every kept entry of the compressed prompt into its blocks, the merged values with them.
"""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.validate import flag, fraction, number

EPS = 1e-6  # the clamp of a key's norm and the weight's denominator (kvpress's epsilon)


def check_merge(method) -> None:
    """Validate a prompt scorer's merge parameters (one line naming the bad value)."""
    flag("merge", method.merge)
    t = number("similarity_threshold", method.similarity_threshold, 0.0, 1.0,
               what=" (the least cosine similarity of keys at which an evicted entry merges)")
    fraction("merge_fraction", method.merge_fraction,
             what=" (the share of the evicted entries, most similar first, that merge)")
    if not method.merge and (t != 0 or method.merge_fraction != 1):
        raise AttnkitError(f"similarity_threshold={t} and merge_fraction={method.merge_fraction} apply with "
                           f"merge=true only")
    if method.merge and method.head_budgets != "uniform":
        raise AttnkitError("merge=true folds evicted values into each kv head's kept entries at one budget per head; "
                           f"head_budgets={method.head_budgets} is not supported with it (use head_budgets=uniform)")


def similarity_merge(keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, threshold: float,
                     merge_fraction: float) -> torch.Tensor:
    """The kept entries' values ``[b, kv, n, d]`` after every evicted entry's value is folded into its most
    key-similar kept entry (see the module docstring). `keys`, `values` ``[b, kv, L, d]`` are the held entries,
    `keep` ``[b, kv, n]`` the kept slots; the evicted ones are the others, in slot order."""
    b, kv, length, d = keys.shape
    n = keep.shape[-1]
    kept_v = values.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, d))
    if n in (0, length):
        return kept_v
    evicted = torch.ones(b, kv, length, dtype=torch.bool, device=keys.device).scatter(2, keep, False)
    gone = evicted.nonzero()[:, 2].reshape(b, kv, length - n).unsqueeze(-1).expand(-1, -1, -1, d)

    def unit(k: torch.Tensor) -> torch.Tensor:
        k = k.float()
        return k / k.norm(dim=-1, keepdim=True).clamp(min=EPS)

    sim = unit(keys.gather(2, gone)) @ unit(keys.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, d))).transpose(2, 3)
    best, target = sim.max(dim=-1)  # [b, kv, L - n]
    passes = best >= threshold
    if merge_fraction < 1 and bool(passes.any()):
        cut = best.masked_fill(~passes, float("-inf")).quantile(1 - merge_fraction, dim=-1, keepdim=True)
        passes &= best >= cut
    gone_v = values.gather(2, gone).float()
    gone_norm = gone_v.norm(dim=-1)
    target_norm = kept_v.float().norm(dim=-1).gather(2, target)
    weight = best.clamp(min=0) * passes * gone_norm / (gone_norm + target_norm + EPS)
    total = torch.zeros(b, kv, n, device=keys.device).scatter_add_(2, target, weight)
    summed = torch.zeros(b, kv, n, d, device=keys.device).scatter_add_(
        2, target.unsqueeze(-1).expand(-1, -1, -1, d), weight.unsqueeze(-1) * gone_v)
    merged = ((kept_v.float() + summed) / (1 + total).unsqueeze(-1)).to(values.dtype)
    return torch.where((total > 0).unsqueeze(-1), merged, kept_v)
