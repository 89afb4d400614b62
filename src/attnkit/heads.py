"""Which of the model's heads a session's layers hold, where they hold only some: a tensor-parallel shard of a serving
engine, which numbers its heads from 0 (the vLLM host hands each worker's sessions a :class:`HeadShard`).

A method that draws or calibrates something per head of the model (Keyformer's noise, random scores, leverage's
sketch, the statistics files of TriAttention, q-filters and Expected Attention, MInference's patterns) reads the
shard's heads (:func:`held_heads`) and checks its file against the whole model's head counts (:func:`model_heads`).
A method whose choice reads every head (TOVA's mean over the heads, Keyformer's shared score) sums over its heads and
adds the other shards' sums with the host's :attr:`HeadShard.sum_across` (:func:`sum_over_heads`). Without a shard
(None) the layers hold every head and each of these is the plain computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class HeadShard:
    """The model-wide index of the shard's first query head and of its first kv head, the model's query and kv head
    counts, the number of shards, and the host's sum of a tensor over them (each shard calls it at the same point with
    its own sum)."""

    first_head: int
    first_kv_head: int
    heads: int
    kv_heads: int
    ranks: int = 1
    sum_across: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)


def first_head(shard: HeadShard | None) -> int:
    """The model-wide index of the first query head the layers hold."""
    return shard.first_head if shard is not None else 0


def model_heads(shard: HeadShard | None, heads: int | None, kv_heads: int | None) -> tuple[int | None, int | None]:
    """The whole model's query and kv head counts, for layers that hold `heads` and `kv_heads` of them (None: not
    known yet), to check a calibration file against."""
    if shard is None:
        return heads, kv_heads
    return None if heads is None else shard.heads, None if kv_heads is None else shard.kv_heads


def held_heads(shard: HeadShard | None, count: int, kv: bool = False) -> slice:
    """The model's query heads (kv heads with `kv`) that layers holding `count` of them hold."""
    first = 0 if shard is None else shard.first_kv_head if kv else shard.first_head
    return slice(first, first + count)


def sum_over_heads(shard: HeadShard | None, values: torch.Tensor, dims: tuple[int, ...], who: str) -> torch.Tensor:
    """The sum of `values` over its head dimensions `dims` (query or kv heads), over every head of the model: in
    float64, so that it is the same, to the last bit of float32 nearly always, in any order (float32 on a device
    without float64, Apple's MPS); a shard's sum added to the other shards' by the host. `who`: the method, named in
    the refusal of a shard whose host cannot add."""
    total = values.to(torch.float32 if values.device.type == "mps" else torch.float64).sum(dim=dims)
    if shard is not None and shard.ranks > 1:
        if shard.sum_across is None:
            raise AttnkitError(f"method {who!r} reads every head of the model, and this host's shards of the heads "
                               f"cannot add their sums")
        total = shard.sum_across(total)
    return total


def count_over_heads(shard: HeadShard | None, values: torch.Tensor, dims: tuple[int, ...]) -> int:
    """How many numbers :func:`sum_over_heads` adds: those of `values` over `dims`, on every shard."""
    return math.prod(values.shape[d] for d in dims) * (shard.ranks if shard is not None else 1)


def mean_over_heads(shard: HeadShard | None, values: torch.Tensor, dims: tuple[int, ...], who: str) -> torch.Tensor:
    """:func:`sum_over_heads` divided by the number of the model's heads it adds."""
    return sum_over_heads(shard, values, dims, who) / count_over_heads(shard, values, dims)
