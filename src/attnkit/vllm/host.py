"""The attention of one request's rows in vLLM, computed by attnkit over the request's paged slots.

A method decides, a host stores (DESIGN.md). For a prompt chunk that runs through the method's hooks
(:attr:`attnkit.vllm.plan.Plan.hooks`: scoring statistics, sparse prefill, compression) the request's earlier
keys are gathered from the paged cache into an attnkit :class:`~attnkit.cache.LayerKV` for the duration of
one layer's call, and the method's own ``prefill_attention`` (and ``after_prefill`` on the prompt's last chunk)
run on it exactly as in attnkit's runner; the method's per-layer state (SnapKV's window queries, say) lives in
an attnkit :class:`~attnkit.session.Session` per request between chunks. After the prompt, the entries the
method kept are written back into the slots just before the first generated token (the plan's layout). Every
other query reads the slots its plan shows it (:meth:`~attnkit.vllm.plan.Plan.visible`), gathered, with dense
attention. Nothing here knows vLLM's layout: the :class:`PagedRequest` given reads and writes slots.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.attention import sdpa
from attnkit.cache import LayerKV
from attnkit.heads import HeadShard
from attnkit.methods.base import Method
from attnkit.methods.compose import Compose
from attnkit.session import LayerContext, Session, Step
from attnkit.vllm import live, metrics
from attnkit.vllm.inputs import LayerInputs
from attnkit.vllm.plan import Plan
from attnkit.vllm.requests import Row


@dataclass
class PagedRequest:
    """One request's slots in one layer's paged cache: ``gather(slots) -> (keys, values)`` ``[1, kv, L, d]``,
    ``write(slots, keys, values)`` with keys and values ``[1, kv, L, d]``, ``heads(slots)``: the entries ``[1, kv, L,
    d]`` at each kv head's own slots ``[kv, L]``, and the slots per block (the unit the scheduler frees)."""

    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    heads: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    block_size: int = 1


@dataclass(frozen=True)
class KernelOutput(Method):
    """A prefill "method" for a request whose prompt outputs vLLM's own kernel computes (dense attention, the
    same numbers): composed before the request's method, it hands the method zeros where it asks for the
    outputs, so the method only stores, observes and compresses. Not registered: the host's own."""

    name = "kernel_output"

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        return torch.zeros_like(q)


def session_method(row: Row) -> Method:
    """What runs the hooks of `row`'s prompt: its method, or, when vLLM's kernel gives the outputs, the method
    composed after :class:`KernelOutput`."""
    return Compose(KernelOutput(), row.method) if row.kernel_prompt else row.method


@dataclass
class Prefill:
    """A request's prompt in progress: the attnkit session holding the method's state, and this forward's step."""

    session: Session
    step: Step | None = None
    step_key: tuple | None = None
    # per layer, the statistics the method keeps beside the prompt's entries (LayerKV.extras: kvzap's scores), carried
    # from one chunk to the next (the entries themselves are gathered anew from their slots)
    extras: dict = field(default_factory=dict)


class Prefills:
    """The prompts in progress in this worker, by request id."""

    def __init__(self):
        self.open: dict[str, Prefill] = {}

    def retain(self, request_ids) -> None:
        """Forget prompts of requests the model runner no longer holds (finished or aborted); a request that sits out
        a step in the middle of its prompt keeps its session (statistics carried across chunks)."""
        for rid in [r for r in self.open if r not in request_ids]:
            del self.open[rid]

    def step(self, row: Row, call: LayerCall, start: int, end: int) -> Step:
        """The step of `row`'s prompt chunk ``[start, end)`` in this forward (one per forward, shared by layers)."""
        plan = row.plan
        entry = self.open.get(row.request_id)
        if entry is None or start == 0 and entry.step_key != (start, end):
            session = live.new_session(session_method(row), call, plan.prompt_len, row.max_tokens)
            entry = self.open[row.request_id] = Prefill(session)
        if entry.step_key != (start, end):
            q_pos = torch.arange(start, end)
            entry.step = Step(entry.session, "prefill", q_pos, last_chunk=end == plan.prompt_len)
            entry.step_key = (start, end)
        return entry.step

    def extras(self, row: Row) -> dict:
        """Per layer, the statistics `row`'s method keeps beside its prompt's entries (see :class:`Prefill`)."""
        return self.open[row.request_id].extras

    def close(self, row: Row) -> None:
        self.open.pop(row.request_id, None)


