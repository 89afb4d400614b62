"""Many requests' decode steps of a per-step eviction method in one call, in vLLM's paged blocks.

A per-step method (``h2o``, ``tova``, ``keyformer`` without ``decode_every``: :attr:`attnkit.methods.base.Method.
stacks_decode`) evicts one entry per kv head and generated token. Run request by request (:mod:`attnkit.vllm.live`),
each step costs every request a gather of its entries, the method's few operations and the bookkeeping of its slots,
per layer: dozens of small operations per request, which on a serving batch cost more than the model. Here the
requests of a step that hold their full budget (a layer full at ``B`` entries per kv head, its state caught up to
this token) and run the same method step together, per layer, as a :class:`Herd`:

- every request's entries, in each request's own order, as one attnkit :class:`~attnkit.cache.LayerKV` whose rows
  are the requests, their per-entry statistics beside them: the entries' addresses in vLLM's blocks
  (:func:`attnkit.vllm.paged.entries`, :class:`InPlace`), which the method's attention reads in place (on a CPU,
  :mod:`attnkit.methods.decode_native`; elsewhere a copy), or, for a layout they cannot describe, one gather per step
  (:func:`attnkit.vllm.paged.gather_heads`);
- one call of the method's own decode hooks on it, a :class:`~attnkit.session.Step` whose rows each sit at their own
  position (:attr:`~attnkit.session.Step.per_row`), on the requests' method states stacked into one
  (:meth:`~attnkit.methods.base.Method.stack_states`): the same operations as one request's step, on more rows;
- the new token took its victim's place in each row and kv head; its slot is its position's (vLLM wrote it there),
  every other entry stays in its slot. A request whose run of slots has just left a block moves that block's
  survivors into the run (:func:`attnkit.vllm.live.relocation`, once per block of steps, to the slots one by one
  gives them): the rows of a step that leave a block, all in one copy.

A herd lasts while the same requests step together in the same order (a serving batch changes when a request joins,
finishes or is preempted, not at every step): its stacked states, entries' slots and addresses are kept from step to
step, so a step costs the method's hooks and the new token's address, not a stacking of every request's state. The
requests' own layers point to it (:class:`attnkit.vllm.live.Herded`) until :meth:`Herd.dissolve` gives each its own
state back: when the group changes, or before a request's step runs one by one.

The entries, their order and the method's arithmetic are those of the one-by-one path, so a request's tokens do not
depend on which requests it stepped with. A request that is not in that state (still filling its budget, in its
prompt, its states not stackable) runs one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.cache import LayerKV
from attnkit.methods import decode_native
from attnkit.methods.decode_native import Entries, tensor
from attnkit.session import Session, Step
from attnkit.vllm import host, live, metrics, paged
from attnkit.vllm.requests import Row


@dataclass
class InPlace(LayerKV):
    """A stacked step's entries read where they lie in vLLM's blocks (:class:`~attnkit.methods.decode_native.Entries`),
    not copied: the new token, which vLLM has written at its own position's slot, takes its victim's place in each row
    and kv head by its address (`fresh`: its keys' and values' entries ``[rows, kv, 1]``)."""

    fresh: tuple[Entries, Entries] | None = None
    taken: list = None  # the indices each write took since the step began (its victims)

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        if self.taken is not None:
            self.taken.append(slots)
        for e, f in zip((self.keys, self.values), self.fresh):  # the herd's own addresses, rewritten in place
            e.offsets.scatter_(2, slots, f.offsets)
        self.positions.scatter_(2, slots, pos.expand_as(slots))
        for stat in self.extras.values():
            stat.scatter_(2, slots, 0)

    def write_slot(self, slot: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.write_slots(torch.full(self.positions.shape[:2] + (1,), slot, device=self.positions.device), k, v, pos)


def stackable(row: Row) -> bool:
    """Whether `row` may step with others: a live per-step request decoding one token after its prompt, on a step
    that runs the method's hooks (not one that fills its budget as a plain decode row: :attr:`Row.kept_queries`)."""
    plan = row.plan
    return (plan.live and plan.every == 1 and row.tokens == 1 and not row.in_prompt and row.method.stacks_decode
            and row.kept_queries is None)


