"""``select``: Select-Attention, a filter layer picks the tokens the later layers see (section 4.2 of
Taniguchi, Xiao, Dong, Oyamada and Onizuka (谷口 令, 肖 川, 董 于洋, 小山田 昌史, 鬼塚 真), "Attention
スコアの分布類似性を用いた大規模言語モデルの動作効率化および省メモリ化"; "the paper" below).

The paper (section 3.2, Fig. 3) finds that the head-mean attention of a middle layer already marks the tokens
the later layers attend to, and (Fig. 4) that which tokens matter changes at every step. Select-Attention
(section 4.2, Fig. 5) therefore picks tokens afresh at every generated token:

- layers ``0 .. L`` (``filter_layer``) run as usual with a KV cache (eq. 6-8);
- at layer ``L``, the attention of the current (last) query, averaged over the heads, optionally weighted by
  the values' norms (``value_weighted``; the paper's ref. [6]: Guo, Kamigaito and Watanabe, "Attention
  Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also Matters",
  EMNLP 2024; also used for the paper's Fig. 3), ranks the tokens; the smallest set whose mass reaches ``p``
  is kept (top-p instead of GemFilter's top-k, section 4.2);
- layers ``L+1 ..`` see only the kept tokens plus the current one, at their ORIGINAL positions (RoPE is
  applied at those positions), causally among themselves. Their outputs change with the selection at every
  step, so they keep **no KV cache** (section 4.2: "後半レイヤはキャッシュを持たない"): what is kept instead is the
  output of layer ``L`` for every token (one hidden vector per token, ``session.cache.extra["select:hidden"]``),
  from which those layers recompute keys and values for the selected tokens at each step.

Memory per token is therefore ``2 (L + 1) kv_heads head_dim`` K/V elements plus ``hidden`` elements of stored
hidden states, instead of ``2 n_layers kv_heads head_dim``: both are counted in ``session.cache`` (the K/V
bytes of layers after ``L`` are zero; the hidden states are in :meth:`KVCache.extra_bytes`).

The prompt (Table 3 of the paper): with ``prefill_select=false`` (default; Table 3's "無", which keeps QA
accuracy) the later layers see the whole prompt, so the first token equals ``full``'s; with
``prefill_select=true`` the last prompt query's attention at layer ``L`` selects with ``p_prefill`` (faster
prefill, Fig. 9). ``p_decode`` is the decode-time ``p`` (Tables 2-3 sweep 0.99 .. 0.91). A chunked prefill
runs layers ``0 .. L`` chunk by chunk and the later layers once, on the selected prompt tokens, at the end.

``filter_layer`` defaults to ``n_layers // 2 - 1`` (layer 15 of Llama3's 32, the paper's choice;
``attnkit calibrate filter-layer`` sweeps it). With ``L`` = the last layer nothing is filtered (= ``full``);
with ``p = 1`` every token is kept and the output equals ``full``'s up to rounding.

Share-Attention composes with it (the paper's Fig. 8): ``share_config=FILE`` makes every layer (cached or not)
compute only its essential heads' softmax (:mod:`attnkit.methods.share`). Select-Attention cannot be put
inside ``compose`` (it runs the layers itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.attention import sdpa
from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers
from attnkit.methods.base import Method
from attnkit.methods.share import (
    LayerPlan,
    ShareConfig,
    ShareRun,
    attend_shared,
    essential_probabilities,
    layer_plan,
    shared_positions,
    shared_prefill_fused,
)
from attnkit.methods.spec import register
from attnkit.session import LayerContext, Step
from attnkit.validate import flag, is_number, whole

HIDDEN = "select:hidden"


def check_p(name: str, p) -> None:
    """A top-p mass: ``0 < p <= 1``."""
    if not is_number(p) or not 0 < p <= 1:
        raise AttnkitError(f"{name}={p!r} is outside the allowed range 0 < p <= 1 (top-p mass of the tokens kept)")


def check_filter_layer_param(layer) -> None:
    """The ``filter_layer`` parameter before a model is known: a layer index >= 0, or None (the middle)."""
    if layer is not None:
        whole("filter_layer", layer, 0, what=" (a layer index; none for the middle layer)")


def check_filter_layer(method: str, layer, n_layers: int) -> int:
    """`layer` (None = ``n_layers // 2 - 1``) checked against the model: an index in ``0 .. n_layers-1``."""
    if layer is None:
        return max(0, n_layers // 2 - 1)
    if not 0 <= layer < n_layers:
        raise AttnkitError(f"{method}: filter_layer={layer} is out of range; the model has {n_layers} layers, "
                           f"allowed 0..{n_layers - 1}")
    return layer


def top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Indices (ascending) of the smallest set of `scores` ``[n]`` whose sum reaches ``p`` of the total
    (section 4.2's top-p: highest first until the mass is at least p). ``p = 1`` keeps every index."""
    n = scores.shape[0]
    if p >= 1:
        return torch.arange(n, device=scores.device)
    values, order = torch.sort(scores.double(), descending=True)
    cum = values.cumsum(0)
    k = int(torch.searchsorted(cum, p * cum[-1])) + 1
    return order[:min(k, n)].sort().values


def head_mean_scores(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int | None, plan: LayerPlan | None,
                     value_weighted: bool) -> torch.Tensor:
    """Attention of the query `q` ``[b, hq, 1, d]`` to each key, averaged over the heads ``[keys]`` (float32);
    with `value_weighted` each head's probability is multiplied by the norm of its kv head's value (ref. [6]).
    Under a share `plan` only the essential heads compute the softmax (shared heads reuse it)."""
    hq, kv = q.shape[1], keys.shape[1]
    plan = plan or LayerPlan.identity(hq, kv)
    probs = essential_probabilities(q, keys, scaling, q_pos, k_pos, window, plan)
    per_head = probs[:, torch.tensor(plan.source, device=q.device), 0]  # [b, hq, keys]
    if value_weighted:
        norms = values.float().norm(dim=-1)  # [b, kv, keys]
        per_head = per_head * norms.repeat_interleave(hq // kv, dim=1)
    return per_head.mean(dim=(0, 1))


@dataclass
class SelectRun(ShareRun):
    """Select-Attention's state for one generation: the tokens the filter layer chose for the layers after
    it, and what the selections kept over the decode steps."""

    chosen: torch.Tensor | None = None
    steps: int = 0
    kept: int = 0
    context: int = 0


def kept_fraction(*stats: dict) -> float | None:
    """Kept tokens / context tokens over the decode steps of one or more generations, from their
    :meth:`Select.run_stats` (``method_stats``; a method that selects nothing adds none): None without any."""
    context = sum(st.get("selection_context", 0) for st in stats)
    return sum(st.get("selection_kept", 0) for st in stats) / context if context else None


@register
@dataclass(frozen=True)
class Select(Method):
    """Select-Attention (Taniguchi et al., section 4.2, Fig. 5; top-p of Tables 2-3; prefill on/off of Table 3):
    layers after ``filter_layer`` see only the top-p tokens of its head-mean attention and keep no KV cache."""

    filter_layer: int | None = None
    p_decode: float = 0.95
    p_prefill: float = 0.99
    prefill_select: bool = False
    value_weighted: bool = False
    share_config: str | dict | None = None

    name = "select"
    batches = False  # each sequence's later layers see its own chosen tokens: one session per sequence
    summary = "Select-Attention: top-p tokens of a filter layer feed cache-free later layers (Taniguchi et al.)"

    def __post_init__(self):
        check_filter_layer_param(self.filter_layer)
        check_p("p_decode", self.p_decode)
        check_p("p_prefill", self.p_prefill)
        flag("prefill_select", self.prefill_select)
        flag("value_weighted", self.value_weighted)
        # derived from `share_config` (the loaded file)
        object.__setattr__(self, "_share", None if self.share_config is None else ShareConfig.load(self.share_config))

    def layer_index(self, n_layers: int) -> int:
        return check_filter_layer(self.name, self.filter_layer, n_layers)

    def new_session_state(self) -> SelectRun:
        return SelectRun()

    def run_stats(self, session) -> dict:
        """What the selections kept over the generation's decode steps: steps, kept tokens, context tokens."""
        run = session.state
        return {"selection_steps": run.steps, "selection_kept": run.kept, "selection_context": run.context}

    # ---- the model-level hook ------------------------------------------------------------------------
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        session = step.session
        n_layers = session.n_layers
        L = self.layer_index(n_layers)
        pos = step.q_pos
        h = run_decoder_layers(model, hidden, pos, step, range(L + 1))
        if L == n_layers - 1:
            return h
        store = session.cache.extra.get(HIDDEN)
        if store is None:
            store = h.new_zeros(session.prompt_len + session.max_new_tokens, h.shape[-1])
            session.cache.extra[HIDDEN] = store
            session.cache.track_peak()
        store[pos.to(store.device)] = h[0]  # the store lives with the filter layer's output
        run = session.state
        chosen, run.chosen = run.chosen, None
        if step.phase == "prefill" and not step.last_chunk:
            if all_positions:
                raise AttnkitError("select: scoring every prompt position needs the prompt in one chunk (layers "
                                   f"after filter_layer={L} run once the whole prompt is in)")
            return h  # later layers run once the prompt is complete; the runner uses the last chunk's output
        end = int(pos[-1]) + 1
        if chosen is None:  # prefill without selection: the later layers see the whole prompt
            sel = torch.arange(end, device=pos.device)
        else:
            if all_positions:
                raise AttnkitError("select: with prefill_select=true only the last prompt position has an output; "
                                   "score every position with prefill_select=false")
            sel = torch.unique(torch.cat([chosen, pos[-1:].to(chosen.device)]))
        if all_positions and not (sel.shape[0] == pos.shape[0] and int(pos[0]) == 0):
            raise AttnkitError("select: scoring every prompt position needs the prompt in one chunk")
        if step.phase == "decode":
            run.steps += 1
            run.kept += int(sel.shape[0])
            run.context += end
        sub = Step(session, step.phase, sel, step.last_chunk)
        return run_decoder_layers(model, store[sel.to(store.device)][None], sel, sub, range(L + 1, n_layers))

    # ---- attention hooks ---------------------------------------------------------------------------------
    def _plan(self, ctx: LayerContext, q, k) -> LayerPlan | None:
        return layer_plan(ctx.session_state, self._share, ctx.session.n_layers, ctx.index, q, k)

    def layer_capacity(self, ctx: LayerContext):
        if ctx.index > self.layer_index(ctx.session.n_layers):
            return None  # no KV cache after the filter layer
        return super().layer_capacity(ctx)

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        return attend_shared(self._plan(ctx, q, keys), q, keys, values, ctx.scaling, ctx.q_pos, positions,
                             ctx.native_window)

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        L = self.layer_index(ctx.session.n_layers)
        if ctx.index > L:
            return self._uncached(ctx, q, k, v)
        out = self._store_and_attend(ctx, q, k, v)
        if ctx.index == L < ctx.session.n_layers - 1 and self.prefill_select and ctx.step.last_chunk:
            self._choose(ctx, q[:, :, -1:], ctx.q_pos[-1:], self.p_prefill)
        return out

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        L = self.layer_index(ctx.session.n_layers)
        if ctx.index > L:
            return self._uncached(ctx, q, k, v)
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, positions = ctx.kv.view()
        out = attend_shared(self._plan(ctx, q, keys), q, keys, values, ctx.scaling, ctx.q_pos, positions,
                            ctx.native_window)
        if ctx.index == L < ctx.session.n_layers - 1:
            self._choose(ctx, q, ctx.q_pos, self.p_decode)
        return out

    def _uncached(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        """A layer after L: its queries, keys and values are the selected tokens' (ascending positions)."""
        plan = self._plan(ctx, q, k)
        if ctx.native_window is not None:
            return attend_shared(plan, q, k, v, ctx.scaling, ctx.q_pos, ctx.q_pos, ctx.native_window)
        # ascending positions, queries = keys: causal by index is causal by position
        if plan is None or not plan.shares:
            return sdpa(q, k, v, ctx.scaling, is_causal=True)
        return shared_prefill_fused(q, k, v, ctx.scaling, plan)

    def _choose(self, ctx: LayerContext, q, q_pos, p: float) -> None:
        keys, values, positions = ctx.kv.view()
        k_pos = shared_positions(positions)
        scores = head_mean_scores(q, keys, values, ctx.scaling, q_pos, k_pos, ctx.native_window,
                                  self._plan(ctx, q, keys), self.value_weighted)
        ctx.session_state.chosen = k_pos[top_p(scores, p)]
