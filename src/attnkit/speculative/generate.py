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

A batch of prompts (:func:`speculative_generate` with a list) runs these rounds side by side: each
sequence has its own target session, draft source (:meth:`DraftSource.fork`), gamma, rollback, stop
and statistics, and accepts its own number of drafts each round; a round's verification is ONE target
forward over every sequence still generating, and model drafts feed together too
(:mod:`attnkit.speculative.rows`). A finished sequence leaves the batch. With a seed, sequence ``i``
samples with ``seed + i`` (its draft and its acceptance rule alike), as :func:`attnkit.generate` does.

The target's forward is nearly all of a round (the n-gram lookup, the acceptance rule and the rollback,
a length assignment per layer, are small beside it). Where that forward is compute-bound (a CPU) a
forward over ``n`` tokens costs more than a one-token step, unlike a GPU where the step is memory-bound
and ``n`` tokens cost about what one does: hence ``verify_cost``. Gamma, fixed or adaptive:
:mod:`attnkit.speculative.gamma`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from attnkit.forward import logits_of
from attnkit.generation import GenerationConfig, TokenEmitter, check_length, encode_prompts, sync
from attnkit.model import LoadedModel, check_loaded_model
from attnkit.runner import Generation, GenerationStats, peak_rss_bytes
from attnkit.sampling import SamplingConfig, choose_token, next_token_distribution
from attnkit.session import Session, new_session
from attnkit.speculative.acceptance import Acceptance, greedy_prefix, speculative_accept
from attnkit.speculative.config import SpeculativeConfig, speculative_config
from attnkit.speculative.draft import DraftRun, DraftSource, Proposal
from attnkit.speculative.factory import make_draft
from attnkit.speculative.gamma import GammaController
from attnkit.speculative.rollback import drop_newest
from attnkit.speculative.rows import forward_each, propose_rows
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


@dataclass
class _Sequence:
    """One prompt while it generates: its sessions, draft, sampler, stop conditions and counts. In a
    batch the times of a round (drafting, verifying) are the batch's, counted for every sequence in it."""

    index: int  # its place in the caller's batch
    ids: torch.Tensor
    source: DraftSource
    session: Session  # the target's
    sampling: SamplingConfig  # the call's, with this sequence's seed
    generator: torch.Generator | None
    emit: TokenEmitter
    context: list[int] = field(default_factory=list)  # prompt + generated tokens
    control: GammaController | None = None
    own_sizes: bool = False  # the source sizes its own proposals (gamma only caps them)
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted_by_rounds: int = 0
    done: bool = False

    def round_gamma(self, max_new_tokens: int) -> int:
        """How many tokens this round may draft (a round emits at most gamma + 1)."""
        remaining = max_new_tokens - len(self.emit.generated)
        return min(self.control.max_gamma if self.own_sizes else self.control.gamma, remaining - 1)

    def push(self, tokens: list[int], max_new_tokens: int) -> None:
        for tok in tokens:
            self.done = self.emit.push(tok)
            if self.done:
                return
        self.done = len(self.emit.generated) >= max_new_tokens


