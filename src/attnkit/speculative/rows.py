"""A batch's speculative work, one forward for all its sequences: the target's verification of every
sequence's drafts (:func:`forward_each`) and model drafts' feeds (:func:`propose_rows`).

Every sequence of a batch has its own sessions (the target's, its draft's): after a round each has
kept its own number of drafted tokens, so their caches no longer have the same length and cannot be
rows of one cache. One forward still serves them all: row ``i`` of the batch holds sequence ``i``'s
new tokens, padded on the LEFT to the longest, and :class:`attnkit.session.RowsStep` hands each
session only its own columns (the padding reaches no session; its outputs are zeros and are dropped).
"""

from __future__ import annotations

import torch

from attnkit.forward import forward_rows, logits_of
from attnkit.model import LoadedModel
from attnkit.session import RowsStep, Session, Step
from attnkit.speculative.draft import DraftSource, Proposal
from attnkit.speculative.model_draft import ModelDraft


def forward_each(model: LoadedModel, feeds: list[tuple[Session, list[int], int, str]]) -> torch.Tensor:
    """One forward in which each feed ``(session, tokens, start, phase)`` gives its session `tokens` at
    positions ``start..`` (a :class:`Step` of `phase`); the logits after every fed token, float32
    ``[sum of the feeds' lengths, V]``, feed after feed.

    One feed is exactly the single-sequence forward. A session whose method runs the layers itself
    (``Method.run_layers``) gets a forward of its own: that hook sees one session's step."""
    device = model.device

    def alone(session, tokens, start, phase):
        pos = torch.arange(start, start + len(tokens), device=device)
        return forward_rows(model, torch.tensor([tokens], device=device), pos, Step(session, phase, pos, False),
                            all_positions=True)[0]

    if len(feeds) == 1 or any(f[0].method.run_layers is not None for f in feeds):
        hidden = [alone(*f) for f in feeds]
        return logits_of(model, hidden[0] if len(hidden) == 1 else torch.cat(hidden))
    width = max(len(tokens) for _, tokens, _, _ in feeds)
    ids, positions, parts = [], [], []
    for row, (session, tokens, start, phase) in enumerate(feeds):
        pad = width - len(tokens)
        ids.append([tokens[0]] * pad + list(tokens))
        positions.append([start] * pad + list(range(start, start + len(tokens))))  # padding: any position
        pos = torch.arange(start, start + len(tokens), device=device)
        parts.append((row, row + 1, len(tokens), Step(session, phase, pos, False)))
    hidden = forward_rows(model, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                          RowsStep(parts), all_positions=True)
    return logits_of(model, torch.cat([hidden[row, width - len(f[1]):] for row, f in enumerate(feeds)]))


def propose_rows(sources: list[DraftSource], contexts: list[list[int]], gammas: list[int]) -> list[Proposal]:
    """Every sequence's proposal for this round (none where its gamma is 0).

    Model drafts that draft with the same model (a batch's forks of one source) run their plans
    (:meth:`ModelDraft.proposing`) side by side: whenever each plan asks for its next feed, the feeds of
    all the plans still drafting are one forward over their rows, each row its own draft session; a row
    whose draft has finished (its gamma reached, or a confidence stop) leaves those forwards. Any other
    source (prompt lookup, which runs no model; a source of the caller's) proposes sequence by sequence."""
    out = [Proposal([]) for _ in sources]
    busy = [i for i, g in enumerate(gammas) if g > 0]
    if len(busy) < 2 or not _drafting_together([sources[i] for i in busy]):
        for i in busy:
            out[i] = sources[i].propose(contexts[i], gammas[i])
        return out
    plans = {i: sources[i].proposing(contexts[i], gammas[i]) for i in busy}
    pending: dict[int, tuple[list[int], int]] = {}

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            pending[i] = next(plans[i]) if logits is None else plans[i].send(logits)
        except StopIteration as done:
            pending.pop(i, None)
            out[i] = done.value

    for i in busy:
        advance(i, None)
    while pending:
        rows = list(pending)
        for i, logits in zip(rows, _feed_rows([sources[i] for i in rows], [pending[i] for i in rows]), strict=True):
            advance(i, logits)
    return out


def _drafting_together(sources: list[DraftSource]) -> bool:
    """Whether these sources' feeds can share forwards: model drafts of one drafting model whose cache
    method leaves the layers to the forward (every draft of a batch's forks of one source, then)."""
    if not all(isinstance(s, ModelDraft) and s.session is not None for s in sources):
        return False
    first = sources[0]
    return all(s.drafter is first.drafter and s.session.method.run_layers is None for s in sources)


def _feed_rows(sources: list[ModelDraft], feeds: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """:meth:`ModelDraft._feed` for several drafts at once: draft ``i`` takes ``feeds[i] = (tokens,
    start)``; its logits ``[len(tokens), V]``. A cache that only appends takes a feed's tokens in one
    forward; an evicting one a token per forward (the ``j``-th forward takes every draft's ``j``-th
    token), as :meth:`ModelDraft._feed` does; each draft counts the forwards it took part in."""
    model = sources[0].drafter
    if all(s.method.decode_only_appends() for s in sources):
        for s in sources:
            s.forwards += 1
        sizes = [len(tokens) for tokens, _ in feeds]
        logits = forward_each(model, [(s.session, tokens, start, "decode") for s, (tokens, start) in zip(sources, feeds)])
        return list(logits.split(sizes))
    rows: list[list[torch.Tensor]] = [[] for _ in feeds]
    for j in range(max(len(tokens) for tokens, _ in feeds)):
        live = [i for i, (tokens, _) in enumerate(feeds) if len(tokens) > j]
        logits = forward_each(model, [(sources[i].session, [feeds[i][0][j]], feeds[i][1] + j, "decode") for i in live])
        for i, row in zip(live, logits, strict=True):
            rows[i].append(row)
            sources[i].forwards += 1
    return [torch.stack(r) for r in rows]
