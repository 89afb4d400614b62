"""``kvcompose``: attention-guided composite tokens with a budget shared by the layers (Akulov, Sana, De Domenico, Si
Salem, Piovesan, Ayed, 2025, "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens",
arXiv 2509.05165; kvpress's ``KVComposePress``).

**Scores.** After the prompt (``n`` tokens) is prefilled and stored, the model reads the prompt a second time (a
*replay*, teacher forced, at the positions ``n..2n-1`` after it, as kvpress's pipeline feeds it), each replay query
attending to the whole cached prompt and to the replay's own earlier tokens, layer after layer. Each cached entry
``j`` of layer ``l`` gets, per query head, the largest (``agg_task=max``) or the mean (``mean``) attention
probability the replay's queries give it (the softmax over every key a query sees); the query heads of a kv group
are then combined (``agg_group``: mean or max) into ``S[l, h, j]``. Optionally each score is multiplied by its
value's norm (``add_v_norm``), and by default the mean over the layer's kv heads is added to every head's score
(``add_mean_across_heads``, for stability).

**Composite tokens and the global budget.** Each kv head of a layer sorts its scores, descending; the ``r``-th
*composite token* of the layer is the ``r``-th entries of all its kv heads together, scored by combining their
``r``-th scores over the kv heads (``agg_head``: mean or max). The first ``keep_token_lower_bound`` composite
tokens of every layer get ``1e9`` added (always kept), and layer 0's composite scores are raised to the largest of
any layer's at each rank (the first layer never gets the fewest). The ``N`` composite tokens of highest score over
the whole model decide how many each layer keeps (``N = int(budget x layers x n)``, or ``budget_tokens x layers``:
the budget is the mean over the layers, at least 1 and ``keep_token_lower_bound`` per layer); each kv head of layer
``l`` then keeps its own ``count[l]`` best entries, so the layer stays one rectangular tensor
(``structured=true``, the paper's method). ``structured=false`` ranks each kv head's sorted scores against every
other head of the model instead (``N`` per kv head times the layers and kv heads), so every kv head keeps its own
count (a flat layer, :meth:`attnkit.cache.LayerKV.keep_flat`).

**What differs from kvpress.** kvpress reduces its maxima over the batch too (one choice for the batch); here each
prompt chooses for itself (the method runs one sequence per session, ``batches=False``). kvpress's replay is left in
its cache by ``structured=false`` (decode then also attends to the replay's duplicated entries) and its
``add_v_norm=true`` multiplies ``n`` scores by ``2n`` value norms (it raises); here the replay's entries never enter
the cache and the value norms are the prompt's. kvpress replays the questions it is given instead of the context
when there are some (``register_prompt_ids``, which its pipeline does not call); attnkit replays the prompt.

**How it runs.** A model-level method (:meth:`run_layers`, like ``kvzip``): the prompt's chunks run as usual (stored,
nothing evicted, the prompt's logits exactly full attention's), then one replay forward computes every layer's
scores in blocks of queries (no ``n x 2n`` matrix), then every layer is compressed at once. At a budget that keeps
every entry no replay runs (exactly ``full``). Generated tokens are appended. ``AttnkitCache``, ``compose`` and vLLM
refuse it (a model-level hook; the kept count of a layer depends on the scores, so no plan exists ahead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnkit import masks
from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers, run_layer_attention
from attnkit.methods import scoring_native
from attnkit.methods.base import Method
from attnkit.methods.budget import check_budget
from attnkit.methods.kvzip import prompt_then
from attnkit.methods.scoring import block_elements_for, flat_attention, visible
from attnkit.methods.spec import register
from attnkit.session import LayerContext, Session, Step, layer_contexts
from attnkit.validate import choice, flag, whole

AGGREGATIONS = ("max", "mean")
ALWAYS = 1e9  # added to the first keep_token_lower_bound composite tokens of a layer


@dataclass
class KVComposeState:
    """Per layer: each prompt entry's replay score ``[b, kv, n]`` (float32), until the layer is compressed."""

    score: torch.Tensor | None = None


@dataclass
class KVComposeRun:
    """Per generation: the prompt's input embeddings, chunk by chunk, until the replay."""

    embeddings: list = field(default_factory=list)


@dataclass
class ReplayStep(Step):
    """The forward of the prompt's replay (positions ``n..2n-1``)."""

    last_layer: int = 0  # its output is never needed


