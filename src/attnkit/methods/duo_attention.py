"""``duo_attention``: retrieval heads keep the whole cache, streaming heads only sinks + a recent window (Xiao,
Tang, Zuo, Guo, Yang, Tang, Fu, Han, 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval
and Streaming Heads", arXiv 2410.10819; "the paper" below).

The paper finds that only some heads need the whole context (*retrieval* heads); the others (*streaming*
heads) attend to the first tokens (attention sinks) and the recent ones and lose little when they keep only
those. Which kv heads are retrieval heads is found once per model, offline: a gate ``alpha`` per kv head mixes
full and streaming attention (eq. 1, ``alpha full_attn + (1 - alpha) streaming_attn``) and is optimised on
synthetic retrieval prompts (section 2.2, "Optimization-Based Identification of Retrieval Heads"; attnkit's
:mod:`attnkit.calibrate.duo`, ``attnkit calibrate duo``); the kv heads of highest ``alpha`` are retrieval
heads (a threshold, or a ratio of all kv heads of the model, section 2.3, "Deploying LLMs with DuoAttention").

The rule, per layer and kv head, at a prompt of ``n`` tokens:

- a retrieval head holds every token, prompt and generated;
- a streaming head holds, between steps, the positions below ``sinks`` and the ``recent`` most recent ones: after
  the prompt ``{0 .. sinks-1} | {n-recent .. n-1}``, the authors' code's trimmed streaming cache and kvpress's
  ``DuoAttentionPress`` mask; a decode query at position ``p`` attends to the sinks, ``p - recent .. p - 1``
  and itself, then the oldest window entry leaves (it is overwritten by the next token, in place).

Every query of the prompt attends to the whole prompt by default (``prefill="full"``: the authors' code for a
prompt in one chunk, and kvpress); ``prefill="streaming"`` gives the streaming heads' prompt queries the rule
above instead (each query at ``p``: sinks + ``p - recent .. p``, the attention the gate was optimised with,
:func:`streaming_attention`). A model's own sliding window applies on top.

Storage: a layer with a streaming head is compacted after the prompt into a *flat* layer
(:meth:`attnkit.cache.LayerKV.keep_flat`, the layout of ``head_budgets=adaptive``): one axis holding every kept
entry, each tagged with its kv head, no padding. A streaming head then occupies ``sinks + recent + 1`` slots (the
``+ 1`` the incoming token's, as the eviction methods count ``B``), a retrieval head ``n + generated``; decode
queries attend over it with the other heads' slots masked (:func:`attnkit.methods.scoring.flat_attention`: one
matmul over every held entry, no padding and no copy, but unfused and with the other heads' logits). The
heads' choice is the same in every row of a batch, so the streaming heads' victims are the same slots in every row.

Parameters: ``config`` (``attnkit calibrate duo``'s file or its dict: per layer the gates and retrieval heads; its
sinks and window are the defaults); ``retrieval_ratio`` (of all the model's kv heads, the highest gates; without a
config 0 or 1) or ``threshold`` (gate >= threshold); ``pattern`` (``RS/SR``: R or S per kv head, layers split by /).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnkit import masks
from attnkit.attention import attend, sdpa
from attnkit.config_file import read_config_file
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.scoring import flat_attention
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, fraction, is_number, is_whole, one_of_two, whole

CONFIG_FORMAT = "attnkit.duo-heads/1"
DEFAULT_SINKS = 128  # the authors' released head patterns (their config.json: sink_size 128, recent_size 256)
DEFAULT_RECENT = 256
PREFILL = ("full", "streaming")
STREAMING_BLOCK = 256  # queries per block of streaming_attention


# ---- the streaming heads' attention ----------------------------------------------------------------------
def streaming_rule(sinks: int, recent: int, window: int | None = None) -> masks.Rule:
    """A streaming head's visibility: the query at ``p`` sees keys ``k < sinks`` and ``p - recent <= k <= p``
    (:func:`attnkit.masks.a_shape` with a window of ``recent + 1``), within the model's own `window`."""
    return masks.and_(masks.a_shape(sinks, recent + 1), masks.sliding_window(window))


