"""``simlayerkv``: lazy layers keep only their initial and recent entries (Zhang, Du, Pang, Liu, Wang, Lin, Wu, Lin,
2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction", arXiv 2410.13846; kvpress's
``SimLayerKVPress``).

SimLayerKV observes that in some layers ("lazy" layers) the last tokens put almost all their attention on the first
tokens (the attention sinks) and the most recent ones, whatever the prompt asks; such a layer loses little when it
keeps only those, as StreamingLLM does, while the other layers keep everything. The test is made per layer on the
prompt (the paper's prefill criterion): the attention probabilities of the prompt's last ``n_last`` queries over the
keys before them (the causal softmax over every key they see, the ``n_last`` keys of their own left out of the sum),
averaged over every query head and those queries, summed over the first ``n_initial`` positions and the ``n_recent``
positions right before the last ``n_last``::

    lazy  <=>  sum_{j < n_initial} a_j + sum_{n - n_last - n_recent <= j < n - n_last} a_j  >  lazy_threshold

A lazy layer keeps its first ``n_initial`` entries and its last ``n_recent - n_last`` (kvpress's count: with
``n_last = 1``, the recent window less one), every kv head alike; any other layer keeps the whole prompt. A prompt
of at most ``n_initial + n_recent + n_last`` tokens, or ``lazy_threshold = 1``, compresses nothing. Generated tokens are
appended in every layer (kvpress's prefill press; the paper's decoding variant re-tests the layers while decoding,
not offered). ``attnkit.generate``'s run statistics count the lazy layers (``lazy_layers``).

There is no budget: what a layer keeps depends on its attention, so each sequence is its own session (``batches``
is False; kvpress averages the test over the batch, attnkit tests each sequence alone), and the vLLM host, whose
plan is a function of the prompt length, refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError
from attnkit.methods.base import Method
from attnkit.methods.prompt_scorer import keep_last_queries
from attnkit.methods.scoring import attention_statistics
from attnkit.methods.spec import register
from attnkit.session import LayerContext
from attnkit.validate import number, whole


@dataclass
class SimLayerKVState:
    """Per layer: the prompt's last queries while the prompt streams in, and whether the layer was found lazy."""

    window_q: torch.Tensor | None = None
    window_pos: torch.Tensor | None = None
    lazy: bool = False


@register
@dataclass(frozen=True)
class SimLayerKV(Method):
    """Per layer: sinks + recent window where the last tokens attend (almost) only there, everything elsewhere."""

    lazy_threshold: float = 0.9
    n_last: int = 1
    n_recent: int = 1024
    n_initial: int = 4

    name = "simlayerkv"
    vllm_refusal = (" (whether a layer keeps only its sinks and recent tokens depends on its attention, so its kept "
                    "count is no function of the prompt length)")
    summary = "lazy layers keep sinks + recent tokens, the others everything (SimLayerKV, Zhang et al. 2024)"
    kvpress = "SimLayerKVPress"
    batches = False  # a layer's kept count depends on its sequence's attention

    def __post_init__(self):
        number("lazy_threshold", self.lazy_threshold, 0.0, 1.0)
        whole("n_last", self.n_last, 1, what=" (last prompt queries that test the layer)")
        whole("n_initial", self.n_initial, 0, what=" (first tokens a lazy layer keeps)")
        whole("n_recent", self.n_recent, 1, what=" (recent tokens tested; a lazy layer keeps n_recent - n_last)")
        if self.n_recent <= self.n_last:
            raise AttnkitError(f"n_recent={self.n_recent} must be larger than n_last={self.n_last}: a lazy layer keeps "
                               f"the last n_recent - n_last tokens")

    def new_layer_state(self) -> SimLayerKVState:
        return SimLayerKVState()

    def keep_rows(self, layer_states: list, session_state, rows: torch.Tensor) -> None:
        for st in layer_states:
            if st.window_q is not None:
                st.window_q = st.window_q[rows.to(st.window_q.device)]

    def decode_only_appends(self) -> bool:
        return True  # generated tokens are appended in every layer

    def tests(self, prompt_len: int) -> bool:
        """Whether a prompt of this length is tested at all (otherwise nothing is compressed)."""
        return self.lazy_threshold < 1.0 and prompt_len > self.n_initial + self.n_recent + self.n_last

    def prefill_attention(self, ctx: LayerContext, q, k, v) -> torch.Tensor:
        out = self._store_and_attend(ctx, q, k, v)
        if self.tests(ctx.session.prompt_len):
            keep_last_queries(ctx.state, q, ctx.q_pos, self.n_last)  # they may straddle prompt chunks
        return out

    def after_prefill(self, ctx: LayerContext, q, k, v) -> None:
        st = ctx.state
        if not self.tests(ctx.session.prompt_len):
            return
        keys, _, positions = ctx.kv.view()
        n = keys.shape[2]
        probs = attention_statistics(st.window_q, keys, ctx.scaling, st.window_pos, positions[0, 0], reduce="mean",
                                     window=ctx.native_window)  # [b, kv, n]: summed over the queries
        share = probs.mean(dim=1) / self.n_last  # mean over every query head and the last queries
        end = n - self.n_last
        mass = share[:, :self.n_initial].sum(dim=-1) + share[:, end - self.n_recent:end].sum(dim=-1)
        st.window_q = st.window_pos = None
        lazy = mass > self.lazy_threshold
        if lazy.any() and not lazy.all():
            raise AttnkitError("simlayerkv tests each sequence alone; its rows disagree on a layer (use one sequence "
                               "per session)")
        if not lazy.all():
            return
        st.lazy = True
        kept = torch.cat([torch.arange(self.n_initial), torch.arange(n - self.n_recent + self.n_last, n)])
        kept = kept.to(keys.device).expand(keys.shape[0], keys.shape[1], -1)
        ctx.kv.keep(kept, spare=ctx.session.max_new_tokens)

    def run_stats(self, session) -> dict:
        return {"lazy_layers": sum(st.lazy for st in session.layer_state)}
