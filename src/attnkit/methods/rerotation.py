"""``positions=reindexed`` on a prompt scorer: after the prompt is compressed the kept keys are re-rotated to
consecutive positions, as if the compressed prompt had been the input (kvpress's ``KeyRerotationPress`` around any
``ScorerPress``, and ``FinchPress(rerotate_keys=True)``; the re-rotation of FINCH: Corallo, Papotti, 2024, "FINCH:
Prompt-guided Key-Value Cache Compression for Large Language Models", TACL 12, and of the sink cache of StreamingLLM:
Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453).

RoPE rotates a key at position ``p`` by ``R(p)``, and rotations compose (``R(a) R(b) = R(a + b)``), so a cached key is
moved from ``p`` to ``p'`` by rotating it by ``p' - p`` (:meth:`attnkit.rope.Rope.rotate`). Each kv head's ``B`` kept
entries, in position order, go to ``n - B .. n - 1`` (``n`` the prompt's length) and are relabelled so; the generated
tokens continue at ``n, n + 1, ...``. Attention with RoPE depends only on query-key distances, and these are those of
kvpress's re-rotated cache, whose kept keys sit at ``0 .. B - 1`` and whose next token is the cache's length ``B``
(transformers' ``generate``). The keys are rotated once, when the prompt is compressed.

Every kv head must keep the same count (uniform budgets): ``head_budgets=adaptive`` and ``score_threshold`` (counts
per head) are refused with it, as are ``decode_every`` (a re-compression while decoding would re-place generated
tokens that were attended at their own positions: kvpress re-rotates the prompt only) and ``block_size`` (blocks
attended at the positions before the re-rotation), and so are the scorers whose layers are compressed by a pass of
their own or keep a count per head (``reindex_refusal``: kvzip, kvgrad, fastkvzip, lukv). A model without RoPE (``session.rope``) is refused; vLLM's cache
cannot be rewritten (refused there as every method that rewrites stored keys).
"""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.session import LayerContext
from attnkit.validate import choice

POSITIONS = ("original", "reindexed")


def check_positions(method) -> None:
    """Validate ``positions`` of a prompt scorer (one line naming what conflicts)."""
    choice("positions", method.positions, POSITIONS)
    if method.positions != "reindexed":
        return
    if method.reindex_refusal:
        raise AttnkitError(f"{method.name}: positions=reindexed is not supported: {method.reindex_refusal}")
    if method.adaptive:
        raise AttnkitError(f"{method.name} positions=reindexed gives each kv head's kept entries the prompt's last B "
                           f"positions, which head_budgets=adaptive (a count per head) does not keep; use "
                           f"positions=original with it")
    for key, default, why in (("decode_every", 0, "re-compressing while decoding would re-place generated tokens"),
                              ("block_size", 0, "its blocks are attended before the keys are re-rotated"),
                              ("decode_fraction", None, "it re-compresses while decoding")):
        value = getattr(method, key, default)
        if value != default:
            raise AttnkitError(f"{method.name} positions=reindexed re-rotates the prompt's kept keys once; {key}="
                               f"{value!r} is not supported with it ({why}; use positions=original)")


def check_rope(method, ctx: LayerContext) -> None:
    if ctx.session.rope is None:
        raise AttnkitError(f"{method.name} positions=reindexed needs the model's rotary embedding (session.rope)")


def reindex(ctx: LayerContext) -> None:
    """The held entries of every kv head, in position order, re-rotated and relabelled to ``n - L .. n - 1`` (``L``
    held per head, ``n`` the prompt's length)."""
    kv = ctx.kv
    if "head" in kv.extras:
        raise AttnkitError(f"{ctx.session.method.name} positions=reindexed: layer {ctx.index} keeps a count per kv "
                           f"head (a flat layer), which consecutive positions cannot hold")
    keys, _, positions = kv.view()
    length = keys.shape[2]
    order = positions.argsort(dim=-1, stable=True)
    place = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=order.device).expand_as(order))
    seen_at = ctx.session.prompt_len - length + place
    kv.keys[:, :, :length] = ctx.session.rope.rotate(keys, seen_at - positions)
    kv.positions[:, :, :length] = seen_at
