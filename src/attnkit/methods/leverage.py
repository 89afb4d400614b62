"""``leverage``: keep the entries whose keys (before RoPE) have the highest approximate statistical leverage (Chari,
Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores",
arXiv 2507.08143; kvpress's ``LeverageScorePress``).

**Why.** A row of a matrix has high leverage when it points where few other rows do: in the hat matrix
``H = K (K^T K)^+ K^T`` of a layer's keys ``K`` (``L x d``, one row per held entry), the diagonal ``l_i = k_i^T
(K^T K)^+ k_i`` measures how much row ``i`` alone spans of the column space. Compactor keeps such geometric outliers,
with no query at all: a key that few others resemble is one no other entry can stand in for when a later query
looks for it. The keys are taken before RoPE (RoPE turns every key by its position, which would make distance in
the sequence look like geometry) and centred over the sequence (the score of a key is then its spread from the
mean key, not its norm).

**Score.** Per kv head, with ``K`` the held keys before RoPE (the cached keys turned back by their positions,
:meth:`attnkit.rope.Rope.rotate`, so every host that knows the model's rotary frequencies can score them), ``K_c =
K - mean(K)`` and a Gaussian sketch ``S`` (``d x k``, entries ``N(0, 1/k)``, ``k = sketch_dimension``; the paper's
right sketch, which keeps the leverage of a tall matrix within a factor in expectation for ``k`` a small multiple
of its rank)::

    X = K_c S                         (L x k, in float32)
    l_i = x_i^T (X^T X + lambda I)^{-1} x_i

through a Cholesky factor of ``X^T X + lambda I`` (no inverse formed). ``lambda`` starts at ``1e-2`` and grows
tenfold for a kv head whose matrix is still not positive definite (at most five tries), as kvpress's factorisation
does; the ridge keeps the scores defined where the ``L x k`` sketch is rank-deficient (fewer entries than
columns, or ``k`` above ``head_dim``). ``sketch_dimension=0`` scores the centred keys themselves (``X = K_c``): the
same ridge leverage, no randomness. Each kv head keeps its ``B`` entries of highest ``l_i`` (kvpress z-normalises
the scores over the whole batch, which leaves every kv head's order as it is).

**The sketch.** Drawn on the CPU from a generator seeded with ``sketch_seed``, in the cache's dtype, one
``[1, kv_heads, head_dim, k]`` draw per layer, layer ``l`` taking the ``(l + 1)``-th draw of that generator (the
same for every row of a batch and every host). kvpress draws a ``[batch, kv_heads, head_dim, k]`` sketch per
layer from torch's global generator, unseeded; seeded with ``torch.manual_seed(sketch_seed)`` right before the
prompt's forward on a CPU, its draws are these (``benchmarks/compare_kvpress.py`` does that). Where kvpress runs on
a GPU its draws come from the GPU's generator and differ.

**Decoding.** Generated tokens are appended (``decode_every=0``, kvpress's prefill-only press), or every
``decode_every`` tokens the layer is compressed back to ``B`` per kv head by the leverage of everything it holds
(the prompt's survivors and the generated tokens, centred and sketched anew with the layer's same sketch): the
score is a function of the held keys alone, so it is defined over any held set.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attnkit import heads
from attnkit.errors import AttnkitError
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import whole

RIDGE = 1e-2  # the first ridge added to the sketched Gram matrix (kvpress's initial jitter)
RIDGE_TRIES = 5  # tenfold larger each time a kv head's matrix is not positive definite


@functools.lru_cache(maxsize=256)
def _draw(seed: int, shape: tuple, dtype: torch.dtype, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s sketch (the ``layer + 1``-th draw of `shape` from a CPU generator seeded with `seed`) and the
    generator's state after it (the next layer's draw starts there)."""
    g = torch.Generator()
    if layer == 0:
        g.manual_seed(seed)
    else:
        g.set_state(_draw(seed, shape, dtype, layer - 1)[1])
    sketch = torch.randn(shape, generator=g, dtype=dtype) * (1 / math.sqrt(shape[-1]))
    return sketch, g.get_state()


def layer_sketch(seed: int, layer: int, kv_heads: int, head_dim: int, columns: int, dtype: torch.dtype,
                 device) -> torch.Tensor:
    """The Gaussian sketch ``[1, kv_heads, head_dim, columns]`` of layer `layer` (see the module docstring)."""
    return _draw(seed, (1, kv_heads, head_dim, columns), dtype, layer)[0].to(device)


