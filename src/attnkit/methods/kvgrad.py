"""``kvgrad``: keep the entries whose contribution, while the model repeats the prompt, matters most to its last hidden
states by input x gradient attribution (KVgrad, OpenReview forum id ``cg1wTCJjjk``, 2026; kvpress's ``KVgradPress``,
NVIDIA/kvpress pull request 279. The paper's text was not readable offline here: the rule below is the one the press's
docstring and that pull request state, checked against the press's code).

**The rule.** As in ``kvzip`` (Kim et al., 2025, arXiv 2505.23416), after the prompt (``n`` tokens) is prefilled the
model reads a *reconstruction input*, a repeat prompt followed by the prompt itself (teacher forced), at positions
``n, n+1, ...``, attending to the cached prompt and to its own earlier tokens, chunk by chunk (kvzip's chunks and
texts, ``chunk_size`` prompt tokens per forward). Instead of the attention an entry receives, kvgrad measures what it
writes into the residual stream and how much the model's last hidden states depend on that stream. With ``p`` the
reconstruction input's tokens (the probes), ``a_p^l`` the residual stream of probe ``p`` right after layer ``l``'s
attention, ``h_p^L`` the last decoder layer's output (before the final norm) and::

    Phi = sum over the probes p of ||h_p^L||^2                     (one objective per chunk)

entry ``c`` of layer ``l`` and kv head ``j`` scores::

    S[l, j, c] = max over the query heads g of kv group j and the probes p of
                 A[g, p, c] * ||W_O^{(g)} v_c|| * ||dPhi / d a_p^l||

``A`` is kvzip's attention of the probe over the scored keys (the softmax over the first ``min(n_sink, start)``
positions, the chunk being repeated and the input's own keys, causal), ``W_O^{(g)}`` the block of layer ``l``'s output
projection that reads query head ``g``, so ``A ||W_O v||`` is the size of what ``c`` adds to ``a_p^l`` through head
``g``, and the gradient's norm is how sensitive ``Phi`` is to ``a_p^l``; since ``a = residual + attention output``,
that gradient is the attention module's output's. The first ``n_sink`` positions are always kept; each kv head keeps
its ``B`` best (``head_budgets=uniform``) or the layer its ``kv x B`` best across its kv heads (``adaptive``; with
``alpha_safeguard=0`` kvpress's ``layerwise=True`` rule).

**How it runs.** A model-level method (:meth:`run_layers`), like ``kvzip``: the prompt's chunks run as usual (stored,
nothing evicted: its logits are full attention's), then per reconstruction chunk one forward through every layer with
autograd on, leaving inference mode (the cache's tensors were made in it; they are only read), and one backward of
``Phi`` to the attention outputs of the layers that evict (``torch.autograd.grad``: no parameter receives a
gradient). Each layer's forward attends densely over the whole cached prompt and its own keys (SDPA, differentiable,
the model's own sliding window applied); its queries and own keys are kept, detached, and once the gradient is known
the score comes from them in blocks of queries (no ``probes x keys`` matrix kept between the forward and the
backward). After the last chunk every layer is compressed. The reconstruction's entries never enter the cache; a
budget that keeps the whole prompt runs no reconstruction (exactly ``full``). Rows of a batch reconstruct their own
prompts in the same forwards (``Phi`` is a sum over rows, so each row's gradient is its own). Generated tokens are
appended (``decode_every`` is refused: the score exists for the prompt only).

**Against kvpress.** The same probes, ``Phi``, ``A``, value norms and maxima; kvpress's default ``layerwise=False``
ranks every layer's scores together (layers keep different counts), where attnkit keeps ``kv x B`` per layer, as its
budgets require; a model's sliding window applies to the reconstruction and its score here (kvpress scores without
it). ``AttnkitCache`` (inside ``model.generate``), ``compose`` and vLLM refuse it: it runs the model's layers itself,
forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit.attention import position_mask, sdpa
from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers
from attnkit.methods.kvzip import ANSWER_PREFIX, CONTINUE_PROMPT, OVERLAP, REPEAT_PROMPT, KVzipRun, prompt_then
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState
from attnkit.methods.scoring import block_elements_for, visible
from attnkit.methods.spec import register
from attnkit.placement import module_weight
from attnkit.session import LayerContext, Session, Step, layer_contexts
from attnkit.validate import whole

NORM_BLOCK = 256  # values projected through W_O at once (a [b, kv, group, block, hidden] tensor)


@dataclass
class KVgradState(PromptScorerState):
    """Per layer: each prompt entry's attribution score ``[b, kv, n]`` (float32), until the layer is compressed."""

    score: torch.Tensor | None = None


@dataclass
class GradientStep(Step):
    """The forward of one reconstruction input, which repeats prompt positions ``start..end-1``, with autograd on."""

    start: int = 0
    end: int = 0
    # per layer that evicts: (queries [b, hq, m, d], own keys [b, kv, m, d], scaling, window), detached
    inputs: dict = field(default_factory=dict)


