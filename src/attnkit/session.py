"""One generation's state and the per-forward step the attention function hands to the active method.

- :class:`Session`: the method, the KV cache, and the method's own state: one object per layer
  (``method.new_layer_state()``) and one for the whole generation (``method.new_session_state()``),
  both typed by the method (dataclasses), never string-keyed dictionaries shared between methods.
- :class:`Step`: one forward pass (prefill chunk or decoding step): its phase, the original positions of
  its tokens, and what the layers of this forward share (e.g. a mask built on the first layer).
- :class:`RowsStep`: one forward over rows of several sessions (a batch of prompts of different lengths).
- :func:`stack_states` / :func:`unstack_states`: several generations' method states as one, for a decode step
  whose rows are theirs (:attr:`Step.per_row`: the vLLM host steps many requests of a per-step method at once).
- :class:`LayerContext`: one layer's view of a step, passed to every method hook.

The method is anything with the hooks of :class:`attnkit.methods.base.Method`; this module sits below
the methods and does not import them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit import heads
from attnkit.attention import watch_layer_inputs
from attnkit.cache import KVCache, LayerKV
from attnkit.errors import AttnkitError
from attnkit.heads import HeadShard
from attnkit.model import LoadedModel
from attnkit.rope import Rope


@dataclass
class Session:
    """State of one generation: the method, the cache, and what the method keeps per layer and per run."""

    method: Any  # an attnkit.methods.base.Method
    cache: KVCache
    n_layers: int
    prompt_len: int
    max_new_tokens: int
    # rotations by position offsets with the model's RoPE frequencies (attnkit.rope.Rope), filled in by
    # the runner / AttnkitCache; methods that re-index key positions need it
    rope: Any = None
    # the model's heads the layers hold, where they hold only some (None: all of them)
    shard: HeadShard | None = None
    layer_state: list = field(default_factory=list)
    state: Any = None  # the method's per-generation state (shared by its layers)

    def __post_init__(self):
        self.layer_state = [self.method.new_layer_state() for _ in range(self.n_layers)]
        self.state = self.method.new_session_state()

    # the model's heads the layers hold (a tensor-parallel shard's), for methods that read something per head of the
    # model or a sum over every head (attnkit.heads)
    @property
    def first_head(self) -> int:
        return heads.first_head(self.shard)

    def model_heads(self, n_heads: int | None, kv_heads: int | None) -> tuple[int | None, int | None]:
        return heads.model_heads(self.shard, n_heads, kv_heads)

    def held_heads(self, count: int, kv: bool = False) -> slice:
        return heads.held_heads(self.shard, count, kv)

    def sum_over_heads(self, values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        return heads.sum_over_heads(self.shard, values, dims, self.method.name)

    def mean_over_heads(self, values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        return heads.mean_over_heads(self.shard, values, dims, self.method.name)

    @property
    def rows(self) -> int:
        """Sequences this session generates side by side (the batch dimension of its cache)."""
        return self.cache.rows

    def keep_rows(self, rows: list[int]) -> None:
        """Go on with the batch rows `rows` only (the others finished): their cache entries and the method's
        per-row state are kept, the rest released."""
        index = torch.tensor(rows, dtype=torch.long)  # each layer takes it to its own device
        self.cache.keep_rows(index)
        self.method.keep_rows(self.layer_state, self.state, index)

    def fork(self, rows: list[int]) -> Session:
        """A new session whose rows are copies of this one's rows `rows` (a row may repeat: several copies of
        one sequence, e.g. one compressed context answering several questions): its cache rows, and the
        method's per-layer and per-generation state copied (:func:`copy_state`), per-row tensors kept for
        `rows` by the method's ``keep_rows``. Nothing is recomputed; this session is left as it was."""
        index = torch.tensor(rows, dtype=torch.long)  # on the CPU: each layer's copy moves it to its own device
        out = Session(self.method, self.cache.copy_rows(index), self.n_layers, self.prompt_len, self.max_new_tokens,
                      self.rope, self.shard)
        out.layer_state, out.state = copy_state(self.layer_state), copy_state(self.state)
        self.method.keep_rows(out.layer_state, out.state, index)
        return out


