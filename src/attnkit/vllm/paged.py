"""Reading and writing entries of vLLM's paged CPU KV cache, in whatever layout its kernels use.

vLLM's CPU cache of one layer is ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, viewed by its attention
as a key half and a value half per block and head; inside a half, the layout depends on the instruction set
the kernels were built for (on the "vec" path a key block is stored transposed). So nothing here assumes a
layout. Writes go through vLLM's own op (``cpu_attn_reshape_and_cache``, the one that stores every new
token), given the slots to write. Reads use an index map learnt once per layout from that same op
(:func:`learn_layout`): entries whose values encode their own ``(slot, dim)`` are written into a scratch
block, and where each one landed is read back. vLLM has no gather of its own to call; a layout the map
cannot describe (an element written twice or never) is refused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError

DIGIT = 32  # every code written is an integer in [1, DIGIT], exact in any float dtype the cache holds


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves ``[num_blocks, kv_heads, block_size, head_dim]`` of a layer's cache tensor (views),
    as vLLM's CPU attention makes them."""
    blocks, heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(blocks, heads, block_size * 2, -1)
    return halves.chunk(2, dim=2)


@dataclass(frozen=True)
class Layout:
    """Where entry ``(slot in block, dim)`` of a key (value) lives inside a block's ``[block_size, head_dim]`` half:
    at row ``key_row[slot, dim]``, column ``key_col[slot, dim]``."""

    key_row: torch.Tensor
    key_col: torch.Tensor
    value_row: torch.Tensor
    value_col: torch.Tensor


def _digits(count: int) -> int:
    out, reach = 1, DIGIT
    while reach < count:
        out, reach = out + 1, reach * DIGIT
    return out


def _decode(read: list[torch.Tensor]) -> torch.Tensor:
    """The integers whose base-DIGIT digits (+1) were read back, one tensor per digit, least significant first."""
    total = torch.zeros_like(read[0], dtype=torch.long)
    for i, r in enumerate(read):
        total += (r.round().long() - 1) * DIGIT ** i
    return total


@functools.lru_cache(maxsize=8)
def learn_layout(write, isa: str, block_size: int, head_dim: int, heads: int, dtype: torch.dtype) -> Layout:
    """The index map of vLLM's cache layout for this instruction set, block size, head size and dtype, learnt by
    writing coded entries with `write` (``write(key, value, key_cache, value_cache, slots, isa)``)."""
    slots = torch.arange(block_size)
    dims = torch.arange(head_dim)
    slot_grid, dim_grid = torch.meshgrid(slots, dims, indexing="ij")
    maps = []
    for half in (0, 1):
        found = {}
        for which, grid, count in (("slot", slot_grid, block_size), ("dim", dim_grid, head_dim)):
            read = []
            for d in range(_digits(count)):
                code = ((grid // DIGIT ** d) % DIGIT + 1).to(dtype)  # [block_size, head_dim]
                entry = code[:, None, :].expand(block_size, heads, head_dim).contiguous()
                scratch = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
                key_cache, value_cache = split_cache(scratch)
                other = torch.ones_like(entry)
                key, value = (entry, other) if half == 0 else (other, entry)
                write(key, value, key_cache, value_cache, slots, isa)
                read.append((key_cache if half == 0 else value_cache)[0, 0].float())
            found[which] = _decode(read)  # [block_size, head_dim] per stored element: the entry it holds
        flat = found["slot"] * head_dim + found["dim"]
        if not torch.equal(flat.flatten().sort().values, torch.arange(block_size * head_dim)):
            raise AttnkitError(f"vLLM's CPU KV-cache layout for isa={isa!r} is not a permutation of each block's "
                               f"entries; the attnkit plugin cannot read it")
        where = torch.empty(block_size * head_dim, dtype=torch.long)
        where[flat.flatten()] = torch.arange(block_size * head_dim)
        where = where.view(block_size, head_dim)
        maps += [where // head_dim, where % head_dim]
    return Layout(*maps)


def physical_slots(block_row: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block id, offset in block)`` of a request's `slots` through its block table row."""
    return block_row[slots // block_size].long(), slots % block_size


def gather(kv_cache: torch.Tensor, layout: Layout, block_row: torch.Tensor,
           slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, kv_heads, len(slots), head_dim]`` of a request's `slots` (copies)."""
    key_cache, value_cache = split_cache(kv_cache)
    blocks, offsets = physical_slots(block_row, slots, kv_cache.shape[2])
    b = blocks[:, None]
    keys = key_cache[b, :, layout.key_row[offsets], layout.key_col[offsets]]  # [L, head_dim, kv]
    values = value_cache[b, :, layout.value_row[offsets], layout.value_col[offsets]]
    return keys.permute(2, 0, 1).unsqueeze(0), values.permute(2, 0, 1).unsqueeze(0)
