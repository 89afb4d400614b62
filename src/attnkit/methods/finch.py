"""``finch``: keep the context entries the question attends to most (Corallo and Papotti, 2024, "FINCH:
Prompt-guided Key-Value Cache Compression for Large Language Models", Transactions of the Association for
Computational Linguistics 12, doi:10.1162/tacl_a_00716; kvpress's ``FinchPress``).

The prompt is a context followed by a question. FINCH ranks the context's entries by the attention the question's
tokens pay them: for each question query ``i`` (at position ``p_i``) the attention probabilities over the keys it
sees (the context and the question up to itself, causal softmax), per query head. With ``normalize=true`` (FINCH's
normalisation, on by default) each query's row is multiplied by ``p_i``, its count of earlier keys (kvpress's count;
the query sees ``p_i + 1`` keys with itself): a query that spreads over more keys gives each less, and the
normalisation puts the question's queries on one scale. The score of context entry ``j`` is the mean over the
question's queries, then over the query heads of its kv group::

    s_j = mean_{h in group} mean_{i in question} c_i a^h_{ij},    c_i = p_i (normalize) or 1

Each kv head keeps the whole question and its ``B - question_tokens`` best context entries (``B`` the budget).

The question is marked by its length: ``question_tokens`` (default 32) is how many of the prompt's last tokens are
the question (the observation window). kvpress finds it with a delimiter token that it adds to the tokenizer and
removes from the input in the embedding layer (the window is everything after it); attnkit's prompts are token ids
that the model sees as they are, so the caller says how long the question is instead. A prompt no longer than the
question has no context: then nothing is compressed when the budget holds it, and a budget smaller than the question
is refused (the question is always kept).

Positions (``positions``): with ``reindexed`` (the default, kvpress's ``rerotate_keys=True``) the kept entries are
re-rotated to consecutive positions ending where the prompt ends, ``n - B .. n - 1`` (RoPE rotations compose, so a
cached key is rotated by ``new - old``; :mod:`attnkit.methods.rerotation`, shared by every prompt scorer), and
relabelled so, as if the compressed prompt
had been the input; generated tokens continue at ``n, n + 1, ...``. Every query-key distance is then kvpress's, whose
kept keys sit at ``0 .. B - 1`` and whose generation continues at ``B`` (attention with RoPE depends only on the
distances). The keys are rotated once, when the prompt is compressed. With ``original`` every key keeps its position
(kvpress's ``rerotate_keys=False``).

kvpress's ``chunk_length`` (a top-k within each stretch of the score vector, standing in for the paper's chunked
prefill) is not offered: the chunking of the paper bounds the prefill's memory, which attnkit's blocked statistic
already does, and ``chunk_length`` on attnkit's prompt scorers is ChunkKV's whole-chunk selection. The question's
attention exists only for the prompt, so ``decode_every`` (a re-compression while decoding) is refused; generated
tokens are appended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods import rerotation
from attnkit.methods.budget import smallest_tokens
from attnkit.methods.prompt_scorer import PromptScorer, PromptScorerState, keep_last_queries
from attnkit.methods.scoring import attention_statistics, softmax_weights
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import flag, whole


@dataclass
class FinchState(PromptScorerState):
    """FINCH's per-layer state: the question's queries while the prompt streams in, then its scores while the layer
    is compressed."""

    window_q: torch.Tensor | None = None
    window_pos: torch.Tensor | None = None
    votes: torch.Tensor | None = None


def position_weighted(logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The attention probabilities of each query, times its position (FINCH's normalisation, kvpress's count)."""
    return softmax_weights(logits, q_pos, k_pos).mul_(q_pos.to(logits.dtype)[:, None])


@register
@dataclass(frozen=True)
class Finch(PromptScorer):
    """Per kv head, the question and the context entries the question attends to most (FINCH); decode appends."""

    question_tokens: int = 32
    normalize: bool = True
    positions: str = "reindexed"

    name = "finch"
    layer_state_type = FinchState
    summary = "keep the context entries the question's tokens attend to most (FINCH, Corallo & Papotti 2024)"
    kvpress = "FinchPress"
    threshold_refusal = "the question's votes exist only while a budget compresses the prompt"

    def __post_init__(self):
        super().__post_init__()
        whole("question_tokens", self.question_tokens, 1, what=" (the prompt's last tokens that are the question)")
        flag("normalize", self.normalize)
        if self.decode_every:
            raise AttnkitError(f"finch scores with the question's queries, which exist only in the prompt; "
                               f"decode_every={self.decode_every} would re-compress without them (use 0)")
        smallest = smallest_tokens(self.budget_tokens)
        if smallest is not None and self.question_tokens > smallest:
            raise AttnkitError(f"question_tokens={self.question_tokens} is larger than budget_tokens="
                               f"{self.budget_tokens!r}; the question is always kept, so it must fit in the budget")

    def check_layer(self, ctx: LayerContext, budget: int) -> None:
        n = ctx.session.prompt_len
        if budget < n and self.question_tokens > budget:
            raise AttnkitError(f"finch: the question ({self.question_tokens} tokens) does not fit in the {budget}-slot "
                               f"budget of layer {ctx.index}; lower question_tokens or raise the budget")
        if self.positions == "reindexed" and budget < n:
            rerotation.check_rope(self, ctx)

    def budget_floor(self) -> int:
        return self.question_tokens  # the question is always kept

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:
            if st.window_q is not None:
                st.window_q = st.window_q[rows.to(st.window_q.device)]

    def observe_prefill(self, ctx: LayerContext, q: torch.Tensor) -> None:
        keep_last_queries(ctx.state, q, ctx.q_pos, self.question_tokens)  # the question may straddle prompt chunks

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        super().after_prefill(ctx, q, k, v)
        ctx.state.window_q = ctx.state.window_pos = None

    def compact(self, ctx: LayerContext, count: int, spare: int, next_pos) -> None:
        st = ctx.state
        st.votes = self.votes(ctx)
        super().compact(ctx, count, spare, next_pos)
        st.votes = None

    def votes(self, ctx: LayerContext) -> torch.Tensor:
        """``[b, kv, n]``: the question's mean (position-weighted) attention to every prompt entry, averaged over
        each kv group's query heads."""
        st = ctx.state
        keys, _, positions = ctx.kv.view()
        weights = position_weighted if self.normalize else None
        votes = attention_statistics(st.window_q, keys, ctx.scaling, st.window_pos, positions[0, 0], reduce="mean",
                                     weights=weights, window=ctx.native_window)
        return votes / st.window_q.shape[2]

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        return ctx.state.votes

    def protect(self, ctx: LayerContext, next_pos) -> torch.Tensor:
        positions = ctx.kv.view()[2]
        return positions >= next_pos - self.question_tokens  # the question