@dataclass
class Step:
    """One forward pass: which phase, which positions, and whether it ends the prompt."""

    session: Session
    phase: str  # "prefill" or "decode"
    q_pos: torch.Tensor  # [n] original positions of the new tokens
    last_chunk: bool = True
    # a decode step of several generations at once, one token per row (a host stacks them: the vLLM host's
    # per-step eviction): :attr:`q_pos` is then ``[rows, 1, 1]``, each row's own position, broadcasting against a
    # cache's ``[rows, kv, length]``; only a method whose ``stacks_decode`` says so is handed one
    per_row: bool = False
    # what the layers of this forward can share (e.g. a mask built on the first layer), by key
    memo: dict = field(default_factory=dict, repr=False)
    # (layer, its attention's input hidden states, its attention module) of the layer running now, handed over by
    # the host (:func:`attnkit.attention.watch_layer_inputs`) for a method that reads them; the last layer's only
    layer_input: tuple | None = field(default=None, repr=False)

    def note_layer_input(self, layer: int, hidden: torch.Tensor, module=None) -> None:
        """Keep layer `layer`'s attention input `hidden` ``[rows, n, hidden]`` (after its input norm) for its hooks."""
        self.layer_input = (layer, hidden, module)

    def shared_value(self, key, build):
        """The value the layers of this forward share under `key`, built by ``build()`` on first use. A tensor
        lives on the device of the layer that built it: where layers sit on several devices (a model placed by
        ``device_map``), the key names the device too (:attr:`LayerContext.device`)."""
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = build()
        return value

    def positions_on(self, device: torch.device | None) -> torch.Tensor:
        """:attr:`q_pos` on `device` (a layer's): one copy of these few positions per device and step."""
        if device is None or self.q_pos.device == device:
            return self.q_pos
        return self.shared_value(("q_pos", device), lambda: self.q_pos.to(device))

    def attention(self, layer: int, q, k, v, scaling: float, native_window: int | None) -> torch.Tensor:
        """Run the session's method on one layer's q, k, v (after RoPE): allocate the layer's cache on
        first use, then the phase's hooks."""
        ctx = LayerContext(self, layer, scaling, native_window, device=k.device)
        method = self.session.method
        if ctx.kv is None:
            capacity = method.layer_capacity(ctx)
            if capacity is not None:  # None: this layer keeps no cache (Select-Attention's later layers)
                self.session.cache.layers[layer] = method.allocate_layer(ctx, k, *capacity)
        if self.phase == "prefill":
            out = method.prefill_attention(ctx, q, k, v)
            self.session.cache.track_peak()
            if self.last_chunk:
                method.after_prefill(ctx, q, k, v)
        else:
            out = method.decode_attention(ctx, q, k, v)
            self.session.cache.track_peak()
            method.after_decode(ctx)
        self.session.cache.track_peak()
        return out


@dataclass
class RowsStep:
    """One forward over a batch whose rows belong to several sessions (sequences of different prompt
    lengths, or of different draft lengths): rows ``start:end`` of the batch are the rows of one
    session's :class:`Step`, whose tokens are the last ``tokens`` columns (the columns before them are
    padding, which no session sees and whose outputs are zeros). Each layer's attention is split by
    parts, so no sequence's attention, cache or eviction touches another's."""

    parts: list  # (start, end, tokens, Step), rows in order, covering the batch

    def note_layer_input(self, layer: int, hidden: torch.Tensor, module=None) -> None:
        """Each session's rows and columns of the layer's attention input (see :meth:`Step.note_layer_input`)."""
        n = hidden.shape[1]
        for start, end, tokens, step in self.parts:
            step.note_layer_input(layer, hidden[start:end, n - tokens:], module)

    def attention(self, layer: int, q, k, v, scaling: float, native_window: int | None) -> torch.Tensor:
        n = q.shape[2]
        outs = []
        for start, end, tokens, step in self.parts:
            cols = slice(n - tokens, n)
            out = step.attention(layer, q[start:end, :, cols], k[start:end, :, cols], v[start:end, :, cols],
                                 scaling, native_window)
            if tokens < n:
                out = torch.cat([out.new_zeros(out.shape[:2] + (n - tokens,) + out.shape[3:]), out], dim=2)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass
