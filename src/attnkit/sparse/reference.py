"""The dense reference of a sparse layout: the same pairs as a boolean mask from the plain definitions
(:meth:`attnkit.sparse.layout.SparseLayout.rule`, built with :mod:`attnkit.masks`), applied with SDPA. The
tests hold every kernel to it; it is also a slow fallback (quadratic memory: short sequences only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.masks import boolean_mask
from attnkit.sparse.layout import SparseLayout


def dense_mask(layout: SparseLayout, rows: slice | None = None) -> torch.Tensor:
    """The layout as a boolean mask ``[h, queries, keys]`` (True = computed): a pair is kept when its tile is
    a main tile and it passes the token rule, or its key is a vertical column of the head; always causal.
    `rows` restricts to a slice of the queries."""
    dev = layout.main.device
    q_pos = torch.arange(layout.q_start, layout.n_keys, device=dev)
    if rows is not None:
        q_pos = q_pos[rows]
    return boolean_mask(layout.rule(), q_pos, torch.arange(layout.n_keys, device=dev), heads=layout.n_heads)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout,
                        scaling: float) -> torch.Tensor:
    """Dense-mask attention of the same pairs (SDPA with :func:`dense_mask`)."""
    groups = q.shape[1] // k.shape[1]
    mask = dense_mask(layout)[None]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=scaling)