def streaming_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                        q_pos: torch.Tensor, k_pos: torch.Tensor, sinks: int, recent: int,
                        window: int | None = None, block: int = STREAMING_BLOCK) -> torch.Tensor:
    """Attention of queries ``[b, hq, c, d]`` at `q_pos` over keys/values ``[b, kv, L, d]`` at the ascending 1-D
    `k_pos` under :func:`streaming_rule`, a block of queries at a time over only the keys it can see (the sinks
    and its band), so the cost is ``c x (sinks + recent + block)``, not ``c x L``. Differentiable (the gate
    optimisation runs through it)."""
    rule = streaming_rule(sinks, recent, window)
    n_sink = int(torch.searchsorted(k_pos, torch.tensor(sinks, device=k_pos.device)))
    outs = []
    for s in range(0, q.shape[2], block):
        qp = q_pos[s:s + block]
        lo = max(n_sink, int(torch.searchsorted(k_pos, qp[:1] - recent)))
        hi = int(torch.searchsorted(k_pos, qp[-1:], right=True))
        ks = torch.cat([keys[:, :, :n_sink], keys[:, :, lo:hi]], 2)
        vs = torch.cat([values[:, :, :n_sink], values[:, :, lo:hi]], 2)
        kp = torch.cat([k_pos[:n_sink], k_pos[lo:hi]])
        outs.append(sdpa(q[:, :, s:s + block], ks, vs, scaling, mask=masks.additive_bias(rule, qp, kp, q.dtype)))
    return torch.cat(outs, 2)


# ---- the head choice ---------------------------------------------------------------------------------------
def select_heads(alpha: list[list[float]], retrieval_ratio: float | None = None,
                 threshold: float | None = None) -> list[list[bool]]:
    """Retrieval heads from the gates ``alpha[layer][kv_head]``: ``alpha >= threshold`` (the authors' rule), or
    the ``n - round(n (1 - retrieval_ratio))`` highest of the model's ``n`` kv heads (kvpress's count of
    ``head_compression_ratio = 1 - retrieval_ratio`` streaming heads); on equal gates the lower (layer, head)
    becomes a streaming head first."""
    if threshold is not None:
        return [[a >= threshold for a in layer] for layer in alpha]
    flat = [(a, i, h) for i, layer in enumerate(alpha) for h, a in enumerate(layer)]
    streaming = {(i, h) for _, i, h in sorted(flat)[:round(len(flat) * (1 - retrieval_ratio))]}
    return [[(i, h) not in streaming for h in range(len(layer))] for i, layer in enumerate(alpha)]


def parse_pattern(text: str) -> list[list[bool]]:
    """``"RS/SR"`` -> per layer, per kv head, whether it is a retrieval head."""
    layers = text.split("/")
    if not all(layer and set(layer) <= {"R", "S"} for layer in layers):
        raise AttnkitError(f"pattern must give one letter per kv head, R (retrieval) or S (streaming), layers "
                           f"separated by '/' (e.g. RS/SR); got {text!r}")
    return [[c == "R" for c in layer] for layer in layers]


@dataclass(frozen=True)
class DuoConfig:
    """A calibrated head choice (``attnkit calibrate duo``): geometry, gates, retrieval heads, streaming shape."""

    n_layers: int
    n_heads: int | None
    n_kv_heads: int
    alpha: list[list[float]] | None
    retrieval: list[list[bool]]
    sinks: int | None
    recent: int | None
    source: str

    def check(self, n_layers: int, n_heads: int | None = None, n_kv: int | None = None) -> None:
        """Refuse a model of another geometry (layers; query and kv heads where given)."""
        heads_differ = None not in (self.n_heads, n_heads) and self.n_heads != n_heads
        if self.n_layers != n_layers or n_kv not in (None, self.n_kv_heads) or heads_differ:
            model = f"{n_layers} layers" + ("" if n_kv is None else f" x {n_kv} kv heads ({n_heads} query heads)")
            raise AttnkitError(f"{self.source} was calibrated for {self.n_layers} layers x {self.n_kv_heads} kv heads "
                               f"({self.n_heads} query heads) but the model has {model}; calibrate it for this "
                               f"model with `attnkit calibrate duo`")


