"""``criticalkv=true`` on a prompt scorer: a two-stage selection that re-weights the scorer's score by how much each
entry's value can move the attention output (CriticalKV: Feng, Lv, Cao, Xie, Zhou, 2025, "Identify Critical KV Cache
in LLM Inference from an Output Perturbation Perspective", arXiv 2502.03805; kvpress's ``CriticalKVPress`` and, with
``head_budgets=adaptive``, ``CriticalAdaKVPress``).

**Why.** A query head's attention output goes through the layer's output projection: ``o = sum_i A_i v_i W_o``
(``A_i`` the attention weight of entry ``i``, ``v_i`` its value, ``W_o`` the head's ``d x hidden`` block of the
output projection). Dropping a set ``E`` of entries perturbs it by at most ``sum_{i in E} A_i ||v_i W_o||_1`` (up to
the renormalisation of the kept weights), so an entry matters by its weight *times* the L1 norm of its projected
value, not by its weight alone. The paper bounds that worst case and selects greedily in two stages, so that entries
of high weight are never lost to the value term.

**The rule**, per kv head, at a compression keeping ``B`` entries (the prompt's, and each ``decode_every`` one):

1. the scorer's score ``s_i`` (its rank on its own scale: SnapKV's votes averaged over the observation window's
   queries, KNorm's ``-||k_i||``, ...; :meth:`~attnkit.methods.prompt_scorer.PromptScorer.critical_score`);
2. stage 1 keeps the protected entries (SnapKV's window, sinks) and the best by ``s`` up to
   ``max(1, int(first_stage_ratio x B))`` entries (0 with ``first_stage_ratio=0``);
3. stage 2 fills the rest of ``B`` with the entries of highest ``(s_i + epsilon) x n_i``, where
   ``n_i = mean over the query heads h of the kv group of ||v_i W_o[h]||_1`` (:func:`projected_value_norms`).

``head_budgets=adaptive`` (``CriticalAdaKVPress``): each kv head's count ``B_h`` is AdaKV's allocation by ``s`` (the
``kv x B`` best of the layer, each head's safeguard ``int(alpha_safeguard x B)`` best included,
:func:`~attnkit.methods.scoring.adaptive_keep`); stage 1 keeps the head's protected and safeguard entries and its
best ``int(first_stage_ratio x B_h)`` by ``s``; stage 2 fills ``B_h`` by ``(s + epsilon) x n`` (:func:`adaptive_keep`).

``W_o`` is read from the layer's attention module (``o_proj``), which the hosts hand over with the layer's input
(:meth:`attnkit.session.LayerContext.layer_module`): attnkit's runner and ``AttnkitCache``; vLLM's attention does not
see it (refused there). A model whose attention has no ``o_proj`` is refused in one line.

Against kvpress: the same rule and defaults (``epsilon=1e-4``, ``first_stage_ratio=0.5``). kvpress's stage-1 count is
``int((1 - compression_ratio) x L x first_stage_ratio)``, attnkit's ``int(B x first_stage_ratio)`` with
``B = int(L (1 - compression_ratio))``: equal at ``first_stage_ratio=0.5`` (halving cannot cross an integer that the
fraction dropped by ``int`` stays below), within one entry otherwise. kvpress gives SnapKV's window the highest score
instead of protecting it, so where stage 1 is smaller than the window kvpress may drop window entries that stage 2
ranks low, which attnkit never does; and ``CriticalAdaKVPress`` counts each head's budget over the whole batch, where
attnkit ranks each sequence alone.
"""

from __future__ import annotations

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.scoring import adaptive_keep as ada_allocation
from attnkit.placement import module_weight
from attnkit.validate import flag, number

EPSILON = 1e-4
FIRST_STAGE_RATIO = 0.5
NORM_BLOCK = 1024  # entries per block of the projected values (a block x group x hidden float32 tensor at once)


def check_critical(method) -> None:
    """Validate a prompt scorer's CriticalKV parameters (one line naming the bad value)."""
    flag("criticalkv", method.criticalkv)
    number("first_stage_ratio", method.first_stage_ratio, 0.0, 1.0,
           what=" (the share of the budget chosen by the scorer alone before the value-weighted stage)")
    number("critical_epsilon", method.critical_epsilon, 0.0, None, what=" (added to the score before it is weighted)")
    if not method.criticalkv and (method.first_stage_ratio != FIRST_STAGE_RATIO
                                  or method.critical_epsilon != EPSILON):
        raise AttnkitError(f"first_stage_ratio={method.first_stage_ratio} and critical_epsilon="
                           f"{method.critical_epsilon} apply with criticalkv=true only")
    if method.criticalkv and method.chunk_length:
        raise AttnkitError(f"criticalkv=true chooses single entries in two stages; chunk_length={method.chunk_length} "
                           f"(whole chunks) is not supported with it (use chunk_length=0)")
    if method.criticalkv and method.segment_length:
        raise AttnkitError(f"criticalkv=true chooses among all entries at once; segment_length="
                           f"{method.segment_length} (a share per segment) is not supported with it")


def output_projection(ctx) -> torch.Tensor:
    """The layer's output projection ``[hidden, q_heads x head_dim]`` (``o_proj.weight``), refused in one line where
    the host did not hand the attention module over or it has none."""
    module = ctx.layer_module()
    proj = getattr(module, "o_proj", None)
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise AttnkitError(f"criticalkv=true weighs values by the layer's output projection (o_proj), which layer "
                           f"{ctx.index}'s attention module does not offer here")
    return module_weight(proj)  # its data where accelerate offloads it


