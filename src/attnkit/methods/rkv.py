"""``rkv``: decode-time eviction by importance minus redundancy (R-KV; Cai, Xiao, Sun, Luo, Zhang, Wan, Li, Zhou,
Chang, Gu, Dong, Anandkumar, Asi, Hu, 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
arXiv 2505.24133).

Reasoning models write long chains of thought that repeat themselves; the repeated tokens attend to each other, so
an attention-only score (SnapKV's, H2O's) keeps the repetitions and drops the rare steps. R-KV ranks every held
entry ``i`` of a kv head by

    ``Z_i = lambda * I_i - (1 - lambda) * R_i``

and keeps the best ``B - window_size`` plus the observation window (the paper's joint selection):

- **Importance** ``I``: the attention of the last ``window_size`` queries (the observation window, alpha = 8 in the
  paper) to the held entries before the window, softmaxed over those entries only, averaged over the window's
  queries and max-pooled along the entries with ``kernel_size`` (7), as SnapKV's clustering. With GQA the logits of
  a kv group's query heads are reduced first (``gqa_reduce``, the maximum by default), then softmaxed: the
  authors' code reduces the logits, not the probabilities as ``snapkv`` does.
- **Redundancy** ``R``: the cosine similarity ``S_ij`` of the L2-normalised keys of every two held entries (the
  diagonal zeroed). Each row ``i`` zeroes its entry for the most recent ``j`` with ``S_ij > threshold`` (0.5), so
  the newest near-duplicate is not penalised for it, and ``R_j = softmax_j((1/L) sum_i S_ij)`` over the ``L`` held
  entries. Of several identical keys the older ones are penalised, the most recent kept; two identical keys
  alone are each other's most recent neighbour and penalise neither (the rule of the authors' code).

``lambda`` (``mix_lambda``) is 0.1 (the paper's default and the authors' evaluation scripts'; their class default
is 0.07). The prompt is compressed to ``B`` right after prefill by the same score (the window: the last prompt
queries), as the authors' code does whenever the prompt reaches the budget; then every ``decode_every`` (the
paper's buffer, 128) generated tokens the layer is compressed back to ``B`` entries per kv head
(:mod:`attnkit.methods.prompt_scorer`, "attend, then compress"), so it holds at most ``B + decode_every``.

Differences from the authors' code: the interval counts generated tokens (theirs fires when the total length is
a multiple of 128, prompt included); a row with no similar neighbour zeroes nothing (theirs zeroes its similarity
to the first entry); the redundancy is computed in blocks of rows, so no ``L x L`` matrix exists; the budget is
per layer and kv head through attnkit's ``budget`` / ``budget_tokens`` (theirs is a token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnkit.errors import AttnkitError
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState, keep_last_queries
from attnkit.methods.scoring import GQA_REDUCTIONS, attention_statistics, avg_or_max_pool, block_elements_for
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import choice, fraction, number, whole

NORM_EPS = 1e-8  # added to a key's norm before normalising (the authors' code)


def importance(window_q: torch.Tensor, keys: torch.Tensor, scaling: float, q_pos: torch.Tensor,
               k_pos: torch.Tensor, *, reduce: str = "max", kernel_size: int = 7, pooling: str = "max",
               window: int | None = None) -> torch.Tensor:
    """R-KV's importance ``[b, kv, L]`` (float32) of `keys` ``[b, kv, L, d]`` (the entries before the observation
    window, in position order) for the window's queries `window_q` ``[b, hq, w, d]``: per query, the logits of a kv
    group's query heads reduced (`reduce`: max or mean), softmaxed over the `keys` (causal by position, within a
    model's own sliding `window`); averaged over the queries; pooled along the keys (`pooling`, `kernel_size`)."""

    def group_softmax(logits, qp, kp):  # logits [b, kv, g, c, L] -> [b, kv, 1, c, L]
        x = logits.amax(dim=2, keepdim=True) if reduce == "max" else logits.mean(dim=2, keepdim=True)
        return torch.softmax(x, dim=-1).nan_to_num_(0.0)  # a query that sees none of the keys votes for none

    # the group is already reduced to one row: "max" over it is the identity, then the queries are summed
    votes = attention_statistics(window_q, keys, scaling, q_pos, k_pos, reduce="max", weights=group_softmax,
                                 window=window)
    return avg_or_max_pool(votes.div_(window_q.shape[2]), kernel_size, pooling)