def attention(rows: list, call: host.LayerCall, query, key, value, cache, output) -> list:
    """Outputs of the step's stackable `rows` (``(token, Row, block table row)``) in one layer, written into
    `output`, for those that can step together; returns the others as ``(first, end, Row, block table row)`` for the
    one-by-one path. `cache`: ``(key cache, value cache, layout, store)`` of the layer (the backend's
    ``cache_layout``)."""
    requests, layer = call.state.live, call.layer
    entered, candidates = _entered(requests, rows, call)
    herds = [requests.herds.get((layer, group)) for group in candidates]
    if (all(h is not None and h.steady(members, layer) for h, members in zip(herds, candidates.values()))
            and sum(at == layer for at, _ in requests.herds) == len(herds)):
        # the usual step: every row in its layer's herd, as in the last step (what the loop below would find)
        for herd, members in zip(herds, candidates.values()):
            herd.step(members, call, query, key, value, cache, output)
        return []
    groups: dict = {}
    rest = []
    for first, row, block_row, entry, planned in entered:
        held = _full(entry, entry.layers[layer], row, planned)
        if held is None:
            rest.append((first, first + 1, row, block_row))
        else:  # one group per method as the session runs it and budget
            groups.setdefault((entry.method_key, held), []).append((first, row, block_row, entry))
    for herd in [h for (at, _), h in requests.herds.items() if at == layer]:
        if not herd.continues(groups.get(herd.key, ())):
            herd.dissolve()
    for group, members in groups.items():
        herd = requests.herds.get((layer, group))
        if herd is None and len(members) > 1:
            herd = Herd.start(members, call, group, query, cache)
        if herd is None:
            rest += [(first, first + 1, row, block_row) for first, row, block_row, _ in members]
        else:
            herd.step(members, call, query, key, value, cache, output)
    return rest


def _entered(requests: live.LiveRequests, rows: list, call: host.LayerCall) -> tuple[list, dict]:
    """``(token, Row, block table row, LiveRequest, the plan's count after this token)`` of each of a forward's
    stackable `rows`, and the groups they would step in where every layer is caught up and full (by method and the
    plan's count: ``(token, Row, block table row, LiveRequest)``, in order): the same for every layer of the forward,
    found on its first. A request's method key is its method as its session runs it, by its whole parameters (a
    composed method's parts are not hashable)."""
    known = requests.entered
    if known is not None and known[0] == requests.forward and known[1] is rows:
        return known[2], known[3]
    found, candidates = [], {}
    for first, row, block_row in rows:
        entry = requests.enter(row, host.session_method, call)
        if entry.method_key is None:
            entry.method_key = repr(entry.session.method)
        planned = row.plan.held(row.start + 1)
        found.append((first, row, block_row, entry, planned))
        candidates.setdefault((entry.method_key, planned), []).append((first, row, block_row, entry))
    requests.entered = (requests.forward, rows, found, candidates)
    return found, candidates


def _full(entry: live.LiveRequest, old, row: Row, planned: int) -> int | None:
    """The entries per kv head the request's layer holds (`old`, as it was left) where it may step with others: its
    state caught up to this token and its budget full (`planned`, the plan's count after this token); else None."""
    if old is None or entry.pending or old.end != row.start:
        return None
    if type(old) is live.Herded:
        held = old.herd.held
    else:
        held = old.kv.length if old.kv.length == old.kv.capacity else -1
    return held if held == planned else None


