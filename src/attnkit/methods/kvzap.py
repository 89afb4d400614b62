"""``kvzap``: KVzip's scores predicted from each layer's hidden states, so no second forward (Jégou, Jeblick, 2026,
"KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891; kvpress's ``KVzapPress`` with
``DMSPress``).

**Why.** KVzip (:mod:`attnkit.methods.kvzip`; Kim et al. 2025, arXiv 2505.23416) scores each cached entry by the
most attention it receives while the model repeats the prompt, which needs a second forward over the whole prompt
after the first, and exists only for the prompt. The paper observes that this score is largely predictable from
the token's own hidden state at the layer, and trains a small surrogate per layer (a linear map or a two-layer
MLP, :mod:`attnkit.methods.kvzap_predictor`) to regress the log score; at inference the surrogate scores every
entry as it enters the cache, at prefill and while decoding, for the cost of one small matrix product per token.

**Score.** For layer ``l``, kv head ``h`` and a token whose attention input (the hidden state after the layer's
input norm, handed over by the host: :meth:`attnkit.session.LayerContext.layer_input`) is ``x``::

    s_hat[l, h] = f_l(x)[h]    ~  log S[l, h]   (S: kvzip's score of the token's entry)

``f_l`` is trained by ``attnkit calibrate kvzap`` (:mod:`attnkit.calibrate.kvzap`) on attnkit's mixture of text or
the user's own; kvpress's published ``KVzapModel`` folders load too (:mod:`attnkit.methods.kvzap_predictor`). The
paper's target is the log of its KVzip+ score (the attention scaled by ``||W_O v|| / ||h||``); attnkit's is the log
of attnkit's ``kvzip`` score, so that ``kvzap`` approximates the method it replaces here.

**Which entries stay.** Two ways, as in the paper:

- ``threshold=T`` (the paper's rule, kvpress's ``DMSPress``): an entry whose predicted score is below ``T`` is
  dropped once it is older than the ``window`` most recent tokens (default 128, the paper's sliding window); after
  the prompt every layer keeps, per kv head, its entries scoring at least ``T`` and the last ``window`` positions,
  so heads, layers and prompts keep different counts (the layer is stored flat:
  :meth:`attnkit.cache.LayerKV.keep_flat`), and each decode step drops the entry leaving the window if it scores
  below ``T``; the incoming token reuses a dropped entry's slot. ``run_stats`` reports the share of entries kept
  (``kvzap_kept_fraction``). ``threshold=-inf`` drops nothing (exactly ``full``). Sequences are scored alone (one
  session each: their counts differ).
- ``budget``/``budget_tokens`` (as every prompt scorer, :mod:`attnkit.methods.prompt_scorer`): each kv head keeps
  the last ``window`` prompt positions and its best-scored entries up to ``B`` (``head_budgets=adaptive``: the
  layer's ``kv x B`` best across its heads); ``decode_every=N`` re-compresses to ``B`` every ``N`` generated tokens,
  the generated tokens scored as they come. A ``window`` that fills a layer's budget is refused.

At a budget that holds everything, or ``threshold=-inf``, nothing is scored into a decision and the tokens and
logits are ``full``'s. The prompt's attention is plain dense attention (SDPA), so prefill costs ``full``'s plus
the surrogate. ``config`` is the surrogate's file; a file trained for a model of another geometry or with other
weights is refused in one line. The hosts that hand over the layers' inputs are attnkit's runner,
``AttnkitCache`` and vLLM's (:mod:`attnkit.vllm.inputs`: budget mode only, since a threshold's kept count depends on
the scores and vLLM's blocks need a plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.kvzap_predictor import load_predictor
from attnkit.methods.prompt_scorer import ALPHA_SAFEGUARD, PromptScorer, PromptScorerState
from attnkit.methods.spec import register
from attnkit.methods.threshold import decode_room, decode_step, keep_above, threshold_evicts
from attnkit.session import LayerContext
from attnkit.validate import number, whole

DEFAULT_WINDOW = 128  # the paper's sliding window (kvpress's DMSPress sliding_window_size)


@dataclass
class KVzapState(PromptScorerState):
    """Per layer: whether the surrogate was checked against this layer (geometry and weights)."""

    checked: bool = False


@register
@dataclass(frozen=True)
class KVzap(PromptScorer):
    """Entries scored by a trained per-layer surrogate of kvzip's score; dropped below a threshold or kept to a
    budget, with a recent window."""

    config: str | None = None
    threshold: float | None = None
    window: int = DEFAULT_WINDOW

    name = "kvzap"
    summary = "kvzip's scores predicted from hidden states, threshold or budget (KVzap, Jégou & Jeblick 2026)"
    kvpress = "KVzapPress"
    layer_state_type = KVzapState
    needs_layer_inputs = True
    size_params = ("threshold",)  # sizes the cache instead of a budget: a sweep's budget does not apply to it

    def __post_init__(self):
        if not isinstance(self.config, str) or not self.config:
            raise AttnkitError(f"kvzap needs config=FILE, a surrogate trained for the model with `attnkit calibrate "
                               f"kvzap --model M --out FILE`; got config={self.config!r}")
        whole("window", self.window, 0, what=" (recent tokens never dropped)")
        if self.threshold is None:
            if self.budget is None and self.budget_tokens is None:
                raise AttnkitError("kvzap needs threshold=T (log-score units: entries below T are dropped) or a "
                                   "budget: budget=<fraction of the prompt> or budget_tokens=<tokens per layer>")
            super().__post_init__()
        else:
            number("threshold", self.threshold, None, None, what=" (a predicted log score; -inf drops nothing)")
            budget_only = {"budget": (self.budget, None), "budget_tokens": (self.budget_tokens, None),
                           "decode_every": (self.decode_every, 0), "head_budgets": (self.head_budgets, "uniform"),
                           "layer_budgets": (self.layer_budgets, "uniform"),
                           "alpha_safeguard": (self.alpha_safeguard, ALPHA_SAFEGUARD),
                           "chunk_length": (self.chunk_length, 0), "merge": (self.merge, False)}
            for key, (value, default) in budget_only.items():
                if value != default:
                    raise AttnkitError(f"kvzap: {key}={value!r} applies to a budget; with threshold={self.threshold} "
                                       f"the entries below it leave as they age out of the window (give one of them)")
        object.__setattr__(self, "_predictor", load_predictor(self.config))

    @property
    def batches(self) -> bool:
        return self.threshold is None  # a threshold keeps a count of its own per sequence

    # ---- sizes ---------------------------------------------------------------------------------------
    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        evicts = budget < s.prompt_len or (self.decode_every and budget + self.decode_every < s.prompt_len
                                           + s.max_new_tokens)
        if evicts and self.window >= budget:
            raise AttnkitError(f"kvzap: window={self.window} recent tokens fill the {budget}-slot budget of layer "
                               f"{ctx.index}; lower window (window=0 keeps no recent window) or raise the budget")

    def evicts(self, ctx: LayerContext) -> bool:
        if self.threshold is None:
            return super().evicts(ctx)
        return threshold_evicts(ctx, self.threshold, self.window, decode=True)

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        if self.threshold is None or not self.evicts(ctx):
            return super().layer_capacity(ctx)
        return ctx.session.prompt_len, False  # the prompt, then a flat layer of what stays

    def planned_slots(self, ctx: LayerContext) -> int:
        if self.threshold is None:
            return super().planned_slots(ctx)
        return ctx.session.prompt_len + ctx.session.max_new_tokens  # at most: a threshold may keep everything

    def decode_only_appends(self) -> bool:
        return self.threshold is None and super().decode_only_appends()

    # ---- scores --------------------------------------------------------------------------------------
    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return self.score_buffer(ctx)[:, :, :ctx.kv.length]

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return self.recent_mask(ctx, self.window, next_pos)

    def predicted(self, ctx: LayerContext, n: int) -> torch.Tensor:
        """The surrogate's log scores ``[b, kv, n]`` of the step's `n` tokens in this layer."""
        hidden = ctx.layer_input()
        if hidden.shape[1] != n:
            raise AttnkitError(f"kvzap: layer {ctx.index}'s input holds {hidden.shape[1]} tokens but its attention "
                               f"{n}")
        scores = self._predictor.scores(ctx.index, hidden)  # every kv head of the model
        if ctx.session.shard is None:
            return scores
        return scores[:, ctx.session.held_heads(ctx.kv.keys.shape[1], kv=True)]  # a shard's own kv heads

    def check_model(self, n_layers: int, hidden_size: int, kv_heads: int, layers: list | None = None) -> None:
        """Refuse, in one line, a model of another geometry than the surrogate's or, where `layers` are given (each
        layer's attention module, or an object with ``key_fingerprint()``), with other key projections: for a host
        that checks before it runs the model (vLLM's, when it takes a request)."""
        self._predictor.check_model(n_layers, hidden_size, kv_heads)
        for index, module in enumerate(layers or []):
            self._predictor.check_layer(index, module)

    def _check(self, ctx: LayerContext, k: torch.Tensor) -> None:
        """Refuse a surrogate trained for another model, once per layer and generation."""
        if not ctx.state.checked:
            kv_heads = ctx.session.model_heads(None, k.shape[1])[1]
            self._predictor.check_model(ctx.session.n_layers, ctx.layer_input().shape[-1], kv_heads)
            self._predictor.check_layer(ctx.index, ctx.layer_module())
            ctx.state.checked = True

    # ---- hooks ---------------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        self._check(ctx, k)
        out = super().prefill_attention(ctx, q, k, v)  # stored whole, dense attention
        if self.evicts(ctx):
            end = ctx.kv.length
            self.score_buffer(ctx)[:, :, end - k.shape[2]:end] = self.predicted(ctx, k.shape[2])
        return out

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        if self.threshold is None:
            return super().after_prefill(ctx, q, k, v)
        if not self.evicts(ctx):
            return
        keep_above(ctx, self.rank(ctx), self.threshold, self.window, decode_room(ctx, self.window, decode=True))
        self._mark_evicting(ctx)

    def after_write(self, ctx: LayerContext, slot) -> None:
        if self.decode_every:  # budget mode re-compressing while decoding: the new token needs its score
            score = self.predicted(ctx, 1)
            buf = self.score_buffer(ctx)
            if isinstance(slot, int):
                buf[:, :, slot] = score[:, :, 0]
            else:
                buf.scatter_(2, slot, score)

    def skip_appends(self, ctx: LayerContext, k, v, q, positions: torch.Tensor) -> None:
        """The appended entries scored from their tokens' layer inputs, as :meth:`after_write` scores one."""
        first = ctx.kv.length
        super().skip_appends(ctx, k, v, q, positions)
        self.score_buffer(ctx)[:, :, first:ctx.kv.length] = self.predicted(ctx, positions.shape[0])

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        if self.threshold is None or not self.evicts(ctx):
            return super().decode_attention(ctx, q, k, v)
        if q.shape[2] != 1:
            raise AttnkitError(f"kvzap with a threshold decodes one token per step, got {q.shape[2]} at once")
        # the same delayed eviction as every prompt scorer's score_threshold (attnkit.methods.threshold)
        return decode_step(ctx, q, k, v, self.predicted(ctx, 1)[:, :, 0], self.threshold, self.window)

    def run_stats(self, session) -> dict:
        held = seen = 0
        for layer in session.cache.layers:
            if layer is None or layer.length == 0:
                continue
            positions = layer.positions[:, :, :layer.length]
            alive = layer.extras["head"][:, :, :layer.length] >= 0 if "head" in layer.extras else positions >= 0
            held += int(alive.sum())
            seen += positions.shape[0] * self._predictor.kv_heads * (int(positions.max()) + 1)
        return {"kvzap_kept_fraction": held / seen} if seen else {}
