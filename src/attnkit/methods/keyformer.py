"""``keyformer``: key tokens chosen by a Gumbel-regularised, temperature-scheduled score (Adnan et al.,
MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative
Inference", arXiv 2403.09054; equation and section numbers below are the paper's).

The budget ``k`` is a fraction of the prompt (``budget``) or a token count (``budget_tokens``); a recent
window of ``w`` tokens (``recent`` x budget, default 20 %; the paper finds 20-30 % best, section 4.6.4)
is always kept and the other ``k - w`` slots hold the *key tokens*: the entries with the highest
accumulated Keyformer score (section 3.3.2, Figure 6)

    f(x_i) = exp((x_i + zeta_i) / tau) / sum_j exp((x_j + zeta_j) / tau)      (eq. 9)

where ``x_i = q . k_i / sqrt(d)`` are the unnormalised logits of a query (eq. 4), ``zeta_i`` the
regularising noise added to them (eq. 4-6: Gumbel by default; :mod:`attnkit.methods.keyformer_noise`) and
``tau`` the temperature, which is ``tau_init`` during the prompt and rises by ``(tau_end - tau_init) / T``
with every generated token, ``T`` being the generation length (eq. 10; ``tau = tau_init + t * delta_tau``,
t = 1 for the first generated token fed back). f is accumulated over every prompt query and every decode
step. The attention output itself is ordinary softmax attention; the noise only steers which tokens stay.

As in the paper's Figure 6 the prompt is reduced to ``k`` after prefill ("n - k tokens dropped from
the n - w window") and every decode step drops one token so the cache stays at ``k``. In attnkit's
terms (see :mod:`attnkit.methods.budget`) ``B`` slots hold the ``k`` kept entries plus the incoming
one, so the paper's ``k`` is ``B - 1``.

Ablations (section 4.6): ``noise`` gumbel | gaussian (mu = 0.5772, sigma = 1.2825: the Gumbel's mean
and standard deviation, eq. 11-12) | constant (c = 0.5772; a constant leaves the softmax unchanged,
so it selects exactly as ``none``) | none (the H2O-like accumulated attention); ``score`` per_layer
(each layer accumulates and chooses its own key tokens, per kv head) | shared (one score per token
accumulated over all layers, heads and steps; every layer keeps the same tokens, decided at each step
from the scores of all layers up to the previous step, so the prompt is compressed at the first decode
step instead of right after prefill); ``positions`` original | new (keys are seen at their rank in the
cache, the query last: "Keyformer (new positions)"; the kept keys are re-rotated for attention each
step, which costs one pass over the cache). ``seed`` fixes the noise: each draw is a function of (seed,
layer, head, query position, key position) (a table entry at a hashed row offset plus the key position,
:mod:`attnkit.methods.keyformer_noise`), so results do not depend on prompt chunking, on the batch or on
the device.

The prompt's scores come from the same blocks as its attention output
(:func:`attnkit.methods.scoring.attention_with_statistics`). At the prompt's temperature 1 with Gumbel
noise, eq. 9 is computed from the attention probabilities ``p`` the output needs:
``softmax(x + zeta) = p * exp(zeta) / sum(p * exp(zeta))`` with ``exp(zeta) = 1 / -log(u)``
(:func:`attnkit.methods.keyformer_noise.gumbel_factor`, the same draws, each ``exp(zeta)`` rounded to bfloat16: zeta
moves by at most 0.004), so no second softmax.

``decode_every=N >= 1`` is the buffered form (:mod:`attnkit.methods.buffered`): generated tokens are appended and
attended with everything held, f still accumulating at every step with its temperature schedule, and after every
``N``-th step the layer goes back to ``B`` entries, the key tokens of highest accumulated f plus the recent window
(at most ``B + N`` held; the paper drops one token per step). With ``score=shared`` the prompt's compression, deferred
to the first decode step, goes to ``B`` entries before that step's token is appended, and a compression after step
``g`` ranks by the shared score through step ``g - 1`` (complete only once the last layer has added step ``g``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnkit.errors import AttnkitError
from attnkit.methods import decode_native
from attnkit.methods.buffered import BufferedEviction, BufferedState
from attnkit.methods.decode_native import KeyformerScore
from attnkit.methods.eviction import RecentWindowEviction
from attnkit.methods.keyformer_noise import (
    EULER_GAMMA,
    NOISES,
    DecodeNoise,
    GumbelFactorWeights,
    keyformer_noise,
    table_counters,
)
from attnkit.methods.scoring import attend_with_logits, attention_statistics, reduce_heads
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, number, whole


def keyformer_tau(t, T, tau_init: float = 1.0, tau_end: float = 2.0):
    """Temperature at decode iteration `t` of a generation of `T` tokens (eq. 10); `t` = 0 is the prompt. `t` and `T`
    may be tensors ``[rows]`` (a stacked decode step's rows, :attr:`attnkit.session.Step.per_row`): the same
    operations per row, in float64."""
    if isinstance(T, torch.Tensor):
        t, T = t.double(), T.double()
        return torch.where(T > 0, tau_init + t * (tau_end - tau_init) / T.clamp(min=1), tau_init)
    if T <= 0:
        return tau_init
    return tau_init + t * (tau_end - tau_init) / T


@dataclass
class KeyformerState(BufferedState):
    """Keyformer's per-layer state: the decode iteration t of eq. 10 and the temperature it gave."""

    t: int = 0
    tau: float | None = None

    per_row = ("t", "tau")  # a stacked decode step's rows are at their own iterations (attnkit.session.stack_states)


@dataclass
class KeyformerRun:
    """Keyformer's state for one generation, shared by the layers: the decode-step noise, and with
    ``score=shared`` one score per token position through the previous step and this step so far."""

    noise: DecodeNoise | None = None
    score: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    step: Any = None  # the step whose scores `pending` collects
    rows_tau: tuple | None = None  # a stacked step's temperatures: ((rows' iterations, lengths), float64, float32)

    # a function of the seed, the geometry and the heads held alone: every generation of the method draws alike; the
    # temperatures are looked up by what they are a function of
    shared = ("noise", "rows_tau")


@register
@dataclass(frozen=True)
class Keyformer(BufferedEviction, RecentWindowEviction):
    """Key tokens by the accumulated Gumbel-softmax score f (eq. 9-10) + recent window."""

    tau_init: float = 1.0
    tau_end: float = 2.0
    noise: str = "gumbel"
    score: str = "per_layer"
    positions: str = "original"
    seed: int = 0

    name = "keyformer"
    summary = "key tokens by Gumbel-softmax score + recent window (Keyformer, Adnan et al. 2024)"
    default_recent = 0.2
    layer_state_type = KeyformerState

    def __post_init__(self):
        super().__post_init__()
        for name in ("tau_init", "tau_end"):
            number(name, getattr(self, name), 0, low_open=True, what=" (a temperature)")
        choice("noise", self.noise, NOISES)
        choice("score", self.score, ("per_layer", "shared"))
        choice("positions", self.positions, ("original", "new"))
        whole("seed", self.seed, 0)

    # ---- parameters per layer ------------------------------------------------------------------------
    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        super().check_layer(ctx, budget)
        if self.positions == "new" and ctx.session.rope is None:
            raise AttnkitError("keyformer positions='new' needs the model's rotary embedding (session.rope)")

    def tau(self, t, T):
        """eq. 10 with this method's tau_init and tau_end."""
        return keyformer_tau(t, T, self.tau_init, self.tau_end)

    @property
    def between(self) -> str | None:
        # the buffered form's per-layer score of the steps between compressions is taken together at the next one
        # (a step's noise and temperature follow from its position); the shared score sums over the layers as it goes
        return "queries" if self.score == "per_layer" and self.positions == "original" else None

    @property
    def stacks_decode(self) -> bool:
        # the shared score sums over a generation's own positions, and new positions rotate by one query's: those
        # decode one generation at a time
        return super().stacks_decode and self.score == "per_layer" and self.positions == "original"

    # ---- the score f (eq. 9) ---------------------------------------------------------------------------
    def _weights(self, ctx: LayerContext, tau, decoding: bool = False):
        """eq. 9 as a weights function of the logits; `tau` a number, a tensor ``[rows]`` (a stacked step's rows) or a
        function of the query positions giving one per query (the queued steps of :meth:`add_queued`)."""
        kv_heads = ctx.kv.positions.shape[1]

        def f(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
            # overwrites `logits` (a fresh tensor): y = x + zeta (eq. 4; masked logits stay -inf), then eq. 9
            if self.noise in ("gumbel", "gaussian"):
                if decoding:
                    logits += self._decode_noise(ctx, kv_heads * logits.shape[2])(ctx, k_pos)
                else:
                    logits += keyformer_noise(self.noise, self.seed, ctx.index, kv_heads, logits.shape[2], q_pos,
                                              k_pos, ctx.session.first_head)
            elif self.noise == "constant":
                logits += EULER_GAMMA
            if callable(tau):  # one per query
                logits /= tau(q_pos).to(logits.dtype).view(1, 1, 1, -1, 1)
            elif isinstance(tau, torch.Tensor):  # one per row of a stacked step (dividing by 1 changes nothing)
                logits /= tau.to(logits.dtype).view(-1, 1, 1, 1, 1)
            elif tau != 1.0:
                logits /= tau
            return torch.softmax(logits, dim=-1)

        return f

    def _prefill_weights(self, ctx: LayerContext, tau: float):
        """eq. 9 for the prompt's queries, from the logits and their softmax
        (:func:`attnkit.methods.scoring.attention_with_statistics`); None: the softmax itself."""
        if tau == 1.0 and self.noise in ("none", "constant"):
            return None  # a constant added to every logit leaves the softmax unchanged
        if tau == 1.0 and self.noise == "gumbel":
            return GumbelFactorWeights(self.seed, ctx.index, ctx.kv.positions.shape[1], ctx.session.first_head)
        noisy = self._weights(ctx, tau)
        return lambda logits, probs, q_pos, k_pos: noisy(logits, q_pos, k_pos)

    def new_session_state(self) -> KeyformerRun:
        return KeyformerRun()

    def keep_rows(self, layer_states: list, session_state: KeyformerRun, rows: torch.Tensor) -> None:
        super().keep_rows(layer_states, session_state, rows)
        if session_state.score is not None:
            rows = rows.to(session_state.score.device)
            session_state.score = session_state.score[rows]
            session_state.pending = session_state.pending[rows]

    def _decode_noise(self, ctx: LayerContext, heads: int) -> DecodeNoise:
        """This generation's :class:`DecodeNoise` (one for all layers)."""
        run = ctx.session_state
        if run.noise is None:
            run.noise = DecodeNoise(self.noise, self.seed, ctx.session.n_layers, heads, ctx.kv.positions.device,
                                    ctx.session.first_head)
        return run.noise

    def _shared(self, ctx: LayerContext) -> KeyformerRun:
        """Keyformer's shared score: one value per token position, summed over layers and heads."""
        run = ctx.session_state
        if run.score is None:
            s = ctx.session
            b, device = ctx.kv.positions.shape[0], ctx.kv.positions.device
            size = s.prompt_len + s.max_new_tokens
            run.score = torch.zeros(b, size, dtype=torch.float32, device=device)
            run.pending = torch.zeros(b, size, dtype=torch.float32, device=device)
        return run

    def _accumulate(self, ctx: LayerContext, contribution: torch.Tensor) -> None:
        """Add this layer's ``[b, kv, length]`` (already GQA-reduced) score to what decides eviction."""
        length = ctx.kv.length
        if self.score == "per_layer":
            self.score_buffer(ctx)[:, :, :length] += contribution
            return
        shared = self._shared(ctx)
        positions = ctx.kv.view()[2][:, 0]  # shared mode: every head holds the same positions
        # one score per position for the whole model, on the device of the first layer: a layer elsewhere
        # sends its per-position sums there (a vector per row, not its cache)
        device = shared.pending.device
        # summed over every kv head of the model (a tensor-parallel shard's and the others')
        total = ctx.session.sum_over_heads(contribution, (1,)).float()
        shared.pending.scatter_add_(1, positions.to(device), total.to(device))

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        length = ctx.kv.length
        if self.score == "per_layer":
            return self.score_buffer(ctx)[:, :, :length]
        positions = ctx.kv.view()[2]
        b = positions.shape[0]
        score = self._shared(ctx).score
        return score.gather(1, positions.reshape(b, -1).to(score.device)).view(positions.shape).to(positions.device)

    def evicts(self, ctx: LayerContext) -> bool:
        if self.score == "shared" and ctx.state.evicts is None:
            # every layer adds to the shared score as soon as any layer can evict
            s = ctx.session
            total = s.prompt_len + s.max_new_tokens
            ctx.state.evicts = any(
                self.budget_of_layer(i, s.n_layers, s.prompt_len) < total
                for i in range(s.n_layers))
        return super().evicts(ctx)

    def defer_prefill_eviction(self, ctx: LayerContext) -> bool:
        return self.score == "shared"  # later layers have not scored the prompt yet

    def before_write(self, ctx: LayerContext) -> None:
        super().before_write(ctx)  # the queued steps' scores at their own iterations, before this step's
        ctx.state.t += 1
        if self.score == "shared":
            shared = self._shared(ctx)
            if shared.step is not ctx.step:  # first layer of a new step: the last step's scores are complete
                shared.score += shared.pending
                shared.pending.zero_()
                shared.step = ctx.step

    # ---- hooks ---------------------------------------------------------------------------------------
    def prefill_scorer(self, ctx: LayerContext):
        tau = self.tau(0, ctx.session.max_new_tokens)  # tau_init: the prompt is scored without extra smoothing
        return self.gqa_reduce, self._prefill_weights(ctx, tau)

    def add_prefill_scores(self, ctx: LayerContext, stats: torch.Tensor) -> None:
        self._accumulate(ctx, stats)

    def skip_appends(self, ctx: LayerContext, k, v, q, positions: torch.Tensor) -> None:
        super().skip_appends(ctx, k, v, q, positions)
        ctx.state.t += positions.shape[0]  # the steps' iterations of eq. 10, as before_write counts them

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        if self.queues(ctx):  # the buffered form, or a per-step layer filling its budget: the score taken later
            out = self._attend_held(ctx, q)
            self.queue_queries(ctx, q, ctx.q_pos)
            if self.takes_queued(ctx):
                self.add_queued(ctx)
            return out
        keys, values, positions = ctx.kv.view()
        if self.positions == "new":
            keys = self._at_new_positions(ctx, keys, positions)
        visible = self.window_visibility(ctx)
        tau, tau32 = self._step_tau(ctx)
        ctx.state.tau = tau
        if decode_native.runs(q, keys, values, visible):  # the step's attention and its score in one kernel call
            out, _, _, score = decode_native.attend(q, keys, values, ctx.scaling, score=self._step_score(
                ctx, tau32, positions, q.shape[1] // keys.shape[1]), logits=False, probabilities=False)
            self._accumulate(ctx, score)
            return out
        out, logits, _ = attend_with_logits(q, keys, values, ctx.scaling, visible, native=False)
        f = self._weights(ctx, tau, decoding=True)(logits, ctx.q_pos, positions)
        self._accumulate(ctx, reduce_heads(f, self.gqa_reduce)[:, :, 0])  # the step's one query
        return out

    def _step_tau(self, ctx: LayerContext) -> tuple:
        """eq. 10 at this decode step, and as float32 ``[rows]`` (what the kernel divides by). A stacked step's rows
        (:attr:`attnkit.session.Step.per_row`) are at the same iterations in every layer: their temperatures are
        computed on the first and looked up by the iterations and the generations' lengths on the others."""
        t, lengths = ctx.state.t, ctx.session.max_new_tokens
        if not ctx.step.per_row:
            tau = self.tau(max(t, 1), lengths)
            return tau, torch.as_tensor(tau, dtype=torch.float32).reshape(-1)
        run, key = ctx.session_state, (t.tolist(), lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)
        if run.rows_tau is None or run.rows_tau[0] != key:
            tau = self.tau(t.clamp(min=1), lengths)
            run.rows_tau = (key, tau, tau.to(torch.float32))
        return run.rows_tau[1], run.rows_tau[2]

    def _step_score(self, ctx: LayerContext, tau: torch.Tensor, positions: torch.Tensor, groups: int
                    ) -> KeyformerScore:
        """eq. 9 of this decode step for the kernel (:class:`~attnkit.methods.decode_native.KeyformerScore`): the
        draws :meth:`_weights` adds, at the temperature `tau` (float32, one or one per row) it divides by."""
        rows, kv_heads = positions.shape[:2]
        if self.noise in ("gumbel", "gaussian"):
            noise = self._decode_noise(ctx, kv_heads * groups)
            offsets = noise.row_offsets(ctx, kv_heads, positions.device).reshape(-1, kv_heads * groups).expand(rows, -1)
            if self.noise == "gumbel":  # the kernel computes the table's draws it needs (KeyformerScore.counters)
                return KeyformerScore(None, offsets, positions, tau, self.gqa_reduce, counters=table_counters())
            return KeyformerScore(noise.table(positions.device), offsets, positions, tau, self.gqa_reduce)
        return KeyformerScore(None, None, positions, tau, self.gqa_reduce,
                              EULER_GAMMA if self.noise == "constant" else 0.0)

    def add_queued(self, ctx: LayerContext) -> None:
        """The score f (eq. 9) of the queued steps' queries (:class:`~attnkit.methods.buffered.BufferedState`), each
        over the entries held at its step, with its own noise and its iteration's temperature (the steps are
        consecutive, the last this one), added in one pass."""
        st = ctx.state
        keys, _, positions = ctx.kv.view()
        last = int(st.queued_pos[-1])

        def tau(q_pos):  # each queued step's iteration: the last queued is the layer's current one
            return torch.as_tensor(self.tau((st.t - (last - q_pos)).clamp(min=1).double(), ctx.session.max_new_tokens))

        self._accumulate(ctx, attention_statistics(st.queued_q, keys, ctx.scaling, st.queued_pos, positions,
                                                   reduce=self.gqa_reduce, weights=self._weights(ctx, tau),
                                                   window=ctx.native_window))
        st.queued_q = st.queued_pos = None

    def _at_new_positions(self, ctx: LayerContext, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys rotated to their rank in the cache, the query (rank length-1) keeping its own rotation:
        the key of rank r is seen at ``P - (length - 1 - r)`` instead of its original position."""
        rank = positions.argsort(dim=-1).argsort(dim=-1)
        seen_at = ctx.q_pos[0] - (positions.shape[-1] - 1) + rank
        return ctx.session.rope.rotate(keys, seen_at - positions)
