"""The speculative decoding loop (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv 2302.01318, Algorithm 2),
lossless with respect to plain decoding with full attention.

One round, with the context ``c`` (prompt + generated tokens, length ``L``) of which the target's
cache holds the first ``L - 1``:

1. the draft source proposes ``g <= gamma`` tokens ``x_1..x_g`` (and their draft distributions
   ``p_1..p_g``, or none for a deterministic draft);
2. the target runs ONE forward over ``[c_L, x_1, .., x_g]`` at positions ``L-1 .. L-1+g`` (the
   ``full`` method appends them and attends causally by position), giving ``q_1 .. q_{g+1}``
   (:class:`attnkit.speculative.target.VerifyingFull`: ``full`` with a faster kernel call for this
   few-query step);
3. :func:`attnkit.speculative.acceptance.speculative_accept` (or the greedy rule) keeps ``n``
   drafts and draws the next token;
4. the target cache drops its newest ``g - n`` entries, keeping ``L + n`` (``LayerKV.length``; full
   attention's cache is append-only, so the slots beyond are simply never read) and the draft source is
   told ``n``.

A round emits ``n + 1`` tokens for one target forward. Temperature, top-k and top-p are applied to
target and draft alike (:func:`attnkit.sampling.next_token_distribution`, as the plain runner does)
before the acceptance rule, so the output distribution is the plain sampler's. In greedy mode the
output is token for token :func:`attnkit.generate`'s.

The target's forward is nearly all of a round (the n-gram lookup, the acceptance rule and the rollback,
a length assignment per layer, are small beside it). Where that forward is compute-bound (a CPU) a
forward over ``n`` tokens costs more than a one-token step, unlike a GPU where the step is memory-bound
and ``n`` tokens cost about what one does: hence ``verify_cost``. Gamma, fixed or adaptive:
:mod:`attnkit.speculative.gamma`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from attnkit.forward import forward, logits_of
from attnkit.generation import GenerationConfig, TokenEmitter, check_length, encode_prompt, sync
from attnkit.model import LoadedModel, check_loaded_model
from attnkit.runner import Generation, GenerationStats, peak_rss_bytes
from attnkit.sampling import choose_token, next_token_distribution
from attnkit.session import Step, new_session
from attnkit.speculative.acceptance import greedy_accept, speculative_accept
from attnkit.speculative.config import SpeculativeConfig, speculative_config
from attnkit.speculative.draft import DraftRun, DraftSource, Proposal
from attnkit.speculative.factory import make_draft
from attnkit.speculative.gamma import GammaController
from attnkit.speculative.rollback import drop_newest
from attnkit.speculative.target import VerifyingFull, prefill_sessions

GENERATION_OPTIONS = frozenset(f.name for f in fields(GenerationConfig))


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


@torch.inference_mode()
def speculative_generate(model: LoadedModel, prompt, config: SpeculativeConfig | str | DraftSource = "prompt_lookup",
                         *, generation: GenerationConfig | None = None,
                         on_token: Callable[[int, str], None] | None = None, **options) -> Generation:
    """Generate like :func:`attnkit.generate` (full attention), drafting with the source of `config` and
    verifying up to ``gamma`` drafted tokens per target forward.

    `config` is a :class:`SpeculativeConfig`, a source name (``"draft_model"``, ``"prompt_lookup"``,
    ``"self"``) or a :class:`DraftSource`. `options` are field names of :class:`SpeculativeConfig`
    (``gamma=3, draft="snapkv:budget_tokens=512", draft_lookup=True``...; see the fields' help) or of
    :class:`attnkit.generation.GenerationConfig` (``max_new_tokens``, ``do_sample``, ``stop``...), set on
    `config` and `generation`. A round with nothing to verify (the source proposed nothing) is an
    ordinary decoding step. Returns a :class:`Generation` whose stats are :class:`SpeculativeStats`.
    """
    model = check_loaded_model(model)
    generation = GenerationConfig.build(generation, **{k: options.pop(k) for k in list(options)
                                                       if k in GENERATION_OPTIONS})
    config = speculative_config(config, **options)
    source = make_draft(config, model)
    gamma, adaptive_gamma, verify_cost = config.gamma, config.adaptive_gamma, config.verify_cost
    max_new_tokens, chunk_size, sampling = generation.max_new_tokens, generation.chunk_size, generation.sampling
    ids = encode_prompt(model, prompt)
    n = ids.shape[0]
    check_length(model, n, max_new_tokens)
    device = model.device
    generator = sampling.generator(device)
    tokenizer = model.tokenizer
    target = VerifyingFull()
    session = new_session(model, target, n, max_new_tokens)

    sync(device)
    t0 = time.perf_counter()
    shared = source.start(DraftRun(model, ids, max_new_tokens, sampling, generator, chunk_size, adaptive_gamma,
                                   float(verify_cost)))
    sessions = [session] if shared is None else [session, shared]
    logits = logits_of(model, prefill_sessions(model, sessions, ids, chunk_size))[-1]
    sync(device)
    prefill_s = time.perf_counter() - t0
    first = choose_token(logits, sampling, generator)
    ttft_s = time.perf_counter() - t0

    own_sizes = adaptive_gamma and source.sizes_own_proposals()  # the source picks each round's length
    # the controller adapts gamma only for a source that does not size its proposals (else it only caps)
    control = GammaController(gamma, adaptive_gamma and not own_sizes, config.max_gamma, source.relative_cost(),
                              verify_cost=verify_cost)
    emit = TokenEmitter(tokenizer, generation.eos(tokenizer), generation.stop, on_token)
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
        sync(device)
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
        sync(device)
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
    sync(device)
    decode_s = time.perf_counter() - t_decode
    draft_session = getattr(source, "session", None)  # a draft model's or the self-draft's cache
    text = emit.close()
    generated, finish = emit.generated, emit.finish
    decode_steps = emit.decode_steps()
    total_s = prefill_s + decode_s
    stats = SpeculativeStats(
        method=target.describe(), prompt_tokens=n, new_tokens=len(generated), prefill_s=prefill_s, ttft_s=ttft_s,
        decode_s=decode_s, decode_tokens_per_s=decode_steps / decode_s if decode_steps and decode_s > 0 else 0.0,
        peak_kv_bytes=session.cache.peak_bytes + (draft_session.cache.peak_bytes if draft_session is not None else 0),
        final_kv_bytes=session.cache.nbytes(),
        peak_rss_bytes=peak_rss_bytes(), finish_reason=finish,
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