def redundancy(keys: torch.Tensor, threshold: float = 0.5, block_elements: int | None = None) -> torch.Tensor:
    """R-KV's redundancy ``[b, kv, L]`` (float32) of the held `keys` ``[b, kv, L, d]`` (slots in position order):
    ``softmax_j((1/L) sum_i S_ij)``, ``S`` the cosine similarities with a zero diagonal and, in each row ``i``, a
    zero for the latest ``j`` (highest slot) with ``S_ij > threshold``. Rows are taken in blocks of at most
    `block_elements` similarities (:data:`~attnkit.methods.scoring.SCORE_BLOCK_ELEMENTS` by device type)."""
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + NORM_EPS)
    b, kv, length, _ = unit.shape
    slots = torch.arange(length, device=keys.device)
    total = torch.zeros(b, kv, length, dtype=torch.float32, device=keys.device)
    if block_elements is None:
        block_elements = block_elements_for(keys.device)
    rows = max(1, block_elements // max(1, b * kv * length))
    for s in range(0, length, rows):
        sim = torch.matmul(unit[:, :, s:s + rows], unit.transpose(-1, -2))  # [b, kv, rows, L]
        sim.diagonal(offset=s, dim1=-2, dim2=-1).zero_()
        latest = torch.where(sim > threshold, slots, -1).amax(dim=-1, keepdim=True)  # -1: no similar entry
        total += sim.masked_fill_(slots == latest, 0.0).sum(dim=2)
    return F.softmax(total.div_(length), dim=-1)


def rkv_score(importance_: torch.Tensor, redundancy_: torch.Tensor, mix_lambda: float) -> torch.Tensor:
    """``Z = lambda * I - (1 - lambda) * R`` (higher = kept)."""
    return importance_ * mix_lambda - redundancy_ * (1.0 - mix_lambda)


@dataclass
class RKVState(PromptScorerState):
    """Per layer: the last ``window_size`` queries seen (and their positions), and the scores while compressing."""

    window_q: torch.Tensor | None = None
    window_pos: torch.Tensor | None = None
    scores: torch.Tensor | None = None


@register
@dataclass(frozen=True)
class RKV(PromptScorer):
    """Importance minus redundancy per kv head; the prompt compressed after prefill, then the layer compressed
    back to ``B`` every ``decode_every`` generated tokens, the observation window kept."""

    decode_every: int = 128
    window_size: int = 8
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "max"
    mix_lambda: float = 0.1
    threshold: float = 0.5

    name = "rkv"
    layer_state_type = RKVState
    summary = "decode-time compression by attention importance minus key redundancy (R-KV, Cai et al. 2025)"

    def __post_init__(self):
        super().__post_init__()
        whole("decode_every", self.decode_every, 1,
              what=" (R-KV compresses while decoding: generated tokens between compressions, the paper's buffer)")
        whole("window_size", self.window_size, 1, what=" (the observation window's queries)")
        whole("kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise AttnkitError(f"kernel_size must be odd so the pooling is centred, got {self.kernel_size}")
        choice("pooling", self.pooling, ("avg", "max"))
        choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)
        fraction("mix_lambda", self.mix_lambda, allow_zero=True,
                 what=" (the weight of importance against redundancy)")
        number("threshold", self.threshold, -1.0, 1.0, what=" (the cosine similarity above which keys are similar)")

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        s = ctx.session
        if budget < s.prompt_len + s.max_new_tokens and self.window_size > budget:
            raise AttnkitError(f"rkv: the observation window ({self.window_size} tokens) does not fit in the "
                               f"{budget}-slot budget of layer {ctx.index}; lower window_size or raise the budget")

    def budget_floor(self) -> int:
        return self.window_size  # the observation window is always kept

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:  # the window's queries are kept per row
            if st.window_q is not None:
                st.window_q = st.window_q[rows.to(st.window_q.device)]

    # ---- the observation window -------------------------------------------------------------------
    def observe(self, ctx: LayerContext, q: torch.Tensor) -> None:
        """Remember the last ``window_size`` queries seen (they may straddle prompt chunks and decode steps)."""
        keep_last_queries(ctx.state, q, ctx.q_pos, self.window_size)

    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        self.observe(ctx, q)

    def decode_queries_kept(self) -> int | None:
        return self.window_size if self.decode_every else None  # the observation window reaches into decoding

    def attend_decode(self, ctx: LayerContext, q: torch.Tensor) -> torch.Tensor:
        self.observe(ctx, q)
        return super().attend_decode(ctx, q)

    # ---- the score ---------------------------------------------------------------------------------
    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        st = ctx.state
        st.scores = self.scores(ctx)
        super().compact(ctx, count, spare, next_pos)
        st.scores = None

    def scores(self, ctx: LayerContext) -> torch.Tensor:
        """``Z`` ``[b, kv, L]`` of every held entry; the observation window's own entries (the last slots: entries
        stay in position order and the window is always kept) score 0, being protected."""
        st = ctx.state
        keys, _, positions = ctx.kv.view()
        # the prompt: every head holds positions 0..n-1 (one shared, ascending axis); later, each its own
        k_pos = positions[0, 0] if ctx.step.phase == "prefill" and not st.evicting else positions
        prefix = keys.shape[2] - st.window_q.shape[2]
        out = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        if prefix <= 0:
            return out
        imp = importance(st.window_q, keys[:, :, :prefix], ctx.scaling, st.window_pos, k_pos[..., :prefix],
                         reduce=self.gqa_reduce, kernel_size=self.kernel_size, pooling=self.pooling,
                         window=ctx.native_window)
        red = redundancy(keys, self.threshold)[..., :prefix]
        out[..., :prefix] = rkv_score(imp, red, self.mix_lambda)
        return out

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.state.scores

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor:
        return ctx.kv.view()[2] >= next_pos - self.window_size
