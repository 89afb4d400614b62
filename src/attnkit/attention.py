"""Attention primitives and the attention function attnkit registers with transformers.

Shapes follow transformers: queries ``[batch, q_heads, q_len, head_dim]``, keys and values
``[batch, kv_heads, k_len, head_dim]`` (GQA: ``q_heads`` is a multiple of ``kv_heads``; the kv heads
are never expanded in memory by the callers). Positions are the ORIGINAL token positions, which is
what every mask here is built from: attention does not care in which slot a key sits.

The function :func:`attnkit_attention` is registered under the name ``"attnkit"`` in transformers'
``AttentionInterface`` (its public extension point, no patching). When a forward pass carries an
``attnkit_step`` keyword (the runner's), each layer's q, k, v after RoPE go to the active method;
otherwise it behaves exactly like transformers' SDPA attention, so ``model.generate`` still works.
A third route serves ``model.generate`` with an :class:`attnkit.hf_cache.AttnkitCache`: the cache's
``update`` defers the layer's call (:func:`defer_attention`) and this function hands it to the cache.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from attnkit.errors import AttnkitError
from attnkit.masks import additive_bias, boolean_mask, sliding_window

ATTN_IMPLEMENTATION = "attnkit"

# A windowed prefill over more than _BANDED_MIN^2 query x key pairs is computed in query blocks of
# _BANDED_BLOCK queries (each block costs block x (window + block) pairs instead of q_len x k_len).
_BANDED_MIN = 1024
_BANDED_BLOCK = 256
# Fewest queries for which a chunk after a prefix is computed as two flash calls (:func:`prefix_attention`); fewer
# (a decode or verification step) take the masked kernel.
_PREFIX_MIN_QUERIES = 64


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
         mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped kv heads (no copy of the kv heads when avoidable)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and q.shape[2] == 1 and mask is None:  # decode: one pass over each kv head
        return folded_attention(q, k, v, scaling)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scaling,
                                          enable_gqa=groups > 1)


def flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True):
    """Fused attention (`causal`: query i sees keys 0..i) and each query's log-sum-exp of its scaled logits,
    ``[b, hq, n]`` float32: torch's flash kernels, which return it beside the output (:func:`has_flash` says where
    they run). The kernels take as many kv heads as query heads, so grouped kv heads are repeated for the call."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if q.device.type == "cuda":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def has_flash(q: torch.Tensor) -> bool:
    """Whether :func:`flash_with_lse` runs for queries like `q`: on a CPU, or on a CUDA device of compute capability
    8.0 on in half precision with a head size that is a multiple of 8 (at most 248)."""
    if q.device.type == "cpu":
        return True
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 248 and torch.cuda.get_device_capability(q.device) >= (8, 0))


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of the last ``q_len`` of ``k_len`` contiguous positions (a prompt chunk after the ones before
    it): every query sees the whole prefix and, causally, its own chunk. Two flash calls, the prefix unmasked and the
    chunk causal, merged by their log-sum-exps (``out = sum_p out_p exp(lse_p - lse)``, ``lse = logaddexp``), where
    one call would need an explicit ``q_len x k_len`` mask and the slower masked kernel."""
    p = k.shape[2] - q.shape[2]
    out_p, lse_p = flash_with_lse(q, k[:, :, :p], v[:, :, :p], scaling, causal=False)
    out_c, lse_c = flash_with_lse(q, k[:, :, p:], v[:, :, p:], scaling, causal=True)
    lse = torch.logaddexp(lse_p, lse_c)
    wide = torch.promote_types(q.dtype, torch.float32)  # half precision merges in float32, float64 stays
    out = out_p.to(wide) * (lse_p - lse).exp_().unsqueeze(-1) + out_c.to(wide) * (lse_c - lse).exp_().unsqueeze(-1)
    return out.to(q.dtype)


def folded_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, groups: int, window: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[groups * n, L]`` (0 = attend, -inf = masked) of `n` queries at `q_pos` over keys
    at `k_pos` ``[L]``, causal by position and within `window`, tiled over the query heads of a group
    in the row order of :func:`folded_attention`."""
    return additive_bias(sliding_window(window), q_pos, k_pos, dtype).repeat(groups, 1)