def duo_config_from_dict(data, source: str = "the duo config") -> DuoConfig:
    """Check a config's structure (``format``, geometry, per layer ``alpha`` and ``retrieval_heads``)."""
    if not isinstance(data, dict) or data.get("format") != CONFIG_FORMAT or not isinstance(data.get("layers"), list) \
            or not data["layers"]:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise AttnkitError(f"{source}: not a duo_attention head config (format {got!r}, expected {CONFIG_FORMAT!r} "
                           f"with a 'layers' list); write one with `attnkit calibrate duo`")
    kv, n_heads = data.get("n_kv_heads"), data.get("n_heads")
    if not is_whole(kv) or kv < 1 or (n_heads is not None and (not is_whole(n_heads) or n_heads % kv)):
        raise AttnkitError(f"{source}: 'n_kv_heads' must be a positive integer dividing 'n_heads', got "
                           f"n_kv_heads={kv!r}, n_heads={n_heads!r}")
    if data.get("n_layers", len(data["layers"])) != len(data["layers"]):
        raise AttnkitError(f"{source}: 'n_layers' is {data.get('n_layers')!r} but 'layers' lists {len(data['layers'])}")
    alpha, retrieval = [], []
    for i, layer in enumerate(data["layers"]):
        gates = layer.get("alpha") if isinstance(layer, dict) else None
        heads = layer.get("retrieval_heads") if isinstance(layer, dict) else None
        if not isinstance(gates, list) or len(gates) != kv or not all(is_number(a) and 0 <= a <= 1 for a in gates):
            raise AttnkitError(f"{source}: layer {i} needs 'alpha', {kv} gates in [0, 1] (one per kv head), got {gates!r}")
        if not isinstance(heads, list) or not all(is_whole(h) and 0 <= h < kv for h in heads) \
                or len(set(heads)) != len(heads):
            raise AttnkitError(f"{source}: layer {i} 'retrieval_heads' must list distinct kv heads 0..{kv - 1}, "
                               f"got {heads!r}")
        alpha.append([float(a) for a in gates])
        retrieval.append([h in heads for h in range(kv)])
    shape = {}
    for key in ("sinks", "recent"):
        if data.get(key) is not None:
            shape[key] = whole(f"{source}: {key}", data[key], 0)
    return DuoConfig(len(alpha), n_heads, kv, alpha, retrieval, shape.get("sinks"), shape.get("recent"), source)


def load_duo_config(source) -> DuoConfig:
    """A config from a file path (JSON / YAML) or a dict."""
    if isinstance(source, dict):
        return duo_config_from_dict(source)
    data = read_config_file(source, "duo config", " (write one with `attnkit calibrate duo`)")
    return duo_config_from_dict(data, f"duo config {str(source)!r}")


# ---- the method --------------------------------------------------------------------------------------------
@dataclass
class DuoState:
    """Per layer: the kv heads of each kind, whether the layer ever drops an entry, what a streaming head holds
    (``held`` entries; once full, the ``ring`` of its window's flat slots, oldest first, and ``evictions`` so far)."""

    retrieval: list[int] | None = None
    streaming: list[int] | None = None
    evicts: bool | None = None
    held: int = 0
    ring: torch.Tensor | None = None
    evictions: int = 0


@dataclass
class DuoRun:
    """Per generation: whether the head choice was checked against the model (its query heads, once seen)."""

    checked: bool = False
    n_heads: int | None = None


