"""A layer's KV cache held as KIVI codes: :class:`KiviLayerKV`, a :class:`attnkit.cache.LayerKV` whose entries
are quantized by :mod:`attnkit.quant.kivi` (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", arXiv 2402.02750: keys per channel over a group of tokens, values per token, the newest tokens in
full precision; its Algorithm 1).

It keeps the slot model every cache method relies on (slots, original positions, ``keep``, ``write_slots``,
``write_slot``, ring writes, the flat per-head layout, ``extras`` that move with their slot), so any method can
sit on it unchanged; only what a slot *stores* differs. Its life has two parts:

**The prompt** (``sealed`` False) is held in full precision exactly as :class:`LayerKV` holds it (the prompt's
attention and a method's prompt-time scoring need its keys anyway); only the slots the prompt itself fills are
allocated. :meth:`KiviLayerKV.seal` then quantizes what the method kept (after its compression): the tokens among
the newest ``R`` to ``R + G - 1`` positions written stay in the full-precision **residual**; every other held
entry joins a key group of ``G`` consecutive held entries (slot order, per kv head) and is quantized.

**Decoding** (``sealed`` True): every new token is written to its slot as the method says (appended, over an
evicted entry, in a ring), its key and value going to the residual; once the residual holds ``R + G`` tokens,
its oldest ``G`` are quantized as one key group per kv head (:meth:`settle`, the runner's after-decode hook).
An entry is quantized once, when its group forms, and never again. Eviction only drops or overwrites slots: a
group's statistics stay while one of its entries lives, and unused groups are dropped from the table when it
fills (:meth:`compact_groups`), so the table holds at most one row per living group.

Storage per slot (``[b, H, capacity, ...]``, ``H`` the kv heads, 1 in a flat layer): packed key and value codes
(``uint8``, ``d * bits / 8`` bytes each), the value's scale and zero point per group of channels, and
``slot_group`` (``int32``): the slot's key group (``>= 0``), or ``-1 - i`` for residual entry ``i``. Per layer:
the key groups' scale and zero point ``[b, H, M, d]`` and the residual's keys and values ``[b, H, rows * E, d]``
(``E`` entries per token: 1, or the kv heads of a flat layer; entry ``i`` is token row ``i // E``). All of it
counts in :meth:`nbytes`. A method reads dequantized keys and values from :meth:`view`; they are computed on
first read and dropped when the step's hooks end (:meth:`release_view`), so between steps only codes,
statistics and the residual stay in memory.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from attnkit.cache import LayerKV
from attnkit.errors import AttnkitError
from attnkit.quant.kivi import (
    affine,
    decode_keys,
    decode_values,
    encode,
    encode_keys,
    encode_values,
    key_stats,
    pack,
)

PER_SLOT = ("kcodes", "vcodes", "vscale", "vzero", "slot_group")
STORED = PER_SLOT + ("kscale", "kzero", "rkeys", "rvalues")


# the residual takes one entry per kv head for every token; a flat layer whose tokens reach only some heads
# (duo_attention's streaming heads roll their windows in place) is not supported
_PER_HEAD_TOKENS = ("kivi: a flat layer whose new tokens go to some kv heads only (duo_attention) cannot be held "
                    "quantized; use duo_attention without kivi")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _pad(t: torch.Tensor, size: int, fill=0) -> torch.Tensor:
    """`t` ``[b, H, C, ...]`` extended along axis 2 to `size` with `fill`."""
    out = t.new_full(t.shape[:2] + (size,) + t.shape[3:], fill)
    out[:, :, :t.shape[2]] = t
    return out


class KiviLayerKV(LayerKV):
    """KIVI storage of one layer (see the module docstring)."""

    @classmethod
    def allocate_dense(cls, bits: int, residual: int, group: int, batch: int, kv_heads: int, capacity: int,
                       head_dim: int, dtype, device, ring: bool, prompt_len: int) -> KiviLayerKV:
        """An empty layer for a prompt of `prompt_len` tokens and a method that asked for `capacity` slots."""
        channels = min(group, head_dim)
        if head_dim % channels or head_dim * bits % 8:
            raise AttnkitError(f"kivi: head_dim={head_dim} must be a multiple of the value group ({channels} "
                               f"channels) and of {8 // bits} codes per byte; choose group= dividing {head_dim}")
        dense = capacity if ring else max(1, min(capacity, prompt_len))
        base = LayerKV.allocate(batch, kv_heads, dense, head_dim, dtype, device, ring)
        layer = cls(base.keys, base.values, base.positions, 0, ring)
        layer.bits, layer.residual, layer.group, layer.channels = bits, residual, group, channels
        layer.kv_heads, layer.head_dim, layer.dtype = kv_heads, head_dim, dtype
        layer.withheld = capacity - dense  # slots granted once the prompt is quantized
        layer.sealed, layer.owners, layer.rows, layer.groups_used, layer._view = False, 1, 0, 0, None
        for name in STORED:
            setattr(layer, name, None)
        return layer

    # ---- sizes ---------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.positions.shape[2]

    def nbytes(self) -> int:
        """Bytes held: full-precision keys and values before :meth:`seal`; then codes, the values' and key
        groups' scales and zero points, slot groups and the residual."""
        if not self.sealed:
            return super().nbytes()
        return sum(getattr(self, name).nbytes for name in STORED)

    # ---- reading --------------------------------------------------------------------------------------
    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.sealed:
            return super().view()
        n = self.length
        if self._view is None:
            self._view = self._dequantize(n)
        return self._view[0], self._view[1], self.positions[:, :, :n]

    def release_view(self) -> None:
        """Drop the dequantized keys and values (the end of a step's hooks on this layer)."""
        self._view = None

    def _dequantize(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        sg = self.slot_group[:, :, :n].long()
        residual = sg < 0
        if bool(residual.all()):  # nothing quantized (yet)
            keys = self.rkeys.new_empty(sg.shape + (self.head_dim,))
            values = torch.empty_like(keys)
        else:
            group = sg.clamp(min=0)
            keys = decode_keys(self.kcodes[:, :, :n], group, self.kscale, self.kzero, self.bits, self.dtype)
            values = decode_values(self.vcodes[:, :, :n], self.vscale[:, :, :n], self.vzero[:, :, :n], self.bits,
                                   self.dtype)
        rows, heads, slots = residual.nonzero(as_tuple=True)
        if slots.numel():  # residual entries: their full-precision keys and values
            entry = -1 - sg[rows, heads, slots]
            keys[rows, heads, slots] = self.rkeys[rows, heads, entry]
            values[rows, heads, slots] = self.rvalues[rows, heads, entry]
        return keys, values

    # ---- the prompt -> codes ----------------------------------------------------------------------------
    def seal(self, written: int) -> None:
        """Quantize what the layer holds after a prompt of `written` tokens (see the module docstring)."""
        if self.sealed:
            return
        b, H, _, d = self.keys.shape
        n, R, G = self.length, self.residual, self.group
        flat = "head" in self.extras
        E = self.owners = self.kv_heads if flat else 1
        keys, values, pos = super().view()
        owner = self.extras["head"][:, :, :n] if flat else torch.zeros_like(pos)
        rows = written if written < R + G else R + (written - R) % G
        first = written - rows
        in_res = pos >= first
        entry = (pos - first) * E + owner
        # key groups: G consecutive held entries (slot order) of each kv head, the residual left out
        held = F.one_hot(owner, E).bool() & ~in_res.unsqueeze(-1)  # [b, H, n, E]
        rank = held.long().cumsum(2).gather(3, owner.unsqueeze(-1)).squeeze(-1) - 1
        per_owner = _ceil(int(held.sum(2).max()) if n else 0, G)
        group = torch.where(in_res, -1, owner * per_owner + rank.div(G, rounding_mode="floor"))
        capacity = self.capacity + self.withheld
        self.withheld = 0
        self.groups_used = E * per_owner
        table = self.groups_used + self._room(capacity - n)
        self.kscale = keys.new_zeros(b, H, table, d)
        self.kzero = keys.new_zeros(b, H, table, d)
        if self.groups_used:
            scale, zero = key_stats(keys, group, self.groups_used, self.bits, self.dtype)
            self.kscale[:, :, :self.groups_used], self.kzero[:, :, :self.groups_used] = scale, zero
        self.kcodes = _pad(encode_keys(keys, group.clamp(min=0), self.kscale, self.kzero, self.bits), capacity)
        vcodes, vscale, vzero = encode_values(values, self.channels, self.bits, self.dtype)
        self.vcodes, self.vscale, self.vzero = _pad(vcodes, capacity), _pad(vscale, capacity), _pad(vzero, capacity)
        self.slot_group = _pad(torch.where(in_res, -1 - entry, group).int(), capacity)
        self.rows = rows
        self.rkeys = keys.new_zeros(b, H, min(R + G, rows + G) * E, d)
        self.rvalues = values.new_zeros(b, H, min(R + G, rows + G) * E, d)
        r, h, s = in_res.nonzero(as_tuple=True)
        self.rkeys[r, h, entry[r, h, s]] = keys[r, h, s]
        self.rvalues[r, h, entry[r, h, s]] = values[r, h, s]
        self.positions = _pad(self.positions, capacity, -1)
        self.extras = {name: _pad(stat, capacity, -1 if name == "head" else 0) for name, stat in self.extras.items()}
        self.keys = self.values = None  # the full-precision prompt leaves memory
        self.sealed = True

    def _room(self, slots: int) -> int:
        """Table rows for the groups that `slots` more entries form, plus one flush of headroom."""
        return self.owners * (_ceil(slots, self.group * self.owners) + 1)

    # ---- writing -----------------------------------------------------------------------------------------
    def _store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, tokens: int) -> None:
        """Write entries to `slots` ``[b, H, m]`` (``m = tokens x E``, token-major) as the next residual rows."""
        need = (self.rows + tokens) * self.owners
        if need > self.rkeys.shape[2]:
            size = max(need, min(2 * self.rkeys.shape[2], (self.residual + self.group) * self.owners))
            self.rkeys, self.rvalues = _pad(self.rkeys, size), _pad(self.rvalues, size)
        entry = (self.rows * self.owners + torch.arange(slots.shape[-1], device=slots.device)).expand_as(slots)
        self.positions.scatter_(2, slots, pos)
        self.slot_group.scatter_(2, slots, (-1 - entry).int())
        index = entry.unsqueeze(-1).expand(-1, -1, -1, self.head_dim)
        self.rkeys.scatter_(2, index, k.to(self.dtype))
        self.rvalues.scatter_(2, index, v.to(self.dtype))
        self.rows += tokens
        self._view = None

    def append(self, k, v, pos) -> None:
        if not self.sealed:
            return super().append(k, v, pos)
        b, H, n, _ = k.shape
        if self.ring:
            cap = self.capacity
            if n > cap:
                k, v, pos, n = k[:, :, -cap:], v[:, :, -cap:], pos[-cap:], cap
            slots = pos % cap
            self.length = min(cap, max(self.length, int(slots.max()) + 1))
        else:
            end = self.length + n
            if end > self.capacity:
                self._grow(max(end, 2 * self.capacity))
            slots, self.length = torch.arange(self.length, end, device=k.device), end
        self._store(slots.expand(b, H, n), k, v, pos.expand(b, H, n), n)

    def write_slots(self, slots, k, v, pos) -> None:
        if not self.sealed:
            return super().write_slots(slots, k, v, pos)
        self._store(slots, k, v, pos.expand_as(slots) if pos.dim() == 1 else pos, slots.shape[-1])
        for stat in self.extras.values():
            stat.scatter_(2, slots, 0)

    def write_slot(self, slot: int, k, v, pos) -> None:
        if not self.sealed:
            return super().write_slot(slot, k, v, pos)
        slots = torch.full(k.shape[:2] + (1,), slot, dtype=torch.long, device=k.device)
        self.write_slots(slots, k, v, pos.reshape(-1)[:1])

    def append_flat(self, k, v, pos, heads: list[int] | None = None) -> None:
        if not self.sealed:
            return super().append_flat(k, v, pos, heads)
        if heads is not None:
            raise AttnkitError(_PER_HEAD_TOKENS)
        b, kv, n, d = k.shape
        end = self.length + kv * n
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        slots = torch.arange(self.length, end, device=k.device).expand(b, 1, kv * n)
        self._store(slots, k.transpose(1, 2).reshape(b, 1, n * kv, d), v.transpose(1, 2).reshape(b, 1, n * kv, d),
                    pos.repeat_interleave(kv).expand(b, 1, kv * n), n)
        for stat in self.extras.values():
            stat[:, 0, self.length:end] = 0
        self.extras["head"][:, 0, self.length:end] = torch.arange(kv, device=k.device).repeat(n)
        self.length = end

    # ---- the residual's oldest tokens -> a key group ---------------------------------------------------------
    def settle(self) -> None:
        """Quantize the residual's oldest ``G`` tokens while it holds ``R + G`` or more; drop the dequantized view."""
        while self.sealed and self.rows >= self.residual + self.group:
            self._flush()
        self._view = None

    def _flush(self) -> None:
        G, E, n = self.group, self.owners, self.length
        if self.groups_used + E > self.kscale.shape[2]:
            self.compact_groups(grow=True)
        sg = self.slot_group[:, :, :n].long()
        entry = -1 - sg
        leaving = (sg < 0) & (entry < G * E)
        r, h, s = leaving.nonzero(as_tuple=True)
        if s.numel():
            e = entry[r, h, s]
            owner = e % E
            x = self.rkeys[r, h, e]
            b, H, _, d = self.kscale.shape
            flat = (r * H + h) * E + owner  # one new group per (row, kv head, owner)
            index = flat.unsqueeze(-1).expand_as(x)
            lo = x.new_full((b * H * E, d), float("inf"), dtype=torch.float32).scatter_reduce_(0, index, x.float(), "amin")
            hi = x.new_full((b * H * E, d), float("-inf"), dtype=torch.float32).scatter_reduce_(0, index, x.float(), "amax")
            scale, zero = affine(lo, hi, self.bits, self.dtype)
            new = slice(self.groups_used, self.groups_used + E)
            self.kscale[:, :, new], self.kzero[:, :, new] = scale.view(b, H, E, d), zero.view(b, H, E, d)
            self.kcodes[r, h, s] = pack(encode(x, scale[flat], zero[flat], self.bits), self.bits)
            self.vcodes[r, h, s], self.vscale[r, h, s], self.vzero[r, h, s] = encode_values(
                self.rvalues[r, h, e], self.channels, self.bits, self.dtype)
            self.slot_group[r, h, s] = (self.groups_used + owner).int()
            self.groups_used += E
        stay = (sg < 0) & ~leaving
        self.slot_group[:, :, :n] = torch.where(stay, sg + G * E, self.slot_group[:, :, :n].long()).int()
        kept = (self.rows - G) * E
        self.rkeys[:, :, :kept] = self.rkeys[:, :, G * E:self.rows * E].clone()
        self.rvalues[:, :, :kept] = self.rvalues[:, :, G * E:self.rows * E].clone()
        self.rows -= G

    def compact_groups(self, room: int | None = None, grow: bool = False) -> None:
        """Renumber the key groups that still have an entry (per row and kv head) and drop the others; the table
        keeps `room` free rows (``grow``: at least one flush more, doubling when it is full of living groups)."""
        n = self.length
        b, H, M, d = self.kscale.shape
        sg = self.slot_group[:, :, :n].long()
        live = torch.zeros(b, H, M, dtype=torch.int32, device=sg.device)
        live = live.scatter_add_(2, sg.clamp(min=0), (sg >= 0).int()) > 0
        new_id = live.long().cumsum(2) - 1
        used = int(live.sum(2).max()) if live.numel() else 0
        if grow:
            size = max(M, used + self.owners) if used + self.owners <= M else max(2 * M, used + self.owners)
        else:
            size = used + (room or 0)
        r, h, m = live.nonzero(as_tuple=True)
        scale, zero = self.kscale.new_zeros(b, H, size, d), self.kzero.new_zeros(b, H, size, d)
        scale[r, h, new_id[r, h, m]], zero[r, h, new_id[r, h, m]] = self.kscale[r, h, m], self.kzero[r, h, m]
        self.kscale, self.kzero, self.groups_used = scale, zero, used
        self.slot_group[:, :, :n] = torch.where(sg >= 0, new_id.gather(2, sg.clamp(min=0)), sg).int()

    # ---- moving slots ------------------------------------------------------------------------------------------
    def keep(self, indices: torch.Tensor, spare: int = 0) -> None:
        if not self.sealed:
            super().keep(indices, spare)
            self.withheld = 0
            return
        n = indices.shape[-1]

        def take(t: torch.Tensor, fill=0) -> torch.Tensor:
            index = indices.view(indices.shape + (1,) * (t.dim() - 3)).expand(indices.shape + t.shape[3:])
            return _pad(t.gather(2, index), n + spare, fill)

        for name in PER_SLOT:
            setattr(self, name, take(getattr(self, name)))
        self.positions = take(self.positions, -1)
        self.extras = {name: take(stat) for name, stat in self.extras.items()}
        self.length = n
        self._view = None
        self.compact_groups(room=self._room(spare))

    def keep_flat(self, heads, slots, spare: int = 0, room: int | None = None) -> None:
        if self.sealed:
            raise AttnkitError("kivi: a head-adaptive layer is laid out flat once, after the prompt; it cannot be "
                               "re-laid out after its entries are quantized")
        if room is not None:
            raise AttnkitError(_PER_HEAD_TOKENS)
        super().keep_flat(heads, slots, spare)
        self.withheld = 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        if not self.sealed:
            return super().keep_rows(rows)
        rows = rows.to(self.positions.device)  # the indices go to where this layer lives
        for name in STORED + ("positions",):
            setattr(self, name, getattr(self, name)[rows])
        self.extras = {name: stat[rows] for name, stat in self.extras.items()}
        self._view = None

    def _grow(self, capacity: int) -> None:
        if not self.sealed:
            return super()._grow(capacity)
        for name in PER_SLOT:
            setattr(self, name, _pad(getattr(self, name), capacity))
        self.positions = _pad(self.positions, capacity, -1)
        self.extras = {name: _pad(stat, capacity) for name, stat in self.extras.items()}

    def clone(self, rows: torch.Tensor | None = None) -> KiviLayerKV:
        rows = None if rows is None else rows.to(self.positions.device)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone() if rows is None else t[rows]

        new = copy.copy(self)
        for name in STORED + ("keys", "values", "positions"):
            setattr(new, name, take(getattr(self, name)))
        new.extras = {name: take(stat) for name, stat in self.extras.items()}
        new._view = None
        return new

