"""``kvzip``: keep the entries the model needs to repeat the prompt (Kim, Kim, Kwon, Lee, Yun, Song, 2025, "KVzip:
Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv 2505.23416; kvpress's ``KVzipPress``).

**Why.** A cache that lets the model reconstruct its context holds what any later question about that context
needs, so the importance of an entry is measured without knowing the question (the paper's section 3). After the
prompt (the context ``c``, ``n`` tokens) is prefilled, the model reads a *reconstruction input*, a repeat prompt
followed by the context itself (teacher forced), at the positions after the context, attending to the cached
context and to the input's own earlier tokens. Each cached entry of layer ``l`` and kv head ``h`` scores the most
attention it receives while the model repeats (section 3, Algorithm 1 of appendix A)::

    S[l, h, j] = max over the query heads g of kv group h and the input's queries i of A[g, i, j],
    A = softmax(Q_in K^T * scaling) over the keys the queries see,

and each kv head keeps its ``B`` best entries (``head_budgets=uniform``), or the layer keeps its ``kv x B`` best
across its kv heads (``head_budgets=adaptive``, the paper's non-uniform head budgets, with AdaKV's safeguard
``alpha_safeguard``; 0 gives the paper's rule). The first ``n_sink`` positions are always kept.

**Chunked reconstruction** (appendix A, Algorithm 1: chunks of ``m`` = 2K tokens; kvpress's ``chunk_size``): the
context is repeated ``chunk_size`` tokens per forward, so one forward holds at most ``chunk_size`` plus the
prompt's tokens. Chunk 1's input is ``REPEAT_PROMPT + ANSWER_PREFIX + c_1``; chunk ``t > 1``'s is
``CONTINUE_PROMPT + (the last OVERLAP tokens of c_{t-1}) + ANSWER_PREFIX + c_t`` (the texts of the authors' code
and of kvpress for a tokenizer without a chat template; attnkit prompts carry no chat template, so none is added
here). Every forward attends to the whole cached context (its outputs feed the next layer as in the authors'
code), but the softmax of the score runs over the keys of the chunk being repeated, the first
``min(n_sink, start)`` positions (the sinks) and the input's own keys, as the authors' code and kvpress do; a
context of at most ``chunk_size`` tokens is one chunk, where this is the formula above over every key.

**What is discarded.** The reconstruction input's own keys and values never enter the cache (they live only
inside each layer's attention call) and its hidden states are dropped, so the tokens the user gets are computed
from the prompt's own prefill and the compressed cache: the prompt's logits are full attention's (on a CPU, where
the reconstruction's kernel beats SDPA's, the prompt's attention runs through it too, equal within float32
rounding), and at a budget that holds the whole prompt no reconstruction runs (exactly ``full``). The prompt's input
embeddings are kept beside the cache until the reconstruction (``rows x n x hidden``), then released.

**How it runs.** The reconstruction needs every layer of the model after the whole prompt, so kvzip is a
model-level method (:meth:`run_layers`): it runs the prompt's chunks through the decoder as usual (storing,
nothing evicted), then one forward per reconstruction chunk (a :class:`ReconstructionStep`), each layer scoring
its cached entries; the last chunk compresses each layer as soon as its attention is done. Since the hidden states
are dropped, a forward stops at the last layer that scores, whose attention computes its score alone. A
model's own sliding window applies to the reconstruction as to any attention, so an entry outside every
reconstruction query's window scores 0 (kvpress scores without the window). Decoding appends generated tokens
(``decode_every`` is refused: the score exists only for the prompt). ``AttnkitCache`` (inside ``model.generate``)
and ``compose`` refuse model-level methods; batches work (every row reconstructs its own prompt in the same
forwards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.attention import attend
from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers, run_layer_attention
from attnkit.methods import scoring_native, scoring_triton
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.scoring import MIN_BLOCK_QUERIES, block_elements_for, visible
from attnkit.methods.spec import register
from attnkit.session import LayerContext, Session, Step, layer_contexts
from attnkit.validate import whole

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
CONTINUE_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
ANSWER_PREFIX = "\n"
OVERLAP = 8  # tokens of the previous chunk that start a later chunk's reconstruction input
# Most keys (the prompt and the reconstruction input) for which one pass computes a reconstruction forward's output
# and score, by device type (None: no limit), where no kernel scores (a CPU without the C++ kernel, a window). Each
# block of the one pass reads every key it sees; on a CPU, past about this many, SDPA's fused kernel for the output
# plus a pass over the scored keys alone is faster (benchmarks/bench_scoring.py; docs/benchmarks.md).
ONE_PASS_MAX_KEYS = {"cpu": 12288, "default": None}
# Below this sum of the scored keys' exponentials (shifted by the row's maximum) they are recomputed, shifted by their
# own maximum: theirs is then at least ~57 below the row's, near where float32 exponentials turn subnormal (~87).
UNDERFLOW = 1e-25


@dataclass
class KVzipState(PromptScorerState):
    """Per layer: the most attention each prompt entry received while the model repeated the prompt."""

    score: torch.Tensor | None = None  # [b, kv, n] float32, until the layer is compressed


@dataclass
class KVzipRun:
    """Per generation: the prompt's input embeddings, chunk by chunk, until the reconstruction."""

    embeddings: list = field(default_factory=list)


