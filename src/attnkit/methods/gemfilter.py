"""``gemfilter``: GemFilter (Shi, Ming, Nguyen, Liang and Joty, 2024, "Discovering the Gems in Early Layers:
Accelerating Long-Context LLMs with 1000x Input Token Reduction", arXiv 2409.17422), the baseline that
Select-Attention is compared with (Taniguchi et al., "Attention スコアの分布類似性を用いた大規模言語モデルの
動作効率化および省メモリ化", ref. [16], Table 2 and Fig. 8).

That paper (sections 2.3 and 4.2) describes GemFilter as choosing the important tokens ONCE, at prefill, with
top-k at an early filter layer, then generating from those tokens only. Here:

1. the prompt runs through layers ``0 .. L`` (``filter_layer``; chunked if the runner chunks), with a
   temporary cache;
2. the last prompt query at layer ``L`` scores every prompt token, summed over the heads: by default the raw
   logits ``q . k`` (``score=logits``, what GemFilter's reference code sums), or the probabilities
   (``score=probs``), then averaged over ``pool`` neighbouring tokens (the reference code's average pooling,
   width 5, zero padding counted at the edges; ``pool=1`` scores each token alone); the ``k`` best tokens are
   kept (the last prompt token always: its output is the first generated token's distribution), in their
   original order;
3. the temporary cache is released and the WHOLE model runs again on only those tokens, whose cache then
   serves an ordinary decode.

Positions (``positions``): GemFilter's reference implementation gathers the selected input ids and generates
from them as a new, shorter prompt, so the selected tokens get new consecutive positions ``0 .. k-1``
(``reindexed``, the default here, faithful to GemFilter); ``original`` keeps each token's original position
(RoPE at the position it had in the prompt, generated tokens continue after the prompt). The Select-Attention
paper does not say which positions its GemFilter runs used; both are offered.

``k`` is a token count (an integer >= 1) or a fraction of the prompt (0 < k < 1). ``k`` at or above the
prompt length keeps every token, and the output equals ``full``'s. ``filter_layer`` defaults to
``n_layers // 2 - 1``. The peak cache counts the temporary cache of step 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnkit.errors import AttnkitError
from attnkit.forward import run_decoder_layers
from attnkit.methods.base import Method
from attnkit.methods.scoring import avg_or_max_pool
from attnkit.methods.select import check_filter_layer, check_filter_layer_param
from attnkit.methods.share import shared_positions
from attnkit.methods.spec import register
from attnkit.session import LayerContext, Step
from attnkit.validate import choice, is_number, whole


@dataclass
class GemFilterRun:
    """GemFilter's state for one generation: phase 1 runs the prompt to the filter layer (its embeddings
    kept, the chosen tokens found there); phase 2 prefills and decodes on the `kept` chosen tokens, whose
    positions are shifted by `offset` when re-indexed."""

    phase: int = 1
    embeddings: list = field(default_factory=list)
    chosen: torch.Tensor | None = None
    kept: int = 0
    offset: int = 0


@register
@dataclass(frozen=True)
class GemFilter(Method):
    """GemFilter (Shi et al., 2024, arXiv 2409.17422): top-k prompt tokens chosen once at an early layer, then
    the whole model prefills and decodes on those tokens only."""

    filter_layer: int | None = None
    k: int | float = 1024
    score: str = "logits"
    positions: str = "reindexed"
    pool: int = 5

    name = "gemfilter"
    batches = False  # each sequence's later forward runs on its own chosen tokens: one session per sequence
    summary = "GemFilter: top-k prompt tokens from an early layer, then prefill+decode on them (Shi et al. 2024)"

    def __post_init__(self):
        check_filter_layer_param(self.filter_layer)
        k = self.k
        if not is_number(k) or k <= 0 or (isinstance(k, float) and k >= 1 and not k.is_integer()):
            raise AttnkitError(f"k={k!r} must be a token count (a whole number >= 1) or a fraction of the prompt "
                             f"(0 < k < 1)")
        choice("score", self.score, ("logits", "probs"))
        choice("positions", self.positions, ("reindexed", "original"))
        whole("pool", self.pool, 1, what=" (tokens averaged around each score)")
        if self.pool % 2 == 0:
            raise AttnkitError(f"pool={self.pool} must be odd so the average is centred on its token")

    def new_session_state(self) -> GemFilterRun:
        return GemFilterRun()

    def kept_tokens(self, prompt_len: int) -> int:
        if isinstance(self.k, float) and self.k < 1:
            return max(1, min(prompt_len, int(math.floor(self.k * prompt_len + 0.5))))
        return min(prompt_len, int(self.k))

    # ---- the model-level hook ----------------------------------------------------------------------
    def run_layers(self, model, step: Step, hidden: torch.Tensor, all_positions: bool) -> torch.Tensor:
        session = step.session
        st = session.state
        if step.phase == "decode":  # decode normally on the compressed prompt
            pos = step.q_pos - st.offset
            return run_decoder_layers(model, hidden, pos, Step(session, "decode", pos))
        if all_positions:
            raise AttnkitError("gemfilter computes only the last prompt position's output (it re-runs the model on "
                               "the selected tokens); it cannot score every prompt position")
        L = check_filter_layer(self.name, self.filter_layer, session.n_layers)
        st.embeddings.append(hidden[0])
        h = run_decoder_layers(model, hidden, step.q_pos, step, range(L + 1))
        if not step.last_chunk:
            return h
        kept, st.chosen = st.chosen, None
        embeddings, st.embeddings = torch.cat(st.embeddings), []
        session.cache.layers = [None] * session.n_layers  # release the filter pass's cache
        st.phase, st.kept = 2, int(kept.shape[0])
        n = session.prompt_len
        pos = kept if self.positions == "original" else torch.arange(kept.shape[0], device=kept.device)
        st.offset = n - int(pos[-1]) - 1
        # the chosen indices come from the filter layer's device; the embeddings stay where they were made
        chosen = embeddings[kept.to(embeddings.device)][None]
        return run_decoder_layers(model, chosen, pos, Step(session, "prefill", pos, True))

    # ---- attention hooks -------------------------------------------------------------------------------
    def layer_capacity(self, ctx: LayerContext):
        st = ctx.session_state
        if st.phase == 2:
            return st.kept + ctx.session.max_new_tokens, False
        return ctx.session.prompt_len, False

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        out = self._store_and_attend(ctx, q, k, v)
        st = ctx.session_state
        L = check_filter_layer(self.name, self.filter_layer, ctx.session.n_layers)
        if st.phase == 1 and ctx.index == L and ctx.step.last_chunk:
            st.chosen = self._choose(ctx, q[:, :, -1:])
        return out

    def _choose(self, ctx: LayerContext, q) -> torch.Tensor:
        keys, _, positions = ctx.kv.view()
        k_pos = shared_positions(positions)
        b, hq, _, d = q.shape
        kv = keys.shape[1]
        logits = torch.matmul(q.view(b, kv, hq // kv, d), keys.transpose(-1, -2)).float()  # [b, kv, g, n]
        if self.score == "probs":
            logits = torch.softmax(logits * ctx.scaling, dim=-1)
        scores = avg_or_max_pool(logits.sum(dim=(0, 1, 2))[None], self.pool, "avg")[0]
        k = self.kept_tokens(ctx.session.prompt_len)
        last = int(k_pos.argmax())
        scores[last] = float("inf")  # the last prompt token is always kept
        top = torch.topk(scores, min(k, scores.shape[0])).indices
        return k_pos[top].sort().values