def keys_before_rope(ctx: LayerContext, keys: torch.Tensor, positions: torch.Tensor, who: str) -> torch.Tensor:
    """The held keys turned back by their positions: the keys before RoPE, in the cache's dtype."""
    rope = ctx.session.rope
    if rope is None:
        raise AttnkitError(f"{who} scores the keys before RoPE, recovered with the model's rotary embedding; this "
                           f"model (or host) has none")
    if 2 * rope.inv_freq.numel() != keys.shape[-1]:
        raise AttnkitError(f"{who} needs RoPE over the whole head (head_dim {keys.shape[-1]}, rotary dimension "
                           f"{2 * rope.inv_freq.numel()}); partial rotary embeddings are not supported")
    return rope.rotate(keys, -positions)


def ridge_cholesky(gram: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factors of ``gram + lambda I`` per matrix, ``lambda`` from :data:`RIDGE`, ten times larger for a
    matrix that is still not positive definite (at most :data:`RIDGE_TRIES` values)."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    ridge = torch.full(gram.shape[:-2], RIDGE, dtype=gram.dtype, device=gram.device)
    for _ in range(RIDGE_TRIES):
        factor, info = torch.linalg.cholesky_ex(gram + ridge[..., None, None] * eye)
        failed = info != 0
        if not bool(failed.any()):
            return factor
        ridge = torch.where(failed, ridge * 10, ridge)
    raise AttnkitError(f"leverage: the sketched keys' Gram matrix is not positive definite even with a ridge of "
                       f"{float(ridge.max()) / 10:g} (non-finite keys?)")


def leverage_scores(before_rope: torch.Tensor, sketch: torch.Tensor | None) -> torch.Tensor:
    """Ridge leverage ``[b, kv, L]`` (float32) of the centred keys `before_rope` ``[b, kv, L, d]``, sketched by
    `sketch` ``[1, kv, d, k]`` (None: the centred keys themselves)."""
    x = before_rope - before_rope.mean(dim=-2, keepdim=True)
    if sketch is not None:
        x = x @ sketch
    x = x.float()
    xt = x.transpose(-2, -1)
    gram = xt @ x
    factor = ridge_cholesky((gram + gram.transpose(-2, -1)) / 2)
    solved = torch.cholesky_solve(xt, factor)  # (X^T X + lambda I)^{-1} X^T, [b, kv, k, L]
    return (x * solved.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def z_scores(scores: torch.Tensor, session=None) -> torch.Tensor:
    """`scores` ``[b, kv, L]`` standardised per row over the model's kv heads and entries (unbiased deviation, at least
    ``1e-6``; in `scores`' dtype); a row of one entry scores 0. The mean and deviation are sums over every kv head
    (:func:`attnkit.heads.sum_over_heads`: with `session`'s shard, a tensor-parallel shard's heads and the others')."""
    shard, who = (session.shard, session.method.name) if session is not None else (None, "z_scores")
    count = heads.count_over_heads(shard, scores, (1, 2))
    if count < 2:
        return torch.zeros_like(scores)
    mean = heads.sum_over_heads(shard, scores, (1, 2), who) / count
    centred = scores.to(mean.dtype) - mean.view(-1, 1, 1)
    std = (heads.sum_over_heads(shard, centred.square(), (1, 2), who) / (count - 1)).sqrt().clamp_min(1e-6)
    return (centred / std.view(-1, 1, 1)).to(scores.dtype)


def held_leverage(ctx: LayerContext, keys: torch.Tensor, positions: torch.Tensor, columns: int, seed: int,
                  who: str) -> torch.Tensor:
    """Leverage ``[b, kv, L]`` of the entries `keys` ``[b, kv, L, d]`` at `positions` of layer ``ctx.index``."""
    before = keys_before_rope(ctx, keys, positions, who)
    sketch = None
    if columns:  # drawn for the model's kv heads; a tensor-parallel shard takes its own heads' draws
        kv_heads = ctx.session.model_heads(None, keys.shape[1])[1]
        sketch = layer_sketch(seed, ctx.index, kv_heads, keys.shape[-1], columns, keys.dtype, keys.device)
        sketch = sketch[:, ctx.session.held_heads(keys.shape[1], kv=True)]
    return leverage_scores(before, sketch)


@register
@dataclass(frozen=True)
class Leverage(PromptScorer):
    """Per kv head, the entries whose centred pre-RoPE keys have the highest (sketched, ridge) leverage; decode
    appends (or re-compresses)."""

    sketch_dimension: int = 48
    sketch_seed: int = 0

    name = "leverage"
    summary = "keep the keys of highest approximate leverage before RoPE, Gaussian sketch (Compactor, Chari 2025)"
    kvpress = "LeverageScorePress"

    def __post_init__(self):
        super().__post_init__()
        whole("sketch_dimension", self.sketch_dimension, 0,
              what=" (columns of the Gaussian sketch; 0: the keys themselves, no sketch)")
        whole("sketch_seed", self.sketch_seed, 0, what=" (the sketch's generator seed)")

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        keys, _, positions = ctx.kv.view()
        return held_leverage(ctx, keys, positions, self.sketch_dimension, self.sketch_seed, self.name)
