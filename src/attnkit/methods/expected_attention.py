"""``expected_attention``: score each key by the attention future queries are expected to give it (Devoto,
Jeblick, Jegou, 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", arXiv 2510.00636; kvpress's ``ExpectedAttentionPress``).

The queries that will read the cache have not been computed yet, but a layer's queries before RoPE are close
to Gaussian, ``q ~ N(mu, Sigma)`` per query head, estimated from the queries seen so far. A future query at
position ``t + j`` is ``R_{t+j} q`` (the RoPE rotation), so over the next ``T`` positions (``n_future_positions``)
the paper replaces the rotations by their average ``Rbar = (1/T) sum_{j<T} R_{t+j}``, giving the rotated
moments ``mu' = Rbar mu`` and ``Sigma' = Rbar Sigma Rbar^T``. The expected unnormalised attention of a key ``k``
(cached after RoPE) is then the Gaussian moment-generating function at ``s k`` (``s`` the attention scaling,
``1/sqrt(d)`` for the models here):

    E[exp(s q.k)] = exp(s mu'.k + s^2 k^T Sigma' k / 2) = exp(mu'.k / sqrt(d) + k^T Sigma' k / (2 d)),

normalised over the keys (a softmax of the exponent), averaged over the query heads of each kv group, and,
since an entry's contribution to the output is its attention times its value, multiplied by ``||v||_2``
(``use_vnorm``; ``epsilon`` is added to the attention first, as in kvpress). The first ``n_sink`` positions are
attention sinks: they are left out of the query statistics and of the softmax and always kept. Each kv head
keeps its ``B`` best entries (the sinks among them). With ``use_covariance=False`` the quadratic term is dropped.

**One pass.** The statistics come from the queries attnkit already computes for the prompt's attention
(:meth:`observe_prefill`, chunk by chunk), never from a second forward: a chunk's queries arrive after RoPE at
their positions, and rotating them back by their positions (:meth:`attnkit.rope.Rope.rotate` by ``-pos``)
recovers the queries before RoPE exactly (rotations compose; the model's ``attention_scaling``, 1 for the usual
RoPE types, stays in them as it does in kvpress's rotated moments). Each chunk's mean and scatter (the sum of
outer products of the deviations from its mean) are merged into the running ones in float64 with Chan et al.'s
pairwise update, so no ``mean(q q^T) - mu mu^T`` cancellation occurs and chunking changes the moments only at
float64 rounding (the same positions are kept). The scatter over ``m`` queries gives ``Sigma = scatter / m``
(the biased estimate, as kvpress).

**Decoding** (:mod:`attnkit.methods.prompt_scorer`): with ``decode_every=0`` generated tokens are appended and
the statistics are released after the prompt's compression. With ``decode_every=N`` every generated query is
folded into the same running moments (prompt and generated queries alike), and each re-compression averages the
rotations over the ``T`` positions after the newest token. kvpress's ``DecodingPress`` instead estimates the
moments from a buffer of the last (at most 256) generated hidden states only, and averages the rotations from
the buffer's length rather than the absolute position; both differ by design.

**Calibrated statistics** (``stats=FILE``, kvpress's ``ExpectedAttentionStatsPress``): ``mu`` and ``Sigma`` per layer
and query head come from a file written by ``attnkit calibrate expected_attention`` (the model's queries before RoPE
on its own text, :mod:`attnkit.calibrate.expected_attention`; :mod:`attnkit.methods.expected_attention_stats`) instead
of the prompt's queries: nothing is gathered during the prompt or decoding, and every compression (the prompt's, and
each ``decode_every`` one) rotates the same moments by the averaged RoPE of the ``T`` positions after the newest
token. A model of another geometry or other RoPE frequencies is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.expected_attention_stats import load_moments
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.scoring import block_elements_for
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, number, whole


@dataclass
class ExpectedAttentionState(PromptScorerState):
    """Per layer: the running moments of the queries before RoPE (float64, per row and query head)."""

    count: int = 0  # queries folded in
    mean: torch.Tensor | None = None  # [b, hq, d]
    scatter: torch.Tensor | None = None  # [b, hq, d, d]: sum of (q - mean)(q - mean)^T
    next_pos: int | None = None  # while compressing: the position of the next token to come


def merge_moments(count: int, mean, scatter, x: torch.Tensor):
    """Fold the vectors `x` ``[b, h, c, d]`` into the running ``(count, mean, scatter)`` (float64), by Chan,
    Golub and LeVeque's pairwise update; returns the new triple."""
    x = x.double()
    c = x.shape[2]
    chunk_mean = x.mean(dim=2)
    if c == 1:
        chunk_scatter = None
    else:
        dev = x - chunk_mean.unsqueeze(2)
        chunk_scatter = dev.transpose(-1, -2) @ dev
    if count == 0:
        if chunk_scatter is None:
            chunk_scatter = x.new_zeros(x.shape[:2] + (x.shape[-1], x.shape[-1]))
        return c, chunk_mean, chunk_scatter
    total = count + c
    delta = chunk_mean - mean
    new_mean = mean + delta * (c / total)
    new_scatter = scatter + (delta.unsqueeze(-1) * delta.unsqueeze(-2)) * (count * c / total)
    if chunk_scatter is not None:
        new_scatter += chunk_scatter
    return total, new_mean, new_scatter