def folded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a few queries ``[b, hq, n, d]`` over keys/values ``[b, kv, L, d]`` with grouped kv
    heads: the query heads of each kv group are folded into the query axis (``[b, kv, groups * n, d]``),
    so each kv head is read once, in one kernel call, and the kv heads are never expanded. Masked by
    `bias` (:func:`folded_bias`); without one every query attends to every key (one decoding query)."""
    b, hq, n, d = q.shape
    kv = keys.shape[1]
    folded = q.reshape(b, kv, (hq // kv) * n, d)  # row = group * n + i
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=bias, scale=scaling)
    return out.reshape(b, hq, n, d)  # CUDA's kernels may return strides a view cannot fold back (a ragged batch's rows)


def position_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean mask (True = attend): causal by original position, optionally within `window`
    (:func:`attnkit.masks.sliding_window`; the mask ``triu(1) + tril(-window)`` of Mistral 7B, Jiang et al.
    2023, arXiv 2310.06825, masks exactly the pairs this leaves False).

    `q_pos` is ``[q_len]``; `k_pos` is ``[k_len]`` (-> ``[q_len, k_len]``) or per kv head
    ``[batch, kv_heads, k_len]`` (-> ``[batch, kv_heads, q_len, k_len]``).
    """
    return boolean_mask(sliding_window(window), q_pos, k_pos)


