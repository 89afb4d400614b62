"""The buffered form of the per-step eviction methods (:class:`BufferedEviction`: ``h2o``, ``tova``, ``keyformer``).

H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
arXiv 2306.14048, Algorithm 1), TOVA (Oren, Hassid, Yarden, Adi, Schwartz, 2024, "Transformers are Multi-State
RNNs", arXiv 2401.06104) and Keyformer (Adnan et al., MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens
Selection for Efficient Generative Inference", arXiv 2403.09054) evict one entry per generated token, so a layer
holds ``B`` entries per kv head, the incoming one included: ``decode_every=0``, the default, the per-step flow of
:mod:`attnkit.methods.eviction`.

``decode_every=N >= 1`` buffers instead. Generated tokens are appended, each attending over everything the layer
holds, while the method accumulates its statistics exactly as in the per-step form (H2O's accumulated attention,
Keyformer's Gumbel-softmax score with its temperature schedule, TOVA's latest query's attention); after every
``N``-th decode step's attention ("attend, then compress", the rhythm of the prompt scorers' ``decode_every``,
:mod:`attnkit.methods.prompt_scorer`) the layer is compressed back to ``B`` entries per kv head by the method's own
rank, its protected entries kept (the recent window before the next position; TOVA's newest entry), the kept entries
in slot order (:meth:`~attnkit.methods.eviction.EvictionMethod.after_decode`,
:func:`~attnkit.methods.scoring.keep_top`). The prompt is compressed to ``B`` after prefill as in the per-step form;
Keyformer's shared score compresses it at the first decode step instead (later layers have not scored the prompt
when the first one finishes it), to ``B`` entries before that step's token is appended.

So the entries a layer holds per kv head are known in advance, whatever the scores (a paged host plans its blocks
by it): after a prompt of ``n`` tokens ``min(n, B)`` (Keyformer's shared score: ``n`` until its first decode step),
and after ``g >= 1`` decode steps, ``g = k N + r`` with ``r < N``,

    min(min(n, B) + k N, B) + r,

one more per step and back to ``B`` after every ``N``-th step whenever above it: at most ``B + N``, the layer's
capacity (``decode_limit``, ``planned_slots``). Against the papers' one-out-per-step rule, a query attends over up
to ``B + N`` entries instead of ``B``, and the ``N`` tokens dropped at a compression are chosen together, with up to
``N`` more steps of statistics than each would have had when dropped one per step. With ``N = 1`` the order is H2O's
Algorithm 1, "attend, then drop one", with the paper's cache size ``k = B`` (the per-step form's ``k`` is ``B - 1``,
its ``B`` counting the incoming token). Keyformer's shared score, summed over the layers, is complete for a step only after the last
layer, so a compression after step ``g`` ranks by every layer's scores through step ``g - 1`` and every layer keeps
the same entries. A decode step takes one token: a speculative verification (several at once) is refused, as in
the per-step form.

Between two compressions a step only appends its entry and attends over everything held, except for what it adds to
the statistics (:attr:`BufferedEviction.between`): H2O's accumulated attention and Keyformer's per-layer score are
taken at the compression step from the queued queries of the steps since the last one, in one pass, each query over
the entries held at its own step (those at its position or before) with its own noise and temperature, the same sums
as step by step; TOVA's scores are its latest query's, which the compression step's replace. So a host may run those
steps as plain attention and catch up (``decode_queries_kept``, ``skip_appends``: attnkit's vLLM host does).
The per-step form does the same with the steps that fill a layer's budget (a prompt shorter than ``B``: they only
append), H2O's and Keyformer's per-layer statistics of them taken every :data:`FILL_QUEUE`-th generated token and
before the first eviction, so that at most that many queries wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.session import LayerContext
from attnkit.validate import whole

# the per-step form's decode steps while a layer still fills its budget (a prompt shorter than it) whose statistics
# are taken together: every FILL_QUEUE-th of them, and before the first eviction
FILL_QUEUE = 32


@dataclass
class BufferedState(EvictionState):
    """The buffered form's queries of the steps since the last compression (``[b, heads, n, d]``, their positions
    ``[n]``), for a method that takes their statistics together at the next one (:attr:`BufferedEviction.between`)."""

    queued_q: torch.Tensor | None = None
    queued_pos: torch.Tensor | None = None


@dataclass(frozen=True)
class BufferedEviction(EvictionMethod):
    """Base of the methods evicting one entry per generated token, with ``decode_every`` (``N``, see the module
    docstring): 0 evicts one entry per step; ``N >= 1`` lets ``N`` tokens in, then compresses back to ``B``."""

    decode_every: int = 0

    # what the buffered form's steps between two compressions leave for the next one, where they only append and
    # attend: "queries" (their statistics are taken together at the compression step from their queries: H2O's
    # accumulated attention), "nothing" (the compression step's own statistics replace theirs: TOVA's latest
    # attention), None (each step's hooks gather something of their own: Keyformer's shared score)
    between: ClassVar[str | None] = None

    def __post_init__(self):
        super().__post_init__()
        whole("decode_every", self.decode_every, 0, what=" (generated tokens let in between two compressions back to "
                                                         "the budget; 0 = one eviction per generated token)")

    @property
    def stacks_decode(self) -> bool:
        # the per-step form's decode step is the same for every row given each row's position (the recent window,
        # the newest entry, the victim per row and kv head): a host may step several generations at once
        return not self.decode_every

    def evicts(self, ctx: LayerContext) -> bool:
        if self.decode_every and ctx.state.evicts is None:
            # every N-th step compresses a layer holding more than B, however B + N compares with the whole length
            s = ctx.session
            ctx.state.evicts = self.layer_budget(ctx) < s.prompt_len + s.max_new_tokens
        return super().evicts(ctx)

    # ---- the steps between two compressions ---------------------------------------------------------
    def decode_queries_kept(self) -> int | None:
        """How many queries the buffered form's steps between two compressions leave in the layer's state (see
        :meth:`attnkit.methods.prompt_scorer.PromptScorer.decode_queries_kept`: a host may run such steps as plain
        attention and catch up with :meth:`skip_appends`); None: the per-step form, or a method whose steps do more
        (:attr:`between`)."""
        if not self.decode_every:  # the per-step form: the steps that fill the layer's budget (FILL_QUEUE)
            return FILL_QUEUE if self.between == "queries" else None
        if self.between is None:
            return None
        return self.decode_every if self.between == "queries" else 0

    def skip_appends(self, ctx: LayerContext, k, v, q, positions: torch.Tensor) -> None:
        """The layer's state after ``len(positions)`` such steps: their entries appended in order, their queries
        queued (:meth:`queue_queries`), the steps counted. `q`: the queries of the last of those steps, at least as
        many as :meth:`decode_queries_kept` says wait, or all of them."""
        ctx.kv.append(k, v, positions)
        if self.between == "queries":
            self.queue_queries(ctx, q, positions[positions.shape[0] - q.shape[2]:])
        if self.decode_every:  # the per-step form counts no steps (its states then stack: attnkit.vllm.stacked)
            ctx.state.decoded += positions.shape[0]

    @staticmethod
    def queue_queries(ctx: LayerContext, q: torch.Tensor, positions: torch.Tensor) -> None:
        """Add steps' queries ``[b, heads, n, d]`` at `positions` to the layer's queue (:class:`BufferedState`)."""
        st = ctx.state
        if st.queued_q is not None:
            q, positions = torch.cat([st.queued_q, q], dim=2), torch.cat([st.queued_pos, positions])
        st.queued_q, st.queued_pos = q, positions

    def queues(self, ctx: LayerContext) -> bool:
        """Whether this decode step's statistics wait in the queue (:class:`BufferedState`): every step of the
        buffered form, and the per-step form's steps while the layer still fills its budget."""
        return self.between == "queries" and (bool(self.decode_every) or not ctx.state.evicting)

    def takes_queued(self, ctx: LayerContext) -> bool:
        """Whether this step takes the queued statistics: the buffered form's compression steps (the ``N``-th since
        the last: :meth:`~attnkit.methods.eviction.EvictionMethod.after_decode`), every ``FILL_QUEUE``-th generated
        token of the per-step form while it fills its budget (its first eviction takes them too:
        :meth:`before_write`)."""
        if self.decode_every:
            return (ctx.state.decoded + 1) % self.decode_every == 0
        return (int(ctx.q_pos[-1]) + 1 - ctx.session.prompt_len) % FILL_QUEUE == 0

    def before_write(self, ctx: LayerContext) -> None:
        super().before_write(ctx)
        if not self.decode_every and ctx.state.queued_q is not None and ctx.kv.length >= self.decode_limit(ctx):
            self.add_queued(ctx)  # the first eviction ranks by every step's statistics

    def add_queued(self, ctx: LayerContext) -> None:
        """Add the queued steps' statistics to the layer's and empty the queue (a method with ``between =
        "queries"``)."""
        raise NotImplementedError

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        super().keep_rows(layer_states, session_state, rows)
        for st in layer_states:
            if getattr(st, "queued_q", None) is not None:
                st.queued_q = st.queued_q[rows.to(st.queued_q.device)]
