"""The visibility rules of attention, written once, and the three masks built from them.

A *rule* is a predicate ``rule(h, q, k) -> bool tensor`` over ORIGINAL token positions: may the query at
position ``q`` see the key at position ``k`` (in head ``h``)? Its arguments are integer tensors that
broadcast against each other; ``h`` is a head index (``None`` when no head axis is asked for) and only
rules with per-head parameters read it. Rules combine with :func:`and_` and :func:`or_`, the shape of
transformers' ``masking_utils`` (``and_masks``/``or_masks``) and of FlexAttention's mask factories.

The vocabulary:

- :data:`causal`: ``k <= q``.
- :func:`window`: ``q - k < w``, the band of a sliding window (Mistral 7B, Jiang et al. 2023, arXiv
  2310.06825, section 2, sliding window attention). :func:`sliding_window` is ``causal & window(w)``: ``w``
  positions, the query's own included; it masks exactly the pairs of Mistral's mask ``triu(1) + tril(-w)``.
- :func:`sinks`: ``k < n``, the first ``n`` tokens (the attention sinks of StreamingLLM, Xiao et al. 2023,
  arXiv 2309.17453; the "initial tokens" of MInference's A-shape, Jiang et al. 2024, arXiv 2407.02490,
  section 3.2). :func:`a_shape` is ``causal & (sinks(n) | window(w))``: StreamingLLM's rule as well.
- :func:`same_block`: ``q // b == k // b``, the key lies in the query's own tile of ``b`` positions.
- :func:`key_in`: ``member[h, k]``, the key is one of a per-head set of positions.

A per-head parameter is a tensor ``[heads]`` (read as ``param[h]``); a plain int applies to every head.

From one rule: :func:`boolean_mask` (True = attend, the dense reference), :func:`additive_bias` (0 / -inf,
for SDPA) and :func:`flex_mask_mod` (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``). Keys come either as
one position list ``[L]`` shared by every head, or per kv head ``[batch, kv_heads, L]`` (a cache whose heads
keep different tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnkit.errors import AttnkitError

Rule = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]


def _per_head(param, h: torch.Tensor | None):
    """A rule parameter at head `h`: ``param[h]`` for a per-head tensor, `param` itself otherwise."""
    if isinstance(param, torch.Tensor) and param.dim() > 0:
        if h is None:
            raise AttnkitError("a rule with per-head parameters needs a head axis (pass heads=...)")
        return param[h]
    return param


def causal(h, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keys at or before the query's position."""
    return k <= q


def everything(h, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """No restriction."""
    return torch.ones_like(k <= q)


def window(size) -> Rule:
    """Keys fewer than `size` positions before the query, ``q - k < size`` (no restriction for None)."""
    if size is None:
        return everything

    def rule(h, q, k):
        return q - k < _per_head(size, h)

    return rule


def sinks(n) -> Rule:
    """The first `n` positions, ``k < n``."""
    def rule(h, q, k):
        return k < _per_head(n, h)

    return rule


def same_block(block: int) -> Rule:
    """Keys in the query's own tile of `block` positions."""
    def rule(h, q, k):
        return q // block == k // block

    return rule


def key_in(member: torch.Tensor) -> Rule:
    """Keys that are members of a set: `member` is bool ``[L]`` (every head) or ``[heads, L]``, indexed by
    key position; positions past its end are not members."""
    size = member.shape[-1]

    def rule(h, q, k):
        inside = k < size
        kk = k.clamp(0, size - 1)
        return inside & (member[kk] if member.dim() == 1 else member[h, kk])

    return rule


def and_(*rules: Rule) -> Rule:
    """Pairs every rule allows."""
    def rule(h, q, k):
        out = rules[0](h, q, k)
        for r in rules[1:]:
            out = out & r(h, q, k)
        return out

    return rule


def or_(*rules: Rule) -> Rule:
    """Pairs any rule allows."""
    def rule(h, q, k):
        out = rules[0](h, q, k)
        for r in rules[1:]:
            out = out | r(h, q, k)
        return out

    return rule


def sliding_window(size: int | None) -> Rule:
    """Causal attention within a window of `size` positions (Mistral 7B's sliding window; None: causal)."""
    return causal if size is None else and_(causal, window(size))


def a_shape(n_init, n_local) -> Rule:
    """Causal attention to the first `n_init` positions and a window of `n_local` (MInference's A-shape,
    StreamingLLM's sinks plus window)."""
    return and_(causal, or_(sinks(n_init), window(n_local)))


# ---- the masks of a rule --------------------------------------------------------------------------------
def _grid(q_pos: torch.Tensor, k_pos: torch.Tensor, heads: int | None):
    """Broadcast views of (h, q, k): ``[q, L]`` / ``[heads, q, L]`` for keys ``[L]``, ``[b, kv, q, L]`` for
    keys per kv head (then the head axis is the kv head)."""
    dev = q_pos.device
    if k_pos.dim() == 1:
        if heads is None:
            return None, q_pos[:, None], k_pos[None, :]
        return torch.arange(heads, device=dev)[:, None, None], q_pos[None, :, None], k_pos[None, None, :]
    if k_pos.dim() != 3:
        raise AttnkitError(f"key positions must be [L] or [batch, kv_heads, L], got shape {tuple(k_pos.shape)}")
    h = None if heads is None else torch.arange(k_pos.shape[1], device=dev)[None, :, None, None]
    return h, q_pos[None, None, :, None], k_pos[:, :, None, :]


def boolean_mask(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """True where the query at ``q_pos [q]`` may see the key: ``[q, L]`` for keys ``[L]`` (``[heads, q, L]``
    when `heads` is given, for per-head rules), ``[b, kv, q, L]`` for keys ``[b, kv, L]``."""
    h, q, k = _grid(q_pos, k_pos, heads)
    allowed = rule(h, q, k)
    shape = torch.broadcast_shapes(q.shape, k.shape, () if h is None else h.shape)
    return allowed if allowed.shape == shape else allowed.expand(shape)


def additive_bias(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype,
                  heads: int | None = None) -> torch.Tensor:
    """The rule as an additive SDPA mask (0 = attend, -inf = masked), shaped as :func:`boolean_mask`."""
    allowed = boolean_mask(rule, q_pos, k_pos, heads)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _position(table, idx: torch.Tensor) -> torch.Tensor:
    """Position of index `idx`: ``idx + table`` for an int/0-d offset, ``table[idx]`` (clamped) for a list."""
    if isinstance(table, torch.Tensor) and table.dim() == 1:
        return table[idx.clamp(0, table.shape[0] - 1)]
    return idx + table


def flex_mask_mod(rule: Rule, q_pos=0, k_pos=0, groups: int = 1):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` of the rule. `q_pos`/`k_pos` map indices to
    positions: an offset (position = index + offset) or a position list ``[L]``; keys may also be per kv
    head ``[b, kv, L]`` (query head ``h`` reads kv head ``h // groups``). Indices past a list's end (padding)
    take its last position. The rule sees the query head as ``h``."""
    if isinstance(k_pos, torch.Tensor) and k_pos.dim() == 3:
        last = k_pos.shape[-1] - 1

        def per_head_keys(b, h, q_idx, kv_idx):
            return rule(h, _position(q_pos, q_idx), k_pos[b, h // groups, kv_idx.clamp(0, last)])

        return per_head_keys

    def shared_keys(b, h, q_idx, kv_idx):
        return rule(h, _position(q_pos, q_idx), _position(k_pos, kv_idx))

    return shared_keys