def expand_kv_mask(mask: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Per-kv-head mask [b, kv, q, k] -> per-query-head [b, q_heads, q, k] (a view where possible)."""
    if mask.dim() == 2 or mask.shape[1] in (1, q_heads):
        return mask
    return mask.repeat_interleave(q_heads // mask.shape[1], dim=1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, q_pos: torch.Tensor,
           k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Dense attention of queries at `q_pos` to keys at `k_pos` (causal by position, optional window).

    Uses the cheapest exact path: no mask when every key is visible to every query, SDPA's causal
    kernel when queries and keys are the same contiguous run of positions, two flash calls when the
    queries are the last positions of that run (:func:`prefix_attention`), a banded block loop for a
    long windowed prefill, and an explicit boolean mask otherwise.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    shared_pos = k_pos if k_pos.dim() == 1 else None
    if k_pos.dim() == 3 and bool((k_pos == k_pos[:1, :1]).all()):  # every row and head alike
        shared_pos = k_pos[0, 0]
    if shared_pos is not None:
        lo, hi = int(shared_pos.min()), int(shared_pos.max())
        q_lo = int(q_pos[0])
        if q_len == 1 and hi <= q_lo and (window is None or q_lo - lo < window):
            return sdpa(q, k, v, scaling)
        contiguous = hi - lo + 1 == k_len and bool((shared_pos[1:] > shared_pos[:-1]).all()) if k_len > 1 else True
        if window is None and contiguous and q_len == k_len and lo == q_lo:
            return sdpa(q, k, v, scaling, is_causal=True)
        if (window is None and contiguous and _PREFIX_MIN_QUERIES <= q_len < k_len and q_lo == hi - q_len + 1
                and has_flash(q) and bool((q_pos[1:] - q_pos[:-1] == 1).all())):  # a chunk's positions
            return prefix_attention(q, k, v, scaling)
        if window is not None and contiguous and q_len * k_len > _BANDED_MIN * _BANDED_MIN:
            return banded_attention(q, k, v, scaling, q_lo, lo, window)
        return sdpa(q, k, v, scaling, mask=position_mask(q_pos, shared_pos, window))
    mask = expand_kv_mask(position_mask(q_pos, k_pos, window), q.shape[1])
    return sdpa(q, k, v, scaling, mask=mask)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, q_start: int,
                     k_start: int, window: int) -> torch.Tensor:
    """Sliding-window causal attention computed one block of queries at a time.

    Queries are the positions ``q_start ..``, keys the contiguous positions ``k_start ..``. Each block of
    queries sees only the keys of its band, so the cost is O(q_len * (window + block)), not O(n^2).
    """
    q_len = q.shape[2]
    block = _BANDED_BLOCK
    outs = []
    for s in range(0, q_len, block):
        e = min(q_len, s + block)
        first_key = max(k_start, q_start + s - window + 1)
        last_key = q_start + e - 1
        ks, ke = first_key - k_start, last_key - k_start + 1
        q_pos = torch.arange(q_start + s, q_start + e, device=q.device)
        k_pos = torch.arange(first_key, last_key + 1, device=q.device)
        outs.append(sdpa(q[:, :, s:e], k[:, :, ks:ke], v[:, :, ks:ke], scaling,
                         mask=position_mask(q_pos, k_pos, window)))
    return torch.cat(outs, dim=2)


# ---- deferred layer calls: a transformers Cache that routes attention to attnkit methods -------------
# transformers' attention modules call ``past_key_values.update(k, v, layer_idx)`` and then the attention
# function, which does not receive the cache. A cache that wants the attention call (attnkit.hf_cache.
# AttnkitCache) records it here from `update`, keyed by the very key tensor `update` returns; the
# attention function below claims it by identity. The slot is per thread, so concurrent generations in
# different threads do not see each other's calls.
_DEFERRED = threading.local()


def defer_attention(handler, layer_idx: int, key: torch.Tensor) -> None:
    """Route the next attention call (in this thread) whose key tensor *is* `key` to
    ``handler.layer_attention(layer_idx, query, key, value, scaling, sliding_window, attention_mask,
    position_ids)`` (the position ids the model rotated q and k with, None where the model does not pass them)."""
    pending = getattr(_DEFERRED, "call", None)
    if pending is not None and pending[0] is handler:
        raise AttnkitError(
            f"layer {pending[1]}'s attention never reached attnkit's attention function: the model must use "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} (attnkit.prepare(model, tokenizer) sets it)")
    _DEFERRED.call = (handler, layer_idx, key)


def claim_deferred(key: torch.Tensor):
    """The ``(handler, layer_idx)`` deferred for this key tensor, removed from the slot; None if none."""
    pending = getattr(_DEFERRED, "call", None)
    if pending is None or pending[2] is not key:
        return None
    _DEFERRED.call = None
    return pending[0], pending[1]


def attnkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"attnkit"`` attention implementation (see the module docstring)."""
    step = kwargs.pop("attnkit_step", None)
    if step is None and (deferred := claim_deferred(key)) is not None:
        handler, layer_idx = deferred
        out = handler.layer_attention(layer_idx, query, key, value,
                                      query.shape[-1] ** -0.5 if scaling is None else scaling,
                                      kwargs.get("sliding_window"), attention_mask, kwargs.get("position_ids"))
        return out.transpose(1, 2).contiguous(), None
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = step.attention(module.layer_idx, query, key, value, scaling, kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


# ---- the layers' attention inputs, for a method that reads them ----------------------------------------------
# The attention function receives q, k, v, never the hidden states they were projected from. A method that scores
# those (kvzap) gets them from its host: a forward pre-hook on each attention module (PyTorch's hook API, registered
# on a model when a method first needs it, never at import) hands the module's input to whoever hosts the call, the
# runner's step (the ``attnkit_step`` keyword) or a cache that asks for it (``past_key_values``), as
# ``note_layer_input(layer_idx, hidden_states, module)``.
_WATCHED: weakref.WeakSet = weakref.WeakSet()


def _hand_layer_input(module, args, kwargs) -> None:
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    for host in (kwargs.get("attnkit_step"), kwargs.get("past_key_values")):
        note = getattr(host, "note_layer_input", None)
        if note is not None:
            note(module.layer_idx, hidden, module)
            return


def watch_layer_inputs(model) -> None:
    """Hand each attention module's input hidden states (after the decoder layer's input norm) to the host of the
    call before the attention runs (see above); `model` is a transformers causal LM. Registered once per module."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise AttnkitError(f"{type(model).__name__} has no decoder layers (model.model.layers) whose attention "
                           f"inputs attnkit can read")
    for layer in layers:
        attn = layer.self_attn
        if attn not in _WATCHED:
            attn.register_forward_pre_hook(_hand_layer_input, with_kwargs=True)
            _WATCHED.add(attn)


AttentionInterface.register(ATTN_IMPLEMENTATION, attnkit_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
