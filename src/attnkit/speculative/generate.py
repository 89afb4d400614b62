"""The speculative decoding loop (seed 003; Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
Algorithm 2), lossless with respect to plain decoding with full attention.

One round, with the context ``c`` (prompt + generated tokens, length ``L``) of which the target's
cache holds the first ``L - 1``:

1. the draft source proposes ``g <= gamma`` tokens ``x_1..x_g`` (and their draft distributions
   ``p_1..p_g``, or none for a deterministic draft);
2. the target runs ONE forward over ``[c_L, x_1, .., x_g]`` at positions ``L-1 .. L-1+g`` (the
   ``full`` method appends them and attends causally by position), giving ``q_1 .. q_{g+1}``;
   (:class:`VerifyingFull`: ``full`` with a faster kernel call for this few-query step);
3. :func:`attnkit.speculative.acceptance.speculative_accept` (or the greedy rule) keeps ``n``
   drafts and draws the next token;
4. the target cache drops its newest ``g - n`` entries, keeping ``L + n`` (``LayerKV.length``; full
   attention's cache is append-only, so the slots beyond are simply never read) and the draft source is
   told ``n``.

A round emits ``n + 1`` tokens for one target forward. Temperature, top-k and top-p are applied to
target and draft alike (:func:`attnkit.sampling.next_token_distribution`, as the plain runner does)
before the acceptance rule, so the output distribution is the plain sampler's. In greedy mode the
output is token for token :func:`attnkit.generate`'s.

Where the time goes on one CPU core (``tiny``, 2k context, measured with perf_counter around each
piece): the target's forward is nearly all of a round (the n-gram lookup, the acceptance rule and the
rollback, a length assignment per layer, take tens of microseconds). Timed inside the loop, a forward
over ``n`` tokens costs about ``1 + 0.1..0.13 (n - 1)`` one-token decoding steps there: the decoder
layers' per-op Python and dispatch overhead is paid once per forward, but the attention over the cache
is compute-bound for a few rows (5 queries over a 16k cache: 2.3x the attention time of 1 query; at 2k,
each further query costs about 28 us per layer, about 75 GFLOP/s), and MKL's projections cost a
staircase in the rows (1-3 rows what one does, the weights being read once; a fourth adds a third of
their time), unlike a GPU where the step is memory-bound and ``n`` tokens cost about what one does.
Hence ``verify_cost``. (Other weight layouts: ``scripts/bench_linear_layout.py``. Storing them
transposed helps ``tiny`` at 4-16 rows and costs a 1024x4096 model 50-80 % at 2-3; oneDNN's prepacked
weights halve that model's projections at 4-12 rows but cost ``tiny`` twice as much at every length.)

Adaptive gamma (``adaptive_gamma=True``): the per-token acceptance rate ``alpha`` is estimated from
the rounds so far (a discounted count of accepted over examined drafts; each round is a run of
Bernoulli trials up to the first rejection), and gamma is set to the value maximising Leviathan et
al.'s expected walltime improvement (their Theorem 3.8)

    (1 - alpha^(gamma + 1)) / ((1 - alpha) (gamma c + 1)),

``c`` being the draft's cost per token relative to a target forward (the source's estimate: bytes
read per step, MagicDec's memory-bound model; at least :data:`MIN_DRAFT_COST`). With a verification
cost ``v`` per drafted token (``verify_cost``) the denominator is ``gamma (c + v) + 1``. A source that
sizes its own proposals (prompt lookup, from the length of its match) gets ``max_gamma`` as a cap
instead. Either depends on the acceptances only, never on timings, so a seeded run is reproducible.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from attnkit.attention import folded_attention, folded_bias
from attnkit.errors import AttnkitError
from attnkit.methods.base import Method, Session, Step
from attnkit.methods.full import FullAttention
from attnkit.model import LoadedModel
from attnkit.runner import (
    Generation,
    GenerationStats,
    TokenEmitter,
    _sync,
    check_length,
    encode_prompt,
    forward,
    generation_options,
    logits_of,
    new_session,
)
from attnkit.sampling import choose_token, next_token_distribution
from attnkit.speculative.acceptance import greedy_accept, speculative_accept
from attnkit.speculative.drafts import (
    DEFAULT_VERIFY_COST,
    DraftRun,
    DraftSource,
    Proposal,
    drop_newest,
    make_draft,
)

# Floor of the relative draft cost in the adaptive-gamma model: python and kernel-launch overhead make
# even a free draft (prompt lookup) cost something per verified token.
MIN_DRAFT_COST = 0.05


@dataclass
class SpeculativeStats(GenerationStats):
    draft: str
    gamma: int  # the initial (or fixed) gamma
    adaptive_gamma: bool
    rounds: int  # target forwards after the prompt (one per round)
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float  # accepted / drafted tokens
    tokens_per_target_forward: float  # mean tokens a round emits: accepted drafts + 1
    mean_gamma: float  # drafted tokens per round
    draft_forwards: int  # forwards of the draft model (0 for prompt lookup); one may take several tokens
    draft_weight_bytes: int  # weights held for drafting besides the target's (a draft model's, int8 copies)
    draft_s: float  # time spent proposing (draft forwards, lookups, snapshots)
    verify_s: float  # time spent in the target's verification forwards and the acceptance rule
    tokens_per_s: float  # new tokens over prefill + decode time (end to end)


# Verification steps of at most this many tokens use the folded attention (attnkit.attention); longer
# multi-token steps (the prompt) take the ordinary path.
VERIFY_FOLD_MAX_TOKENS = 64


class VerifyingFull(FullAttention):
    """``full`` attention as the speculative target: identical semantics (every key kept, causal by
    position, the model's own window), with one faster kernel call for the verification step.

    A verification step is a handful of queries over the whole cache. Handing SDPA the query heads
    with grouped kv heads and a boolean mask sends it to a path that expands the kv heads; instead the
    query heads of each kv group are folded into the query axis (``[b, kv, groups * n, d]``,
    :func:`attnkit.attention.folded_attention`, as the decode step does for one token) with an additive
    mask tiled over the groups (:func:`attnkit.attention.folded_bias`), so the cache is read once per kv
    head. Measured on CPU at 16k tokens, 5 queries, GQA 4:1: 4.6 ms -> 2.7 ms per layer.
    Every layer of a full cache holds the same positions, so the tiled mask is built once per forward
    (on its first layer) and reused by the others (at 2k tokens, 5 queries: 220 -> 145 us per layer).
    Not registered: it is ``full`` to everyone else.
    """

    def prefill_attention(self, ctx, q, k, v):
        n = q.shape[2]
        if ctx.kv.length == 0 or n > VERIFY_FOLD_MAX_TOKENS:  # the prompt (or a prompt chunk)
            return super().prefill_attention(ctx, q, k, v)
        ctx.kv.append(k, v, ctx.q_pos)
        keys, values, positions = ctx.kv.view()
        groups = q.shape[1] // keys.shape[1]
        bias = ctx.step.shared_value(
            ("verify", ctx.native_window, keys.shape[2], groups, q.dtype),
            lambda: folded_bias(ctx.q_pos, positions[0, 0], groups, ctx.native_window, q.dtype))
        return folded_attention(q, keys, values, ctx.scaling, bias)


class GammaController:
    """Fixed gamma, or adaptive from the observed acceptance (see the module docstring)."""

    def __init__(self, gamma: int = 4, adaptive: bool = False, max_gamma: int | None = None, cost: float = 0.0,
                 prior_alpha: float = 0.6, decay: float = 0.9, verify_cost: float = 0.0):
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
            raise AttnkitError(f"gamma must be a whole number of drafted tokens >= 1, got {gamma!r}")
        max_gamma = max(2 * gamma, 8) if max_gamma is None else max_gamma
        if not isinstance(max_gamma, int) or isinstance(max_gamma, bool) or max_gamma < gamma:
            raise AttnkitError(f"max_gamma must be a whole number >= gamma ({gamma}), got {max_gamma!r}")
        self.gamma, self.adaptive, self.max_gamma = gamma, adaptive, max_gamma
        self.cost = max(MIN_DRAFT_COST, float(cost))
        self.verify_cost = float(verify_cost)
        self.decay = decay
        self._accepted, self._trials = 2 * prior_alpha, 2.0  # a weak prior worth two trials

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        trials = accepted + (accepted < drafted)  # the drafts examined: accepted ones and the first rejection
        self._accepted = self.decay * self._accepted + accepted
        self._trials = self.decay * self._trials + trials
        if self.adaptive:
            self.gamma = best_gamma(self.alpha, self.cost, self.max_gamma, self.verify_cost)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens a round emits with per-token acceptance `alpha` (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, cost: float, max_gamma: int, verify_cost: float = 0.0) -> int:
    """The gamma in 1..max_gamma maximising expected tokens per unit time, ``E / (gamma (c + v) + 1)``
    (Leviathan et al.'s Theorem 3.8 denominator ``gamma c + 1`` plus `verify_cost` ``v`` per drafted
    token: the target's forward over gamma + 1 tokens is not free where it is compute-bound, e.g. on a
    CPU); the smallest gamma within 1% of the best (extra drafts that barely help still cost)."""
    scores = [expected_tokens(alpha, g) / (g * (cost + verify_cost) + 1.0) for g in range(1, max_gamma + 1)]
    best = max(scores)
    return next(g for g, s in enumerate(scores, start=1) if s >= 0.99 * best)


class _Tee:
    """A step that hands every layer's attention call to several sessions (the first one's output is
    the forward's): the target's prompt pass also fills the self-draft's compressed cache."""

    def __init__(self, steps: list[Step]):
        self.steps = steps

    def attention(self, layer, q, k, v, scaling, native_window):
        out = self.steps[0].attention(layer, q, k, v, scaling, native_window)
        for step in self.steps[1:]:
            step.attention(layer, q, k, v, scaling, native_window)
        return out


class _OutputDiscarded(Method):
    """A session's method during a prompt pass whose attention output nobody reads (the extra sessions
    of :func:`prefill_sessions`): every cache hook goes to the wrapped method (it stores, observes and
    compresses as always), but the dense prompt attention a store-then-attend method asks the session
    for (:meth:`attnkit.methods.base.Method.prefill_output`) is not computed."""

    def __init__(self, inner: Method):
        self.inner = inner
        self.name = inner.name

    def layer_capacity(self, ctx):
        return self.inner.layer_capacity(ctx)

    def prefill_attention(self, ctx, q, k, v):
        return self.inner.prefill_attention(ctx, q, k, v)

    def after_prefill(self, ctx, q, k, v):
        self.inner.after_prefill(ctx, q, k, v)

    def prefill_output(self, ctx, q, keys, values, positions):
        return torch.empty_like(q)

    def describe(self) -> str:
        return self.inner.describe()


def prefill_sessions(model: LoadedModel, sessions: list[Session], ids: torch.Tensor,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Prompt pass feeding every session's method from the same forward (q, k, v of the first
    session's forward); final hidden state of the last position ``[1, hidden]``. The other sessions'
    methods store and observe the prompt but compute no attention output of their own (their output
    would be discarded); a method that computes its prompt attention itself (``window``) still does."""
    n = ids.shape[0]
    if chunk_size is not None and chunk_size <= 0:
        raise AttnkitError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    chunk = chunk_size or n
    hidden = None
    extra = sessions[1:]
    methods = [s.method for s in extra]
    for s in extra:
        s.method = _OutputDiscarded(s.method)
    try:
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            last = end == n

            def step(pos, last=last):
                steps = [Step(s, "prefill", pos, last) for s in sessions]
                return steps[0] if len(steps) == 1 else _Tee(steps)

            hidden = forward(model, ids[start:end], start, step)
    finally:
        for s, m in zip(extra, methods):
            s.method = m
    return hidden


def resolve_draft(draft: str | DraftSource, draft_spec, model: LoadedModel, draft_lookup: bool | str = False,
                  draft_confidence: float | None = None, draft_weights: str | None = None) -> DraftSource:
    if isinstance(draft, DraftSource):
        if draft_spec is not None or draft_lookup or draft_confidence is not None or draft_weights is not None:
            raise AttnkitError("draft_spec, draft_lookup, draft_confidence or draft_weights is given with a DraftSource "
                               "instance; configure the instance instead")
        return draft
    if isinstance(draft, str):
        return make_draft(draft, draft_spec, model, lookup=draft_lookup, confidence=draft_confidence,
                          weights=draft_weights)
    raise AttnkitError(f"draft must be a kind (draft_model, prompt_lookup, self) or a DraftSource, "
                       f"got {type(draft).__name__}")


@torch.inference_mode()
def speculative_generate(model: LoadedModel, prompt, draft: str | DraftSource = "prompt_lookup", *,
                         draft_spec=None, draft_lookup: bool | str = False,
                         draft_confidence: float | None = None, draft_weights: str | None = None, gamma: int = 4,
                         adaptive_gamma: bool = False, max_gamma: int | None = None,
                         verify_cost: float = DEFAULT_VERIFY_COST,
                         max_new_tokens: int = 64, chunk_size: int | None = None,
                         do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int | None = None,
                         stop: Sequence[str] | str | None = None, stop_at_eos: bool = True,
                         on_token: Callable[[int, str], None] | None = None) -> Generation:
    """Generate like :func:`attnkit.generate` (full attention), drafting with `draft` and verifying
    ``gamma`` drafted tokens per target forward.

    `draft` is ``"draft_model"`` (`draft_spec`: a model spec, default ``tiny-draft``, or a loaded
    model), ``"prompt_lookup"`` (`draft_spec`: ``"max_ngram=3,min_ngram=1"``), ``"self"``
    (`draft_spec`: an eviction method spec for the draft's cache, default
    ``streaming:budget_tokens=256,sinks=4``), or a :class:`DraftSource`. `draft_lookup` (``draft_model``
    and ``self``): the draft model verifies prompt-lookup guesses several at a time (TriForce's
    hierarchy; True or a ``prompt_lookup`` spec; see :func:`attnkit.speculative.drafts.make_draft`).
    `draft_confidence` (``draft_model`` and ``self``): stop a round's drafting after the first token the
    draft gave less than this probability (gamma is then a cap). `draft_weights` (``draft_model`` and
    ``self``): ``"int8"`` drafts with weight-only int8 copies of the drafting model's linear layers
    (:mod:`attnkit.speculative.int8_weights`); the target verifies with its own weights.
    `verify_cost` is the extra cost of one more token in the target's verification forward relative to
    a one-token step (used only to choose gamma adaptively: ~0 on a GPU, ~0.1 on one CPU core). A round
    with nothing to verify (the source proposed nothing) is an ordinary decoding step. The other
    arguments are the plain runner's.
    Returns a :class:`Generation` whose stats are :class:`SpeculativeStats`.
    """
    sampling, stops = generation_options(max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop)
    if not isinstance(verify_cost, (int, float)) or isinstance(verify_cost, bool) or verify_cost < 0:
        raise AttnkitError(f"verify_cost must be a number >= 0, got {verify_cost!r}")
    source = resolve_draft(draft, draft_spec, model, draft_lookup, draft_confidence, draft_weights)
    ids = encode_prompt(model, prompt)
    n = ids.shape[0]
    check_length(model, n, max_new_tokens)
    device = model.device
    generator = sampling.generator(device)
    tokenizer = model.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None) if stop_at_eos else None
    target = VerifyingFull()
    session = new_session(model, target, n, max_new_tokens)

    _sync(device)
    t0 = time.perf_counter()
    shared = source.start(DraftRun(model, ids, max_new_tokens, sampling, generator, chunk_size, adaptive_gamma,
                                   float(verify_cost)))
    sessions = [session] if shared is None else [session, shared]
    logits = logits_of(model, prefill_sessions(model, sessions, ids, chunk_size))[-1]
    _sync(device)
    prefill_s = time.perf_counter() - t0
    first = choose_token(logits, sampling, generator)
    ttft_s = time.perf_counter() - t0

    own_sizes = adaptive_gamma and source.sizes_own_proposals()  # the source picks each round's length
    # the controller adapts gamma only for a source that does not size its proposals (else it only caps)
    control = GammaController(gamma, adaptive_gamma and not own_sizes, max_gamma, source.relative_cost(),
                              verify_cost=verify_cost)
    emit = TokenEmitter(tokenizer, eos, stops, on_token)
    context = ids.tolist() + [first]
    rounds = drafted_total = accepted_total = emitted_by_rounds = 0
    draft_s = verify_s = 0.0
    t_decode = time.perf_counter()
    done = emit.push(first)
    while not done and len(emit.generated) < max_new_tokens:
        remaining = max_new_tokens - len(emit.generated)
        g = min(control.max_gamma if own_sizes else control.gamma, remaining - 1)  # a round emits <= g + 1
        t_round = time.perf_counter()
        proposal = source.propose(context, g) if g > 0 else Proposal([])
        drafted = list(proposal.tokens[:g])
        probs = proposal.probs[:len(drafted)] if proposal.probs is not None else None
        _sync(device)
        t_verify = time.perf_counter()
        draft_s += t_verify - t_round

        L = len(context)
        phase = "prefill" if drafted else "decode"  # nothing to verify: an ordinary decoding step
        hidden = forward(model, torch.tensor([context[-1]] + drafted, device=device), L - 1,
                         lambda pos, phase=phase: Step(session, phase, pos, False), all_positions=True)
        logits = logits_of(model, hidden)
        if sampling.do_sample:
            result = speculative_accept(torch.tensor(drafted, dtype=torch.long, device=device), probs,
                                        next_token_distribution(logits, sampling), generator)
        else:
            result = greedy_accept(drafted, logits)
        drop_newest(session, len(drafted) - result.accepted)  # the target keeps c_L and the accepted drafts
        if g > 0:
            source.feedback(result.accepted)
        _sync(device)
        verify_s += time.perf_counter() - t_verify

        rounds += 1
        drafted_total += len(drafted)
        accepted_total += result.accepted
        control.update(len(drafted), result.accepted)
        new = result.tokens(drafted)
        emitted_by_rounds += len(new)
        context.extend(new)
        for tok in new:
            done = emit.push(tok)
            if done:
                break
    _sync(device)
    decode_s = time.perf_counter() - t_decode
    draft_session = getattr(source, "session", None)  # a draft model's or the self-draft's cache
    text = emit.close()
    generated, finish = emit.generated, emit.finish
    decode_steps = max(0, len(generated) - 1 + (finish == "eos"))
    total_s = prefill_s + decode_s
    stats = SpeculativeStats(
        method=target.describe(), prompt_tokens=n, new_tokens=len(generated), prefill_s=prefill_s, ttft_s=ttft_s,
        decode_s=decode_s, decode_tokens_per_s=decode_steps / decode_s if decode_steps and decode_s > 0 else 0.0,
        peak_kv_bytes=session.cache.peak_bytes + (draft_session.cache.peak_bytes if draft_session is not None else 0),
        final_kv_bytes=session.cache.nbytes(),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, finish_reason=finish,
        draft=source.describe(), gamma=gamma, adaptive_gamma=adaptive_gamma, rounds=rounds,
        drafted_tokens=drafted_total, accepted_tokens=accepted_total,
        acceptance_rate=accepted_total / drafted_total if drafted_total else 0.0,
        tokens_per_target_forward=emitted_by_rounds / rounds if rounds else 0.0,
        mean_gamma=drafted_total / rounds if rounds else 0.0, draft_forwards=source.forwards,
        draft_weight_bytes=source.weight_bytes(), draft_s=draft_s,
        verify_s=verify_s,
        tokens_per_s=len(generated) / total_s if total_s > 0 else 0.0,
    )
    return Generation(text, generated, stats)