@dataclass
class ReconstructionStep(Step):
    """A forward of one reconstruction input, which repeats the prompt positions ``start..end-1``."""

    start: int = 0
    end: int = 0
    last_layer: int = 0  # the last layer that scores: its output, and any later layer, is never needed


def max_attention(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  columns: slice, window: int | None = None) -> torch.Tensor:
    """The most attention each key of `columns` receives: ``[b, kv, columns]`` (float32), the maximum over the
    queries `q` ``[b, hq, m, d]`` (at `q_pos`) and the query heads of each kv group of the softmax of the scaled
    logits over `keys` ``[b, kv, L, d]`` (at `k_pos` ``[L]``, causal by position, within `window`). Queries go in
    blocks of at most :data:`~attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` (query head x query x key) entries; the
    maximum of ``exp(logit - logsumexp)`` is taken on the logits, so no probability matrix is written."""
    b, hq, m, d = q.shape
    kv, length = keys.shape[1], keys.shape[2]
    g = hq // kv
    limit = block_elements_for(q.device)
    block = max(1, limit // max(1, b * hq * length))
    grouped = q.reshape(b, kv, g, m, d)
    best = torch.full((b, kv, columns.stop - columns.start), float("-inf"), device=q.device)
    for s in range(0, m, block):
        e = min(m, s + block)
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
        logits = torch.matmul(qb, keys.transpose(-1, -2)).float().mul_(scaling).view(b, kv, g, e - s, length)
        logits.masked_fill_(~visible(q_pos[s:e], k_pos, window), float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        best = torch.maximum(best, (logits[..., columns] - lse).amax(dim=(2, 3)))
    return best.exp_()


def reconstruction_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, start: int,
                             end: int, sink: int, window: int | None = None, one_pass: bool | None = None,
                             kernels: bool | None = None, native: bool | None = None, output: bool = True
                             ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One reconstruction forward's attention in one layer, and its score.

    `q` ``[b, hq, m, d]`` are the input's queries at positions ``n..n+m-1``; `keys`/`values` ``[b, kv, n+m, d]`` hold
    the prompt (positions ``0..n-1``, in order) and then the input's own entries. Returns the attention output
    ``[b, hq, m, d]`` (causal by position, within `window`) and the score of prompt positions ``start..end-1``
    ``[b, kv, end-start]`` (float32): the maximum over the queries and the query heads of each kv group of the same
    logits' softmax over the scored keys only (the sinks ``0..sink-1``, the chunk ``start..end-1`` and the own keys).
    `one_pass` (None: up to :data:`ONE_PASS_MAX_KEYS` keys, and never where a kernel scores) computes both in one
    pass over the logits; otherwise the output comes from SDPA's fused kernel (:func:`attnkit.attention.attend`) and
    the score from a second pass over the scored keys: with `kernels` (None: on a CUDA device with Triton, no window)
    two kernels that tile queries and keys (:mod:`attnkit.methods.scoring_triton`: the scored keys' log-sum-exp per
    query, then the chunk's maximum), with `native` (None: where :func:`attnkit.methods.scoring_native.kernel_pays`,
    no window) the CPU kernel: one sweep over every key for the output and the score (its softmax over the scored
    keys kept beside the full one), or, where that sum loses precision, a sweep for the output and one over the
    scored keys; otherwise :func:`max_attention`. Without `output` (the last layer that scores: what it would give
    the next layer is never read) only the score is computed, and the output returned is None."""
    total = keys.shape[2]
    tiled = window is None and scoring_triton.kernels_pay(q) if kernels is None else kernels
    if native is None:
        native = not tiled and window is None and scoring_native.kernel_pays(q, keys)
    if (tiled or native) and window is not None:
        raise ValueError(f"the kernels take no window (window={window})")
    if one_pass is None:
        limit = ONE_PASS_MAX_KEYS.get(q.device.type, ONE_PASS_MAX_KEYS["default"])
        one_pass = not tiled and not native and (limit is None or total <= limit)
    if one_pass and output:
        return one_pass_reconstruction(q, keys, values, scaling, start, end, sink, window)
    n = total - q.shape[2]
    positions = torch.arange(total, device=q.device)
    scored = torch.cat([positions[:sink], positions[start:end], positions[n:]])
    sweeps = native and scoring_native.kernel_pays(q, keys, values)  # the kernel's sweeps with the output
    if sweeps and output and end > start:
        mask = torch.zeros(total, dtype=torch.bool)
        mask[scored] = True
        both = scoring_native.prompt_attention_with_subset_statistics(q, keys, values, scaling, mask,
                                                                      slice(start, end), reduce="max", rows="max")
        if both is not None:
            return both
    out = None
    if output:
        out = (scoring_native.prompt_attention(q, keys, values, scaling) if sweeps
               else attend(q, keys, values, scaling, positions[n:], positions, window))
    if end <= start:  # nothing to score
        return out, torch.zeros(keys.shape[:2] + (0,), dtype=torch.float32, device=q.device)
    if tiled:
        shift = scoring_triton.row_normalisers(q, keys[:, :, scored], scaling, positions[n:], scored)
        return out, scoring_triton.column_statistics(q, keys[:, :, start:end], scaling, positions[n:],
                                                     positions[start:end], shift, rows="max", reduce="max")
    if native:  # gathered, the scored keys are a prefix every query sees (sinks, chunk), then the input's own keys
        best = scoring_native.prompt_statistics(q, keys[:, :, scored], scaling, reduce="max", rows="max")
        return out, best[..., sink:sink + end - start]
    return out, max_attention(q, keys[:, :, scored], scaling, positions[n:], scored, slice(sink, sink + end - start),
                              window)


def one_pass_reconstruction(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, start: int,
                            end: int, sink: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reconstruction_attention` in one pass per block of queries (about
    :data:`~attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` query head x query x key entries): the logits over the
    keys the block sees, their exponentials, the output from their full normalisation and the score from their
    normalisation over the scored keys (recomputed with the scored keys' own maximum where the row's maximum lies so
    far above them that their exponentials lose precision, :data:`UNDERFLOW`)."""
    b, hq, m, d = q.shape
    kv, total = keys.shape[1], keys.shape[2]
    n, g = total - m, hq // kv
    limit = block_elements_for(q.device)
    block = max(MIN_BLOCK_QUERIES, limit // max(1, b * hq * total))
    grouped = q.reshape(b, kv, g, m, d)
    out = torch.empty(b, kv, g, m, values.shape[-1], dtype=q.dtype, device=q.device)
    best = torch.zeros(b, kv, end - start, dtype=torch.float32, device=q.device)
    positions = torch.arange(total, device=q.device)
    for s in range(0, m, block):
        e = min(m, s + block)
        lo, hi = (0 if window is None else max(0, n + s - window + 1)), n + e  # the keys this block sees
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
        logits = torch.matmul(qb, keys[:, :, lo:hi].transpose(-1, -2)).float().mul_(scaling)
        logits = logits.view(b, kv, g, e - s, hi - lo)
        q_pos = positions[n + s:n + e]
        # only the block's own newest keys (causal) and, with a window, its oldest ones can hide from a query
        for a, z in {(max(lo, n + s), hi), (lo, min(hi, lo + e - s))} if window is not None else {(n + s, hi)}:
            logits[..., a - lo:z - lo].masked_fill_(~visible(q_pos, positions[a:z], window), float("-inf"))
        ex = (logits - logits.amax(-1, keepdim=True)).exp_()
        parts = [(max(a, lo) - lo, min(z, hi) - lo) for a, z in ((0, sink), (start, end), (n, total))]
        parts = [(a, z) for a, z in parts if z > a]
        c0, c1 = max(start, lo), min(end, hi)
        if c1 > c0:  # the score: the exponentials normalised over the scored keys only
            scored = ex
            z_scored = sum(scored[..., a:z].sum(-1, keepdim=True) for a, z in parts)
            if bool((z_scored < UNDERFLOW).any()):  # the scored keys' exponentials lose precision: shift again
                scored_top = torch.stack([logits[..., a:z].amax(-1) for a, z in parts]).amax(0).unsqueeze(-1)
                scored = (logits - scored_top).exp_()
                z_scored = sum(scored[..., a:z].sum(-1, keepdim=True) for a, z in parts)
            chunk = (scored[..., c0 - lo:c1 - lo] / z_scored).amax(dim=(2, 3))
            best[..., c0 - start:c1 - start] = torch.maximum(best[..., c0 - start:c1 - start], chunk)
        probs = ex.div_(ex.sum(-1, keepdim=True)).view(b, kv, g * (e - s), hi - lo)
        out[:, :, :, s:e] = torch.matmul(probs.to(values.dtype), values[:, :, lo:hi]).view(b, kv, g, e - s, -1)
    return out.view(b, hq, m, -1), best


def prompt_then(model, step: Step, hidden: torch.Tensor, second: type, acts, after) -> torch.Tensor:
    """``run_layers`` of a method that reads its prompt a second time once the prompt is in (kvzip's reconstruction,
    kvgrad's, kvcompose's replay, restorekv's pass): every chunk runs the layers as usual and its input embeddings are
    kept, then after the last chunk ``after(session, embeddings)`` runs with the whole prompt's ``[rows, n, hidden]``.
    A step of the `second` pass itself, a step past the prompt, or a session where ``acts(session)`` is false runs
    the layers only."""
    session = step.session
    prompt = step.phase == "prefill" and not isinstance(step, second) and int(step.q_pos[0]) < session.prompt_len
    if not prompt or not acts(session):
        return run_decoder_layers(model, hidden, step.q_pos, step)
    run = session.state
    run.embeddings.append(hidden)
    out = run_decoder_layers(model, hidden, step.q_pos, step)
    if step.last_chunk:
        embeddings, run.embeddings = torch.cat(run.embeddings, dim=1), []
        after(session, embeddings)
    return out


@register
@dataclass(frozen=True)
class KVzip(PromptScorer):
    """Per kv head (or across the layer's kv heads, ``head_budgets=adaptive``), the prompt entries that receive the
    most attention while the model repeats the prompt; sinks kept; decode appends."""

    chunk_size: int = 2048
    n_sink: int = 4

    name = "kvzip"
    layer_state_type = KVzipState
    summary = "keep what the model attends to when asked to repeat the prompt (KVzip, Kim et al. 2025)"
    kvpress = "KVzipPress"
    threshold_refusal = reindex_refusal = "its scores come from a reconstruction pass that compresses the layers itself"  # score_threshold, positions=reindexed

    def __post_init__(self):
        super().__post_init__()
        whole("chunk_size", self.chunk_size, 1, what=" (prompt tokens repeated per reconstruction forward)")
        whole("n_sink", self.n_sink, 0, what=" (first positions always kept)")
        if self.decode_every:
            raise AttnkitError(f"kvzip scores the prompt by reconstructing it, once; decode_every="
                               f"{self.decode_every} is not supported (generated tokens are appended)")

    def budget_floor(self) -> int:
        return self.n_sink

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        self.check_sinks(ctx, budget)

    def new_session_state(self) -> KVzipRun:
        return KVzipRun()

    # ---- the model-level hook: the prompt, then its reconstruction -------------------------------------
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        return prompt_then(model, step, hidden, ReconstructionStep,
                           lambda session: any(self.evicts(ctx) for ctx in layer_contexts(session)),
                           lambda session, embeddings: self.reconstruct(model, session, embeddings))

    def reconstruct(self, model, session: Session, embeddings: torch.Tensor) -> None:
        """Run the reconstruction inputs of the prompt (input embeddings `embeddings` ``[rows, n, hidden]``) through
        the decoder, chunk by chunk; each layer scores its entries, and is compressed by the last chunk. The layers
        run up to the last one that scores, which runs its attention alone: the hidden states are dropped, so no
        later layer is needed, nor that layer's attention output or MLP."""
        n, rows = session.prompt_len, embeddings.shape[0]
        last = max(ctx.index for ctx in layer_contexts(session) if self.evicts(ctx))
        embed = model.hf.model.embed_tokens

        def text(words: str) -> torch.Tensor:
            ids = model.tokenizer(words, add_special_tokens=False).input_ids
            return embed(torch.tensor(ids, dtype=torch.long, device=embeddings.device))[None].expand(rows, -1, -1)

        first, later, answer = text(REPEAT_PROMPT), text(CONTINUE_PROMPT), text(ANSWER_PREFIX)
        starts = range(0, n, self.chunk_size)
        for i, start in enumerate(starts):
            end = min(n, start + self.chunk_size)
            head = [first] if start == 0 else [later, embeddings[:, max(0, start - OVERLAP):start]]
            x = torch.cat(head + [answer, embeddings[:, start:end]], dim=1)
            pos = torch.arange(n, n + x.shape[1], device=x.device)
            step = ReconstructionStep(session, "prefill", pos, i == len(starts) - 1, start=start, end=end,
                                      last_layer=last)
            run_layer_attention(model, run_decoder_layers(model, x, pos, step, layers=range(last)), pos, step, last)

    # ---- attention hooks ---------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        step = ctx.step
        if not isinstance(step, ReconstructionStep):  # the prompt: stored and attended in full
            return super().prefill_attention(ctx, q, k, v)
        keys, values, _ = ctx.kv.view()  # the whole prompt, positions 0..n-1 in order (nothing evicted yet)
        scores = self.evicts(ctx)  # a layer that keeps everything needs only the output (an empty chunk)
        output = ctx.index < step.last_layer
        out, score = reconstruction_attention(q, torch.cat([keys, k], 2), torch.cat([values, v], 2), ctx.scaling,
                                              step.start, step.end if scores else step.start,
                                              min(self.n_sink, step.start), ctx.native_window, output=output)
        if scores:
            st = ctx.state
            if st.score is None:
                st.score = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
            st.score[:, :, step.start:step.end] = score
        return out if output else q.new_zeros(q.shape[:3] + v.shape[-1:])

    def prefill_output(self, ctx: LayerContext, q, keys, values, positions) -> torch.Tensor:
        # the prompt of a layer that will be scored: on a CPU, its causal attention by the kernel that computes the
        # reconstruction's output, where that beats SDPA's kernels here (an unlimited budget keeps SDPA's path)
        if (not isinstance(ctx.step, ReconstructionStep) and ctx.native_window is None and self.evicts(ctx)
                and scoring_native.ends_with_queries(ctx.q_pos, positions)
                and scoring_native.kernel_pays(q, keys, values, output_only=True)):
            return scoring_native.prompt_attention(q, keys, values, ctx.scaling)
        return super().prefill_output(ctx, q, keys, values, positions)

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        # the prompt's last chunk: nothing yet (its reconstruction scores it); the reconstruction's last chunk:
        # this layer's scores are complete, keep its best entries
        if isinstance(ctx.step, ReconstructionStep):
            super().after_prefill(ctx, q, k, v)
            ctx.state.score = None

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.state.score

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return ctx.kv.view()[2] < self.n_sink if self.n_sink else None
