"""Shared machinery of the KV-cache eviction methods: budgets, chunked attention statistics, selection,
counter-based noise, and the common prefill/decode flow (:class:`EvictionMethod`).

The four eviction methods (``streaming``, ``h2o``, ``keyformer``, ``snapkv``) differ only in which
entries they rank high and which they never evict; the flow is the same:

**Budget.** ``budget`` (a fraction of the prompt, ``0 < f <= 1``) or ``budget_tokens`` (a count),
optionally one per layer (a list; ``"512/256"`` on the command line), resolves to ``B`` slots per layer
and kv head. ``B`` is the most entries a layer ever holds while decoding, the incoming token included:
a decode query attends to at most ``B`` keys and the cache allocates exactly ``B`` slots, so
``B`` x bytes-per-token is the real memory. (H2O and Keyformer count their cache ``k`` before the
incoming token is appended, so their ``k`` is ``B - 1``; StreamingLLM's cache size is ``B``. SnapKV
compresses only the prompt: ``B`` is the prompt's share and generated tokens come on top.)

**Prefill.** The prompt (in chunks if the runner chunks it) is attended in full and stored; a scoring
method accumulates its statistics chunk by chunk (:func:`attention_statistics`, never more than
:data:`SCORE_BLOCK_ELEMENTS` query x key entries at once, so no N x N matrix exists even for a
32k-token prompt). After the last chunk the layer keeps its ``B`` best entries per kv head
(:func:`keep_top`) and the larger tensors are released (:meth:`LayerKV.keep`).

**Decode.** When the layer is full, the lowest-ranked entry per kv head that is not protected (the
recent window, attention sinks) is evicted (:func:`lowest`) and the incoming token is written into its
slot in place (:meth:`LayerKV.write_slots`): the kept entries stay where they are, contiguous in the
first ``length`` slots, and nothing is gathered or copied per step. Evicting at the start of a step
with the statistics of the steps before it is the same rule as the papers' "attend, then drop one":
the candidates and statistics are identical, the victim just leaves one step later.

**GQA.** The cache holds kv heads only; statistics of the query heads of a group are reduced per query
(``gqa_reduce``: mean or max over the group) before they are accumulated, so a choice is per kv head
and does not depend on how queries were chunked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.base import LayerContext, Method

# Largest number of (query head x query x key) entries one block of the score computation holds, by
# device type. Each entry costs a few 4-byte temporaries (logits, weights; hashed noise). Small blocks
# stay in the CPU's caches (1M entries measured fastest on a 2-core CPU); a GPU wants fewer, larger ones.
SCORE_BLOCK_ELEMENTS = {"cpu": 1 << 20, "default": 1 << 24}

GQA_REDUCTIONS = ("mean", "max")


# ---- parameter checks ------------------------------------------------------------------------------
def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_budget(method: str, budget, budget_tokens) -> None:
    """Validate ``budget`` (fraction(s) of the prompt) / ``budget_tokens`` (count(s)): exactly one given."""
    if budget is not None and budget_tokens is not None:
        raise ValueError(f"give budget (a fraction of the prompt) or budget_tokens (a token count), not both; "
                         f"got budget={budget!r} and budget_tokens={budget_tokens!r}")
    if budget is None and budget_tokens is None:
        raise ValueError(f"{method} needs a cache budget: budget=<fraction of the prompt, 0 < f <= 1> or "
                         f"budget_tokens=<tokens per layer>")
    if budget is not None:
        for f in (budget if isinstance(budget, (list, tuple)) else [budget]):
            if not _is_number(f) or not 0 < f <= 1:
                raise ValueError(f"budget must be a fraction of the prompt with 0 < budget <= 1, got {f!r} "
                                 f"(use budget_tokens for a token count)")
        if isinstance(budget, (list, tuple)) and not budget:
            raise ValueError("budget is an empty list; give one fraction per layer")
    if budget_tokens is not None:
        for t in (budget_tokens if isinstance(budget_tokens, (list, tuple)) else [budget_tokens]):
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise ValueError(f"budget_tokens must be a positive whole number of tokens, got {t!r}")
        if isinstance(budget_tokens, (list, tuple)) and not budget_tokens:
            raise ValueError("budget_tokens is an empty list; give one count per layer")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_recent(recent, recent_tokens, budget_tokens) -> None:
    """``recent`` is a fraction of the budget, ``recent_tokens`` a count; at most one, and smaller than the budget."""
    if recent is not None and recent_tokens is not None:
        raise ValueError(f"give recent (a fraction of the budget) or recent_tokens (a count), not both; "
                         f"got recent={recent!r} and recent_tokens={recent_tokens!r}")
    if recent is not None and (not _is_number(recent) or not 0 <= recent <= 1):
        raise ValueError(f"recent is the recent window as a fraction of the budget (0 <= recent <= 1); a recent "
                         f"window larger than the budget is impossible; got recent={recent!r}")
    if recent_tokens is not None:
        if not isinstance(recent_tokens, int) or isinstance(recent_tokens, bool) or recent_tokens < 0:
            raise ValueError(f"recent_tokens must be a whole number >= 0, got {recent_tokens!r}")
        smallest = min(budget_tokens) if isinstance(budget_tokens, (list, tuple)) else budget_tokens
        if smallest is not None and recent_tokens >= smallest:
            raise ValueError(f"recent window larger than the budget: recent_tokens={recent_tokens} must be smaller "
                             f"than budget_tokens={budget_tokens!r} (one slot is the incoming token's)")


def resolve_budget(budget, budget_tokens, layer: int, n_layers: int, prompt_len: int) -> int:
    """Slots per kv head for `layer`: a fraction of the prompt (rounded, at least 1) or a count."""
    spec = budget if budget is not None else budget_tokens
    if isinstance(spec, (list, tuple)):
        if len(spec) != n_layers:
            which = "budget" if budget is not None else "budget_tokens"
            raise AttnkitError(f"{which} lists {len(spec)} values but the model has {n_layers} layers; "
                               f"give one per layer or a single value")
        spec = spec[layer]
    if budget is not None:
        return max(1, int(math.floor(spec * prompt_len + 0.5)))
    return int(spec)


def recent_window(recent, recent_tokens, default: float, budget: int, layer: int) -> int:
    """Tokens of the recent window (never evicted), at most ``budget - 1``."""
    if recent_tokens is not None:
        if recent_tokens >= budget:
            raise AttnkitError(f"recent window larger than the budget: recent_tokens={recent_tokens} but layer "
                               f"{layer} holds {budget} slots (the window must leave room for the incoming token)")
        return recent_tokens
    frac = default if recent is None else recent
    return min(int(math.floor(frac * budget)), budget - 1)


# ---- statistics ------------------------------------------------------------------------------------
def reduce_heads(x: torch.Tensor, how: str, dim: int = 2) -> torch.Tensor:
    """Reduce the query heads of each kv group (axis `dim`) to the kv head: mean or max."""
    return x.mean(dim) if how == "mean" else x.amax(dim)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and optional window) visibility by original positions, shaped to broadcast against
    logits ``[b, kv, g, c, l]``: ``k_pos`` 1-D -> ``[c, l]``; per head ``[b, kv, l]`` -> ``[b, kv, 1, c, l]``."""
    if k_pos.dim() == 1:
        diff = q_pos[:, None] - k_pos[None, :]
    else:
        diff = q_pos[None, None, None, :, None] - k_pos[:, :, None, None, :]
    ok = diff >= 0
    if window is not None:
        ok &= diff < window
    return ok


