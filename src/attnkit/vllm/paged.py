"""Reading and writing entries of vLLM's paged KV cache, in whatever layout its kernels use.

A layer's cache is ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` in vLLM's CPU and FlashAttention backends,
which split it differently into keys and values (the backend says how: each half is viewed here as
``[num_blocks, kv_heads, block_size, head_dim]``). Inside a half, FlashAttention stores entry ``(slot, dim)`` at
row ``slot``, column ``dim`` (:func:`identity_layout`); the CPU layout depends on the instruction set its kernels
were built for (on the "vec" path a key block is stored transposed). So reads go through an index map: the
identity, or one learnt once per layout from vLLM's own writing op (:func:`learn_layout`): entries whose values
encode their own ``(slot, dim)`` are written into a scratch block, and where each one landed is read back (vLLM has
no gather to call; a layout the map cannot describe, an element written twice or never, is refused). Writes always
go through vLLM's op (the one that stores every new token), given the physical slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.decode_native import Entries

DIGIT = 32  # every code written is an integer in [1, DIGIT], exact in any float dtype the cache holds


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves ``[num_blocks, kv_heads, block_size, head_dim]`` of a layer's cache tensor (views),
    as vLLM's CPU attention makes them."""
    blocks, heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(blocks, heads, block_size * 2, -1)
    return halves.chunk(2, dim=2)


TRANSPOSED = "transposed"  # entry (slot, dim) at flat index dim * block_size + slot of its block's half


@dataclass(frozen=True)
class Layout:
    """Where entry ``(slot in block, dim)`` of a key (value) lives inside a block's ``[block_size, head_dim]`` half:
    at flat index ``slot * head_dim + dim`` (None), ``dim * block_size + slot`` (:data:`TRANSPOSED`), or
    ``key_order[slot * head_dim + dim]``."""

    key_order: torch.Tensor | str | None
    value_order: torch.Tensor | str | None


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


@functools.lru_cache(maxsize=16)
def identity_layout(block_size: int, head_dim: int) -> Layout:
    """Entry ``(slot, dim)`` at row ``slot``, column ``dim`` of its block's half (FlashAttention's layout)."""
    return Layout(None, None)


_LEARNT: dict = {}


def learn_layout(key, store, split, block_size: int, head_dim: int, heads: int, dtype: torch.dtype) -> Layout:
    """The index map of a cache layout (one per `key`: the backend, instruction set, block size, head size, dtype),
    learnt on the CPU by writing coded entries with ``store(key, value, key_cache, value_cache, slots)`` into a
    scratch cache that ``split`` cuts into its halves."""
    if key not in _LEARNT:
        _LEARNT[key] = _learn(store, split, block_size, head_dim, heads, dtype)
    return _LEARNT[key]


def _learn(store, split, block_size: int, head_dim: int, heads: int, dtype: torch.dtype) -> Layout:
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
                key_cache, value_cache = split(scratch)
                other = torch.ones_like(entry)
                key, value = (entry, other) if half == 0 else (other, entry)
                store(key, value, key_cache, value_cache, slots)
                read.append((key_cache if half == 0 else value_cache)[0, 0].float())
            found[which] = _decode(read)  # [block_size, head_dim] per stored element: the entry it holds
        flat = found["slot"] * head_dim + found["dim"]
        if not torch.equal(flat.flatten().sort().values, torch.arange(block_size * head_dim)):
            raise AttnkitError("vLLM's KV-cache layout here is not a permutation of each block's entries; the attnkit "
                               "plugin cannot read it")
        where = torch.empty(block_size * head_dim, dtype=torch.long)
        where[flat.flatten()] = torch.arange(block_size * head_dim)
        transposed = (torch.arange(head_dim)[None, :] * block_size + torch.arange(block_size)[:, None]).flatten()
        maps.append(None if torch.equal(where, torch.arange(block_size * head_dim))
                    else TRANSPOSED if torch.equal(where, transposed) else where)
    return Layout(*maps)


