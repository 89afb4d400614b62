"""Questions after a compressed context: prefill (and compress) a context once, then answer each question from
that compressed state.

    answers = attnkit.generate_after(model, document, ["Who wrote it?", "When?"], "snapkv",
                                     params={"budget": 0.3}, max_new_tokens=16)

This is how a compressed cache is used in practice: a long document, a cached system prompt or a chat history
is compressed before the question is known, so a method cannot pick what to keep by looking at the question.
Evaluating with the question inside the compressed prompt ("query-aware") favours methods that score keys by
the prompt's last queries (SnapKV's observation window); the query-agnostic protocol compresses the context
first and feeds the question afterwards (as the leaderboard of the repository NVIDIA/kvpress measures; the term
is Kim et al. 2025's, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv
2505.23416), and the shared-context protocol answers several questions about one compressed context (SCBench:
Li et al. 2024, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods", arXiv 2412.10319).

How: each context is prefilled as a prompt (in chunks with ``chunk_size``); the method compresses it in
``after_prefill`` as it compresses any prompt, its budget resolved on the context's length. Each question is
then fed *through the compressed cache* with the method's decode hooks, exactly as generated tokens are fed:
in one step when the method's decoding only appends (``full``, ``snapkv`` and the other prompt-time scorers),
else one token per step (so a method that evicts while decoding, H2O, keeps evicting while the question
streams in, as it would in use). The answer is then generated from the last question token's logits.
Every question of a context starts from the same compressed state: the context's session is forked
(:meth:`attnkit.session.Session.fork`: its cache rows and the method's state copied, nothing recomputed), one
fork per question length, the questions of one length side by side as rows. A context is prefilled once, however
many questions it has. Every method at an unlimited budget gives full attention's output here too (tested).

:func:`teacher_force` feeds a reference continuation after a compressed prompt one token per decoding step, as
generated tokens are fed, and returns each token's likelihood: the quality of a long output under a method whose
decode-time eviction or selection acts on every step, for the same text under every method (the ``continuation``
task of :mod:`attnkit.eval.data.long_output`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.forward import forward, logits_of, prefill
from attnkit.generation import GenerationConfig, check_length, encode_prompt, encode_prompts, sync
from attnkit.methods.base import Method, resolve_method
from attnkit.model import LoadedModel, check_loaded_model
from attnkit.runner import (
    Generation,
    GenerationStats,
    RunGroup,
    check_batch,
    choose_tokens,
    decode_groups,
    generations,
    group_prompts,
    peak_rss_bytes,
    start_sequence,
)
from attnkit.session import Session, Step, new_session, planned_slots


def _questions_of(model: LoadedModel, questions, what: str) -> list[torch.Tensor]:
    """One context's questions -> 1-D id tensors. A text is tokenized without special tokens (it continues the
    context); a list of ids is taken as it is. One question may be given alone."""
    if isinstance(questions, (str, torch.Tensor)) or (isinstance(questions, (list, tuple)) and questions
                                                      and all(isinstance(q, int) for q in questions)):
        questions = [questions]
    if not isinstance(questions, (list, tuple)) or not questions:
        raise AttnkitError(f"{what}: give at least one question (a text or a list of token ids)")
    out = []
    for j, q in enumerate(questions):
        label = f"{what}, question {j}"
        if isinstance(q, str):
            q = model.tokenizer(q, add_special_tokens=False).input_ids
        empty = len(q) == 0  # nothing asked: the answer follows the context
        out.append(torch.zeros(0, dtype=torch.long, device=model.device) if empty else encode_prompt(model, q, label))
    return out


def feed(model: LoadedModel, session: Session, ids: torch.Tensor, start: int, stepwise: bool = False) -> torch.Tensor:
    """Feed tokens ``ids`` ``[rows, n]`` at positions ``start..start+n-1`` through `session`'s cache with the
    method's decode hooks; the logits ``[rows, vocab]`` after the last one. One step when decoding only appends
    (and the method runs no layers itself) unless `stepwise`, else one token per step, as generated tokens are."""
    method = session.method
    n = ids.shape[1]

    if not stepwise and method.run_layers is None and method.decode_only_appends():
        return logits_of(model, decode_step(model, session, ids, start)[:, -1])
    hidden = None
    for t in range(n):  # a method that runs the layers itself decodes all its session's rows in one forward too
        hidden = decode_step(model, session, ids[:, t:t + 1], start + t)
    return logits_of(model, hidden[:, -1])


def decode_step(model: LoadedModel, session: Session, ids: torch.Tensor, pos: int) -> torch.Tensor:
    """One decoding step of every row of `session`: tokens ``ids`` ``[rows, n]`` at positions ``pos..`` (one token
    as the runner feeds a generated one; several where the method's decoding only appends), through the method's
    decode hooks (``decode_attention``, ``after_decode``); the final hidden states ``[rows, n, hidden]``."""
    return forward(model, ids, pos, lambda p: Step(session, "decode", p))


def _forks(lengths: list[int], batches: bool) -> list[list[int]]:
    """Which (row, question) pairs share a fork: those whose questions have the same length `lengths[k]` (one
    each when the method keeps one sequence per session); indices into the pairs."""
    if not batches:
        return [[k] for k in range(len(lengths))]
    by_length: dict[int, list[int]] = {}
    for k, n in enumerate(lengths):
        by_length.setdefault(n, []).append(k)
    return list(by_length.values())


@torch.inference_mode()
def generate_after(model: LoadedModel, context, questions, method: str | Method | None = "full", *,
                   params: dict | None = None, config: GenerationConfig | None = None, stepwise: bool = False,
                   **options) -> list[Generation] | list[list[Generation]]:
    """Prefill `context` once with `method` (which compresses it as a prompt), then answer every question of
    `questions` from that compressed state; see the module docstring.

    `context` is one context (text or token ids) or a batch of them (a list of texts or of id lists); for one
    context `questions` is a list of questions (texts, tokenized without special tokens, or id lists) or one
    question, and the result one :class:`Generation` per question; for a batch, `questions` holds one such list
    per context and the result one list per context. Options are :func:`attnkit.generate`'s (a
    :class:`GenerationConfig` or its fields); a generation's ``prompt_tokens`` counts context and question, its
    ``prefill_s`` is its context's prefill (shared by the context's questions). `stepwise` feeds every question
    one token per decoding step, as generated tokens are, whatever the method (a long stretch of text before the
    question: :mod:`attnkit.eval.data.long_output`).
    """
    model = check_loaded_model(model)
    config = GenerationConfig.build(config, **options)
    method = resolve_method(method, params)
    contexts, batched = encode_prompts(model, context)
    if batched and (not isinstance(questions, (list, tuple)) or len(questions) != len(contexts)):
        raise AttnkitError(f"a batch of {len(contexts)} contexts needs one list of questions per context")
    per_context = [_questions_of(model, qs, f"context {i}" if batched else "the context")
                   for i, qs in enumerate(questions if batched else [questions])]
    max_new = config.max_new_tokens
    for i, (ctx, qs) in enumerate(zip(contexts, per_context)):
        for j, q in enumerate(qs):
            check_length(model, ctx.shape[0] + q.shape[0], max_new,
                         f"context {i} + question {j}" if batched else f"the context + question {j}")
    # every (context, question) pair is one sequence, numbered in order
    pairs = [(i, j) for i, qs in enumerate(per_context) for j in range(len(qs))]
    seqs = {pair: start_sequence(model, k, torch.cat([contexts[pair[0]], per_context[pair[0]][pair[1]]]), config)
            for k, pair in enumerate(pairs)}
    ctx_lengths = [int(c.shape[0]) for c in contexts]
    parents, plan = [], group_prompts(ctx_lengths, method)
    for idx in plan:
        after = max(q.shape[0] for i in idx for q in per_context[i]) + max_new  # question + answer tokens
        session = new_session(model, method, ctx_lengths[idx[0]], after, rows=len(idx))
        parents.append(RunGroup(session, [seqs[(i, 0)] for i in idx]))
    check_batch(model, parents, batched)

    sync(model.device)
    t0 = time.perf_counter()
    groups = []
    for p, idx in enumerate(plan):
        t_group = time.perf_counter()
        session, parents[p] = parents[p].session, None  # the uncompressed parent lives on only in its forks
        last = prefill(model, session, torch.stack([contexts[i] for i in idx]), config.chunk_size)  # compressed
        sync(model.device)
        prefill_s = time.perf_counter() - t_group
        rows = [(r, j) for r, i in enumerate(idx) for j in range(len(per_context[i]))]
        lengths = [int(per_context[idx[r]][j].shape[0]) for r, j in rows]
        forks = _forks(lengths, method.batches)
        for members in forks:
            fork_rows = [rows[k][0] for k in members]
            whole = len(forks) == 1 and fork_rows == list(range(session.rows))
            child = session if whole else session.fork(fork_rows)
            ids = torch.stack([per_context[idx[rows[k][0]]][rows[k][1]] for k in members])
            if ids.shape[1]:
                logits = feed(model, child, ids, session.prompt_len, stepwise)
            else:  # empty questions: the answers follow the context
                logits = logits_of(model, last[torch.tensor(fork_rows, device=last.device), -1])
            group = RunGroup(child, [seqs[(idx[rows[k][0]], rows[k][1])] for k in members], offset=ids.shape[1])
            for seq in group.members:
                seq.prefill_s = prefill_s
            choose_tokens(group, logits, config.sampling, t0, first=True)
            groups.append(group)
        del session
    decode_groups(model, method, groups, config.sampling, max_new)
    gens = generations(groups, method, len(pairs))
    if not batched:
        return gens
    out, k = [], 0
    for qs in per_context:
        out.append(gens[k:k + len(qs)])
        k += len(qs)
    return out


@dataclass
class Forced:
    """One sequence of :func:`teacher_force`: each continuation token's negative log-likelihood (nats, float32 on
    the CPU, ``[n]``) given the prompt and the continuation before it, how far each token's log-probability lies
    below the step's most likely token's (``margin``, ``[n]``, 0 where the token is the greedy choice), and the
    run's statistics (``new_tokens`` counts the continuation's tokens, ``decode_tokens_per_s`` the tokens fed per
    second of decoding)."""

    nll: torch.Tensor
    stats: GenerationStats
    margin: torch.Tensor


@torch.inference_mode()
def teacher_force(model: LoadedModel, prompts, continuations, method: str | Method | None = "full", *,
                  params: dict | None = None, chunk_size: int | list[int] | None = None) -> list[Forced]:
    """Prefill each prompt with `method` (compressed as any prompt), then feed its reference continuation one token
    per decoding step through the method's decode hooks, exactly as a generated token is fed, so eviction and
    decode-time selection act as they would while generating; the logits before each step score the token fed in
    it (the first from the prompt's last position, as a first generated token is chosen).

    `prompts` is a batch of token-id lists and `continuations` one id list per prompt, all of one length.
    Prompts of one length are rows of one session (one per prompt where the method keeps one sequence per
    session), so every step is one forward over them. `chunk_size`: the prompt fed in chunks of that many tokens, or
    of the given lengths (the chunks a serving engine's scheduler chose, to compare with its outputs).
    """
    model = check_loaded_model(model)
    method = resolve_method(method, params)
    prompts, _ = encode_prompts(model, [list(p) for p in prompts])
    if len(continuations) != len(prompts) or len({len(c) for c in continuations}) != 1 or not len(continuations[0]):
        raise AttnkitError(f"teacher_force needs one non-empty continuation per prompt, all of one length "
                           f"({len(prompts)} prompts, continuation lengths {sorted({len(c) for c in continuations})})")
    n = len(continuations[0])
    targets = torch.tensor([list(c) for c in continuations], dtype=torch.long, device=model.device)
    lengths = [int(p.shape[0]) for p in prompts]
    for i, length in enumerate(lengths):
        check_length(model, length, n, f"prompt {i}")
    plan = group_prompts(lengths, method)
    sessions = [new_session(model, method, lengths[idx[0]], n, rows=len(idx)) for idx in plan]
    for session in sessions:
        planned_slots(session)  # the method's one-line refusal of parameters that do not fit, before any work
    out: list[Forced | None] = [None] * len(prompts)
    for idx, session in zip(plan, sessions, strict=True):
        rows, start = targets[idx], lengths[idx[0]]
        sync(model.device)
        t0 = time.perf_counter()
        hidden = prefill(model, session, torch.stack([prompts[i] for i in idx]), chunk_size)
        scored = [_scores(model, hidden[:, -1], rows[:, 0])]
        sync(model.device)
        prefill_s = time.perf_counter() - t0
        for t in range(n - 1):
            hidden = decode_step(model, session, rows[:, t:t + 1], start + t)
            scored.append(_scores(model, hidden[:, -1], rows[:, t + 1]))
        nll = torch.stack([a for a, _ in scored], dim=1).float().cpu()
        margin = torch.stack([b for _, b in scored], dim=1).float().cpu()
        sync(model.device)
        decode_s = time.perf_counter() - t0 - prefill_s
        cache = session.cache
        for r, i in enumerate(idx):
            stats = GenerationStats(
                method=method.describe(), prompt_tokens=start, new_tokens=n, prefill_s=prefill_s, ttft_s=prefill_s,
                decode_s=decode_s, decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                peak_kv_bytes=cache.peak_row_bytes, final_kv_bytes=cache.row_nbytes(), peak_rss_bytes=peak_rss_bytes(),
                finish_reason="length", method_stats=method.run_stats(session), batch_size=len(prompts))
            out[i] = Forced(nll[r], stats, margin[r])
    return out


def _scores(model: LoadedModel, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NLL (nats) of `target` ``[rows]`` under the logits of `hidden` ``[rows, hidden]``, and its log-probability
    minus the largest one (``<= 0``)."""
    logp = torch.log_softmax(logits_of(model, hidden).float(), dim=-1)
    chosen = logp.gather(-1, target.to(logp.device)[:, None])[:, 0]
    return -chosen, chosen - logp.max(dim=-1).values
