"""A request whose method acts while decoding, in vLLM's paged blocks: the method's own hooks on every token.

A method decides and a host stores (DESIGN.md). For a request whose plan is live (:attr:`attnkit.vllm.plan.Plan.live`:
``h2o``, ``tova``, ``keyformer``, and the prompt scorers with ``decode_every``), the worker keeps the request's
attnkit :class:`~attnkit.session.Session` from its first prompt chunk to its end, and every layer call runs the
method's hooks exactly as attnkit's runner does: the prompt through ``prefill_attention`` / ``after_prefill``, each
generated token through ``decode_attention`` / ``after_decode`` (one step per token, also when vLLM recomputes a
preempted request's generated tokens in one chunk; a re-compressing method's tokens between two compressions there
as one appending step, :func:`appending`). Between calls a layer's :class:`~attnkit.cache.LayerKV` keeps
only what the method keeps beside the entries (their positions, its per-entry statistics): its keys and values live
in vLLM's blocks alone, and the worker remembers which slot holds each of the layer's entries, per kv head.

A call *hydrates* the layer (the entries gathered from their slots into the LayerKV's own order, so ties break as in
attnkit's runner), runs the hooks, then puts what the layer holds back into the plan's layout: every entry a kv head
holds in the run of slots ``[end - held, end)`` that ends just before the next token's slot (``end``). vLLM has
already written the call's tokens at their own positions' slots, and most kept entries already lie in the run; the
few that lie before it (the survivors of a compression; for a per-step method, which evicts one entry per kv head
and token, the entries of the block the run is leaving, moved together once the run has left it: until then they
wait in a block the scheduler keeps) move into the run's free slots, every head's entry of a touched slot written
through vLLM's own writing op. Moving a few entries instead of shifting the run keeps the cost to the moved entries'
count; a slot's order does not matter to attention. The blocks wholly before the run go back to vLLM's pool
(:meth:`~attnkit.vllm.plan.Plan.freeable`); the layer's count is checked against the plan after every call.

Requests of a per-step method that decode in the same step, each holding its full budget, step together instead,
one call per layer for all of them (:mod:`attnkit.vllm.stacked`); while the same requests do, their layers point to
the group (:class:`Herded`), and each gets its own slots and state back (the ones this module keeps) when the group
changes or before it steps alone.

Steps that cannot compress, of a method whose decode step between two compressions only appends its entry, attends
densely over everything held and remembers recent queries (:meth:`~attnkit.methods.prompt_scorer.PromptScorer.
decode_queries_kept`: the re-compressing scorers, ``decode_every``), run as vLLM's other decode rows do, batched
over the run's slots (:attr:`attnkit.vllm.requests.Row.kept_queries`); the worker notes each such step's position
and, if the method keeps recent queries, its queries (:meth:`LiveRequests.skipped`). The next call through the
hooks first brings the layer up to date (:meth:`~attnkit.methods.prompt_scorer.PromptScorer.skip_appends`: the
skipped entries appended in order, the queries remembered), then runs its step, so the method compresses exactly
what it would have in attnkit's runner while most steps cost what a plain decode row costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.attention import sdpa
from attnkit.cache import KVCache, LayerKV
from attnkit.session import LayerContext, Session, Step
from attnkit.vllm import metrics
from attnkit.vllm.requests import Row

META = torch.device("meta")


@dataclass
class LiveLayer:
    """One layer of a live request between calls: its LayerKV (keys and values as meta tensors: shapes only), and
    the position and slot ``[kv, held]`` of each held entry, in the LayerKV's order (the LayerKV itself changes in
    the next call)."""

    kv: LayerKV
    positions: torch.Tensor
    slots: torch.Tensor
    end: int  # the position after the layer's last call through the hooks (its run ends there)


@dataclass(eq=False)
class Herded:
    """One layer of a live request whose state lies, between steps, in a group of requests stepping together: row
    `row` of `herd` (an :class:`attnkit.vllm.stacked.Herd`), whose ``dissolve()`` puts every member's own
    :class:`LiveLayer` and state back."""

    herd: Any
    row: int

    @property
    def end(self) -> int:
        return self.herd.ends[self.row]


@dataclass
class LiveRequest:
    """A live request in this worker: its session, its layers, the position it expects next, and the steps of the
    forward in progress (``(Step, first, end)``: token offsets into the row's tokens), built on its first layer."""

    session: Session
    layers: list
    next: int = 0
    forward: int = -1
    steps: list = field(default_factory=list)
    # steps run as plain attention since each layer's last call through the hooks: layer -> [(position, queries or
    # None, the layer's input hidden state or None)], consecutive positions in order
    pending: dict = field(default_factory=dict)
    # what requests share to step together (attnkit.vllm.stacked): the method as its session runs it, by its whole
    # parameters (kept, not rebuilt per layer)
    method_key: str | None = None


class LiveRequests:
    """The live requests of this worker, by request id."""

    def __init__(self):
        self.open: dict[str, LiveRequest] = {}
        self.forward = 0
        # groups of requests stepping together, by (layer, their method and budget) (attnkit.vllm.stacked.Herd)
        self.herds: dict = {}
        # (forward, its stackable rows, what every layer needs of them, their groups: attnkit.vllm.stacked._entered)
        self.entered: tuple | None = None

    def begin_forward(self, known) -> None:
        """A new forward pass; forget requests the model runner no longer holds (finished or aborted)."""
        self.forward += 1
        for rid in [r for r in self.open if r not in known]:
            del self.open[rid]
        alive = {id(e) for e in self.open.values()}
        for herd in [h for h in self.herds.values() if any(id(e) not in alive for e in h.members)]:
            herd.dissolve()

    def enter(self, row: Row, make_method, call) -> LiveRequest:
        """`row`'s request with the steps of this forward (its tokens ``row.start ...``); ``make_method(row)``: the
        method a new session runs; `call`: the layer's :class:`attnkit.vllm.host.LayerCall`."""
        entry = self.open.get(row.request_id)
        if entry is not None and entry.forward == self.forward:
            return entry
        if entry is None or row.start == 0:  # a new request, or one preempted and now recomputed from its start
            if row.start != 0:
                raise RuntimeError(f"attnkit: request {row.request_id} resumes at position {row.start} with no state")
            session = new_session(make_method(row), call, row.plan.prompt_len, row.max_tokens)
            entry = self.open[row.request_id] = LiveRequest(session, [None] * call.n_layers)
        elif row.start != entry.next:
            raise RuntimeError(f"attnkit: request {row.request_id} continues at position {row.start}, its state at "
                               f"{entry.next}")
        entry.forward, entry.next = self.forward, row.start + row.tokens
        entry.steps = steps_of(entry.session, row)
        return entry

    def skipped(self, request_id: str, layer: int, position: int, q: torch.Tensor | None,
                hidden: torch.Tensor | None = None) -> None:
        """Note a decode step that ran as plain attention: its position, this layer's queries ``[heads, d]`` (None
        when the method keeps none) and its input hidden state ``[hidden]`` (None when the method reads none)."""
        entry = self.open.get(request_id)
        if entry is None or (entry.forward != self.forward and position != entry.next):
            raise RuntimeError(f"attnkit: request {request_id} skipped position {position} with no state to catch up")
        if entry.forward != self.forward:
            entry.forward, entry.next, entry.steps = self.forward, position + 1, []
        noted = entry.pending.setdefault(layer, [])
        if noted and noted[-1][0] + 1 != position:
            raise RuntimeError(f"attnkit: request {request_id} skipped position {position} of layer {layer} after "
                               f"{noted[-1][0]}")
        noted.append((position, q, hidden))


def new_session(method, call, prompt_len, max_tokens, rows: int = 1) -> Session:
    """A fresh session of `method` for `rows` requests in the worker of layer call `call` (a
    :class:`attnkit.vllm.host.LayerCall`: the model's layers, its rotary frequencies, the heads the worker holds)."""
    return Session(method, KVCache(call.n_layers, rows), call.n_layers, prompt_len, max_tokens, call.rope, call.shard)


def steps_of(session: Session, row: Row) -> list[tuple[Step, int, int]]:
    """The steps of `row`'s tokens: its prompt part as one prefill step, then one decode step per generated token;
    for a method whose steps between compressions only append (:attr:`Row.kept_queries`'s methods), the generated
    tokens between two compressions (a recomputed request's) as one appending step (:func:`appending`)."""
    plan = row.plan
    n, start, end = plan.prompt_len, row.start, row.start + row.tokens
    steps = []
    if start < n:
        stop = min(end, n)
        steps.append((Step(session, "prefill", torch.arange(start, stop), last_chunk=stop == n), 0, stop - start))
    appends = plan.every > 1 and getattr(row.method, "decode_queries_kept", lambda: None)() is not None
    t = max(start, n)
    while t < end:
        stop = t + 1
        if appends and not plan.compresses_at(t):
            while stop < end and not plan.compresses_at(stop):
                stop += 1
        steps.append((Step(session, "decode", torch.arange(t, stop)), t - start, stop - start))
        t = stop
    return steps


def appending(step: Step, layer: int, scaling: float, q, k, v) -> torch.Tensor:
    """Decode steps between two compressions of a method whose such steps only append (its ``skip_appends``): each
    token attends densely over what the layer holds and the tokens before it, then the tokens are appended and
    their queries noted, as the method's own steps would, one by one."""
    ctx = LayerContext(step, layer, scaling, None, device=k.device)
    held_k, held_v, _ = ctx.kv.view()
    count, held = q.shape[2], held_k.shape[2]
    allowed = torch.ones(count, held + count, dtype=torch.bool, device=q.device).tril(held)
    out = sdpa(q, torch.cat([held_k, k], dim=2), torch.cat([held_v, v], dim=2), scaling, mask=allowed[None, None])
    step.session.method.skip_appends(ctx, k, v, q, step.q_pos)
    return out


def hydrate(layer: LiveLayer, paged) -> LayerKV:
    """The layer's LayerKV with its keys and values read back from their slots, each kv head's where they lie
    (``paged.heads``: `paged` is the request's :class:`attnkit.vllm.host.PagedRequest`)."""
    kv, held = layer.kv, layer.kv.length
    shape, dtype = kv.keys.shape, kv.keys.dtype
    device = kv.positions.device
    keys, values = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    if held:
        keys[:, :, :held], values[:, :, :held] = paged.heads(layer.slots)
    kv.keys, kv.values = keys, values
    return kv


def dehydrate(kv: LayerKV) -> None:
    kv.keys, kv.values = torch.empty_like(kv.keys, device=META), torch.empty_like(kv.values, device=META)


def slots_after(kv: LayerKV, old: LiveLayer | None, first: int) -> torch.Tensor:
    """``[kv, held]``: the slot of every entry the layer holds after a call whose tokens start at `first` (vLLM wrote
    those at their positions' slots; the others are where they were before the call)."""
    positions = kv.positions[0, :, :kv.length]
    if old is None or old.slots.shape[-1] == 0:
        return positions.clone()
    fresh = positions >= first
    kept = old.positions.shape[-1]
    if kept <= positions.shape[-1]:  # the common case: entries stay at their index (a per-step method writes the
        # new entry over the evicted one's; appends go after the others): one comparison instead of a search
        stay = (positions[:, :kept] == old.positions.to(positions.device)) | fresh[:, :kept]
        if bool(stay.all()) and bool(fresh[:, kept:].all()):
            slots = positions.clone()
            slots[:, :kept] = torch.where(fresh[:, :kept], positions[:, :kept], old.slots.to(positions.device))
            return slots
    before, order = old.positions.sort(dim=-1)
    where = old.slots.to(positions.device).gather(-1, order)
    found = torch.searchsorted(before.contiguous(), positions.contiguous()).clamp(max=before.shape[-1] - 1)
    if not bool((fresh | (before.gather(-1, found) == positions)).all()):
        raise RuntimeError("attnkit: a live layer holds an entry that was neither held before nor new")
    return torch.where(fresh, positions, where.gather(-1, found))


def relocate(kv: LayerKV, slots: torch.Tensor, end: int, write, floor: int) -> torch.Tensor:
    """Move the entries lying before slot `floor` into the free slots of the run ``[end - held, end)`` (per kv head)
    and return every entry's slot; a moved entry's slot keeps the other kv heads' entries it held. `floor` is the
    run's first slot, or for a per-step method the first slot of the run's first block: an entry in a block the plan
    keeps may stay there until the run leaves that block, so one move of up to a block's entries replaces a move on
    every step."""
    heads, held = slots.shape
    lo = end - held
    if not bool((slots < floor).any()):
        return slots
    new, moved = relocation(slots, lo, floor)
    # a touched slot's whole content (every head's entry) comes from the layer's own entries: the entry each head
    # holds there (`holder`; entries outside the run go to the spare last column), or for a head with no entry there
    # its first entry (that head reads nothing from the slot); a slot two heads moved into is written twice alike
    touched = new[moved]
    holder = torch.zeros(heads, held + 1, dtype=slots.dtype, device=slots.device)
    holder.scatter_(1, torch.where(new < lo, held, new - lo), torch.arange(held, device=slots.device).expand(heads, held))
    index = holder[:, touched - lo][None, :, :, None].expand(1, -1, -1, kv.keys.shape[-1])
    write(touched, kv.keys[:, :, :held].gather(2, index), kv.values[:, :, :held].gather(2, index))
    return new


def block_floor(end: int, held: int, block_size: int) -> int:
    """The first slot of the block that holds the first slot of the run ``[end - held, end)``: a per-step method's
    floor (:func:`relocate`)."""
    lo = end - held
    return lo - lo % block_size


def relocation(slots: torch.Tensor, lo, floor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where :func:`relocate` moves entries: ``(every entry's slot, which moved)`` for `slots` ``[..., held]`` (a
    kv head's entries per row), each row's run starting at slot `lo` and its entries before `floor` moved (ints, or
    tensors that broadcast to ``[..., 1]``: many requests' heads at once)."""
    held = slots.shape[-1]
    moved = slots < floor
    flat = slots.reshape(-1, held)
    start = lo if isinstance(lo, int) else (
        torch.as_tensor(lo, device=slots.device).expand(slots.shape[:-1] + (1,)).reshape(-1, 1))
    taken = torch.zeros(flat.shape[0], held + 1, dtype=torch.bool, device=slots.device)
    # an entry outside the run marks the spare last column
    taken.scatter_(1, torch.where(flat < start, held, flat - start), True)
    # the free offsets of each head's run, in order; the r-th moved entry of a head takes its r-th free offset (there
    # are as many free offsets as entries outside the run, moved or not)
    free = torch.where(taken[:, :held], held, torch.arange(held, device=slots.device)).sort(-1).values
    rank = (moved.reshape(-1, held).cumsum(dim=-1) - 1).clamp(min=0)
    return torch.where(moved, (start + free.gather(-1, rank)).view_as(slots), slots), moved


def catch_up(entry: LiveRequest, call, start: int, end: int, gather, module=None) -> None:
    """Bring a layer's state past the steps ``[start, end)`` that ran as plain attention (:meth:`LiveRequests.
    skipped`): their entries (vLLM wrote them at their positions' slots), noted queries and layer inputs (`module`:
    the layer's key projection, handed over with them), through the method."""
    noted = entry.pending.pop(call.layer, [])
    if len(noted) != end - start or noted[0][0] != start:  # consecutive by LiveRequests.skipped
        raise RuntimeError(f"attnkit: a live request's layer {call.layer} misses steps between {start} and {end}")
    keys, values = gather(range(start, end))
    # the method remembers its last `kept` queries at most (decode_queries_kept): only those are handed over
    kept = entry.session.method.decode_queries_kept() or len(noted)
    q = None if noted[0][1] is None else torch.stack([n[1] for n in noted[-kept:]], dim=1)[None].to(keys.device)
    step = Step(entry.session, "decode", torch.arange(start, end, device=keys.device))
    if noted[0][2] is not None:  # [1, steps, hidden]
        step.note_layer_input(call.layer, torch.stack([n[2] for n in noted])[None].to(keys.device), module)
    entry.session.method.skip_appends(LayerContext(step, call.layer, call.scaling, None, device=keys.device), keys,
                                      values, q, step.q_pos)


def attention(row: Row, make_method, call, q, k, v, paged, inputs=None) -> torch.Tensor:
    """Outputs ``[1, heads, tokens, d]`` of a live row's tokens in one layer (see the module docstring); `call` is
    the :class:`attnkit.vllm.host.LayerCall`, `paged` the request's :class:`attnkit.vllm.host.PagedRequest`,
    ``make_method(row)`` the method a new session runs, `inputs` the layer's input hidden states of the row's tokens
    and its key projection (for a method that reads them; else None)."""
    started = time.perf_counter()
    entry = call.state.live.enter(row, make_method, call)
    session, index = entry.session, call.layer
    old = entry.layers[index]
    if isinstance(old, Herded):  # its state lies in a group stepping together: its own first
        old.herd.dissolve()
        old = entry.layers[index]
    session.cache.layers[index] = None if old is None else hydrate(old, paged)
    module = None if inputs is None else inputs[1]
    if inputs is not None:
        for step, a, b in entry.steps:
            step.note_layer_input(index, inputs[0][None, a:b], module)
    try:
        if old is not None and old.end < row.start:
            catch_up(entry, call, old.end, row.start, paged.gather, module)
        outs = [appending(step, index, call.scaling, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                if step.phase == "decode" and b - a > 1 else
                step.attention(index, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], call.scaling, None)
                for step, a, b in entry.steps]
        kv = session.cache.layers[index]
        end = row.start + row.tokens
        expected = row.plan.held(end)
        if kv is None or kv.length != expected:
            raise RuntimeError(f"attnkit: layer {index} of request {row.request_id} holds "
                               f"{0 if kv is None else kv.length} entries per kv head after position {end}, its plan "
                               f"{expected}")
        first = row.start if old is None else old.end  # the call's tokens, and those it caught up with
        # a per-step method's entries may wait in the run's first block (see relocate)
        floor = block_floor(end, expected, paged.block_size) if row.plan.every == 1 else end - expected
        slots = relocate(kv, slots_after(kv, old, first), end, paged.write, floor)
        entry.layers[index] = LiveLayer(kv, kv.positions[0, :, :kv.length].clone(), slots, end)
        dehydrate(kv)
    finally:
        session.cache.layers[index] = None
    plan = row.plan
    if (plan.kept is not None and row.start < plan.prompt_len <= end) or any(
            plan.compresses_at(t) for t in range(max(row.start, plan.prompt_len), end)):
        metrics.compacted(time.perf_counter() - started, expected)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