class LayerContext:
    """One layer's view of a step. The hooks see the method's state for this layer (:attr:`state`) and
    for the generation (:attr:`session_state`); a composed method gives each of its parts their own
    through :meth:`scoped`."""

    step: Step
    index: int
    scaling: float
    native_window: int | None  # the model's own sliding window for this layer, if any
    state_of: Any = None  # (the session's layer state) -> the state these hooks see; None: that state itself
    session_state_of: Any = None  # likewise for the session's per-generation state
    # where this layer runs (its q, k, v and cache live there); None before any tensor is seen
    device: torch.device | None = None

    @property
    def kv(self) -> LayerKV:
        return self.step.session.cache.layers[self.index]

    @property
    def q_pos(self) -> torch.Tensor:
        """The step's positions, on this layer's device."""
        return self.step.positions_on(self.device)

    @property
    def state(self):
        own = self.step.session.layer_state[self.index]
        return own if self.state_of is None else self.state_of(own)

    @property
    def session_state(self):
        own = self.step.session.state
        return own if self.session_state_of is None else self.session_state_of(own)

    @property
    def session(self) -> Session:
        return self.step.session

    def layer_input(self) -> torch.Tensor:
        """This layer's attention input for the step's tokens, ``[rows, n, hidden]`` (the hidden states after the
        layer's input norm, what its q, k, v projections read), for a method that scores them
        (``needs_layer_inputs``); refused in one line where the host did not hand them over."""
        noted = self.step.layer_input
        if noted is None or noted[0] != self.index:
            raise AttnkitError(f"method {self.session.method.name!r} reads each layer's input hidden states, which "
                               f"this host did not hand over for layer {self.index} (attnkit.generate and "
                               f"AttnkitCache do; speculative decoding and vLLM do not)")
        return noted[1]

    def layer_module(self):
        """The attention module of this layer as the host handed it over with :meth:`layer_input` (None if not)."""
        noted = self.step.layer_input
        return noted[2] if noted is not None and noted[0] == self.index else None

    def scoped(self, state_of, session_state_of) -> LayerContext:
        """The same layer and step, its hooks seeing ``state_of(layer state)`` and
        ``session_state_of(session state)`` (of the session's own states) as theirs."""
        return LayerContext(self.step, self.index, self.scaling, self.native_window, state_of, session_state_of,
                            self.device)


def new_session(model: LoadedModel, method, prompt_len: int, max_new_tokens: int, rows: int = 1) -> Session:
    """A fresh session of `method` for `rows` generations side by side on `model` (prompts of the same
    length `prompt_len`; an empty cache per layer)."""
    n_layers = model.geometry.n_layers
    if getattr(method, "needs_layer_inputs", False):
        watch_layer_inputs(model.hf)
    return Session(method, KVCache(n_layers, rows), n_layers, prompt_len, max_new_tokens, rope=Rope.from_model(model))


def layer_contexts(session: Session) -> list[LayerContext]:
    """A context per layer of `session` before its first forward (no tokens yet), for checks a method makes
    ahead of any work (:meth:`attnkit.methods.base.Method.planned_slots`)."""
    step = Step(session, "prefill", torch.zeros(0, dtype=torch.long))
    return [LayerContext(step, i, 1.0, None) for i in range(session.n_layers)]