RECENT = 1024  # requests whose prompt chunks a worker remembers


@dataclass
class WorkerState:
    """What one model runner (one engine's worker) keeps between forwards: its prompts in progress and its live
    requests. Kept per runner, so that two engines in one process never see each other's requests."""

    prefills: Prefills = field(default_factory=Prefills)
    live: live.LiveRequests = field(default_factory=live.LiveRequests)
    # the layers' attention inputs of the forward in progress, for methods that read them (attnkit.vllm.inputs)
    inputs: LayerInputs = field(default_factory=LayerInputs)
    # the chunk lengths vLLM fed each recent request's prompt in (its last feeding, after a preemption the recompute's),
    # by request id: attnkit's runner given the same chunks computes the same prompt (chunk_size=...)
    prompt_chunks: OrderedDict = field(default_factory=OrderedDict)

    def begin_forward(self, known) -> None:
        """A new forward; `known`: the ids of every request the runner holds (running, waiting or preempted)."""
        self.prefills.retain(known)
        self.live.begin_forward(known)
        self.inputs.begin_forward()

    def note_prompt(self, request_id: str, prompt_len: int, start: int, tokens: int) -> None:
        """A row of a step feeding `tokens` tokens from position `start` (kept: :attr:`prompt_chunks`)."""
        if start >= prompt_len or not tokens:
            return
        chunks = [] if start == 0 else self.prompt_chunks.pop(request_id, [])
        chunks.append(min(start + tokens, prompt_len) - start)
        self.prompt_chunks[request_id] = chunks
        while len(self.prompt_chunks) > RECENT:
            self.prompt_chunks.popitem(last=False)


@dataclass(frozen=True)
class LayerCall:
    """One attention layer's call in the host: its index among the model's `n_layers`, its softmax scale, the
    model's rotary frequencies (:class:`attnkit.rope.Rope`: methods that undo or redo rotations need it), the
    worker's state, and the model's heads the worker holds (:class:`attnkit.heads.HeadShard`; None: all)."""

    layer: int
    n_layers: int
    scaling: float
    rope: object
    state: WorkerState
    shard: HeadShard | None = None