def physical_slots(block_row: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block id, offset in block)`` of a request's `slots` through its block table row (on its device)."""
    slots = slots.to(block_row.device)
    return block_row[slots // block_size].long(), slots % block_size


def _transposed(half: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, kv_heads, head_dim, block_size]``: a :data:`TRANSPOSED` half viewed as it lies in memory."""
    nb, kv, size, dim = half.shape
    return half.as_strided((nb, kv, dim, size), (half.stride(0), half.stride(1), size, 1))


def _entries(half: torch.Tensor, order, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[n, kv_heads, head_dim]``: entries ``(blocks[i], offsets[i])`` of one half of the cache (copies)."""
    if order is None:
        return half[blocks, :, offsets]
    _, kv, size, dim = half.shape
    if isinstance(order, str):  # TRANSPOSED: each block's half is [head_dim, block_size] in memory
        return _transposed(half)[blocks, :, :, offsets]
    used, which = torch.unique(blocks, return_inverse=True)  # any other permutation: whole blocks, reordered
    chunk = half[used].reshape(len(used), kv, size * dim)[:, :, order.to(half.device)].view(len(used), kv, size, dim)
    return chunk[which, :, offsets]


def gather_entries(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: Layout, blocks: torch.Tensor,
                   offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[n, kv_heads, head_dim]`` of the entries at ``(blocks[i], offsets[i])`` (copies)."""
    return (_entries(key_cache, layout.key_order, blocks, offsets),
            _entries(value_cache, layout.value_order, blocks, offsets))


def gather_heads(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: Layout, block_rows: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[rows, kv_heads, n, head_dim]`` of several requests' entries, each kv head at its own slots
    `slots` ``[rows, kv_heads, n]`` through the requests' block table rows `block_rows` ``[rows, blocks]`` (copies):
    one gather for every request of a step, each entry copied as one row of ``head_dim`` numbers where the layout
    stores it so (:func:`_entry_rows`), number by number where it stores each block's half transposed
    (:func:`_transposed_entries`: vLLM's CPU keys)."""
    rows, kv, n = slots.shape
    slots = slots.to(block_rows.device)
    return tuple(_entry_rows(half, order, block_rows, slots).view(rows, kv, n, -1) if not isinstance(order, str)
                 else _transposed_entries(half, block_rows, slots)
                 for half, order in ((key_cache, layout.key_order), (value_cache, layout.value_order)))


def entries(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: Layout, block_rows: torch.Tensor,
            slots: torch.Tensor) -> tuple[Entries, Entries] | None:
    """:func:`gather_heads`'s entries read where they lie, not copied (:class:`~attnkit.methods.decode_native.Entries`:
    each entry's address in its half of the cache), or None for a layout whose entries are not one run of numbers at
    a fixed distance (a permutation :func:`learn_layout` found)."""
    if not all(order is None or isinstance(order, str) for order in (layout.key_order, layout.value_order)):
        return None
    slots = slots.to(block_rows.device)
    blocks = _blocks_of(block_rows, slots, key_cache.shape[2])
    return tuple(Entries(half, _starts(half, order, blocks, slots),  # TRANSPOSED: numbers block_size apart
                         half.shape[2] if isinstance(order, str) else half.stride(3), half.shape[3])
                 for half, order in ((key_cache, layout.key_order), (value_cache, layout.value_order)))


def _blocks_of(block_rows: torch.Tensor, slots: torch.Tensor, size: int) -> torch.Tensor:
    """The block id of each of the requests' `slots` ``[rows, kv_heads, n]`` through their block table rows."""
    return block_rows.long().gather(1, slots.div(size, rounding_mode="floor").flatten(1)).view_as(slots)


def _starts(half: torch.Tensor, order, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Where each entry's first number lies in `half` (elements from its first), for the row layout (None) and
    :data:`TRANSPOSED`, given its block (:func:`_blocks_of`) and slot."""
    heads = torch.arange(half.shape[1], device=slots.device).view(1, -1, 1)
    within = slots.remainder(half.shape[2])
    start = (blocks * half.stride(0)).add_(heads * half.stride(1))
    return start.add_(within if isinstance(order, str) else within * half.stride(2))


def _transposed_entries(half: torch.Tensor, block_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[rows, kv_heads, n, head_dim]``, a transposed view of ``[rows, kv_heads, head_dim, n]`` (the layout a
    product with queries wants): a :data:`TRANSPOSED` half's entries at `slots`, each number taken from the cache's
    storage where it lies (an entry's numbers lie ``block_size`` apart there, so rows cannot be picked whole)."""
    nb, kv, size, dim = half.shape
    first = _starts(half, TRANSPOSED, _blocks_of(block_rows, slots, size), slots)  # [rows, kv, n]: each entry's dim 0
    numbers = first.unsqueeze(2) + (torch.arange(dim, device=slots.device) * size).view(1, 1, dim, 1)
    storage = half.as_strided(((nb - 1) * half.stride(0) + (kv - 1) * half.stride(1) + dim * size,), (1,))
    return storage.take(numbers).transpose(-1, -2)


def _entry_rows(half: torch.Tensor, order, block_rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    nb, kv, size, dim = half.shape
    heads = torch.arange(kv, device=slots.device).view(1, kv, 1)
    if order is None and half.stride(2) == dim and half.stride(3) == 1 and half.stride(0) % dim == half.stride(1) % dim == 0:
        # every entry is a row of the cache's storage: pick the rows
        blocks = _blocks_of(block_rows, slots, size)
        ids = blocks * (half.stride(0) // dim) + heads * (half.stride(1) // dim) + slots % size
        storage = half.as_strided(((nb - 1) * (half.stride(0) // dim) + (kv - 1) * (half.stride(1) // dim) + size, dim),
                                  (dim, 1))
        return storage.index_select(0, ids.flatten())
    # otherwise the blocks spanning each request's slots are read whole (head_blocks: contiguous runs), laid out as
    # rows, and the entries picked from them; a request's entries lie in one run of slots, so little more is read
    rows = slots.shape[0]
    first = slots.flatten(1).min(dim=1).values // size  # each request's first block
    count = int((slots.flatten(1).max(dim=1).values // size - first).max()) + 1
    spans = (first[:, None] + torch.arange(count, device=slots.device)).clamp(max=block_rows.shape[1] - 1)
    blocks = block_rows.long().gather(1, spans)[:, None, :].expand(rows, kv, count)
    stored = head_blocks(half, order, blocks).reshape(-1, dim)
    row = torch.arange(rows, device=slots.device).view(-1, 1, 1)
    ids = (row * kv + heads) * (count * size) + slots - first.view(-1, 1, 1) * size
    return stored.index_select(0, ids.flatten())


def _span(half: torch.Tensor, order, blocks: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """``[kv_heads, count, head_dim]``: the `count` consecutive entries from offset `first` of the request's
    blocks `blocks` (whole blocks read in their stored layout, then put in slot order)."""
    _, kv, _, dim = half.shape
    if order is None:
        chunk = half[blocks].permute(1, 0, 2, 3)
    else:  # TRANSPOSED
        chunk = _transposed(half)[blocks].permute(1, 0, 3, 2)
    return chunk.reshape(kv, -1, dim)[:, first:first + count]


def head_blocks(half: torch.Tensor, order, blocks: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """``blocks.shape + [block_size, head_dim]`` (`transposed`: ``[head_dim, block_size]``, a key block as a product
    with queries wants it): whole blocks of one half of the cache, where ``blocks[:, h, ...]`` are the block ids read
    for kv head ``h`` (copies, or views of copies). Where each block's half of a head is one contiguous run (vLLM's
    CPU layout), one row gather copies them."""
    nb, kv, size, dim = half.shape
    heads = torch.arange(kv, device=blocks.device).view(1, kv, *([1] * (blocks.dim() - 2)))
    if half.stride(0) == kv * half.stride(1) and half.stride(2) == dim and half.stride(3) == 1:
        runs = half.as_strided((nb * kv, size * dim), (half.stride(1), 1))
        stored = runs.index_select(0, (blocks.long() * kv + heads).flatten()).view(*blocks.shape, size * dim)
    elif isinstance(order, str):
        stored = _transposed(half)[blocks, heads]
    else:
        stored = half[blocks, heads]
    if isinstance(order, str):  # TRANSPOSED: each block's half is [head_dim, block_size] in memory
        out = stored.reshape(*blocks.shape, dim, size)
        return out if transposed else out.transpose(-1, -2)
    if order is not None:
        stored = stored.reshape(*blocks.shape, size * dim)[..., order.to(half.device)]
    out = stored.reshape(*blocks.shape, size, dim)
    return out.transpose(-1, -2) if transposed else out


def gather(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: Layout, block_row: torch.Tensor,
           slots) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, kv_heads, len(slots), head_dim]`` of a request's `slots` (copies): a tensor of slots, or
    a ``range`` of consecutive ones (read block by block where the layout allows)."""
    if isinstance(slots, range):
        orders = (layout.key_order, layout.value_order)
        if slots.step == 1 and all(o is None or isinstance(o, str) for o in orders):
            if not len(slots):
                empty = key_cache.new_zeros(1, key_cache.shape[1], 0, key_cache.shape[3])
                return empty, empty.clone()
            size = key_cache.shape[2]
            blocks = block_row[slots.start // size:(slots.stop - 1) // size + 1].long()
            first = slots.start % size
            return (_span(key_cache, orders[0], blocks, first, len(slots))[None],
                    _span(value_cache, orders[1], blocks, first, len(slots))[None])
        slots = torch.tensor(slots, dtype=torch.long)
    keys, values = gather_entries(key_cache, value_cache, layout, *physical_slots(block_row, slots, key_cache.shape[2]))
    return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class PaddedEntries:
    """Several requests' slots as one gather, request ``r``'s entries first in row ``r`` and its first entry
    repeated after them (``valid`` says which are entries): the physical ``blocks`` and ``offsets`` of every
    position ``[requests * longest]``. Built once per step, used by every layer."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, block_rows: list, slots: list, block_size: int) -> PaddedEntries:
        longest = max(len(s) for s in slots)
        padded = [torch.cat([s, s[:1].expand(longest - len(s))]) for s in slots]
        parts = [physical_slots(row, s, block_size) for row, s in zip(block_rows, padded)]
        valid = torch.arange(longest)[None] < torch.tensor([len(s) for s in slots])[:, None]
        return cls(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), valid.to(parts[0][0].device))

    def gather(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
               layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[requests, kv_heads, longest, head_dim]``."""
        keys, values = gather_entries(key_cache, value_cache, layout, self.blocks, self.offsets)
        shape = self.valid.shape + keys.shape[1:]
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)


def request_slots(key_cache, value_cache, layout: Layout, block_row: torch.Tensor, block_size: int, store):
    """``(gather(slots), write(slots, keys, values), heads(slots))`` of one request's slots, keys and values ``[1, kv,
    L, d]`` (:class:`attnkit.vllm.host.PagedRequest`), writing through ``store`` (vLLM's op, see :func:`learn_layout`);
    ``heads`` reads each kv head's entries at its own slots ``[kv, L]`` (:func:`gather_heads`)."""

    def read(slots):
        return gather(key_cache, value_cache, layout, block_row, slots)

    def heads(slots):
        return gather_heads(key_cache, value_cache, layout, block_row[None], slots[None])

    def write(slots, keys, values):
        blocks, offsets = physical_slots(block_row, slots, block_size)
        store(keys[0].transpose(0, 1).contiguous(), values[0].transpose(0, 1).contiguous(), key_cache, value_cache,
              blocks * block_size + offsets)

    return read, write, heads
