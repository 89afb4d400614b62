"""``cam``: while decoding, compress the cache back to ``B`` every ``decode_every`` tokens and merge the values of
evicted entries into the kept entries after them, by attention (Zhang, Du, Luo, Zhong, Zhang, Liu, Ji, ICML 2024,
"CaM: Cache Merging for Memory-efficient LLMs Inference", https://openreview.net/forum?id=LCTmppB165; kvpress's
``CAMPress``, whose batched form this is).

The paper's observation: evicting an entry perturbs the next outputs in proportion to the attention it would have
received, so an entry about to be evicted hands its value to the entries that follow it, with a probability set by
how much attention it drew compared with them. With ``A_i`` the attention entry ``i`` has received from every
decoded query so far (each query's softmax over the held entries, averaged over the query heads of a kv group;
the prompt's queries do not count), a compression of a layer holding ``L > B`` entries:

1. scores every entry with the ``scorer``'s rule (``knorm``: ``-||k_i||``; ``keydiff``: ``-cos(k_i, mean unit key)``)
   averaged over the kv heads, so every kv head keeps the same ``B`` entries of highest score, in position order;
2. takes as merge candidates the ``c`` evicted entries of highest score (ties: the later first), ``c`` the decode
   steps since the last compression (``decode_every``, or more while the layer held ``B`` entries or fewer);
3. gives candidate ``i`` the window ``W_i`` of the first ``merge_budget`` (``m``) kept entries after it in position
   order (fewer at the end of the cache) and the probability ``p_i = clamp(A_i / mean_{j in W_i} A_j, 0, 1)`` per kv
   head (``0/0``: 0; ``x/0``: 1);
4. draws ``M_i ~ Bernoulli(p_i)`` and adds ``M_i v_i / |W_i|`` to the value of every entry of ``W_i`` (the paper's
   ``V_j += M_i V_i / m``); then the evicted entries leave.

The prompt is held whole until the first compression (kvpress's ``CAMPress`` acts while decoding only): a layer holds
``n + decode_every`` entries at most before it, ``B + decode_every`` after (the allocation and the batch memory
check). ``decode_every=1`` is the paper's per-step merging (kvpress's default is 512). Keys and positions never
change; the merged values are the method's instruction to the host
(:meth:`attnkit.methods.base.Method.merged_values`). The Bernoulli draws come from a CPU generator per
sequence seeded with ``seed`` at the start of the generation and drawn layer after layer, one
``torch.bernoulli`` over ``[1, kv, c]`` per layer and compression: at batch 1 the draws kvpress makes from torch's
global generator after ``torch.manual_seed(seed)``, and in a batch no sequence's draws depend on another's. A budget at
or above the prompt plus the generated tokens never compresses: full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.methods.keydiff import key_diff_rank
from attnkit.methods.knorm import key_norm_rank
from attnkit.methods.scoring import attend_with_logits, reduce_heads
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, whole

SCORERS = {"knorm": key_norm_rank, "keydiff": key_diff_rank}  # scores that read the held keys only


@dataclass
class CaMState(EvictionState):
    since: int = 0  # decode steps since the layer's last compression (kvpress's step count)
    score: torch.Tensor | None = None  # [b, L]: the entries' scores during a compression


@dataclass
class CaMRun:
    rng: torch.Tensor | None = None  # [rows, state bytes]: each sequence's Bernoulli generator, between draws


def draw(run: CaMRun, p: torch.Tensor, seed: int) -> torch.Tensor:
    """``Bernoulli(p)`` for `p` ``[b, kv, c]``, row ``r`` drawn from row ``r``'s generator (seeded with `seed` on its
    first draw), on the CPU."""
    rows = p.shape[0]
    if run.rng is None:
        run.rng = torch.Generator().manual_seed(seed).get_state().unsqueeze(0).repeat(rows, 1)
    out = []
    for r in range(rows):
        g = torch.Generator()
        g.set_state(run.rng[r].clone())
        out.append(torch.bernoulli(p[r:r + 1].float().cpu(), generator=g))
        run.rng[r] = g.get_state()
    return torch.cat(out).to(p.device)


@register
@dataclass(frozen=True)
class CaM(EvictionMethod):
    """Every ``decode_every`` tokens, back to ``B`` entries (the same for every kv head), the evicted entries' values
    merged into the kept ones after them with a probability set by attention (CaM)."""

    scorer: str = "knorm"
    decode_every: int = 1
    merge_budget: int = 32
    seed: int = 0

    name = "cam"
    summary = "merge evicted values into the next kept entries by attention while decoding (CaM, Zhang et al. 2024)"
    kvpress = "CAMPress"
    layer_state_type = CaMState
    # why attnkit's vLLM host refuses it (attnkit.vllm.plan.check_supported)
    vllm_refusal = (" (it merges evicted values into kept entries while decoding, which the host writes back only for "
                    "entries that move between slots)")

    def __post_init__(self):
        super().__post_init__()
        choice("scorer", self.scorer, SCORERS)
        whole("decode_every", self.decode_every, 1, what=" (generated tokens between compressions back to B)")
        whole("merge_budget", self.merge_budget, 1, what=" (kept entries after an evicted one that share its value)")
        whole("seed", self.seed, 0, what=" (the Bernoulli draws' generator seed)")

    def new_session_state(self) -> CaMRun:
        return CaMRun()

    def keep_rows(self, layer_states: list, session_state: CaMRun, rows: torch.Tensor) -> None:
        if session_state is not None and session_state.rng is not None:
            session_state.rng = session_state.rng[rows.cpu()]

    # ---- sizes: the prompt whole, then at most B + decode_every -------------------------------------------------
    def prefill_keep(self, ctx: LayerContext) -> int:
        return ctx.session.prompt_len

    def decode_limit(self, ctx: LayerContext) -> int | None:
        return None  # tokens are appended; after_decode compresses

    def evicts(self, ctx: LayerContext) -> bool:
        st = ctx.state
        if st.evicts is None:
            s = ctx.session
            st.evicts = self.layer_budget(ctx) < s.prompt_len + s.max_new_tokens
        return st.evicts

    def layer_capacity(self, ctx: LayerContext) -> tuple[int, bool]:
        s = ctx.session
        total = s.prompt_len + s.max_new_tokens
        if not self.evicts(ctx):
            return total, False
        return min(total, max(s.prompt_len, self.layer_budget(ctx)) + self.decode_every), False

    def planned_slots(self, ctx: LayerContext) -> int:
        return self.layer_capacity(ctx)[0]

    # ---- decoding ----------------------------------------------------------------------------------------------
    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        keys, values, _ = ctx.kv.view()
        out, _, probs = attend_with_logits(q, keys, values, ctx.scaling, self.window_visibility(ctx), logits=False)
        self.score_buffer(ctx, "attention")[:, :, :ctx.kv.length] += reduce_heads(probs[:, :, :, 0], "mean")
        return out

    def after_decode(self, ctx: LayerContext) -> None:
        if not self.evicts(ctx):
            return
        st = ctx.state
        st.since += 1
        budget = self.layer_budget(ctx)
        if st.since >= self.decode_every and ctx.kv.length > budget:
            keys = ctx.kv.view()[0]
            score = SCORERS[self.scorer](keys).mean(dim=1)  # [b, L]: one choice for every kv head
            st.score = score
            kept = score.topk(budget, dim=-1).indices.sort(dim=-1).values
            self.keep_slots(ctx, kept.unsqueeze(1).expand(-1, keys.shape[1], -1), self.decode_every)
            st.score, st.since = None, 0
            self._mark_evicting(ctx)

    def merged_values(self, ctx: LayerContext, keep: torch.Tensor) -> torch.Tensor:
        """The kept entries' values after CaM's merge (steps 2-4 of the module docstring)."""
        keys, values, _ = ctx.kv.view()
        b, kv, length, d = values.shape
        kept = keep[:, 0]  # [b, B], ascending: every kv head keeps the same slots
        budget, m = kept.shape[-1], self.merge_budget
        score = ctx.state.score
        evicted = torch.ones(b, length, dtype=torch.bool, device=kept.device).scatter(1, kept, False)
        later_first = evicted.nonzero()[:, 1].reshape(b, length - budget).flip(-1)
        best = score.gather(1, later_first).argsort(dim=-1, descending=True, stable=True)[:, :ctx.state.since]
        merging = later_first.gather(1, best).sort(dim=-1).values  # [b, c]
        c = merging.shape[-1]
        window = torch.searchsorted(kept, merging, right=True).unsqueeze(-1) + torch.arange(m, device=kept.device)
        inside = window < budget  # [b, c, m]
        targets = kept.gather(1, window.clamp(max=budget - 1).reshape(b, c * m)).reshape(b, c, m)
        size = inside.sum(dim=-1)  # [b, c]
        attention = self.score_buffer(ctx, "attention")[:, :, :length]
        around = attention.gather(2, targets.reshape(b, 1, c * m).expand(-1, kv, -1)).reshape(b, kv, c, m)
        mean = (around * inside.unsqueeze(1)).sum(dim=-1) / size.clamp(min=1).unsqueeze(1)
        own = attention.gather(2, merging.unsqueeze(1).expand(-1, kv, -1))
        p = torch.nan_to_num(own / mean, nan=0.0, posinf=1.0).clamp(0, 1)
        chosen = draw(ctx.session_state, p, self.seed)  # [b, kv, c]
        share = torch.where(size.unsqueeze(1) > 0, chosen / size.unsqueeze(1), torch.zeros_like(chosen))
        moved = values.gather(2, merging.reshape(b, 1, c, 1).expand(-1, kv, -1, d)) * share.unsqueeze(-1)
        moved = (moved.unsqueeze(3) * inside.reshape(b, 1, c, m, 1)).expand(-1, -1, -1, m, -1).reshape(b, kv, c * m, d)
        merged = values.clone()
        merged.scatter_add_(2, targets.reshape(b, 1, c * m, 1).expand(-1, kv, -1, d), moved.to(values.dtype))
        return merged.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, d))