def row_attention(row: Row, call: LayerCall, q, k, v, paged: PagedRequest, inputs=None) -> torch.Tensor:
    """Outputs ``[1, heads, tokens, d]`` of one row's queries `q` (keys `k`, values `v` ``[1, kv, tokens, d]``
    already stored in their slots), at positions ``row.start ...``; zeros for prompt tokens whose outputs vLLM's
    kernel computes (:attr:`Row.kernel_prompt`). `inputs`: for a method that reads them, the layer's input hidden
    states of the row's tokens ``[tokens, hidden]`` and its key projection (:mod:`attnkit.vllm.inputs`)."""
    plan, start = row.plan, row.start
    if plan.live:
        return live.attention(row, session_method, call, q, k, v, paged, inputs)
    outs = []
    if plan.hooks and start < plan.prompt_len:
        m = min(start + q.shape[2], plan.prompt_len) - start
        chunk_inputs = None if inputs is None else (inputs[0][:m], inputs[1])
        outs.append(prompt_chunk(row, call, q[:, :, :m], k[:, :, :m], v[:, :, :m], paged, chunk_inputs))
        q, start = q[:, :, m:], start + m
    if q.shape[2]:
        outs.append(visible_attention(plan, start, q, paged, call.scaling))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def prompt_chunk(row: Row, call: LayerCall, q, k, v, paged: PagedRequest, inputs=None) -> torch.Tensor:
    """A prompt chunk through the method's own hooks; the prompt's last chunk writes back what the method kept."""
    plan, start, layer = row.plan, row.start, call.layer
    end = start + q.shape[2]
    step = call.state.prefills.step(row, call, start, end)
    if inputs is not None:
        step.note_layer_input(layer, inputs[0][None], inputs[1])
    kept_extras = call.state.prefills.extras(row)
    held = LayerKV.allocate(1, k.shape[1], plan.prompt_len, k.shape[-1], k.dtype, k.device)
    if start:
        keys, values = paged.gather(torch.arange(start))
        held.append(keys, values, torch.arange(start, device=k.device))
        held.extras = kept_extras.pop(layer, {})  # entry i is position i: nothing leaves before the prompt's end
    cache = step.session.cache
    cache.layers[layer] = held
    started = time.perf_counter()
    try:
        out = step.attention(layer, q, k, v, call.scaling, None)
        extras = cache.layers[layer].extras
        if extras and not step.last_chunk:
            # the next chunk's layer is gathered anew from the slots, in position order: the statistics beside the
            # entries are carried to it, which holds only while every entry of the prompt so far is held
            if cache.layers[layer].length != end:
                raise RuntimeError(f"attnkit: {row.method.name} evicted within the prompt and keeps per-entry "
                                   f"statistics ({', '.join(sorted(extras))}), which this host does not carry "
                                   f"between chunks")
            kept_extras[layer] = extras
        if step.last_chunk and plan.kept is not None:
            keys, values, positions = cache.layers[layer].view()
            if keys.shape[2] != plan.kept:
                raise RuntimeError(f"attnkit: layer {layer} kept {keys.shape[2]} entries per kv head, the plan "
                                   f"{plan.kept}")
            paged.write(torch.arange(plan.base, plan.prompt_len), keys, values)
            metrics.compacted(time.perf_counter() - started, plan.kept)
    finally:
        cache.layers[layer] = None
    if step.last_chunk and layer == call.n_layers - 1:
        call.state.prefills.close(row)
    return out


def _hull(first: list[tuple[int, int]], last: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The slots any query between two positions reads: the fixed ranges of both (sinks, compacted entries) and
    one window from the first query's start to the last query's end."""
    ranges = sorted(first[:-1] + last[:-1] + [(first[-1][0], last[-1][1])])
    merged = [ranges[0]]
    for a, b in ranges[1:]:
        if a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _slots(ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def decode_slots(plan: Plan, position: int) -> torch.Tensor:
    """The slots a single query at `position` reads, in slot order."""
    return _slots(plan.visible(position))


def batched_decode(q, keys, values, valid, scaling: float) -> torch.Tensor:
    """One query per request ``q`` ``[requests, heads, 1, d]`` over each request's gathered entries (``keys``,
    ``values`` ``[requests, kv, longest, d]``, ``valid`` ``[requests, longest]``): the decode step of many requests
    in one attention call (unmasked when every request holds as many entries)."""
    if bool(valid.all()):
        return sdpa(q, keys, values, scaling)
    return sdpa(q, keys, values, scaling, mask=valid[:, None, None, :])


def visible_attention(plan: Plan, start: int, q, paged: PagedRequest, scaling: float) -> torch.Tensor:
    """Dense attention of queries at ``start ...`` over the slots their plan shows them, in slot order."""
    nq = q.shape[2]
    last = start + nq - 1
    slots = _slots(_hull(plan.visible(start), plan.visible(last)))
    keys, values = paged.gather(slots)
    if nq == 1:
        return sdpa(q, keys, values, scaling)
    allowed = torch.zeros(nq, slots.shape[0], dtype=torch.bool)
    for i in range(nq):
        for a, b in plan.visible(start + i):
            allowed[i] |= (slots >= a) & (slots < b)
    return sdpa(q, keys, values, scaling, mask=allowed[None, None].to(q.device))
