"""KIVI's quantizer: asymmetric min/zero-point quantization of keys per channel and values per token, and the
packing of the integer codes into bytes (Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen and Hu, 2024, "KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024, arXiv 2402.02750).

A group ``X`` of numbers is stored as ``B``-bit codes with one zero point and one scale (the paper's section 3,
asymmetric quantization)::

    z = min X,   s = (max X - min X) / (2^B - 1),   Q(x) = round((x - z) / s),   x' = Q(x) s + z

so ``|x - x'| <= s / 2`` for every member (``s = 0``, a constant group, stores it exactly). The paper's
analysis (its section 3, Figure 2) finds a few fixed outlier channels in the keys and none in the values, so

- **keys** are quantized **per channel**: a group is a set of tokens, and each channel of the group has its
  own ``z`` and ``s`` (statistics over the group's tokens, channel by channel);
- **values** are quantized **per token**: each token's vector is split into groups of consecutive channels,
  each with its own ``z`` and ``s``.

Which tokens form a key group is the cache's business (:mod:`attnkit.quant.layer`); here a group is given by
an index per token. Statistics are computed in float32 and stored in the cache's dtype; the codes are
computed against the stored (rounded) statistics, so the bound holds for what is actually dequantized.

Codes of ``B`` bits (2, 4 or 8) are packed ``8 / B`` to a byte along the channel axis, so every token's codes
sit in bytes of their own: a token can be written, moved or dropped without touching its neighbours'.
Everything here is whole-tensor torch arithmetic (shifts and masks on ``uint8``, ``amin``/``amax``,
``scatter_reduce``), no loop over tokens or channels.
"""

from __future__ import annotations

import torch

BITS = (2, 4, 8)


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes of packed codes per token vector of `head_dim` channels."""
    return head_dim * bits // 8


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)  # code i of a byte sits at bits*i


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``[..., d]`` (each below ``2^bits``) -> bytes ``[..., d * bits / 8]``: channels
    ``8/bits * j .. 8/bits * (j + 1) - 1`` share byte ``j``, the first in the lowest bits."""
    per = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    # the codes of a byte occupy disjoint bits, so their sum is their bitwise or (and stays below 256)
    return (grouped << _shifts(bits, codes.device)).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: bytes ``[..., P]`` -> ``uint8`` codes ``[..., P * 8 / bits]`` (one shift and
    mask of the whole tensor per code position in a byte)."""
    mask = (1 << bits) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], -1).flatten(-2)


def affine(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (``s = (hi - lo) / (2^B - 1)``, ``z = lo``) in `dtype`; a group with no member
    (``lo = inf``) gets zeros."""
    empty = ~torch.isfinite(lo)
    scale = ((hi - lo) / float((1 << bits) - 1)).masked_fill(empty, 0.0)
    return scale.to(dtype), lo.masked_fill(empty, 0.0).to(dtype)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``uint8`` codes ``round((x - z) / s)`` clamped to ``0 .. 2^B - 1`` (``s``/``z`` broadcast to `x`); a
    zero scale (a constant group) gives code 0, which dequantizes to ``z`` exactly."""
    s, z = scale.float(), zero.float()
    q = (x.float() - z) / torch.where(s > 0, s, torch.ones_like(s))
    return q.round_().clamp_(0, (1 << bits) - 1).to(torch.uint8)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Q s + z`` (computed in float32, returned in `dtype`)."""
    return torch.addcmul(zero.float(), codes.float(), scale.float()).to(dtype)


# ---- keys: per channel over a group of tokens ----------------------------------------------------------
def key_stats(keys: torch.Tensor, group: torch.Tensor, groups: int, bits: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scale and zero point ``[b, h, groups, d]`` of the key groups: `keys` ``[b, h, n, d]``,
    `group` ``[b, h, n]`` the group of each token (``-1``: not quantized here); statistics over each group's
    tokens, channel by channel, separately for every row and head."""
    member = (group >= 0).unsqueeze(-1)
    index = group.clamp(min=0).unsqueeze(-1).expand_as(keys)
    x = keys.float()
    shape = keys.shape[:2] + (groups, keys.shape[-1])
    lo = x.new_full(shape, float("inf")).scatter_reduce_(2, index, x.masked_fill(~member, float("inf")), "amin")
    hi = x.new_full(shape, float("-inf")).scatter_reduce_(2, index, x.masked_fill(~member, float("-inf")), "amax")
    return affine(lo, hi, bits, dtype)


def encode_keys(keys: torch.Tensor, group: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bits: int) -> torch.Tensor:
    """Packed codes ``[b, h, n, P]`` of `keys` ``[b, h, n, d]`` in their groups (`group` ``[b, h, n]``, entries
    ``>= 0``) of the table `scale`/`zero` ``[b, h, M, d]``."""
    index = group.unsqueeze(-1).expand_as(keys)
    return pack(encode(keys, scale.gather(2, index), zero.gather(2, index), bits), bits)


def decode_keys(packed: torch.Tensor, group: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Keys ``[b, h, n, d]`` from their packed codes and groups (the inverse of :func:`encode_keys`); each token's
    row of the table is picked by one ``index_select`` over the flattened (row, head, group) axis."""
    b, h, n = group.shape
    M, d = scale.shape[2], scale.shape[3]
    rows = (torch.arange(b * h, device=group.device).view(b, h, 1) * M + group).reshape(-1)
    s = scale.reshape(-1, d).index_select(0, rows).view(b, h, n, d)
    z = zero.reshape(-1, d).index_select(0, rows).view(b, h, n, d)
    return decode(unpack(packed, bits), s, z, dtype)


# ---- values: per token, groups of consecutive channels --------------------------------------------------
def encode_values(values: torch.Tensor, channels: int, bits: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed codes ``[..., P]`` and scale, zero point ``[..., d / channels]`` of `values` ``[..., d]``, each
    token's channels taken `channels` at a time."""
    grouped = values.float().unflatten(-1, (-1, channels))
    scale, zero = affine(grouped.amin(-1), grouped.amax(-1), bits, dtype)
    codes = encode(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), bits).flatten(-2)
    return pack(codes, bits), scale, zero


def decode_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Values ``[..., d]`` from :func:`encode_values`' output."""
    codes = unpack(packed, bits).unflatten(-1, (scale.shape[-1], -1))
    return decode(codes, scale.unsqueeze(-1), zero.unsqueeze(-1), dtype).flatten(-2)
