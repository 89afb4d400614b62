"""The queries of a model on its own text, summed per layer and query head: what ``attnkit calibrate qfilter`` and
``attnkit calibrate expected_attention`` compute their files from.

``samples`` windows of ``length`` tokens (each starting with the model's BOS token) of the training split of attnkit's
corpus (:mod:`attnkit.eval.data.corpus`, on which the bundled ``tiny`` was trained), drawn by seed
(:func:`attnkit.calibrate.kvzap.text_windows`), are prefilled with full attention in batches. Every layer's queries, as
its attention sees them (after RoPE, after Qwen3's query norm), or rotated back by their positions to the queries
before RoPE (:meth:`attnkit.rope.Rope.rotate` by ``-t``), are folded into a running count, mean and scatter (the sum of
outer products of the deviations from the mean) per query head, in float64 with Chan et al.'s pairwise update
(:func:`attnkit.methods.expected_attention.merge_moments`), so no ``E[q q^T] - mu mu^T`` cancellation occurs. The
first ``skip`` positions of every window (attention sinks, whose queries are outliers) may be left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnkit.calibrate.kvzap import text_windows
from attnkit.calibrate.samples import check_length
from attnkit.errors import AttnkitError
from attnkit.forward import prefill
from attnkit.methods.expected_attention import merge_moments
from attnkit.methods.full import Full
from attnkit.model import LoadedModel
from attnkit.session import new_session
from attnkit.validate import whole

BATCH_ROWS = 8  # windows prefilled together


@dataclass
class QueryMoments:
    """Per layer: queries folded in, their mean ``[heads, d]`` and scatter ``[heads, d, d]`` (float64, CPU)."""

    count: dict = field(default_factory=dict)
    mean: dict = field(default_factory=dict)
    scatter: dict = field(default_factory=dict)

    def second_moment(self, layer: int) -> torch.Tensor:
        """The uncentred ``sum_i q_i q_i^T`` ``[heads, d, d]`` of layer `layer`."""
        mean = self.mean[layer]
        return self.scatter[layer] + self.count[layer] * mean.unsqueeze(-1) * mean.unsqueeze(-2)


@dataclass(frozen=True)
class _QueryRecorder(Full):
    """``full`` attention that folds every layer's queries into the run's moments."""

    before_rope: bool = True
    skip: int = 0

    def new_session_state(self) -> QueryMoments:
        return QueryMoments()

    def prefill_attention(self, ctx, q, k, v):
        rope, pos = ctx.session.rope, ctx.q_pos
        if self.before_rope and (rope is None or 2 * rope.inv_freq.numel() != q.shape[-1]):
            raise AttnkitError("this calibration needs a model with RoPE over the whole head (to recover the queries "
                               "before RoPE)")
        x = q.float()
        if self.before_rope:
            x = rope.rotate(x, -pos)
        if self.skip:
            x = x[:, :, pos >= self.skip]
        if x.shape[2]:
            b, h, n, d = x.shape
            x = x.transpose(0, 1).reshape(1, h, b * n, d)  # every row's queries, one sample per head
            st, i = ctx.session_state, ctx.index
            st.count[i], mean, scatter = merge_moments(st.count.get(i, 0), st.mean.get(i), st.scatter.get(i), x)
            st.mean[i], st.scatter[i] = mean, scatter
        return super().prefill_attention(ctx, q, k, v)


def _combine(a: QueryMoments, b: QueryMoments) -> QueryMoments:
    """Both runs' queries as one (Chan et al.'s pairwise update of count, mean and scatter)."""
    for i in b.count:
        if i not in a.count:
            a.count[i], a.mean[i], a.scatter[i] = b.count[i], b.mean[i], b.scatter[i]
            continue
        n1, n2 = a.count[i], b.count[i]
        delta = b.mean[i] - a.mean[i]
        a.mean[i] = a.mean[i] + delta * (n2 / (n1 + n2))
        a.scatter[i] = a.scatter[i] + b.scatter[i] + delta.unsqueeze(-1) * delta.unsqueeze(-2) * (n1 * n2 / (n1 + n2))
        a.count[i] = n1 + n2
    return a


@torch.inference_mode()
def query_moments(model: LoadedModel, *, samples: int, length: int, seed: int, before_rope: bool, skip: int = 0,
                  progress: Callable[[str], None] | None = None) -> QueryMoments:
    """The moments of `model`'s queries on `samples` windows of `length` tokens (see the module docstring), per layer
    ``[query heads, ...]``, ``[:, 0]`` of a batch of rows summed into one sample per head."""
    say = progress or (lambda _msg: None)
    whole("samples", samples, 1)
    check_length(model, length)
    whole("skip", skip, 0, length - 1, what=" (first positions of each window left out; below --length)")
    windows = text_windows(model, "train", samples, length, seed)
    total = QueryMoments()
    recorder = _QueryRecorder(before_rope=before_rope, skip=skip)
    for start in range(0, len(windows), BATCH_ROWS):
        ids = torch.tensor(windows[start:start + BATCH_ROWS], device=model.device)
        say(f"queries: windows {start + 1}-{start + ids.shape[0]} of {len(windows)}")
        session = new_session(model, recorder, ids.shape[1], 0, rows=ids.shape[0])
        prefill(model, session, ids)
        run = session.state
        for i in run.count:  # [1, h, ...] -> [h, ...] on the CPU
            run.mean[i], run.scatter[i] = run.mean[i][0].cpu(), run.scatter[i][0].cpu()
        total = _combine(total, run)
    return total


__all__ = ["QueryMoments", "query_moments"]