@register
@dataclass(frozen=True)
class DuoAttention(Method):
    """Retrieval kv heads keep every token, streaming kv heads sinks + a recent window (DuoAttention)."""

    config: str | dict | None = None
    retrieval_ratio: float | None = None
    threshold: float | None = None
    pattern: str | None = None
    sinks: int | None = None
    recent: int | None = None
    prefill: str = "full"

    name = "duo_attention"
    summary = "retrieval heads keep all, streaming heads sinks + recent (DuoAttention, Xiao et al. 2024)"
    kvpress = "DuoAttentionPress"

    def __post_init__(self):
        if self.config is not None and not isinstance(self.config, (str, dict)):
            raise AttnkitError(f"config must be a duo config file (from `attnkit calibrate duo`) or a dict, got "
                               f"{type(self.config).__name__}")
        one_of_two("config", self.config, "pattern", self.pattern)
        one_of_two("retrieval_ratio", self.retrieval_ratio, "threshold", self.threshold)
        if self.retrieval_ratio is not None:
            fraction("retrieval_ratio", self.retrieval_ratio, allow_zero=True,
                     what=" (the fraction of the model's kv heads kept as retrieval heads)")
        if self.threshold is not None:
            fraction("threshold", self.threshold, allow_zero=True, what=" (retrieval heads: gate >= threshold)")
        for key in ("sinks", "recent"):
            if getattr(self, key) is not None:
                whole(key, getattr(self, key), 0, what=" (tokens)")
        choice("prefill", self.prefill, PREFILL)
        config = None if self.config is None else load_duo_config(self.config)
        if self.pattern is not None:
            if not isinstance(self.pattern, str):
                raise AttnkitError(f"pattern must be a string like RS/SR, got {self.pattern!r}")
            if self.retrieval_ratio is not None or self.threshold is not None:
                raise AttnkitError("pattern names every head; give retrieval_ratio or threshold only with a config")
            choice_ = parse_pattern(self.pattern)
        elif config is not None:
            choice_ = config.retrieval if self.retrieval_ratio is None and self.threshold is None else \
                select_heads(config.alpha, self.retrieval_ratio, self.threshold)
        elif self.retrieval_ratio in (0, 1):
            choice_ = bool(self.retrieval_ratio)  # every kv head of every layer
        else:
            given = f"retrieval_ratio={self.retrieval_ratio}" if self.retrieval_ratio is not None else \
                f"threshold={self.threshold}" if self.threshold is not None else "nothing"
            raise AttnkitError(f"duo_attention needs its retrieval heads: config=FILE (from `attnkit calibrate duo`), "
                               f"pattern=RS/SR, or retrieval_ratio=0 or 1 for all streaming / all retrieval heads; "
                               f"got {given} (a ratio between 0 and 1 ranks the gates of a config)")
        defaults = (DEFAULT_SINKS, DEFAULT_RECENT) if config is None else (
            config.sinks if config.sinks is not None else DEFAULT_SINKS,
            config.recent if config.recent is not None else DEFAULT_RECENT)
        object.__setattr__(self, "_config", config)  # derived
        object.__setattr__(self, "_choice", choice_)
        object.__setattr__(self, "_sinks", defaults[0] if self.sinks is None else self.sinks)
        object.__setattr__(self, "_recent", defaults[1] if self.recent is None else self.recent)

    # ---- the choice per layer ------------------------------------------------------------------------------
    @property
    def slots_per_streaming_head(self) -> int:
        """``C = sinks + recent + 1``: what a streaming head holds while decoding, the incoming token included."""
        return self._sinks + self._recent + 1

    def retrieval_heads(self, layer: int, kv_heads: int) -> list[int]:
        """The retrieval kv heads of `layer` (every kv head, or none, for a ratio of 1 or 0 without a config)."""
        if isinstance(self._choice, bool):
            return list(range(kv_heads)) if self._choice else []
        return [h for h, r in enumerate(self._choice[layer]) if r]

    def _check(self, ctx: LayerContext, n_heads: int | None = None, n_kv: int | None = None) -> None:
        """Refuse a model whose geometry differs from the config's or the pattern's: the layers always, the heads
        once they are known (the first attention call of a generation)."""
        if isinstance(self._choice, bool):
            return
        n_layers = ctx.session.n_layers
        if self._config is not None:
            return self._config.check(n_layers, n_heads, n_kv)
        if len(self._choice) != n_layers or n_kv is not None and {len(x) for x in self._choice} != {n_kv}:
            raise AttnkitError(f"pattern={self.pattern!r} names {len(self._choice)} layers x "
                               f"{'/'.join(str(len(x)) for x in self._choice)} kv heads but the model has {n_layers} "
                               f"layers" + ("" if n_kv is None else f" x {n_kv} kv heads"))

    def retrieval_share(self, layer: int) -> float:
        """The fraction of `layer`'s kv heads that are retrieval heads."""
        if isinstance(self._choice, bool):
            return float(self._choice)
        return sum(self._choice[layer]) / len(self._choice[layer])

    def _plan(self, ctx: LayerContext, kv_heads: int | None = None) -> DuoState:
        """This layer's state, its heads split by kind once `kv_heads` is known (the first attention call)."""
        st = ctx.state
        if st.evicts is None:
            self._check(ctx)
            s = ctx.session
            st.evicts = self.retrieval_share(ctx.index) < 1 and \
                s.prompt_len + s.max_new_tokens > self.slots_per_streaming_head
        if st.retrieval is None and kv_heads is not None:
            if not ctx.session_state.checked:
                self._check(ctx, ctx.session_state.n_heads, kv_heads)
                ctx.session_state.checked = True
            st.retrieval = self.retrieval_heads(ctx.index, kv_heads)
            st.streaming = [h for h in range(kv_heads) if h not in st.retrieval]
        return st

    # ---- state and sizes -------------------------------------------------------------------------------------
    def new_layer_state(self) -> DuoState:
        return DuoState()

    def new_session_state(self) -> DuoRun:
        return DuoRun()

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        return (s.prompt_len if self._plan(ctx).evicts else s.prompt_len + s.max_new_tokens), False

    def planned_slots(self, ctx: LayerContext) -> int:
        """Entries of the layer once the prompt is processed, per kv head (rounded up): a retrieval head holds
        every token, a streaming head at most ``sinks + recent + 1``."""
        self._check(ctx)
        s = ctx.session
        total = s.prompt_len + s.max_new_tokens
        share = self.retrieval_share(ctx.index)
        return math.ceil(share * total + (1 - share) * min(total, self.slots_per_streaming_head))

    def decode_only_appends(self) -> bool:
        return False  # streaming heads overwrite their oldest entries; a flat layer takes one token per step

    # ---- hooks ---------------------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        ctx.session_state.n_heads = q.shape[1]
        st = self._plan(ctx, k.shape[1])
        if self.prefill == "full" or not st.evicts:
            return self._store_and_attend(ctx, q, k, v)
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, positions = ctx.kv.view()
        b, hq, n, d = q.shape
        kv = keys.shape[1]
        grouped = q.reshape(b, kv, hq // kv, n, d)
        out = torch.empty(b, kv, hq // kv, n, values.shape[-1], dtype=values.dtype, device=q.device)
        for heads, fn in ((st.retrieval, attend), (st.streaming, self._streaming_of)):
            if heads:
                part = fn(grouped[:, heads].reshape(b, -1, n, d), keys[:, heads], values[:, heads], ctx.scaling,
                          ctx.q_pos, positions[0, 0], ctx.native_window)
                out[:, heads] = part.view(b, len(heads), hq // kv, n, -1)
        return out.view(b, hq, n, -1)

    def _streaming_of(self, q, keys, values, scaling, q_pos, k_pos, window):
        return streaming_attention(q, keys, values, scaling, q_pos, k_pos, self._sinks, self._recent, window)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        st = self._plan(ctx, k.shape[1])
        if not st.evicts:
            return
        kv, s = ctx.kv, ctx.session
        n, kv_heads, rows = kv.length, kv.keys.shape[1], kv.keys.shape[0]
        pos = kv.positions[0, 0, :n]  # the prompt, in order: slot j holds position j
        kept = torch.nonzero((pos < self._sinks) | (pos >= s.prompt_len - self._recent)).flatten()
        every = torch.arange(n, device=pos.device)
        parts = [every if h in st.retrieval else kept for h in range(kv_heads)]
        heads = torch.cat([torch.full_like(p, h) for h, p in enumerate(parts)])
        total = s.prompt_len + s.max_new_tokens
        room = len(st.retrieval) * s.max_new_tokens + len(st.streaming) * (
            min(total, self.slots_per_streaming_head) - kept.shape[0])
        kv.keep_flat(heads.expand(rows, -1), torch.cat(parts).expand(rows, -1), room=room)
        st.held = kept.shape[0]

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        st = self._plan(ctx, k.shape[1])
        if not st.evicts:
            return self._store_and_attend(ctx, q, k, v)
        if q.shape[2] != 1:
            raise AttnkitError(f"duo_attention decodes one token per step, got {q.shape[2]} at once")
        kv = ctx.kv
        if st.held < self.slots_per_streaming_head:  # the streaming heads still have room: every head appends
            kv.append_flat(k, v, ctx.q_pos)
            st.held += 1
        else:
            if st.ring is None:
                st.ring = self._window_ring(kv, st.streaming)
            slots = st.ring[:, st.evictions % st.ring.shape[1]]
            st.evictions += 1
            if st.retrieval:
                kv.append_flat(k, v, ctx.q_pos, heads=st.retrieval)
            kv.write_flat(slots, k, v, ctx.q_pos, heads=st.streaming)
        keys, values, positions = kv.view()
        allowed = None
        if ctx.native_window is not None:
            allowed = masks.boolean_mask(masks.sliding_window(ctx.native_window), ctx.q_pos, positions)
        return flat_attention(q, keys, values, kv.extras["head"][:, :, :kv.length], k.shape[1], ctx.scaling, allowed)

    def _window_ring(self, kv, streaming: list[int]) -> torch.Tensor:
        """``[streaming heads, recent + 1]``: the flat slots of each streaming head's window entries (position
        >= sinks), oldest first. Each new token overwrites the oldest, which then becomes the newest, so the
        victims walk these slots in turn. Every row has the same layout, row 0 is read."""
        owner, pos = kv.extras["head"][0, 0, :kv.length], kv.positions[0, 0, :kv.length]
        ring = []
        for h in streaming:
            slots = torch.nonzero((owner == h) & (pos >= self._sinks)).flatten()
            ring.append(slots[pos[slots].argsort()])
        return torch.stack(ring)
