"""The prompt-time scorers' shared flow (:class:`PromptScorer`): compress the prompt once, and optionally
re-compress every ``decode_every`` generated tokens.

A prompt-time scorer (``snapkv``, ``knorm``, ``keydiff``) ranks the entries a layer holds with a score of its
own (:meth:`~attnkit.methods.eviction.EvictionMethod.rank`) and keeps the ``B`` best per kv head after the
prompt (the shared eviction flow of :mod:`attnkit.methods.eviction`). What happens while decoding is the
same for all of them, so it lives here, written once:

- ``decode_every=0`` (default): generated tokens are appended; the cache grows by one slot per token on
  top of the compressed prompt (SnapKV's own setting, and kvpress's prefill-only presses).
- ``decode_every=N >= 1``: every ``N`` generated tokens the layer is compressed back to ``B`` entries per kv
  head by the method's own score over everything it holds (the prompt survivors and the generated tokens),
  as kvpress's ``DecodingPress`` with ``compression_interval=N`` and ``target_size=B`` after a prefill
  compression to ``B``. A layer therefore holds at most ``B + N`` entries (the capacity and
  ``planned_slots`` say so, for the batch memory check) and exactly ``B`` after each compression; with
  ``N=1`` it holds ``B`` after every step. The compressions run after a step's attention ("attend, then
  compress"), so the ``N``-th token's query has seen everything before the layer shrinks. Entries stay in
  ascending position order in their slots (compression keeps slot order, tokens are appended), which a
  score over the sequence (SnapKV's pooling) relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.methods.eviction import EvictionMethod, EvictionState
from attnkit.session import LayerContext
from attnkit.validate import whole


@dataclass
class PromptScorerState(EvictionState):
    """Per layer: generated tokens stored since the last compression while decoding."""

    since_compression: int = 0


@dataclass(frozen=True)
class PromptScorer(EvictionMethod):
    """Base of the prompt-time scorers: the prompt is compressed to ``B`` by :meth:`rank`; ``decode_every``
    (``N``) re-compresses the layer to ``B`` every ``N`` generated tokens (0: generated tokens are appended)."""

    decode_every: int = 0

    layer_state_type = PromptScorerState

    def __post_init__(self):
        super().__post_init__()
        whole("decode_every", self.decode_every, 0,
              what=" (generated tokens between re-compressions of the cache; 0 = compress the prompt only)")

    def decode_only_appends(self) -> bool:
        return self.decode_every == 0

    def decode_limit(self, ctx: LayerContext) -> int | None:
        if self.decode_every == 0:
            return None
        return self.layer_budget(ctx) + self.decode_every

    def after_decode(self, ctx: LayerContext) -> None:
        if not self.decode_every or not self.evicts(ctx):
            return
        st = ctx.state
        st.since_compression += 1
        if st.since_compression < self.decode_every:
            return
        st.since_compression = 0
        budget = self.layer_budget(ctx)
        if ctx.kv.length > budget:
            self.compact(ctx, budget, self.decode_every, ctx.q_pos[-1] + 1)