def averaged_rotation(inv_freq: torch.Tensor, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Rbar = (1/T) sum_{j<T} R_{start+j}`` in RoPE's half-split form: ``Rbar x = C * x + S * rotate_half(x)``;
    returns ``C`` and ``S`` ``[d]`` (float64)."""
    pos = torch.arange(start, start + count, dtype=torch.float64, device=inv_freq.device)
    angles = pos[:, None] * inv_freq.double()
    c, s = angles.cos().mean(0), angles.sin().mean(0)
    return torch.cat((c, c)), torch.cat((s, s))


def apply_rotation(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``Rbar`` applied along the last axis of `x`."""
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def future_moments(mean: torch.Tensor, scatter: torch.Tensor, count: int, c: torch.Tensor, s: torch.Tensor):
    """``mu' = Rbar mu`` and ``Sigma' = Rbar Sigma Rbar^T`` with ``Sigma = scatter / count``."""
    mu = apply_rotation(mean, c, s)
    sigma = apply_rotation(scatter / count, c, s)  # Sigma Rbar^T (rows rotated)
    sigma = apply_rotation(sigma.transpose(-1, -2), c, s).transpose(-1, -2)  # Rbar (Sigma Rbar^T)
    return mu, sigma


def expected_attention_logits(keys: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor | None,
                              scaling: float) -> torch.Tensor:
    """``s mu'.k + s^2 k^T Sigma' k / 2`` ``[b, kv, g, L]`` (float32) for keys ``[b, kv, L, d]`` and per query
    head moments ``mu`` ``[b, kv * g, d]``, ``sigma`` ``[b, kv * g, d, d]`` (None: the mean term only); the
    quadratic form runs over blocks of keys so its ``[.., L, g * d]`` temporary stays small."""
    b, kv, n, d = keys.shape
    g = mu.shape[1] // kv
    k = keys.float()
    logits = torch.einsum("bkgd,bkld->bkgl", mu.float().view(b, kv, g, d), k).mul_(scaling)
    if sigma is None:
        return logits
    # [b, kv, d, g * d]: column (j, e) is row e of head j's Sigma', so k @ it gives every head's Sigma' k
    stacked = sigma.float().view(b, kv, g, d, d).permute(0, 1, 3, 2, 4).reshape(b, kv, d, g * d)
    limit = block_elements_for(keys.device)
    block = max(1, limit // max(1, b * kv * g * d))
    half_s2 = scaling * scaling / 2
    for start in range(0, n, block):
        kb = k[:, :, start:start + block]
        quad = ((kb @ stacked).view(b, kv, kb.shape[2], g, d) * kb.unsqueeze(3)).sum(-1)  # [b, kv, l, g]
        logits[..., start:start + block] += quad.transpose(2, 3).mul_(half_s2)
    return logits


@register
@dataclass(frozen=True)
class ExpectedAttention(PromptScorer):
    """Per kv head, the entries future queries are expected to attend to most (Gaussian query moments rotated
    by the averaged RoPE of the next positions), times ``||v||``; sinks kept; decode appends (or re-compresses
    every ``decode_every`` tokens)."""

    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    stats: str | None = None

    name = "expected_attention"
    layer_state_type = ExpectedAttentionState
    summary = "keep the keys future queries are expected to attend to (Expected Attention, Devoto et al. 2025)"
    kvpress = "ExpectedAttentionPress"

    def __post_init__(self):
        super().__post_init__()
        whole("n_future_positions", self.n_future_positions, 1, what=" (future positions the RoPE is averaged over)")
        whole("n_sink", self.n_sink, 0, what=" (first positions always kept)")
        flag("use_covariance", self.use_covariance)
        flag("use_vnorm", self.use_vnorm)
        number("epsilon", self.epsilon, 0.0, what=" (added to the expected attention before the value-norm rescaling)")
        if self.stats is not None and (not isinstance(self.stats, str) or not self.stats):
            raise AttnkitError(f"stats must be the path of a file written by `attnkit calibrate expected_attention`, "
                               f"got {self.stats!r}")
        object.__setattr__(self, "_stats", None if self.stats is None else load_moments(self.stats))

    def budget_floor(self) -> int:
        return self.n_sink  # the sinks are always kept

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        if s.rope is None:
            raise AttnkitError("expected_attention needs the model's rotary embedding (rotary_emb.inv_freq) to "
                               "recover the queries before RoPE; this model has none")
        if self._stats is not None:
            self._stats.check(s.n_layers, None, None, s.rope.inv_freq)
        self.check_sinks(ctx, budget)

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:
            if st.mean is not None:
                st.mean = st.mean[rows.to(st.mean.device)]
                st.scatter = st.scatter[rows.to(st.scatter.device)]

    # ---- the query moments, gathered with the attention ---------------------------------------------
    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        self._observe(ctx, q)

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        if self.decode_every:
            self._observe(ctx, q)
        return super().attend_decode(ctx, q)

    def _observe(self, ctx: LayerContext, q: torch.Tensor) -> None:
        if self._stats is not None:  # calibrated moments: the prompt's own are not needed
            self._stats.check(ctx.session.n_layers, ctx.session.model_heads(q.shape[1], None)[0], q.shape[-1],
                              ctx.session.rope.inv_freq)
            return
        pos = ctx.q_pos
        if self.n_sink:
            outside = pos >= self.n_sink
            if not bool(outside.all()):
                if not bool(outside.any()):
                    return
                q, pos = q[:, :, outside], pos[outside]
        rope = ctx.session.rope
        if 2 * rope.inv_freq.numel() != q.shape[-1]:
            raise AttnkitError(f"expected_attention needs RoPE over the whole head (head_dim {q.shape[-1]}, rotary "
                               f"dimension {2 * rope.inv_freq.numel()}); partial rotary embeddings are not supported")
        before_rope = rope.rotate(q.float(), -pos)
        st = ctx.state
        st.count, st.mean, st.scatter = merge_moments(st.count, st.mean, st.scatter, before_rope)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        super().after_prefill(ctx, q, k, v)
        if not self.decode_every or not self.evicts(ctx):  # no later compression needs the moments
            ctx.state.mean = ctx.state.scatter = None

    # ---- scores ----------------------------------------------------------------------------------
    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        ctx.state.next_pos = int(next_pos)
        super().compact(ctx, count, spare, next_pos)
        ctx.state.next_pos = None

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        st = ctx.state
        keys, values, positions = ctx.kv.view()
        start = st.next_pos if st.next_pos is not None else int(positions.max()) + 1
        b, kv, _, d = keys.shape
        if self._stats is not None:
            inv_freq = ctx.session.rope.inv_freq.to(keys.device)
            c, s = ctx.step.shared_value(("expected_attention_rotation", start, self.n_future_positions, keys.device),
                                         lambda: averaged_rotation(inv_freq, start, self.n_future_positions))
            mean, cov = self._stats.layer(ctx.index, keys.device)
            # the query heads the layer holds (a tensor-parallel shard's) of the model's
            held = ctx.session.held_heads(kv * mean.shape[0] // ctx.session.model_heads(None, kv)[1])
            mean, cov = mean[held], cov[held]
            mu, sigma = future_moments(mean.expand(b, -1, -1), cov.expand(b, -1, -1, -1), 1, c, s)
            logits = expected_attention_logits(keys, mu, sigma if self.use_covariance else None, ctx.scaling)
        elif st.count:
            inv_freq = ctx.session.rope.inv_freq.to(keys.device)
            c, s = ctx.step.shared_value(("expected_attention_rotation", start, self.n_future_positions, keys.device),
                                         lambda: averaged_rotation(inv_freq, start, self.n_future_positions))
            mu, sigma = future_moments(st.mean, st.scatter, st.count, c, s)
            logits = expected_attention_logits(keys, mu, sigma if self.use_covariance else None, ctx.scaling)
        else:  # no query outside the sinks seen yet: nothing to prefer (the value norms decide)
            logits = keys.new_zeros((b, kv, 1, keys.shape[2]), dtype=torch.float32)
        sinks = positions < self.n_sink
        scores = torch.softmax(logits.masked_fill(sinks.unsqueeze(2), float("-inf")), dim=-1).mean(dim=2)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.float().norm(dim=-1)
        return scores

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return ctx.kv.view()[2] < self.n_sink if self.n_sink else None
