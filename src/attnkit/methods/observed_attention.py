"""``observed_attention``: keep the prompt entries of highest mean attention received from the prompt's queries
(kvpress's ``ObservedAttentionPress``, the prompt-time form of H2O's accumulated attention: Zhang et al., 2023,
"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models", NeurIPS 2023,
arXiv 2306.14048, section 4).

H2O ranks an entry by the attention probabilities it received, summed over the queries; an early key is seen by
every later query and a late one by few, so the sum favours the start of the prompt. Here the sum is divided by the
number of prompt queries that could attend to the entry, ``n - j`` for position ``j`` of an ``n``-token prompt (a
mean over them), per query head, then averaged over the kv group:

    s_j = mean_{h in group} (1 / (n - j)) sum_{i >= j} a^h_{ij}

Each kv head keeps its ``B`` entries of highest ``s_j`` after the prompt and generated tokens are appended. The sums
come from the prompt's own attention pass in the blocks that compute its output (the statistic H2O keeps,
:func:`attnkit.methods.scoring.attention_with_statistics`, or the C++ and Triton kernels), so no attention matrix is
stored, unlike kvpress's, which needs the eager attention's full matrix. The statistic exists only for prompt
queries: ``decode_every`` (a re-compression while decoding) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.eviction import EvictionState
from attnkit.methods.prompt_scorer import PromptScorer
from attnkit.methods.spec import register
from attnkit.session import LayerContext


@dataclass
class ObservedAttentionState(EvictionState):
    """Per layer: the attention each prompt position has received so far ``[b, kv, positions]``, kept in the layer's
    state rather than beside the entries, so a host that gathers a layer's entries anew for every prompt chunk (vLLM's)
    carries it across chunks."""

    received: torch.Tensor | None = None


@register
@dataclass(frozen=True)
class ObservedAttention(PromptScorer):
    """Per kv head, the prompt entries of highest mean attention from the prompt's queries; decode appends."""

    name = "observed_attention"
    summary = "keep the entries of highest mean attention from the prompt's queries (H2O's statistic, averaged)"
    kvpress = "ObservedAttentionPress"
    layer_state_type = ObservedAttentionState

    def __post_init__(self):
        super().__post_init__()
        if self.decode_every:
            raise AttnkitError(f"observed_attention scores with the prompt's queries only; decode_every="
                               f"{self.decode_every} would re-compress without them (use 0)")

    def prefill_scorer(self, ctx: LayerContext):
        return "mean", None  # the attention probabilities, averaged over the kv group

    def add_prefill_scores(self, ctx: LayerContext, stats: torch.Tensor) -> None:
        # a prompt chunk's statistic over the entries held, which are the prompt's positions 0.. in order
        st, length = ctx.state, stats.shape[-1]
        if st.received is None or st.received.shape[-1] < length:
            grown = stats.new_zeros(stats.shape, dtype=torch.float32)
            if st.received is not None:
                grown[..., :st.received.shape[-1]] = st.received
            st.received = grown
        st.received[..., :length] += stats

    def rank(self, ctx: LayerContext) -> torch.Tensor:
        positions = ctx.kv.view()[2]
        received = ctx.state.received
        if received is None:  # no prompt query attended here (a layer the prompt never reached)
            return torch.zeros(positions.shape, device=positions.device)
        n = torch.as_tensor(ctx.session.prompt_len, device=positions.device).reshape(-1, 1, 1)
        seen = (n - positions).clamp(min=1).float()  # prompt queries at or after each entry's position
        return received.gather(-1, positions.clamp(max=received.shape[-1] - 1)) / seen
