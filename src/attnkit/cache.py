"""The KV cache: per layer, keys and values of the kv heads only, with the original position of every slot.

Layout per layer: ``keys``/``values`` ``[batch, kv_heads, capacity, head_dim]``, ``positions``
``[batch, kv_heads, capacity]`` (-1 marks an empty slot). The first ``length`` slots are filled, the
same count in every head, but each head may hold different positions (per-head eviction). Keys are
stored after RoPE at their original positions, so slot order is irrelevant to attention.

A batch holds sequences of the same prompt length, which therefore hold the same number of entries
at every step (their budgets resolve alike); sequences of other lengths live in other caches, so a
batch is ragged across caches, and :meth:`KVCache.row_nbytes` is one sequence's share.

A layer's tensors live where its layer runs (allocated on the device of the keys it is first given), so a model
whose layers sit on several devices (``device_map``) keeps each layer's cache beside its layer; nothing moves a
cache between devices.

Capacity is allocated up front (the runner knows the prompt length and the token budget), so
decoding never reallocates. ``keep`` compacts a layer to a chosen subset per head into fresh, smaller
tensors: evicted entries really leave memory, and :meth:`KVCache.nbytes` shows it. In ring mode a
layer holds at most ``capacity`` entries and a token at position p lands in slot p mod capacity,
overwriting the oldest (the rolling buffer cache of Mistral 7B, Jiang et al. 2023, arXiv 2310.06825).

A **flat** layer (head-adaptive budgets, :mod:`attnkit.methods.prompt_scorer`; DuoAttention's retrieval and
streaming heads, :mod:`attnkit.methods.duo_attention`) holds a different number of
entries per kv head without padding any head: its kv-head axis is 1 and its slots hold every kept entry of
every head of the row, the head owning each slot in ``extras["head"]`` ``[batch, 1, capacity]`` (:meth:`keep_flat`,
:meth:`append_flat`). Every row holds as many slots as the others; rows differ only in which head owns which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.errors import AttnkitError


@dataclass
class LayerKV:
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    length: int = 0
    ring: bool = False
    # per-slot statistics a method keeps beside the entries (e.g. accumulated attention);
    # each is [batch, kv_heads, capacity] and moves with its slot on keep()
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype, device,
                 ring: bool = False) -> LayerKV:
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.full(shape[:3], -1, dtype=torch.long, device=device), 0, ring)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of key and value storage this layer holds (allocated, not just filled)."""
        return self.keys.nbytes + self.values.nbytes

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Filled slots: keys, values ``[b, kv, length, d]`` and positions ``[b, kv, length]``."""
        n = self.length
        return self.keys[:, :, :n], self.values[:, :, :n], self.positions[:, :, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write new entries (same positions `pos` [n] for every head) after the filled slots."""
        if self.ring:
            return self._write_ring(k, v, pos)
        n = k.shape[2]
        end = self.length + n
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.positions[:, :, self.length:end] = pos
        self.length = end

    def _write_ring(self, k, v, pos) -> None:
        cap = self.capacity
        if k.shape[2] > cap:  # only the newest `cap` entries survive anyway
            k, v, pos = k[:, :, -cap:], v[:, :, -cap:], pos[-cap:]
        slots = pos % cap
        self.keys[:, :, slots] = k
        self.values[:, :, slots] = v
        self.positions[:, :, slots] = pos
        self.length = min(cap, max(self.length, int(slots.max()) + 1))

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Overwrite chosen slots in place, per head: `slots` ``[b, kv, n]`` (entries that were evicted), with the
        new entries at positions `pos` broadcastable to `slots` (``[n]``, or ``[b, 1, 1]`` one per row)."""
        idx = slots.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys.scatter_(2, idx, k)
        self.values.scatter_(2, idx, v)
        self.positions.scatter_(2, slots, pos.expand_as(slots))  # one position per new entry, or per row
        for stat in self.extras.values():
            stat.scatter_(2, slots, 0)

    def write_slot(self, slot: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Overwrite slot `slot` of every row and head with one new entry (``k``/``v`` ``[b, kv, 1, d]``)."""
        self.keys[:, :, slot] = k[:, :, 0]
        self.values[:, :, slot] = v[:, :, 0]
        self.positions[:, :, slot] = pos.reshape(-1)[0]
        for stat in self.extras.values():
            stat[:, :, slot] = 0

    def write_values(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the values of the slots `slots` ``[b, kv, n]`` with `values` ``[b, kv, n, d]`` in place, their
        keys and positions unchanged (evicted values merged into kept entries, :meth:`keep_merged`)."""
        if self.values is None:  # a layer holding its values as codes (kivi, once sealed)
            raise AttnkitError("merging rewrites kept entries' values, which this layer holds quantized")
        self.values.scatter_(2, slots.unsqueeze(-1).expand(-1, -1, -1, self.values.shape[-1]),
                             values.to(self.values.dtype))

    def keep_merged(self, indices: torch.Tensor, spare: int, values: torch.Tensor | None) -> None:
        """:meth:`keep`, the kept slots' values replaced first by `values` ``[b, kv, n, d]`` when given: the host's side
        of a merging method's compression (:meth:`attnkit.methods.base.Method.merged_values`)."""
        if values is not None:
            self.write_values(indices, values)
        self.keep(indices, spare=spare)

    def keep(self, indices: torch.Tensor, spare: int = 0) -> None:
        """Keep only the slots `indices` ``[b, kv, n]`` per head, compacted into new tensors of
        capacity ``n + spare``. The old tensors are released."""
        n = indices.shape[-1]
        idx = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        new = LayerKV.allocate(self.keys.shape[0], self.keys.shape[1], n + spare, self.keys.shape[-1],
                               self.keys.dtype, self.keys.device, self.ring)
        new.keys[:, :, :n] = self.keys.gather(2, idx)
        new.values[:, :, :n] = self.values.gather(2, idx)
        new.positions[:, :, :n] = self.positions.gather(2, indices)
        for name, stat in self.extras.items():
            grown = stat.new_zeros(stat.shape[:2] + (n + spare,))
            grown[:, :, :n] = stat.gather(2, indices)
            new.extras[name] = grown
        self.keys, self.values, self.positions, self.extras = new.keys, new.values, new.positions, new.extras
        self.length = n

    def keep_flat(self, heads: torch.Tensor, slots: torch.Tensor, spare: int = 0, room: int | None = None) -> None:
        """Keep the entries ``(heads[r, i], slots[r, i])`` of each row ``r`` (``[b, m]``), compacted into a flat
        layer (see the module docstring) of ``m + spare * kv_heads`` slots, room for `spare` tokens appended
        by :meth:`append_flat` (or of ``m + room`` slots when `room` is given: a method whose tokens append
        fewer entries than ``kv_heads``). The old tensors are released."""
        b, kv, _, d = self.keys.shape
        m = heads.shape[-1]
        rows = torch.arange(b, device=heads.device)[:, None]
        new = LayerKV.allocate(b, 1, m + (spare * kv if room is None else room), d, self.keys.dtype, self.keys.device)
        new.keys[:, 0, :m] = self.keys[rows, heads, slots]
        new.values[:, 0, :m] = self.values[rows, heads, slots]
        new.positions[:, 0, :m] = self.positions[rows, heads, slots]
        for name, stat in self.extras.items():
            new.extras[name] = stat.new_zeros((b, 1, new.capacity))
            new.extras[name][:, 0, :m] = stat[rows, heads, slots]
        new.extras["head"] = torch.full((b, 1, new.capacity), -1, dtype=torch.long, device=heads.device)
        new.extras["head"][:, 0, :m] = heads
        self.keys, self.values, self.positions, self.extras = new.keys, new.values, new.positions, new.extras
        self.length = m

    def append_flat(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, heads: list[int] | None = None) -> None:
        """Append new tokens (``k``/``v`` ``[b, kv_heads, n, d]`` at positions `pos` ``[n]``) to a flat layer:
        one entry per token owned by each kv head (by each of `heads` only, when given)."""
        owners = torch.arange(k.shape[1], device=k.device) if heads is None else torch.tensor(heads, device=k.device)
        if heads is not None:
            k, v = k[:, heads], v[:, heads]
        b, kv, n, d = k.shape
        end = self.length + kv * n
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        new = slice(self.length, end)
        self.keys[:, 0, new] = k.transpose(1, 2).reshape(b, n * kv, d)  # token-major, then head
        self.values[:, 0, new] = v.transpose(1, 2).reshape(b, n * kv, v.shape[-1])
        self.positions[:, 0, new] = pos.repeat_interleave(kv)
        for stat in self.extras.values():
            stat[:, 0, new] = 0
        self.extras["head"][:, 0, new] = owners.repeat(n)
        self.length = end

    def write_flat(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   heads: list[int]) -> None:
        """Overwrite the flat slots `slots` ``[m]`` (the same in every row, slot ``i`` owned by kv head
        ``heads[i]``) with the entries of those heads for one new token (``k``/``v`` ``[b, kv_heads, 1, d]`` at
        position `pos` ``[1]``): each head replaces one of its own entries in place, so the owners stay and the
        other per-slot statistics restart at 0."""
        self.keys[:, 0, slots] = k[:, heads, 0]
        self.values[:, 0, slots] = v[:, heads, 0]
        self.positions[:, 0, slots] = pos.reshape(-1)[0]
        for name, stat in self.extras.items():
            if name != "head":
                stat[:, 0, slots] = 0

    def clone(self, rows: torch.Tensor | None = None) -> LayerKV:
        """An independent copy, every tensor cloned (a snapshot that speculative decoding restores); with `rows`
        (batch row indices, one may repeat) a copy of those rows only (:meth:`KVCache.copy_rows`)."""
        rows = None if rows is None else rows.to(self.positions.device)  # where this layer lives

        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if rows is None else t[rows]

        return LayerKV(copy(self.keys), copy(self.values), copy(self.positions), self.length, self.ring,
                       {name: copy(stat) for name, stat in self.extras.items()})

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (sequences that go on generating); the others leave memory."""
        rows = rows.to(self.positions.device)  # the indices, not the entries, go to where this layer lives
        self.keys, self.values, self.positions = self.keys[rows], self.values[rows], self.positions[rows]
        self.extras = {name: stat[rows] for name, stat in self.extras.items()}

    def _grow(self, capacity: int) -> None:
        pad = capacity - self.capacity
        self.keys = torch.cat([self.keys, self.keys.new_zeros(self.keys.shape[:2] + (pad, self.keys.shape[3]))], 2)
        self.values = torch.cat([self.values, self.values.new_zeros(self.values.shape[:2] + (pad, self.values.shape[3]))], 2)
        self.positions = torch.cat([self.positions, self.positions.new_full(self.positions.shape[:2] + (pad,), -1)], 2)
        for name, stat in self.extras.items():
            self.extras[name] = torch.cat([stat, stat.new_zeros(stat.shape[:2] + (pad,))], 2)


class KVCache:
    """All layers' :class:`LayerKV` (``None`` for a layer that keeps no cache), with a peak byte count.

    ``extra`` holds per-token tensors a method keeps *instead of* or beside keys and values (Select-Attention
    keeps the filter layer's hidden states to rebuild the later layers' keys and values): they are memory
    the method needs per token, so :meth:`nbytes` counts them; :meth:`kv_nbytes` is keys and values only.
    """

    def __init__(self, n_layers: int, rows: int = 1):
        self.layers: list[LayerKV | None] = [None] * n_layers
        self.extra: dict[str, torch.Tensor] = {}
        self.rows = rows  # sequences in the batch dimension (all hold the same number of entries)
        self.peak_bytes = 0
        self.peak_row_bytes = 0  # the most one sequence held

    def kv_nbytes(self) -> int:
        """Bytes of key and value storage over all layers."""
        return sum(layer.nbytes() for layer in self.layers if layer is not None)

    def extra_bytes(self) -> int:
        """Bytes of the per-token tensors in ``extra``."""
        return sum(t.nbytes for t in self.extra.values())

    def nbytes(self) -> int:
        """Everything the cache holds: keys, values and ``extra``."""
        return self.kv_nbytes() + self.extra_bytes()

    def row_nbytes(self) -> int:
        """What one sequence holds (every row of a layer holds as many entries as the others)."""
        return self.nbytes() // self.rows if self.rows else 0

    def track_peak(self) -> None:
        """Record the current size as a candidate peak (call after every allocation change)."""
        total = self.nbytes()
        self.peak_bytes = max(self.peak_bytes, total)
        if self.rows:
            self.peak_row_bytes = max(self.peak_row_bytes, total // self.rows)

    def copy_rows(self, rows: torch.Tensor) -> KVCache:
        """A new cache holding copies of the batch rows `rows` (indices; one may repeat, to copy a sequence
        several times) of every layer and of ``extra``; its peaks start at this cache's peak per sequence. A copy
        of a one-sequence cache into one sequence clones ``extra`` whole (a method that keeps one sequence per
        session, Select-Attention, keeps its per-token tensors without a batch axis)."""
        out = KVCache(len(self.layers), int(rows.shape[0]))
        for i, layer in enumerate(self.layers):
            if layer is not None:  # the layer copies itself (a quantized layer its codes), on its own device
                out.layers[i] = layer.clone(rows)
        single = self.rows == 1 and out.rows == 1
        out.extra = {name: t.clone() if single else t[rows.to(t.device)] for name, t in self.extra.items()}
        out.peak_row_bytes = self.peak_row_bytes
        out.peak_bytes = max(out.nbytes(), self.peak_row_bytes * out.rows)
        return out

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (indices, ascending) of every layer and of ``extra``."""
        for layer in self.layers:
            if layer is not None:
                layer.keep_rows(rows)
        self.extra = {name: t[rows.to(t.device)] for name, t in self.extra.items()}
        self.rows = int(rows.shape[0])

    def lengths(self) -> list[int]:
        return [0 if layer is None else layer.length for layer in self.layers]
