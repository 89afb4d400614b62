"""Many requests' decode steps of a per-step eviction method in one call, in vLLM's paged blocks.

A per-step method (``h2o``, ``tova``, ``keyformer`` without ``decode_every``: :attr:`attnkit.methods.base.Method.
stacks_decode`) evicts one entry per kv head and generated token. Run request by request (:mod:`attnkit.vllm.live`),
each step costs every request a gather of its entries, the method's few operations and the bookkeeping of its slots,
per layer: dozens of small operations per request, which on a serving batch cost more than the model. Here the
requests of a step that hold their full budget (a layer full at ``B`` entries per kv head, its state caught up to
this token) and run the same method step together, per layer:

- every request's entries, in each request's own order, as one attnkit :class:`~attnkit.cache.LayerKV` whose rows
  are the requests, their per-entry statistics beside them: the entries' addresses in vLLM's blocks
  (:func:`attnkit.vllm.paged.entries`, :class:`InPlace`), which the method's attention reads in place (on a CPU,
  :mod:`attnkit.methods.decode_native`; elsewhere a copy), or, for a layout they cannot describe, one gather
  (:func:`attnkit.vllm.paged.gather_heads`);
- one call of the method's own decode hooks on it, a :class:`~attnkit.session.Step` whose rows each sit at their own
  position (:attr:`~attnkit.session.Step.per_row`), the requests' method states stacked into one and back
  (:meth:`~attnkit.methods.base.Method.stack_states`): the same operations as one request's step, on more rows;
- the new token took its victim's place in each row and kv head; its slot is its position's (vLLM wrote it there),
  every other entry stays in its slot. A request whose run of slots has just left a block moves that block's
  survivors into the run (:func:`attnkit.vllm.live.relocate`, once per block of steps, as one by one).

The entries, their order and the method's arithmetic are those of the one-by-one path, so a request's tokens do not
depend on which requests it stepped with. A request that is not in that state (still filling its budget, in its
prompt, its states not stackable) runs one by one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attnkit.cache import LayerKV
from attnkit.methods import decode_native
from attnkit.methods.decode_native import Entries, tensor
from attnkit.session import Step
from attnkit.vllm import host, live, metrics, paged
from attnkit.vllm.requests import Row


@dataclass
class InPlace(LayerKV):
    """A stacked step's entries read where they lie in vLLM's blocks (:class:`~attnkit.methods.decode_native.Entries`),
    not copied: the new token, which vLLM has written at its own position's slot, takes its victim's place in each row
    and kv head by its address (`fresh`: its keys' and values' entries ``[rows, kv, 1]``)."""

    fresh: tuple[Entries, Entries] | None = None

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        self.keys, self.values = (e.with_offsets(e.offsets.scatter(2, slots, f.offsets))
                                  for e, f in zip((self.keys, self.values), self.fresh))
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
    groups: dict = {}
    rest = []
    for first, row, block_row in rows:
        entry = call.state.live.enter(row, host.session_method, call)
        old = entry.layers[call.layer]
        if (old is None or old.end != row.start or entry.pending or old.kv.length != old.kv.capacity
                or old.kv.length != row.plan.held(row.start + 1)):
            rest.append((first, first + 1, row, block_row))
        else:
            # one group per method as the session runs it (its whole parameters: a composed method's parts are not
            # hashable) and budget
            if entry.method_key is None:
                entry.method_key = repr(entry.session.method)
            groups.setdefault((entry.method_key, old.kv.capacity), []).append((first, row, block_row, entry, old))
    for members in groups.values():
        if len(members) == 1 or not _step(members, call, query, key, value, cache, output):
            rest += [(first, first + 1, row, block_row) for first, row, block_row, _, _ in members]
    return rest


def _step(members: list, call: host.LayerCall, query, key, value, cache, output) -> bool:
    started = time.perf_counter()
    firsts, rows, block_rows, entries, olds = zip(*members)
    sessions = [e.session for e in entries]
    method, layer = sessions[0].method, call.layer
    stacked = method.stack_states([s.layer_state[layer] for s in sessions], [s.state for s in sessions])
    if stacked is None or any(o.kv.extras.keys() != olds[0].kv.extras.keys() for o in olds):
        return False
    key_cache, value_cache, layout, store = cache
    count, held = len(members), olds[0].kv.length
    index = torch.tensor(firsts, device=query.device)
    slots = torch.stack([o.slots for o in olds])  # [rows, kv, held]: each entry's slot, in its LayerKV's order
    tables = torch.stack(block_rows)
    positions = torch.tensor([r.start for r in rows])
    held_at = torch.cat([o.kv.positions for o in olds]).to(key_cache.device)
    extras = {name: torch.cat([o.kv.extras[name] for o in olds]) for name in olds[0].kv.extras}
    found = None
    if query.dtype == key_cache.dtype and decode_native.reads_in_place(key_cache.device, key_cache.dtype,
                                                                        key_cache.shape[-1], value_cache.shape[-1]):
        # the held entries and, last, the new token at its position's slot
        found = paged.entries(key_cache, value_cache, layout, tables,
                              torch.cat([slots, positions.view(-1, 1, 1).expand(slots.shape[:2] + (1,))], dim=2))
    if found is None:  # no kernel to read them in place, or a layout whose entries it cannot address: copies
        kv = LayerKV(*paged.gather_heads(key_cache, value_cache, layout, tables, slots), held_at, held, extras=extras)
    else:
        kv = InPlace(*(e[:, :, :held] for e in found), held_at, held, extras=extras,
                     fresh=tuple(e[:, :, held:] for e in found))
    session = live.new_session(method, call, torch.tensor([s.prompt_len for s in sessions]),
                               torch.tensor([s.max_new_tokens for s in sessions]), count)
    session.layer_state[layer], session.state = stacked
    session.cache.layers[layer] = kv
    step = Step(session, "decode", positions.view(-1, 1, 1).to(key_cache.device), per_row=True)
    out = step.attention(layer, query[index].unsqueeze(2), key[index].unsqueeze(2), value[index].unsqueeze(2),
                         call.scaling, None)
    kv = session.cache.layers[layer]
    if kv.length != held:
        raise RuntimeError(f"attnkit: a stacked step of layer {layer} left {kv.length} entries per kv head, its "
                           f"plans {held}")
    method.unstack_states(stacked, [s.layer_state[layer] for s in sessions], [s.state for s in sessions])
    output[index] = out[:, :, 0].reshape((count,) + tuple(output.shape[1:])).to(output.dtype)
    # the new token holds its victim's index in each row and kv head, at its own position's slot
    at = positions.view(-1, 1, 1).to(slots.device)
    fresh = kv.positions[:, :, :held].to(slots.device) == at
    if not bool((fresh.sum(dim=-1) == 1).all()):
        raise RuntimeError(f"attnkit: a stacked step of layer {layer} did not take each new token once per kv head")
    slots = torch.where(fresh, at, slots)
    ends = positions + 1
    floors = ends - held
    floors -= floors % key_cache.shape[2]  # a per-step run's entries may wait in its first block (live.relocate)
    leaving = (slots < floors.view(-1, 1, 1).to(slots.device)).flatten(1).any(dim=1).tolist()
    for r in (r for r, moved in enumerate(leaving) if moved):
        write = paged.request_slots(key_cache, value_cache, layout, block_rows[r], key_cache.shape[2], store)[1]
        own = LayerKV(tensor(kv.keys[r:r + 1]), tensor(kv.values[r:r + 1]), kv.positions[r:r + 1], held)
        slots[r] = live.relocate(own, slots[r], int(ends[r]), write, int(floors[r]))
    lowest = slots.flatten(1).min(dim=1).values.tolist()
    # each request's rows of the step's tensors (views: a request's later steps write only its own row)
    meta = torch.empty((1,) + tuple(kv.keys.shape[1:]), dtype=kv.keys.dtype, device=live.META)
    held_positions = kv.positions[:, :, :held].clone()
    for r, entry in enumerate(entries):
        own = LayerKV(meta, meta, kv.positions[r:r + 1], held,
                      extras={name: stat[r:r + 1] for name, stat in kv.extras.items()})
        entry.layers[layer] = live.LiveLayer(own, held_positions[r], slots[r], int(ends[r]), lowest[r])
    # every step of a per-step method compresses: one layer's compression per request
    metrics.compacted((time.perf_counter() - started) / count, held, count)
    return True