@dataclass(eq=False)
class Herd:
    """One layer's requests of one method and budget (`key`) stepping together, kept from step to step (see the
    module's docstring): `members` (their :class:`attnkit.vllm.live.LiveRequest`, row by row), the method's
    states stacked (`stacked`) in a session of their rows, each entry's slot ``[rows, kv, held]`` and each request's
    end of its run (the position after its last step; its run's first block holds the entries not yet moved into it:
    :func:`attnkit.vllm.live.block_floor`)."""

    requests: live.LiveRequests
    layer: int
    key: tuple
    members: tuple
    marks: tuple  # what each member's layer holds while the herd lasts (its own LiveLayer comes back on dissolve)
    method: Any
    stacked: tuple
    session: Session
    slots: torch.Tensor
    ends: list
    in_place: bool  # the entries read where they lie (InPlace); else gathered at each step
    shape: tuple  # one request's keys ``[1, kv, held, d]``
    held: int
    deltas: tuple = (0, 0)  # the distance of a block's consecutive slots, in the keys' and the values' half
    last: tuple | None = None  # the last step's positions and new tokens' entries (_fresh)

    @classmethod
    def start(cls, members: list, call: host.LayerCall, key: tuple, query, cache) -> Herd | None:
        """The herd of `members` (``(token, Row, block table row, LiveRequest)``, each holding its own
        :class:`~attnkit.vllm.live.LiveLayer`), or None where their states do not stack."""
        _, rows, block_rows, entries = zip(*members)
        olds = [e.layers[call.layer] for e in entries]
        sessions = [e.session for e in entries]
        method, layer = sessions[0].method, call.layer
        stacked = method.stack_states([s.layer_state[layer] for s in sessions], [s.state for s in sessions])
        if stacked is None or any(o.kv.extras.keys() != olds[0].kv.extras.keys() for o in olds):
            return None
        for other in call.state.live.herds.values():  # one run state for every layer, as one generation has
            if other.key == key and len(other.members) == len(entries) and all(
                    a is b for a, b in zip(other.members, entries)):
                stacked = (stacked[0], other.stacked[1])
                break
        key_cache, value_cache, layout, _ = cache
        held = olds[0].kv.length
        slots = torch.stack([o.slots for o in olds])  # [rows, kv, held]: each entry's slot, in its LayerKV's order
        held_at = torch.cat([o.kv.positions for o in olds]).to(key_cache.device)
        extras = {name: torch.cat([o.kv.extras[name] for o in olds]) for name in olds[0].kv.extras}
        shape = (1,) + tuple(olds[0].kv.keys.shape[1:])
        found = None
        if query.dtype == key_cache.dtype and decode_native.reads_in_place(key_cache.device, key_cache.dtype,
                                                                            key_cache.shape[-1], value_cache.shape[-1]):
            found = paged.entries(key_cache, value_cache, layout, torch.stack(block_rows), slots)
        if found is None:  # no kernel to read them in place, or a layout whose entries it cannot address: copies
            blank = torch.empty((len(olds),) + shape[1:], dtype=key_cache.dtype, device=live.META)
            kv = LayerKV(blank, blank, held_at, held, extras=extras)
        else:
            kv = InPlace(*found, held_at, held, extras=extras)
        session = live.new_session(method, call, torch.tensor([s.prompt_len for s in sessions]),
                                   torch.tensor([s.max_new_tokens for s in sessions]), len(members))
        session.layer_state[layer], session.state = stacked
        session.cache.layers[layer] = kv
        ends = [o.end for o in olds]
        herd = cls(call.state.live, layer, key, entries, (), method, stacked, session, slots, ends, found is not None,
                   shape, held)
        if found is not None:  # a block's first two slots, through the first request's table
            pair = paged.entries(key_cache, value_cache, layout, block_rows[0][None],
                                 torch.tensor([0, 1]).expand(1, shape[1], 2))
            herd.deltas = tuple(int(e.offsets[0, 0, 1] - e.offsets[0, 0, 0]) for e in pair)
        herd.marks = tuple(live.Herded(herd, r) for r in range(len(entries)))
        for entry, mark in zip(entries, herd.marks):
            entry.layers[layer] = mark
        herd.requests.herds[(layer, key)] = herd
        return herd

    def steady(self, members, layer: int) -> bool:
        """Whether `members` (``(token, Row, block table row, LiveRequest)``) are the herd's requests in its order,
        each still in it and caught up to this step: where :func:`_full` finds every one of them full at the herd's
        count."""
        return self.continues(members) and all(e.layers[layer] is mark and not e.pending and end == m[1].start
                                               for m, e, mark, end in zip(members, self.members, self.marks, self.ends))

    def continues(self, members) -> bool:
        """Whether `members` (this layer's group of the herd's method and budget in this step) are the herd's
        requests, in its order."""
        return len(members) == len(self.members) and all(m[3] is e for m, e in zip(members, self.members))

    def step(self, members: list, call: host.LayerCall, query, key, value, cache, output) -> None:
        """One decode step of the herd's requests (`members`: :meth:`continues`) in its layer, their outputs written
        into `output`."""
        started = time.perf_counter()
        firsts, rows, block_rows, _ = zip(*members)
        key_cache, value_cache, layout, store = cache
        count, held, layer = len(members), self.held, self.layer
        # a decode batch's rows are usually consecutive tokens: views then, not gathers
        index = (slice(firsts[0], firsts[0] + count) if firsts == tuple(range(firsts[0], firsts[0] + count))
                 else torch.tensor(firsts, device=query.device))
        starts = [r.start for r in rows]
        at = torch.tensor(starts, device=key_cache.device).view(-1, 1, 1)
        kv = self.session.cache.layers[layer]
        if self.in_place:  # the new token at its position's slot, where vLLM wrote it
            kv.fresh, kv.taken = self._fresh(cache, block_rows, at, starts), []
        else:
            kv.keys, kv.values = paged.gather_heads(key_cache, value_cache, layout, torch.stack(block_rows),
                                                    self.slots)
        step = Step(self.session, "decode", at, per_row=True)
        out = step.attention(layer, query[index].unsqueeze(2), key[index].unsqueeze(2), value[index].unsqueeze(2),
                             call.scaling, None)
        kv = self.session.cache.layers[layer]
        if kv.length != held:
            raise RuntimeError(f"attnkit: a stacked step of layer {layer} left {kv.length} entries per kv head, its "
                               f"plans {held}")
        output[index] = out[:, :, 0].reshape((count,) + tuple(output.shape[1:])).to(output.dtype)
        # the new token holds its victim's index in each row and kv head, at its own position's slot
        at = at.to(self.slots.device)
        taken = kv.taken if self.in_place else None
        if taken is not None and len(taken) == 1 and tuple(taken[0].shape) == (count, self.shape[1], 1):
            self.slots.scatter_(2, taken[0].to(self.slots.device), at.expand(count, self.shape[1], 1))
        else:  # the method wrote otherwise than once per kv head, or the entries are copies: found by position
            fresh = kv.positions[:, :, :held].to(self.slots.device) == at
            if not bool((fresh.sum(dim=-1) == 1).all()):
                raise RuntimeError(f"attnkit: a stacked step of layer {layer} did not take each new token once per kv "
                                   f"head")
            self.slots = torch.where(fresh, at, self.slots)
        # each row's run moved on by one slot (its end was its start: steady, _full); a per-step run's entries wait in
        # its first block, so those left before it move when the run's first slot is the first of a new block
        size = key_cache.shape[2]
        if self.ends != starts:
            raise RuntimeError(f"attnkit: a stacked step of layer {layer} found rows that do not continue their runs")
        self.ends = [s + 1 for s in starts]
        due = [r for r, end in enumerate(self.ends) if live.block_floor(end, held, size) == end - held]
        if due:
            self._relocate(kv, due, cache, block_rows)
        if not self.in_place:  # the copies go: the next step gathers its entries again
            kv.keys = kv.values = torch.empty((count,) + self.shape[1:], dtype=kv.keys.dtype, device=live.META)
        # every step of a per-step method compresses: one layer's compression per request
        metrics.compacted((time.perf_counter() - started) / count, held, count)

    def _fresh(self, cache, block_rows: tuple, at: torch.Tensor, starts: list) -> tuple[Entries, Entries]:
        """The new tokens' entries ``[rows, kv, 1]`` at their positions' slots: where every row's token follows the
        last step's in the same block, the last step's moved by one slot (a block's slots lie a fixed distance apart
        in either half of vLLM's cache: :attr:`deltas`), else read through the block tables."""
        key_cache, value_cache, layout, _ = cache
        size, heads = key_cache.shape[2], self.shape[1]
        last = self.last
        if last is not None and all(p % size and p == q + 1 for p, q in zip(starts, last[0])):
            fresh = tuple(e.with_offsets(e.offsets + d) for e, d in zip(last[1], self.deltas))
        else:
            fresh = paged.entries(key_cache, value_cache, layout, torch.stack(block_rows),
                                  at.expand(len(starts), heads, 1))
        self.last = (starts, fresh)
        return fresh

    def _relocate(self, kv: LayerKV, due: list, cache, block_rows: tuple) -> None:
        """The entries of rows `due` (whose runs start a block: :meth:`step`) that lie before their runs moved into the
        runs' free slots (:func:`attnkit.vllm.live.relocation`), and their addresses with them: read in place, every
        row's moved entries in one copy within vLLM's cache, each kv head's own (the other heads' entries in a slot
        stay); else row by row (:func:`attnkit.vllm.live.relocate`, through vLLM's store op)."""
        key_cache, value_cache, layout, store = cache
        size, held = key_cache.shape[2], self.held
        if not self.in_place:
            for r in due:
                write = paged.request_slots(key_cache, value_cache, layout, block_rows[r], size, store)[1]
                own = LayerKV(tensor(kv.keys[r:r + 1]), tensor(kv.values[r:r + 1]), kv.positions[r:r + 1], held)
                self.slots[r] = live.relocate(own, self.slots[r], self.ends[r], write, self.ends[r] - held)
            return
        index = torch.tensor(due, device=self.slots.device)
        lo = torch.tensor([self.ends[r] - held for r in due], device=self.slots.device).view(-1, 1, 1)
        slots = self.slots[index]
        new, moved = live.relocation(slots, lo, lo)
        if not bool(moved.any()):
            return
        targets = paged.entries(key_cache, value_cache, layout, torch.stack([block_rows[r] for r in due]), new)
        for entries, target in zip((kv.keys, kv.values), targets):
            offsets = entries.offsets[index]
            entries.move(offsets[moved], target.offsets[moved])
            entries.offsets[index] = torch.where(moved, target.offsets, offsets)
        self.slots[index] = new

    def dissolve(self) -> None:
        """Every member's own state and layer back (:class:`attnkit.vllm.live.LiveLayer`: the meta keys and values
        of a layer between calls), the herd forgotten."""
        layer = self.layer
        self.requests.herds.pop((layer, self.key), None)
        sessions = [e.session for e in self.members]
        self.method.unstack_states(self.stacked, [s.layer_state[layer] for s in sessions], [s.state for s in sessions])
        kv = self.session.cache.layers[layer]
        meta = torch.empty(self.shape, dtype=kv.keys.dtype, device=live.META)
        held_positions = kv.positions[:, :, :self.held].clone()
        for r, (entry, mark) in enumerate(zip(self.members, self.marks)):
            if entry.layers[layer] is mark:
                own = LayerKV(meta, meta, kv.positions[r:r + 1], self.held,
                              extras={name: stat[r:r + 1] for name, stat in kv.extras.items()})
                entry.layers[layer] = live.LiveLayer(own, held_positions[r], self.slots[r], self.ends[r])