def replay_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, n: int, task: str,
                     group: str, window: int | None = None, output: bool = True):
    """The replay's attention in one layer and the score of the `n` cached prompt entries. `q` ``[b, hq, m, d]`` are
    the replay's queries at positions ``n..n+m-1``; `keys`/`values` ``[b, kv, n+m, d]`` the prompt (positions
    ``0..n-1``) then the replay's own entries. Returns the output ``[b, hq, m, d]`` (None without `output`) and
    ``[b, kv, n]``: per query head the maximum or mean (`task`) over the queries of the softmax probability of each
    prompt entry, then the maximum or mean (`group`) over each kv group's query heads."""
    b, hq, m, d = q.shape
    kv, total = keys.shape[1], keys.shape[2]
    g = hq // kv
    if b == 1 and window is None and total == n + m:
        done = _replay_native(q, keys, values, scaling, n, task, group, output)
        if done is not None:
            return done
    positions = torch.arange(total, device=q.device)
    block = max(1, block_elements_for(q.device) // max(1, b * hq * total))
    grouped = q.reshape(b, kv, g, m, d)
    per_head = torch.full((b, kv, g, n), float("-inf") if task == "max" else 0.0, device=q.device)
    out = torch.empty(b, kv, g, m, values.shape[-1], dtype=q.dtype, device=q.device) if output else None
    for s in range(0, m, block):
        e = min(m, s + block)
        qb = grouped[:, :, :, s:e].reshape(b, kv, g * (e - s), d)
        logits = torch.matmul(qb, keys.transpose(-1, -2)).float().mul_(scaling).view(b, kv, g, e - s, total)
        logits.masked_fill_(~visible(positions[n + s:n + e], positions, window), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if task == "max":
            per_head = torch.maximum(per_head, probs[..., :n].amax(dim=3))
        else:
            per_head += probs[..., :n].sum(dim=3)
        if output:
            out[:, :, :, s:e] = torch.matmul(probs.view(b, kv, g * (e - s), total).to(values.dtype),
                                             values).view(b, kv, g, e - s, -1)
    if task == "mean":
        per_head /= m
    score = per_head.amax(dim=2) if group == "max" else per_head.mean(dim=2)
    return (None if out is None else out.view(b, hq, m, -1)), score


def _replay_native(q, keys, values, scaling, n, task, group, output):
    """:func:`replay_attention` of one sequence through the CPU scoring kernel (:mod:`attnkit.methods.scoring_native`)
    where it runs and pays, else None. The replay's queries sit at the last ``m`` of ``n + m`` contiguous positions,
    as the kernel's prompt queries do. The kernel reduces a kv group's query heads before the queries, this score the
    queries first (per head), so each query head runs as a kv head of its own: the group's heads become the batch
    (views, the keys and values shared through a zero stride)."""
    _, hq, m, d = q.shape
    kv = keys.shape[1]
    g = hq // kv
    heads = q[0].reshape(kv, g, m, d).transpose(0, 1)  # [g, kv, m, d]: batch j holds head j of every group
    shared_keys = keys.expand(g, -1, -1, -1)
    shared_values = values.expand(g, -1, -1, -1) if output else None
    if not scoring_native.kernel_pays(heads, shared_keys, shared_values):
        return None
    rows = "max" if task == "max" else "sum"
    if output:
        out, stats = scoring_native.prompt_attention_with_statistics(heads, shared_keys, shared_values, scaling,
                                                                     rows=rows)
        out = out.transpose(0, 1).reshape(1, hq, m, -1).to(values.dtype)
    else:
        out, stats = None, scoring_native.prompt_statistics(heads, shared_keys, scaling, rows=rows)
    per_head = stats[..., :n]  # [g, kv, n]
    if task == "mean":
        per_head = per_head / m
    score = per_head.amax(dim=0) if group == "max" else per_head.mean(dim=0)
    return out, score[None]


def composite_counts(scores: torch.Tensor, kept: int, head: str, structured: bool, lower_bound: int) -> torch.Tensor:
    """How many entries each layer (``[L]``, `structured`) or each layer and kv head (``[L, kv]``) keeps, from the
    scores ``[L, kv, n]`` of one prompt: the `kept` composite tokens of highest score over the model (see the module
    docstring)."""
    layers, kv, n = scores.shape
    ranked = scores.sort(dim=-1, descending=True).values  # [L, kv, n]: each head's scores by rank
    if not structured:
        ranked[..., :lower_bound] += ALWAYS
        top = ranked.reshape(-1).topk(kept).indices // n
        return torch.bincount(top, minlength=layers * kv).reshape(layers, kv)
    composite = ranked.amax(dim=1) if head == "max" else ranked.mean(dim=1)  # [L, n]
    composite[:, :lower_bound] += ALWAYS
    composite[0] = composite.amax(dim=0)
    top = composite.reshape(-1).topk(kept).indices // n
    return torch.bincount(top, minlength=layers).clamp(min=max(1, lower_bound))


@register
@dataclass(frozen=True)
class KVCompose(Method):
    """Composite tokens from the attention a replay of the prompt gives each entry, their count per layer from one
    budget for the whole model (KVCompose); decode appends."""

    budget: float | None = None
    budget_tokens: int | None = None
    structured: bool = True
    agg_task: str = "max"
    agg_group: str = "mean"
    agg_head: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0

    name = "kvcompose"
    vllm_refusal = (" (how many entries each layer keeps depends on its scores, so no plan of blocks exists before "
                    "the prompt is read)")
    summary = "keep composite tokens ranked by a replay's attention, counts per layer from one model-wide budget"
    kvpress = "KVComposePress"
    batches = False

    def __post_init__(self):
        check_budget(self.name, self.budget, self.budget_tokens)
        if isinstance(self.budget, (list, tuple)) or isinstance(self.budget_tokens, (list, tuple)):
            raise AttnkitError("kvcompose shares one budget over the model's layers; give a single budget or "
                               "budget_tokens, not one per layer")
        flag("structured", self.structured)
        choice("agg_task", self.agg_task, AGGREGATIONS)
        choice("agg_group", self.agg_group, AGGREGATIONS)
        choice("agg_head", self.agg_head, AGGREGATIONS)
        flag("add_v_norm", self.add_v_norm)
        flag("add_mean_across_heads", self.add_mean_across_heads)
        whole("keep_token_lower_bound", self.keep_token_lower_bound, 0,
              what=" (composite tokens every layer keeps first)")

    def new_layer_state(self) -> KVComposeState:
        return KVComposeState()

    def new_session_state(self) -> KVComposeRun:
        return KVComposeRun()

    def kept_total(self, session: Session, kv: int) -> int:
        """Entries the model keeps of the prompt over its layers (and kv heads, ``structured=false``)."""
        n, cells = session.prompt_len, session.n_layers * (1 if self.structured else kv)
        if self.budget_tokens is not None:
            return min(n, self.budget_tokens) * cells
        return max(1, int(n * cells * self.budget))

    def compresses(self, session: Session, kv: int) -> bool:
        return self.kept_total(session, kv) < session.prompt_len * session.n_layers * (1 if self.structured else kv)

    def decode_only_appends(self) -> bool:
        return self.structured  # a flat layer takes one token per step

    # ---- the model-level hook: the prompt, then its replay -------------------------------------------
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        def after(session, embeddings):
            self.replay(model, session, embeddings)
            self.compress(session)

        return prompt_then(model, step, hidden, ReplayStep,
                           lambda session: self.compresses(session, model.geometry.n_kv_heads), after)

    def replay(self, model, session: Session, embeddings: torch.Tensor) -> None:
        """The prompt read again at positions ``n..2n-1``: every layer scores its entries. The last layer runs its
        attention alone (its output is never needed)."""
        n, last = session.prompt_len, session.n_layers - 1
        pos = torch.arange(n, 2 * n, device=embeddings.device)
        step = ReplayStep(session, "prefill", pos, False, last_layer=last)
        run_layer_attention(model, run_decoder_layers(model, embeddings, pos, step, layers=range(last)), pos, step,
                            last)

    def compress(self, session: Session) -> None:
        """Every layer keeps its composite tokens' entries (see the module docstring), then forgets its scores."""
        contexts = layer_contexts(session)
        scores = []
        for ctx in contexts:
            score = ctx.state.score[0]  # [kv, n]; one sequence per session
            if self.add_v_norm:
                score = score * ctx.kv.view()[1][0].float().norm(dim=-1)
            if self.add_mean_across_heads:
                score = score + score.mean(dim=0, keepdim=True)
            scores.append(score)
            ctx.state.score = None
        scores = torch.stack(scores)  # [L, kv, n]
        kv = scores.shape[1]
        counts = composite_counts(scores, self.kept_total(session, kv), self.agg_head, self.structured,
                                  self.keep_token_lower_bound).tolist()
        spare = session.max_new_tokens
        for ctx, score, count in zip(contexts, scores, counts):
            if self.structured:
                kept = torch.stack([score[h].argsort(descending=True)[:count].sort().values for h in range(kv)])
                ctx.kv.keep(kept[None], spare=spare)
                continue
            chosen = [score[h].argsort(descending=True)[:count[h]].sort().values for h in range(kv)]
            heads = torch.cat([torch.full_like(c, h) for h, c in enumerate(chosen)])
            ctx.kv.keep_flat(heads[None], torch.cat(chosen)[None], spare=spare)

    # ---- attention hooks ------------------------------------------------------------------------------
    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        step = ctx.step
        if not isinstance(step, ReplayStep):  # the prompt: stored and attended in full
            return super().prefill_attention(ctx, q, k, v)
        keys, values, _ = ctx.kv.view()  # the whole prompt, positions 0..n-1 in order
        output = ctx.index < step.last_layer
        out, ctx.state.score = replay_attention(q, torch.cat([keys, k], 2), torch.cat([values, v], 2), ctx.scaling,
                                                keys.shape[2], self.agg_task, self.agg_group, ctx.native_window,
                                                output=output)
        return out if output else q.new_zeros(q.shape[:3] + v.shape[-1:])

    def decode_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        kv = ctx.kv
        if "head" not in kv.extras:
            return super().decode_attention(ctx, q, k, v)
        if q.shape[2] != 1:
            raise AttnkitError(f"kvcompose with structured=false decodes one token per step, got {q.shape[2]} at once")
        kv.append_flat(k, v, ctx.q_pos)
        keys, values, positions = kv.view()
        allowed = None
        if ctx.native_window is not None:
            allowed = masks.boolean_mask(masks.sliding_window(ctx.native_window), ctx.q_pos, positions)
        return flat_attention(q, keys, values, kv.extras["head"][:, :, :kv.length], k.shape[1], ctx.scaling, allowed)