@torch.inference_mode()
def speculative_generate(model: LoadedModel, prompt, config: SpeculativeConfig | str | DraftSource = "prompt_lookup",
                         *, generation: GenerationConfig | None = None, on_token: Callable | None = None,
                         **options) -> Generation | list[Generation]:
    """Generate like :func:`attnkit.generate` (full attention), drafting with the source of `config` and
    verifying up to ``gamma`` drafted tokens per target forward.

    `prompt` is one prompt (text or token ids) or a batch (a list of texts, a list of token-id lists, a
    ``[batch, n]`` tensor; :func:`attnkit.generation.encode_prompts`): for a batch the result is one
    :class:`Generation` per prompt, in order, each sequence drafting with its own copy of the source and
    verified in one target forward per round with the others (module docstring); with ``seed``, prompt
    ``i`` samples with ``seed + i``. `config` is a :class:`SpeculativeConfig`, a source name
    (``"draft_model"``, ``"prompt_lookup"``, ``"self"``) or a :class:`DraftSource`. `options` are field
    names of :class:`SpeculativeConfig` (``gamma=3, draft="snapkv:budget_tokens=512", draft_lookup=True``...;
    see the fields' help) or of :class:`attnkit.generation.GenerationConfig` (``max_new_tokens``,
    ``do_sample``, ``stop``...), set on `config` and `generation`. A round with nothing to verify (the
    source proposed nothing) is an ordinary decoding step. `on_token(token_id, text_delta)` streams (for a
    batch: ``on_token(index, token_id, text_delta)``). The stats are :class:`SpeculativeStats`.
    """
    model = check_loaded_model(model)
    generation = GenerationConfig.build(generation, **{k: options.pop(k) for k in list(options)
                                                       if k in GENERATION_OPTIONS})
    config = speculative_config(config, **options)
    source = make_draft(config, model)
    prompts, batched = encode_prompts(model, prompt)
    max_new_tokens = generation.max_new_tokens
    for i, ids in enumerate(prompts):
        check_length(model, ids.shape[0], max_new_tokens, f"prompt {i}" if batched else "the prompt")
    sources = [source] + [source.fork() for _ in prompts[1:]]
    target = VerifyingFull()
    seqs = [_sequence(model, target, generation, i, ids, sources[i], on_token, batched)
            for i, ids in enumerate(prompts)]

    sync(model.device)
    t0 = time.perf_counter()
    for seq in seqs:
        _start(model, seq, config, generation, t0)
    t_decode = time.perf_counter()
    active = [seq for seq in seqs if not seq.done]
    while active:
        _round(model, active, generation)
        now = time.perf_counter()
        for seq in active:
            seq.decode_s = now - t_decode
        active = [seq for seq in active if not seq.done]
    rss = peak_rss_bytes()
    gens = [_generation(seq, target, config, len(prompts), rss) for seq in seqs]
    return gens if batched else gens[0]


def _sequence(model: LoadedModel, target: VerifyingFull, generation: GenerationConfig, i: int, ids: torch.Tensor,
              source: DraftSource, on_token, batched: bool) -> _Sequence:
    sampling = generation.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
    stream = on_token if not batched or on_token is None else (lambda t, text, i=i: on_token(i, t, text))
    emit = TokenEmitter(model.tokenizer, generation.eos(model.tokenizer), generation.stop, stream)
    session = new_session(model, target, int(ids.shape[0]), generation.max_new_tokens)
    return _Sequence(i, ids, source, session, sampling, sampling.generator(model.output_device), emit)


def _start(model: LoadedModel, seq: _Sequence, config: SpeculativeConfig, generation: GenerationConfig,
           t0: float) -> None:
    """The prompt pass of one sequence (its draft source started, a self-draft's cache filled by the same
    pass) and its first token."""
    t_start = time.perf_counter()
    shared = seq.source.start(DraftRun(model, seq.ids, generation.max_new_tokens, seq.sampling, seq.generator,
                                       generation.chunk_size, config.adaptive_gamma, float(config.verify_cost)))
    sessions = [seq.session] if shared is None else [seq.session, shared]
    logits = logits_of(model, prefill_sessions(model, sessions, seq.ids, generation.chunk_size))[-1]
    sync(model.device)
    seq.prefill_s = time.perf_counter() - t_start
    first = choose_token(logits, seq.sampling, seq.generator)
    seq.ttft_s = time.perf_counter() - t0
    seq.own_sizes = config.adaptive_gamma and seq.source.sizes_own_proposals()  # it picks each round's length
    # the controller adapts gamma only for a source that does not size its proposals (else it only caps)
    seq.control = GammaController(config.gamma, config.adaptive_gamma and not seq.own_sizes, config.max_gamma,
                                  seq.source.relative_cost(), verify_cost=config.verify_cost)
    seq.context = seq.ids.tolist() + [first]
    seq.push([first], generation.max_new_tokens)