def value_output_norms(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``||W_O^{(g)} v||`` ``[b, kv, group, t]`` (float32) for every value `values` ``[b, kv, t, d]`` of kv head ``j``
    and every query head ``g`` of its group, `weight` being the output projection ``[hidden, q_heads x d]`` (query
    head ``j x group + g`` reads kv head ``j``)."""
    b, kv, t, d = values.shape
    hidden = weight.shape[0]
    if weight.shape[1] % (kv * d):
        raise AttnkitError(f"kvgrad: o_proj reads {weight.shape[1]} inputs, not a multiple of {kv} kv heads x {d} dims")
    group = weight.shape[1] // (kv * d)
    w = weight.float().t().reshape(kv, group, d, hidden).to(values.device)
    out = torch.empty(b, kv, group, t, dtype=torch.float32, device=values.device)
    for s in range(0, t, NORM_BLOCK):
        e = min(t, s + NORM_BLOCK)
        out[..., s:e] = torch.einsum("bjtd,jgdh->bjgth", values[:, :, s:e].float(), w).norm(dim=-1)
    return out


def attribution(q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor, k_pos: torch.Tensor,
                columns: slice, value_norm: torch.Tensor, grad_norm: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
    """``[b, kv, columns]`` (float32): for each key of `columns`, the maximum over the queries `q` ``[b, hq, m, d]`` (at
    `q_pos`) and the query heads ``g`` of each kv group of ``A[g, i, j] x value_norm[g, j] x grad_norm[i]``, ``A`` the
    softmax of the scaled logits over `keys` ``[b, kv, L, d]`` (at `k_pos` ``[L]``, causal, within `window`),
    `value_norm` ``[b, kv, group, columns]``, `grad_norm` ``[b, m]``. Queries go in blocks of about
    :data:`~attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` logits."""
    b, hq, m, d = q.shape
    kv, length = keys.shape[1], keys.shape[2]
    g = hq // kv
    block = max(1, block_elements_for(q.device) // max(1, b * hq * length))
    grouped = q.float().reshape(b, kv, g, m, d)
    keys_t = keys.float().transpose(-1, -2)
    vn = value_norm[:, :, :, None, :]
    best = torch.zeros(b, kv, columns.stop - columns.start, device=q.device)
    for s in range(0, m, block):
        e = min(m, s + block)
        logits = torch.matmul(grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d), keys_t).mul_(scaling)
        logits = logits.view(b, kv, g, e - s, length).masked_fill_(~visible(q_pos[s:e], k_pos, window), float("-inf"))
        weighted = torch.softmax(logits, dim=-1)[..., columns] * vn * grad_norm[:, None, None, s:e, None]
        best = torch.maximum(best, weighted.amax(dim=(2, 3)))
    return best


@register
@dataclass(frozen=True)
class KVgrad(PromptScorer):
    """Per kv head (or across the layer's kv heads, ``head_budgets=adaptive``), the prompt entries whose attention
    output, while the model repeats the prompt, the last hidden states depend on most (input x gradient); sinks kept;
    decode appends."""

    chunk_size: int = 512
    n_sink: int = 4

    name = "kvgrad"
    vllm_refusal = (" (it scores the prompt with a backward pass through every layer of a second forward, which "
                    "vLLM's model runner does not run)")
    layer_state_type = KVgradState
    summary = "keep what the last hidden states depend on most while the model repeats the prompt (KVgrad, 2026)"
    kvpress = "KVgradPress"
    threshold_refusal = reindex_refusal = "its scores come from a reconstruction pass that compresses the layers itself"  # score_threshold, positions=reindexed

    def __post_init__(self):
        super().__post_init__()
        whole("chunk_size", self.chunk_size, 1, what=" (prompt tokens repeated per reconstruction forward)")
        whole("n_sink", self.n_sink, 0, what=" (first positions always kept)")
        if self.decode_every:
            raise AttnkitError(f"kvgrad scores the prompt by reconstructing it, once; decode_every="
                               f"{self.decode_every} is not supported (generated tokens are appended)")
        if self.criticalkv:
            raise AttnkitError("kvgrad already weighs each entry by its value through the output projection; "
                               "criticalkv=true is not supported with it")

    def budget_floor(self) -> int:
        return self.n_sink

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        self.check_sinks(ctx, budget)

    def new_session_state(self) -> KVzipRun:
        return KVzipRun()

    # ---- the model-level hook: the prompt, then its reconstruction with gradients ---------------------------
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        return prompt_then(model, step, hidden, GradientStep,
                           lambda session: any(self.evicts(ctx) for ctx in layer_contexts(session)),
                           lambda session, embeddings: self.reconstruct(model, session, embeddings))

    def reconstruct(self, model, session: Session, embeddings: torch.Tensor) -> None:
        """Score every prompt entry of the layers that evict from the reconstruction of the prompt (input embeddings
        `embeddings` ``[rows, n, hidden]``), one forward and one backward per chunk, then compress those layers."""
        contexts = layer_contexts(session)
        scoring = [ctx.index for ctx in contexts if self.evicts(ctx)]
        attention = [model.hf.model.layers[i].self_attn for i in scoring]
        for i, module in zip(scoring, attention):
            if not isinstance(getattr(getattr(module, "o_proj", None), "weight", None), torch.Tensor):
                raise AttnkitError(f"kvgrad weighs values by each layer's output projection (o_proj), which layer "
                                   f"{i}'s attention module does not have")
        n, rows = session.prompt_len, embeddings.shape[0]
        embed = model.hf.model.embed_tokens
        # the cache and the embeddings were made in inference mode: read only; autograd runs on new tensors
        with torch.inference_mode(False), torch.enable_grad():
            def text(words: str) -> torch.Tensor:
                ids = model.tokenizer(words, add_special_tokens=False).input_ids
                out = embed(torch.tensor(ids, dtype=torch.long, device=embeddings.device)).detach()
                return out[None].expand(rows, -1, -1)

            first, later, answer = text(REPEAT_PROMPT), text(CONTINUE_PROMPT), text(ANSWER_PREFIX)
            for start in range(0, n, self.chunk_size):
                end = min(n, start + self.chunk_size)
                head = [first] if start == 0 else [later, embeddings[:, max(0, start - OVERLAP):start]]
                x = torch.cat(head + [answer, embeddings[:, start:end]], dim=1)
                self.score_chunk(model, contexts, scoring, attention, x, start, end)
        for ctx in contexts:  # every layer's scores are complete: keep its best entries
            super().after_prefill(ctx, None, None, None)
            ctx.state.score = None

    def score_chunk(self, model, contexts: list[LayerContext], scoring: list[int], attention: list, x: torch.Tensor,
                    start: int, end: int) -> None:
        """One reconstruction forward of the input `x` ``[rows, m, hidden]`` (it repeats prompt positions
        ``start..end-1``), the gradient of ``Phi`` at the attention outputs of the layers `scoring`, and their
        scores of those positions."""
        session = contexts[0].session
        n = session.prompt_len
        pos = torch.arange(n, n + x.shape[1], device=x.device)
        step = GradientStep(session, "prefill", pos, False, start=start, end=end)
        outputs: dict = {}
        hooks = [module.register_forward_hook(lambda mod, args, out, i=i: outputs.__setitem__(i, out[0]))
                 for i, module in zip(scoring, attention)]
        try:
            last = run_decoder_layers(model, x.detach().requires_grad_(True), pos, step)
        finally:
            for hook in hooks:
                hook.remove()
        phi = last.float().square().sum()
        grads = torch.autograd.grad(phi, [outputs[i] for i in scoring], allow_unused=True)
        del last, phi
        outputs.clear()
        with torch.no_grad():
            for i, module, grad in zip(scoring, attention, grads):
                ctx = contexts[i]
                q, own, scaling, window = step.inputs.pop(i)
                keys, values, _ = ctx.kv.view()  # the whole prompt, positions 0..n-1 in order
                sink = min(self.n_sink, start)
                scored = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + q.shape[2])])
                grad_norm = (torch.zeros(q.shape[0], q.shape[2], device=q.device) if grad is None
                             else grad.float().norm(dim=-1).to(q.device))
                score = attribution(q, torch.cat([keys[:, :, :sink], keys[:, :, start:end], own], 2), scaling,
                                    pos.to(q.device), scored.to(q.device), slice(sink, sink + end - start),
                                    value_output_norms(values[:, :, start:end], module_weight(module.o_proj)), grad_norm,
                                    window)
                st = ctx.state
                if st.score is None:
                    st.score = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
                st.score[:, :, start:end] = score

    # ---- attention hooks ---------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        step = ctx.step
        if not isinstance(step, GradientStep):  # the prompt: stored and attended in full
            return super().prefill_attention(ctx, q, k, v)
        keys, values, _ = ctx.kv.view()  # the whole prompt, positions 0..n-1 in order (nothing evicted yet)
        n, m = keys.shape[2], q.shape[2]
        positions = torch.arange(n + m, device=q.device)
        if self.evicts(ctx):
            step.inputs[ctx.index] = (q.detach(), k.detach(), ctx.scaling, ctx.native_window)
        return sdpa(q, torch.cat([keys, k], 2), torch.cat([values, v], 2), ctx.scaling,
                    mask=position_mask(positions[n:], positions, ctx.native_window))

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        pass  # the prompt's last chunk: its reconstruction scores it, then compresses every layer (reconstruct)

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.state.score

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor | None:
        return ctx.kv.view()[2] < self.n_sink if self.n_sink else None