def planned_slots(session: Session) -> list[int]:
    """Slots per kv head each layer of `session` will hold once its prompt is processed, asked of the method before
    any work (:meth:`attnkit.methods.base.Method.planned_slots`): raises the method's one-line AttnkitError when
    its parameters do not fit the prompt. Every host asks it before it starts (the runner, vLLM's request check)."""
    return [session.method.planned_slots(ctx) for ctx in layer_contexts(session)]


def copy_state(obj):
    """Deep copy of the tensors inside a method's state dataclasses and the dicts/lists/tuples they hold; any
    other object is kept by reference (e.g. the Step a method remembers, whose identity is what it compares,
    or Keyformer's decode-noise tables, which depend on nothing a generation changes)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (Step, Session)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, copy_state(getattr(obj, f.name)))
        return new
    if isinstance(obj, dict):
        return {k: copy_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_state(v) for v in obj)
    return obj


class _Apart(Exception):
    """States that cannot stand as one (:func:`stack_states`)."""


def stack_states(states: list) -> tuple[bool, Any]:
    """``(True, state)``: one state standing for `states`, each a generation's (of one row), for a decode step whose
    rows are theirs in order (:attr:`Step.per_row`); ``(False, None)`` where they differ beyond that. Tensors (one row
    each) are concatenated along the rows; in a dataclass, the numbers its class names in ``per_row`` become a
    tensor ``[rows]`` (float64 for floats and None, which becomes nan; int64 otherwise), the fields it names in
    ``shared`` (an object every generation may use alike, e.g. a table of draws) come from the first state holding
    one, and every other field must be equal in all."""
    try:
        return True, _stack(states)
    except _Apart:
        return False, None


_FIELDS: dict = {}


def _fields(state) -> tuple | None:
    """``(name, kind)`` of each field of a dataclass instance `state` (kind: ``"per_row"``, ``"shared"`` or ``""``,
    from its class's ``per_row`` and ``shared``), cached per class; None for anything else."""
    if isinstance(state, type):
        return None
    cls = type(state)
    got = _FIELDS.get(cls)
    if got is None:
        if not dataclasses.is_dataclass(cls):
            return None
        per_row, shared = getattr(cls, "per_row", ()), getattr(cls, "shared", ())
        got = _FIELDS[cls] = tuple((f.name, "per_row" if f.name in per_row else "shared" if f.name in shared else "")
                                   for f in dataclasses.fields(cls))
    return got


def _stack(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 1 and v.shape == first.shape
                   and v.dtype == first.dtype and v.device == first.device for v in values):
            raise _Apart
        return torch.cat(values)
    fields = _fields(first)
    if fields is not None:
        if any(type(v) is not type(first) for v in values):
            raise _Apart
        out = copy.copy(first)
        for name, kind in fields:
            got = [getattr(v, name) for v in values]
            if kind == "shared":
                value = next((g for g in got if g is not None), None)
            elif kind == "per_row":
                floats = any(g is None or isinstance(g, float) for g in got)
                value = torch.tensor([float("nan") if g is None else g for g in got],
                                     dtype=torch.float64 if floats else torch.int64)
            else:
                value = _stack(got)
            object.__setattr__(out, name, value)
        return out
    if any(isinstance(v, torch.Tensor) or (v is not first and v != first) for v in values):
        raise _Apart
    return first


def unstack_states(stacked, states: list) -> None:
    """Put what a stacked decode step left in `stacked` (:func:`stack_states` of `states`) back into each of
    `states` (dataclasses, updated in place): row ``r`` of every tensor (a view: each generation's own row, which
    the next stacked step copies again), the ``per_row`` numbers as Python numbers, everything else as it is."""
    fields = _fields(stacked)
    if fields is None:
        return
    for name, kind in fields:
        value = getattr(stacked, name)
        if kind == "per_row":
            owns = value.tolist()
        elif isinstance(value, torch.Tensor) and kind != "shared":
            owns = value.split(1)
        elif _fields(value) is not None:
            unstack_states(value, [getattr(s, name) for s in states])
            continue
        else:
            owns = [value] * len(states)
        for state, own in zip(states, owns):
            object.__setattr__(state, name, own)