def _round(model: LoadedModel, active: list[_Sequence], generation: GenerationConfig) -> None:
    """One round for every active sequence: their proposals, ONE target forward verifying all of them,
    each sequence's acceptance, rollback and new tokens."""
    max_new_tokens, sampling = generation.max_new_tokens, generation.sampling
    t_round = time.perf_counter()
    gammas = [seq.round_gamma(max_new_tokens) for seq in active]
    proposals = propose_rows([seq.source for seq in active], [seq.context for seq in active], gammas)
    drafts = [_drafted(p, g) for p, g in zip(proposals, gammas, strict=True)]
    sync(model.device)
    t_verify = time.perf_counter()

    # row i: the context's last token (not in the target's cache yet) and the drafts; nothing to verify:
    # an ordinary decoding step
    logits = forward_each(model, [(seq.session, [seq.context[-1]] + drafted, len(seq.context) - 1,
                                   "prefill" if drafted else "decode")
                                  for seq, (drafted, _) in zip(active, drafts, strict=True)])
    rows = logits.split([len(drafted) + 1 for drafted, _ in drafts])
    best = None if sampling.do_sample else logits.argmax(-1).tolist()  # every row's argmaxes in one transfer
    results: list[Acceptance] = []
    offset = 0
    for seq, row, (drafted, probs) in zip(active, rows, drafts, strict=True):
        if best is None:
            results.append(speculative_accept(torch.tensor(drafted, dtype=torch.long, device=row.device), probs,
                                              next_token_distribution(row, sampling), seq.generator))
        else:
            results.append(greedy_prefix(drafted, best[offset:offset + len(drafted) + 1]))
        offset += len(drafted) + 1
    for seq, g, (drafted, _), result in zip(active, gammas, drafts, results, strict=True):
        drop_newest(seq.session, len(drafted) - result.accepted)  # the target keeps c_L and the accepted drafts
        if g > 0:
            seq.source.feedback(result.accepted)
    sync(model.device)
    now = time.perf_counter()

    for seq, (drafted, _), result in zip(active, drafts, results, strict=True):
        seq.draft_s += t_verify - t_round
        seq.verify_s += now - t_verify
        seq.rounds += 1
        seq.drafted += len(drafted)
        seq.accepted += result.accepted
        seq.control.update(len(drafted), result.accepted)
        new = result.tokens(drafted)
        seq.emitted_by_rounds += len(new)
        seq.context.extend(new)
        seq.push(new, max_new_tokens)


def _drafted(proposal: Proposal, gamma: int) -> tuple[list[int], torch.Tensor | None]:
    """A proposal's tokens (at most `gamma`) and the distributions they were drawn from."""
    drafted = list(proposal.tokens[:gamma])
    return drafted, proposal.probs[:len(drafted)] if proposal.probs is not None else None


def _generation(seq: _Sequence, target: VerifyingFull, config: SpeculativeConfig, batch_size: int,
                rss: int) -> Generation:
    emit, source, session = seq.emit, seq.source, seq.session
    draft_session = getattr(source, "session", None)  # a draft model's or the self-draft's cache
    text = emit.close()
    generated = emit.generated
    decode_steps = emit.decode_steps()
    total_s = seq.prefill_s + seq.decode_s
    stats = SpeculativeStats(
        method=target.describe(), prompt_tokens=int(seq.ids.shape[0]), new_tokens=len(generated),
        prefill_s=seq.prefill_s, ttft_s=seq.ttft_s, decode_s=seq.decode_s,
        decode_tokens_per_s=decode_steps / seq.decode_s if decode_steps and seq.decode_s > 0 else 0.0,
        peak_kv_bytes=session.cache.peak_bytes + (draft_session.cache.peak_bytes if draft_session is not None else 0),
        final_kv_bytes=session.cache.nbytes(), peak_rss_bytes=rss, finish_reason=emit.finish,
        draft=source.describe(), gamma=config.gamma, adaptive_gamma=config.adaptive_gamma, rounds=seq.rounds,
        drafted_tokens=seq.drafted, accepted_tokens=seq.accepted,
        acceptance_rate=seq.accepted / seq.drafted if seq.drafted else 0.0,
        tokens_per_target_forward=seq.emitted_by_rounds / seq.rounds if seq.rounds else 0.0,
        mean_gamma=seq.drafted / seq.rounds if seq.rounds else 0.0, draft_forwards=source.forwards,
        draft_weight_bytes=source.weight_bytes(), draft_s=seq.draft_s, verify_s=seq.verify_s,
        tokens_per_s=len(generated) / total_s if total_s > 0 else 0.0, batch_size=batch_size,
    )
    return Generation(text, generated, stats)