def projected_value_norms(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``n`` ``[b, kv, L]`` (float32): for every held value ``v`` of kv head ``j``, the mean over the query heads ``h``
    of its group of ``||v W_o[h]||_1``, ``W_o[h]`` the ``head_dim x hidden`` block of the output projection that reads
    head ``h``'s output (`weight` is ``o_proj.weight``, ``[hidden, q_heads x head_dim]``; query head ``h`` reads kv
    head ``h // group``). Computed in blocks of entries so no ``L x group x hidden`` tensor exists at once."""
    b, kv, length, d = values.shape
    hidden = weight.shape[0]
    if weight.shape[1] % (kv * d):
        raise AttnkitError(f"criticalkv: o_proj reads {weight.shape[1]} inputs, not a multiple of {kv} kv heads x "
                           f"{d} dims")
    group = weight.shape[1] // (kv * d)
    # [kv, d, group * hidden]: kv head j's values times the blocks of its group's query heads
    w = weight.float().t().reshape(kv, group, d, hidden).permute(0, 2, 1, 3).reshape(kv, d, group * hidden)
    out = torch.empty(b, kv, length, dtype=torch.float32, device=values.device)
    for s in range(0, length, NORM_BLOCK):
        e = min(length, s + NORM_BLOCK)
        projected = torch.matmul(values[:, :, s:e].float(), w.to(values.device))  # [b, kv, e - s, group * hidden]
        out[:, :, s:e] = projected.view(b, kv, e - s, group, hidden).abs().sum(-1).mean(-1)
    return out


def stage_two(score: torch.Tensor, norms: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The second stage's score ``(s + epsilon) x n`` (float32)."""
    return (score.float() + epsilon) * norms


def first_stage(ratio: float, count: int) -> int:
    """Entries stage 1 keeps by the score alone at a budget of `count`: ``int(ratio x count)``, at least 1 when
    ``ratio > 0`` and anything is kept."""
    first = int(ratio * count)
    return max(1, first) if ratio > 0 and count > 0 else first


def uniform_keep(score: torch.Tensor, protect: torch.Tensor | None, norms: torch.Tensor, count: int, ratio: float,
                 epsilon: float) -> torch.Tensor:
    """Slot indices ``[b, kv, count]`` (ascending) kept per kv head by the two stages (see the module docstring)."""
    s = score.float()
    forced = s if protect is None else s.masked_fill(protect, float("inf"))
    first = min(first_stage(ratio, count), s.shape[-1])
    final = stage_two(s, norms, epsilon)
    if first:
        final = final.scatter(-1, forced.topk(first, dim=-1).indices, float("inf"))
    if protect is not None:
        final = final.masked_fill(protect, float("inf"))
    return final.topk(count, dim=-1).indices.sort(dim=-1).values


def places(x: torch.Tensor) -> torch.Tensor:
    """Where each entry stands per row when sorted descending (0 = the highest; ties by slot)."""
    order = x.argsort(dim=-1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1], device=x.device).expand_as(order))


def adaptive_keep(score: torch.Tensor, protect: torch.Tensor | None, norms: torch.Tensor, count: int, alpha: float,
                  ratio: float, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CriticalAdaKV: the kv head and slot of each kept entry, ``[b, kv x count]`` each, ordered by head then slot
    (as :func:`attnkit.methods.scoring.adaptive_keep`), each head's count AdaKV's and its entries the two stages'."""
    b, kv, length = score.shape
    heads, _ = ada_allocation(score, protect, count, alpha)
    budgets = torch.zeros(b, kv, dtype=torch.long, device=score.device).scatter_add_(-1, heads, torch.ones_like(heads))
    s = score.float()
    forced = s if protect is None else s.masked_fill(protect, float("inf"))
    safe = first_stage(alpha, count)
    if safe:
        forced = forced.scatter(-1, forced.topk(min(safe, length), dim=-1).indices, float("inf"))
    first = (budgets.float() * ratio).long()  # each head's stage 1, of its own count
    chosen = (places(forced) < first.unsqueeze(-1)) | (forced == float("inf"))
    final = stage_two(s, norms, epsilon).masked_fill(chosen, float("inf"))
    kept = places(final) < budgets.unsqueeze(-1)
    flat = (~kept).reshape(b, kv * length).to(torch.uint8).argsort(dim=-1, stable=True)[:, :kv * count]
    return flat.div(length, rounding_mode="floor"), flat % length


def critical_keep(method, ctx, protect: torch.Tensor | None, count: int):
    """The entries `method` (a prompt scorer with ``criticalkv=true``) keeps in this layer: slot indices per kv head
    (uniform), or ``(heads, slots)`` of a flat layer (``head_budgets=adaptive``)."""
    score = method.critical_score(ctx)
    norms = projected_value_norms(ctx.kv.view()[1], output_projection(ctx))
    if method.adaptive:
        return adaptive_keep(score, protect, norms, count, method.alpha_safeguard, method.first_stage_ratio,
                             method.critical_epsilon)
    return uniform_keep(score, protect, norms, count, method.first_stage_ratio, method.critical_epsilon)