def softmax_weights(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The ordinary attention probabilities (eq. 1 of Keyformer; H2O's accumulated attention)."""
    return torch.softmax(logits, dim=-1)


def attention_statistics(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                         k_pos: torch.Tensor, *, reduce: str = "mean",
                         weights: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                         window: int | None = None, block_elements: int | None = None) -> torch.Tensor:
    """Attention each key receives, summed over the queries: ``[b, kv_heads, keys]`` (float32).

    For every query ``i`` (at ``q_pos[i]``) the per-key weights are ``weights(logits, q_pos, k_pos)`` of
    the scaled logits ``q_i . k_j * scaling`` (a fresh ``[b, kv, g, queries, keys]`` float32 tensor the
    function may overwrite; keys at later positions, or outside `window`, are ``-inf``); the default
    is the softmax, i.e. the attention probabilities. The query heads of a kv
    group are reduced per query with `reduce` (mean/max), then summed over queries. Queries are taken
    in blocks of at most `block_elements` (query head x query x key) entries, and with 1-D ascending
    `k_pos` a block only reads the keys it can see, so neither memory nor time is quadratic in a
    single allocation. `k_pos` is ``[keys]`` (ascending) or per kv head ``[b, kv_heads, keys]``.
    """
    b, hq, n, d = q.shape
    kv, n_keys = keys.shape[1], keys.shape[2]
    if hq % kv:
        raise ValueError(f"{hq} query heads are not a multiple of {kv} kv heads")
    g = hq // kv
    weights = weights or softmax_weights
    out = torch.zeros(b, kv, n_keys, dtype=torch.float32, device=q.device)
    if block_elements is None:
        block_elements = SCORE_BLOCK_ELEMENTS.get(q.device.type, SCORE_BLOCK_ELEMENTS["default"])
    block = max(1, block_elements // max(1, b * hq * n_keys))
    grouped = q.reshape(b, kv, g, n, d)
    shared = k_pos.dim() == 1
    for s in range(0, n, block):
        e = min(n, s + block)
        qp = q_pos[s:e]
        if shared:  # keys ascending: this block sees keys [:lim], and only keys [first_hidden:] hide from some query
            bounds = torch.searchsorted(k_pos, qp[[0, -1]], right=True).tolist()
            first_hidden, lim = bounds
            if lim == 0:
                continue
            kp = k_pos[:lim]
        else:
            first_hidden, lim, kp = 0, n_keys, k_pos
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
        logits = torch.matmul(qb, keys[:, :, :lim].transpose(-1, -2)).float().mul_(scaling)
        logits = logits.view(b, kv, g, e - s, lim)
        if window is not None:
            logits.masked_fill_(~_visible(qp, kp, window), float("-inf"))
        elif first_hidden < lim:
            tail = kp[first_hidden:] if shared else kp[:, :, first_hidden:]
            logits[..., first_hidden:].masked_fill_(~_visible(qp, tail, None), float("-inf"))
        w = weights(logits, qp, kp)
        if reduce == "mean":
            out[:, :, :lim] += w.sum(dim=(2, 3)).div_(g)
        else:
            out[:, :, :lim] += w.amax(dim=2).sum(dim=2)
    return out


def attend_with_logits(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                       visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of decode queries that also returns what a scoring method needs.

    q ``[b, hq, n, d]`` (n small), keys/values ``[b, kv, L, d]`` (never expanded to the query heads),
    `visible` a boolean mask broadcastable to ``[b, kv, g, n, L]`` or None. Returns the output
    ``[b, hq, n, d]``, the float32 logits and the probabilities, both ``[b, kv, g, n, L]``.
    """
    b, hq, n, d = q.shape
    kv, n_keys = keys.shape[1], keys.shape[2]
    g = hq // kv
    qg = q.reshape(b, kv, g * n, d)
    logits = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scaling).view(b, kv, g, n, n_keys)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.view(b, kv, g * n, n_keys).to(values.dtype), values)
    return out.view(b, hq, n, d), logits, probs


# ---- selection -------------------------------------------------------------------------------------
def keep_top(rank: torch.Tensor, protect: torch.Tensor | None, count: int) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) of the protected entries plus the highest-ranked others,
    chosen per kv head. `rank` ``[b, kv, L]``: higher is kept first."""
    r = rank.float()
    if protect is not None:
        r = r.masked_fill(protect, float("inf"))
    return r.topk(count, dim=-1).indices.sort(dim=-1).values


def lowest(rank: torch.Tensor, protect: torch.Tensor | None) -> torch.Tensor:
    """Slot ``[b, kv, 1]`` of the lowest-ranked unprotected entry per kv head (the one to evict)."""
    r = rank.float()
    if protect is not None:
        r = r.masked_fill(protect, float("inf"))
    return r.argmin(dim=-1, keepdim=True)


def avg_or_max_pool(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Pool ``[..., L]`` along the last axis with an odd `kernel`, stride 1, same length (SnapKV's
    clustering). At the edges average pooling divides by the full kernel, the zero padding counted, as the
    SnapKV authors' code does (``avg_pool1d`` defaults); a side-by-side run with kvpress
    (scripts/compare_kvpress.py) keeps the same positions only with this convention."""
    if kernel <= 1:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if how == "max":
        pooled = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        pooled = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(shape)


# ---- counter-based noise ---------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer mixing function (the MurmurHash3 finaliser) on Python ints or int64 tensors
    holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _signed32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


_M1, _M2 = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35)


def _to_i32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensor of values in [0, 2**32) -> int32 with the same bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _stream_base(seed: int, stream: int, second: bool) -> int:
    base = _mix32(_mix32((seed * 0x9E3779B1 + 0x632BE5AB) & _MASK32) ^ ((stream * 0x85EBCA77 + 0x27D4EB2F) & _MASK32))
    return _mix32(base ^ 0x5BD1E995) if second else base


def head_hashes(seed: int, stream: int, heads: torch.Tensor, second: bool = False) -> torch.Tensor:
    """The (seed, stream, head) part of :func:`counter_uniforms`'s row hash (int64, values < 2**32)."""
    return _mix32(heads.to(torch.int64) ^ _stream_base(seed, stream, second))


def row_hashes(heads_hashed: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """The row hash of :func:`counter_uniforms`: :func:`head_hashes` with the query position mixed in (int32)."""
    return _to_i32(_mix32(heads_hashed ^ q_pos.to(torch.int64)))


def row_hash_ints(heads_hashed: list[int], q: int) -> list[int]:
    """:func:`row_hashes` on Python ints for one query position (the int32 values, signed): cheaper than
    tensor operations for the few heads of a decode step."""
    return [_signed32(_mix32(h ^ q)) for h in heads_hashed]


def key_hashes(k_pos: torch.Tensor) -> torch.Tensor:
    """The column hash of :func:`counter_uniforms`, one per key position (int32)."""
    return _to_i32(_mix32(k_pos.to(torch.int64) ^ 0x27220A95))


def uniforms_from_hashes(rows: torch.Tensor, keys: torch.Tensor,
                         buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Uniforms on (0, 1) from int32 :func:`row_hashes` and :func:`key_hashes`, broadcast together.

    Both hashes are already fully mixed, so their combination gets one multiply-xorshift-multiply round
    (enough to decorrelate rows that share keys; half the work of a full :func:`_mix32` at full size).
    `buffers`: two int32 tensors of the broadcast shape to compute in (the result is a float32 view of
    the second) instead of fresh ones."""
    x, scratch = buffers if buffers is not None else (None, None)
    x = torch.bitwise_xor(rows, keys, out=x).mul_(_M1)
    t = torch.bitwise_right_shift(x, 16, out=scratch)
    t &= 0xFFFF
    x ^= t
    x.mul_(_M2)
    # the top 23 bits as the mantissa of a float in [1, 2), shifted to (m + 1/2) / 2**23 in (0, 1) (exact)
    x = torch.bitwise_right_shift(x, 9, out=scratch)
    x &= 0x7FFFFF
    x |= 0x3F800000
    return x.view(torch.float32).sub_(1.0 - 2.0 ** -24)


def counter_uniforms(seed: int, stream: int, heads: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, second: bool = False) -> torch.Tensor:
    """Uniform draws on (0, 1) indexed by (seed, stream, head, query position, key position), broadcast
    together (float32).

    Each draw is a hash of its coordinates, so the noise a (query, key) pair of a head gets does not
    depend on chunking, on which slot the key occupies, on the device or on the order of computation.
    The (head, query) and key coordinates are mixed separately on the small tensors (:func:`row_hashes`,
    :func:`key_hashes`, which a caller may also compute once and reuse); only their combination is mixed
    at full size (:func:`uniforms_from_hashes`).
    """
    return uniforms_from_hashes(row_hashes(head_hashes(seed, stream, heads, second), q_pos), key_hashes(k_pos))


# ---- the common flow -------------------------------------------------------------------------------
@dataclass
class EvictionMethod(Method):
    """Base of the eviction methods (see the module docstring). Subclasses say how entries rank
    (:meth:`rank`), which are never evicted (:meth:`protect`) and what statistics they gather."""

    budget: float | list[float] | None = None
    budget_tokens: int | list[int] | None = None

    name = "eviction-base"

    def __post_init__(self):
        check_budget(self.name, self.budget, self.budget_tokens)

    # ---- sizes -------------------------------------------------------------------------------------
    def layer_budget(self, ctx: LayerContext) -> int:
        """``B``: slots per kv head of this layer while decoding (resolved once per generation)."""
        st = ctx.state
        if "budget" not in st:
            s = ctx.session
            st["budget"] = resolve_budget(self.budget, self.budget_tokens, ctx.index, s.n_layers, s.prompt_len)
            self.check_layer(ctx, st["budget"])
        return st["budget"]

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        """Raise AttnkitError when this layer's resolved budget does not fit the method's other parameters."""

    def prefill_keep(self, ctx: LayerContext) -> int:
        """Entries per kv head kept when the prompt is compressed."""
        return self.layer_budget(ctx)

    def decode_limit(self, ctx: LayerContext) -> int | None:
        """Most entries per kv head while decoding (the incoming one included); None: no limit."""
        return self.layer_budget(ctx)

    def evicts(self, ctx: LayerContext) -> bool:
        """Whether this layer can ever drop an entry in this generation (otherwise it behaves as `full`)."""
        if "evicts" not in ctx.state:
            s = ctx.session
            n, total = s.prompt_len, s.prompt_len + s.max_new_tokens
            limit = self.decode_limit(ctx)
            ctx.state["evicts"] = self.prefill_keep(ctx) < n or (limit is not None and limit < total)
        return ctx.state["evicts"]

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        n, total = s.prompt_len, s.prompt_len + s.max_new_tokens
        if not self.evicts(ctx):
            return total, False
        if n > self.prefill_keep(ctx):
            return n, False  # the whole prompt until after_prefill compresses it
        limit = self.decode_limit(ctx)
        return (total if limit is None else min(limit, total)), False

    def spare_after_prefill(self, ctx: LayerContext, kept: int) -> int:
        limit = self.decode_limit(ctx)
        return ctx.session.max_new_tokens if limit is None else max(0, limit - kept)

    # ---- what subclasses define --------------------------------------------------------------------
    def rank(self, ctx: LayerContext) -> torch.Tensor:
        """``[b, kv, length]``: how much each held entry deserves to stay (higher = kept)."""
        raise NotImplementedError

    def protect(self, ctx: LayerContext, next_pos: torch.Tensor | int) -> torch.Tensor | None:
        """``[b, kv, length]`` boolean: entries never evicted when the token at `next_pos` comes in."""
        return None

    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        """Gather statistics of a prompt chunk's queries (the chunk is already stored)."""

    def defer_prefill_eviction(self, ctx: LayerContext) -> bool:
        """True when the prompt must be compressed at the first decode step instead of after prefill."""
        return False

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        """Attention of the incoming token over the held entries (it is already stored)."""
        return self._attend_held(ctx, q)

    def before_write(self, ctx: LayerContext) -> None:
        """Hook at the start of every decode step, before the incoming token is stored."""

    def on_evict(self, ctx: LayerContext) -> None:
        """Hook called when this layer first drops entries."""

    # ---- the flow ----------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        out = self._store_and_attend(ctx, q, k, v)
        if self.evicts(ctx):
            self.observe_prefill(ctx, q)
        return out

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if not self.evicts(ctx) or self.defer_prefill_eviction(ctx):
            return
        keep = self.prefill_keep(ctx)
        if ctx.kv.length > keep:
            self.compact(ctx, keep, self.spare_after_prefill(ctx, keep), ctx.session.prompt_len)

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        """Keep `count` entries per kv head (protected first, then by rank) in fresh tensors."""
        ctx.kv.keep(keep_top(self.rank(ctx), self.protect(ctx, next_pos), count), spare=spare)
        self._mark_evicting(ctx)

    def _mark_evicting(self, ctx: LayerContext) -> None:
        if not ctx.state.get("evicting"):
            ctx.state["evicting"] = True
            self.on_evict(ctx)

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if q.shape[2] != 1 and not self.decode_only_appends():
            raise AttnkitError(f"method {self.name!r} decodes one token per step, got {q.shape[2]} at once")
        kv = ctx.kv
        if self.evicts(ctx):
            self.before_write(ctx)
            limit = self.decode_limit(ctx)
            if limit is not None and kv.length > limit:  # a deferred prompt compression
                self.compact(ctx, limit - 1, 1, ctx.q_pos)
            if limit is not None and kv.length >= limit:
                victim = lowest(self.rank(ctx), self.protect(ctx, ctx.q_pos))
                kv.write_slots(victim, k, v, ctx.q_pos)
                self._mark_evicting(ctx)
            else:
                kv.append(k, v, ctx.q_pos)
        else:  # this layer never drops anything in this generation: exactly `full`
            return self._store_and_attend(ctx, q, k, v)
        return self.attend_decode(ctx, q)

    # ---- helpers for subclasses --------------------------------------------------------------------
    @staticmethod
    def score_buffer(ctx: LayerContext, name: str = "score") -> torch.Tensor:
        """A float32 per-slot statistic ``[b, kv, capacity]`` that moves with its entry (created on first use)."""
        kv = ctx.kv
        buf = kv.extras.get(name)
        if buf is None:
            buf = kv.extras[name] = torch.zeros(kv.keys.shape[:3], dtype=torch.float32, device=kv.keys.device)
        return buf

    @staticmethod
    def recent_mask(ctx: LayerContext, recent: int, next_pos) -> torch.Tensor | None:
        """Entries among the `recent` tokens right before `next_pos` (the recent window)."""
        if recent <= 0:
            return None
        positions = ctx.kv.view()[2]
        return positions >= (next_pos - recent)

    @staticmethod
    def window_visibility(ctx: LayerContext) -> torch.Tensor | None:
        """For a model with its own sliding window: which held keys the decode query may see."""
        if ctx.native_window is None:
            return None
        positions = ctx.kv.view()[2]
        return _visible(ctx.q_pos, positions, ctx.native_window)


@dataclass
class RecentWindowEviction(EvictionMethod):
    """Base of the methods that always keep a recent window (H2O, Keyformer): ``recent`` is the window
    as a fraction of the budget (default ``default_recent``), ``recent_tokens`` as a count; the query
    heads of a kv group are reduced with ``gqa_reduce``."""

    recent: float | None = None
    recent_tokens: int | None = None
    gqa_reduce: str = "mean"

    default_recent = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_recent(self.recent, self.recent_tokens, self.budget_tokens)
        check_choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        recent_window(self.recent, self.recent_tokens, self.default_recent, budget, ctx.index)

    def recent_tokens_for(self, ctx: LayerContext) -> int:
        """This layer's recent window in tokens, from the subclass's ``recent`` (a fraction of the budget,
        default ``default_recent``) or ``recent_tokens`` (resolved once per generation)."""
        if "recent" not in ctx.state:
            ctx.state["recent"] = recent_window(self.recent, self.recent_tokens, self.default_recent,
                                                self.layer_budget(ctx), ctx.index)
        return ctx.state["recent"]
