"""``cap``: keep the entries of highest query-weighted leverage in the values (CAPKV, arXiv 2604.25975; kvpress's
``CapPress``).

**Why.** An entry is worth keeping when the output directions it writes are ones few other entries write (a high
*leverage*) and when the queries to come are likely to read it (a high *relevance*). CAPKV measures both at once with
a capacity matrix over the held entries ``i`` of a query head (their values ``u_i = v_i`` stand for their output
directions, as kvpress does):

    A = I + sum_i w_i u_i u_i^T,        s_i = w_i * u_i^T A^{-1} u_i,        w_i = exp(tau * <k_i, mu_q>)

``u_i^T A^{-1} u_i`` is the ridge leverage of ``u_i`` among the weighted values: near 1 for a direction only ``u_i``
spans, small for one many entries share. ``mu_q`` is the anchor of the queries to come: the mean of the layer's
queries seen so far before RoPE (the first ``n_sink`` positions left out), rotated by the RoPE averaged over the
``n_future_positions`` positions after the newest token (``Rbar``, as in Expected Attention,
:func:`attnkit.methods.expected_attention.averaged_rotation`). As in kvpress, the key and the anchor are
L2-normalised first (a cosine, clamped to ``[-1, 1]``) and the exponent is shifted by its maximum over the entries
of the head, so ``w_i = exp(tau * (cos_i - max_j cos_j))``; the capacity matrix takes ``w_i + epsilon`` and is
solved in float32. A kv head's score is the mean of its query heads' ``s_i``; the first ``n_sink`` positions (the
attention sinks) are left out of the anchor and of the capacity matrix and always kept. Each kv head keeps its ``B``
best entries.

**Chunked prompts, one pass.** The anchor comes from the queries attnkit already computes for the prompt's
attention (:meth:`observe_prefill`, chunk by chunk), rotated back to before RoPE by their positions; only their sum
is kept (float64), so chunking changes the anchor by rounding alone. Averaging the rotated queries (kvpress) or
rotating their mean (here) is the same linear map; the anchor's scale cancels in the cosine, so RoPE's
``attention_scaling`` does not matter.

**Decoding** (:mod:`attnkit.methods.prompt_scorer`): ``decode_every=0`` appends generated tokens. With
``decode_every=N`` every generated query is folded into the same running mean and each re-compression averages the
rotations over the ``T`` positions after the newest token; kvpress's ``DecodingPress`` instead takes the anchor from a
buffer of the last generated hidden states only (by design: attnkit keeps no hidden states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError
from attnkit.methods.expected_attention import apply_rotation, averaged_rotation
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import number, whole


@dataclass
class CapState(PromptScorerState):
    """Per layer: the running sum of the queries before RoPE (float64, per row and query head) and their count."""

    count: int = 0
    total: torch.Tensor | None = None  # [b, hq, d]
    next_pos: int | None = None  # while compressing: the position of the next token to come


def cap_scores(keys: torch.Tensor, values: torch.Tensor, anchor: torch.Tensor, sinks: torch.Tensor, tau: float,
               epsilon: float) -> torch.Tensor:
    """CAPKV's score ``[b, kv, L]`` (float32) of keys/values ``[b, kv, L, d]`` for the rotated query anchors ``[b, hq,
    d]``; `sinks` ``[b, kv, L]`` marks the entries left out of the relevance weights and the capacity matrix (scored
    here above every other entry of their row)."""
    b, kv, n, d = keys.shape
    g = anchor.shape[1] // kv
    out = sinks.new_zeros((b, kv, n), dtype=torch.float32)
    for row in range(b):
        for h in range(kv):
            free = ~sinks[row, h]
            k, v = keys[row, h, free].float(), values[row, h, free].float()  # [m, d]
            if k.shape[0] == 0:
                continue
            a = F.normalize(anchor[row, h * g:(h + 1) * g].float(), dim=-1)  # [g, d]
            cos = (a @ F.normalize(k, dim=-1).T).clamp(-1.0, 1.0)  # [g, m]
            logits = tau * cos
            w = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
            scaled = v * torch.sqrt(w + epsilon).unsqueeze(-1)  # [g, m, d]
            capacity = torch.eye(d, dtype=torch.float32, device=v.device) + scaled.transpose(1, 2) @ scaled
            solved = torch.linalg.solve(capacity, v.T.expand(g, d, -1))  # [g, d, m]: A^{-1} u_i
            leverage = (v.T * solved).sum(dim=1)  # [g, m]
            out[row, h, free] = (w * leverage).mean(dim=0)
    best = out.amax(dim=-1, keepdim=True) + 1.0
    return torch.where(sinks, best.expand_as(out), out)


@register
@dataclass(frozen=True)
class Cap(PromptScorer):
    """Per kv head, the entries of highest leverage among the values weighted by their keys' alignment with the
    rotated mean query (CAPKV); sinks kept; decode appends (or re-compresses every ``decode_every`` tokens)."""

    tau: float = 5.0
    n_future_positions: int = 512
    n_sink: int = 4
    epsilon: float = 1e-6

    name = "cap"
    layer_state_type = CapState
    summary = "keep the entries of highest query-weighted leverage in the values (CAPKV, 2026)"
    kvpress = "CapPress"

    def __post_init__(self):
        super().__post_init__()
        number("tau", self.tau, 0.0, low_open=True, what=" (the sharpness of the query-key alignment weights)")
        whole("n_future_positions", self.n_future_positions, 1, what=" (future positions the RoPE is averaged over)")
        whole("n_sink", self.n_sink, 0, what=" (first positions always kept)")
        number("epsilon", self.epsilon, 0.0, what=" (added to the weights in the capacity matrix)")

    def budget_floor(self) -> int:
        return self.n_sink

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        if s.rope is None:
            raise AttnkitError("cap needs the model's rotary embedding (rotary_emb.inv_freq) to recover the queries "
                               "before RoPE; this model has none")
        self.check_sinks(ctx, budget)

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:
            if st.total is not None:
                st.total = st.total[rows.to(st.total.device)]

    # ---- the query anchor, gathered with the attention ----------------------------------------------------
    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        self._observe(ctx, q)

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        if self.decode_every:
            self._observe(ctx, q)
        return super().attend_decode(ctx, q)

    def _observe(self, ctx: LayerContext, q: torch.Tensor) -> None:
        pos = ctx.q_pos
        if self.n_sink:
            outside = pos >= self.n_sink
            if not bool(outside.all()):
                if not bool(outside.any()):
                    return
                q, pos = q[:, :, outside], pos[outside]
        rope = ctx.session.rope
        if 2 * rope.inv_freq.numel() != q.shape[-1]:
            raise AttnkitError(f"cap needs RoPE over the whole head (head_dim {q.shape[-1]}, rotary dimension "
                               f"{2 * rope.inv_freq.numel()}); partial rotary embeddings are not supported")
        chunk = rope.rotate(q.float(), -pos).double().sum(dim=2)
        st = ctx.state
        st.total = chunk if st.total is None else st.total + chunk
        st.count += q.shape[2]

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        super().after_prefill(ctx, q, k, v)
        if not self.decode_every or not self.evicts(ctx):  # no later compression needs the anchor
            ctx.state.total = None

    # ---- scores ----------------------------------------------------------------------------------------
    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        ctx.state.next_pos = int(next_pos)
        super().compact(ctx, count, spare, next_pos)
        ctx.state.next_pos = None

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        st = ctx.state
        keys, values, positions = ctx.kv.view()
        start = st.next_pos if st.next_pos is not None else int(positions.max()) + 1
        b, kv, _, d = keys.shape
        if st.count:
            inv_freq = ctx.session.rope.inv_freq.to(keys.device)
            c, s = ctx.step.shared_value(("expected_attention_rotation", start, self.n_future_positions, keys.device),
                                         lambda: averaged_rotation(inv_freq, start, self.n_future_positions))
            anchor = apply_rotation(st.total / st.count, c, s)
        else:  # no query outside the sinks seen yet: every key equally aligned
            anchor = keys.new_zeros((b, kv, d), dtype=torch.float64)
        return cap_scores(keys, values, anchor, positions < self.n_sink, self.tau, self.epsilon)

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return ctx.kv.view()[2] < self.n_sink if self.n_sink else None
