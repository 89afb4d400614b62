"""The acceptance rule of speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv 2211.17192, section 2.3 and Algorithm 1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", arXiv 2302.01318, Algorithm 2).

Notation (Chen et al.'s, the reverse of Leviathan et al.'s): ``p`` is the DRAFT distribution, ``q`` the
TARGET distribution, both already
processed by temperature / top-k / top-p (:func:`attnkit.sampling.next_token_distribution`). A drafted
token ``x~ ~ p`` is

    accepted with probability  min(1, q(x~) / p(x~))                                      (A)
    otherwise replaced by      x ~ max(0, q(x) - p(x)) / sum_x' max(0, q(x') - p(x'))      (B)

and the proof (Leviathan et al., Appendix A.1) gives, for one position,

    P(X = x) = min(p(x), q(x)) + max(0, q(x) - p(x)) = q(x).

With ``gamma`` drafted tokens the rule is applied left to right: the first rejected position ends the
round with a token drawn from (B) at that position; if every drafted token passes, one more token is
drawn from the target's distribution after the last draft (``q_{gamma+1}``), so a round emits between
1 and ``gamma + 1`` tokens. Each position's (A) only depends on its own ``p_i``, ``q_i`` and draft
token, so the ratios for all positions, and the uniforms tested against them, are computed at once
(one gather, one ``rand``); the first failure is found with a cumulative product. Only the single
residual (B) that is needed is formed.

Deterministic drafts (prompt lookup) have a point-mass ``p`` (``p(x~) = 1``): (A) becomes "accept with
probability ``q(x~)``" and (B) becomes ``q`` with ``x~`` removed and renormalised. Such proposals pass
``draft_probs=None`` and nothing of size ``vocab`` is built for them until a residual is needed.

Greedy decoding (no sampling) is the ``temperature -> 0`` limit: a drafted token is accepted while it
equals the target's argmax, and the round ends with the target's argmax at the first disagreement (or
after the last draft), so the output is token for token the target's greedy output.

:func:`outcome_probabilities` computes, with the same pieces (:func:`acceptance_probabilities`,
:func:`residual_distribution`), the exact probability of every result of a round for given drafts;
the tests use it to check losslessness by enumeration, not only by sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.errors import AttnkitError

# Below this total mass the residual (B) is numerically empty: that only happens when q == p up to
# rounding, in which case a rejection has probability ~0 and q itself is the correct fallback.
_RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class Acceptance:
    """Result of one verification round: how many drafted tokens were accepted, and the token that
    follows them (the resampled one at the first rejection, or the bonus token after all of them)."""

    accepted: int
    next_token: int

    def tokens(self, drafted: list[int]) -> list[int]:
        """The tokens this round emits: the accepted drafts then the next token."""
        return list(drafted[: self.accepted]) + [self.next_token]


def _check_shapes(draft_tokens: torch.Tensor | list[int], draft_probs: torch.Tensor | None,
                  target: torch.Tensor) -> int:
    if isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() != 1:
        raise AttnkitError(f"draft tokens must be 1-D [gamma], got shape {tuple(draft_tokens.shape)}")
    gamma = len(draft_tokens)
    if target.dim() != 2 or target.shape[0] != gamma + 1:
        raise AttnkitError(f"target distributions must be [gamma + 1, vocab] = [{gamma + 1}, V], "
                           f"got shape {tuple(target.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != gamma
                                    or draft_probs.shape[1] != target.shape[1]):
        raise AttnkitError(f"draft distributions must be [gamma, vocab] = [{gamma}, {target.shape[1]}], "
                           f"got shape {tuple(draft_probs.shape)}")
    return gamma


def acceptance_probabilities(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                             target_probs: torch.Tensor) -> torch.Tensor:
    """Rule (A) at every drafted position at once: ``min(1, q_i(x_i) / p_i(x_i))``, shape ``[gamma]``.

    `draft_tokens` ``[gamma]``, `draft_probs` ``[gamma, V]`` (None: point masses, ``p_i(x_i) = 1``),
    `target_probs` ``[gamma (+ 1), V]`` (only the first `gamma` rows are used). A token the draft gave
    probability 0 (it cannot have been sampled from p, only a point mass proposes such tokens) is
    treated as ``p = 0``: accepted iff ``q > 0``.
    """
    gamma = draft_tokens.shape[0]
    idx = draft_tokens.view(gamma, 1)
    q = target_probs[:gamma].gather(1, idx).squeeze(1)
    if draft_probs is None:
        return q.clamp(max=1.0)
    p = draft_probs.gather(1, idx).squeeze(1)
    ratio = torch.where(p > 0, q / p.clamp(min=torch.finfo(p.dtype).tiny), (q > 0).to(q.dtype))
    return ratio.clamp(max=1.0)


def residual_distribution(draft_probs_row: torch.Tensor | None, target_probs_row: torch.Tensor,
                          draft_token: int | None = None) -> torch.Tensor:
    """Rule (B) at one position: ``max(0, q - p)`` normalised, ``[V]``.

    With a point-mass draft (`draft_probs_row` None) ``p`` is one-hot at `draft_token`. If the residual
    has (numerically) no mass, ``q == p`` and a rejection is a rounding artefact: ``q`` is returned.
    """
    q = target_probs_row
    if draft_probs_row is None:
        if draft_token is None:
            raise AttnkitError("a point-mass draft needs its draft token to form the residual")
        residual = q.clone()
        residual[draft_token] = torch.clamp(residual[draft_token] - 1.0, min=0.0)
    else:
        residual = torch.clamp(q - draft_probs_row, min=0.0)
    total = residual.sum()
    if float(total) <= _RESIDUAL_EPS:
        return q / q.sum()
    return residual / total


def speculative_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> Acceptance:
    """Sample one round's outcome with rules (A) and (B), vectorised over the drafts.

    `draft_tokens` ``[gamma]`` (may be empty), `draft_probs` ``[gamma, V]`` or None (point masses),
    `target_probs` ``[gamma + 1, V]``: row ``i`` is the target's distribution for the token after the
    context and the first ``i`` drafts. Draws ``gamma`` uniforms at once, accepts the longest prefix
    with ``u_i < min(1, q_i(x_i) / p_i(x_i))``, then draws the next token from (B) at the first
    rejection or from ``q_{gamma+1}`` if all were accepted.
    """
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    accepted = gamma
    if gamma:
        accept = acceptance_probabilities(draft_tokens, draft_probs, target_probs)
        u = torch.rand(gamma, generator=generator, device=target_probs.device, dtype=accept.dtype)
        passed = (u < accept).to(torch.int64)
        accepted = int(passed.cumprod(0).sum())
    if accepted == gamma:
        dist = target_probs[gamma]
    else:
        dist = residual_distribution(None if draft_probs is None else draft_probs[accepted], target_probs[accepted],
                                     int(draft_tokens[accepted]))
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Acceptance(accepted, token)


def greedy_accept(draft_tokens: torch.Tensor | list[int], target_logits: torch.Tensor) -> Acceptance:
    """Greedy verification: accept drafts while each equals the target's argmax at its position; the
    next token is the target's argmax after the accepted prefix. `target_logits` ``[gamma + 1, V]``;
    `draft_tokens` ``[gamma]`` (a tensor or a list of ids). The argmaxes come back to Python in one
    transfer and the prefix is compared there (a handful of ids: cheaper than tensor ops, which the
    speculative loop would pay once per round)."""
    _check_shapes(draft_tokens, None, target_logits)
    drafted = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else draft_tokens
    return greedy_prefix(drafted, target_logits.argmax(-1).tolist())


def greedy_prefix(drafted: list[int], best: list[int]) -> Acceptance:
    """:func:`greedy_accept` from the target's argmaxes `best` (``gamma + 1`` ids, one per position):
    a batch finds every row's argmaxes in one transfer, then each row's prefix here."""
    if len(best) != len(drafted) + 1:
        raise AttnkitError(f"greedy verification needs gamma + 1 = {len(drafted) + 1} target tokens, got {len(best)}")
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == best[accepted]:
        accepted += 1
    return Acceptance(accepted, best[accepted])


def outcome_probabilities(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor) -> torch.Tensor:
    """Exact probabilities of every outcome of :func:`speculative_accept` for these drafts:
    ``P[k, x]`` = P(exactly ``k`` drafts accepted and the next token is ``x``), ``[gamma + 1, V]``.

    With ``a_i`` from (A): ``P[k] = a_1 ... a_k (1 - a_{k+1}) * residual_{k+1}`` for ``k < gamma`` and
    ``P[gamma] = a_1 ... a_gamma * q_{gamma+1}``. Summed over the drafts ``x~ ~ p`` this reproduces the
    target's distribution (Leviathan et al. 2023, appendix A.1); the tests check it by enumeration.
    """
    gamma = _check_shapes(draft_tokens, draft_probs, target_probs)
    out = torch.zeros_like(target_probs, dtype=torch.float64)
    reach = torch.ones((), dtype=torch.float64)
    accept = acceptance_probabilities(draft_tokens, draft_probs, target_probs).double() if gamma else None
    for k in range(gamma):
        residual = residual_distribution(None if draft_probs is None else draft_probs[k], target_probs[k],
                                         int(draft_tokens[k])).double()
        out[k] = reach * (1 - accept[k]) * residual
        reach = reach * accept[k]
    out[gamma] = reach * target_probs[gamma].double()
    return out
