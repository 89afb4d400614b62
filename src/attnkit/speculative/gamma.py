"""How many tokens to draft per round: fixed, or adaptive from the observed acceptance.

Adaptive gamma (``adaptive_gamma=True``): the per-token acceptance rate ``alpha`` is estimated from
the rounds so far (a discounted count of accepted over examined drafts; each round is a run of
Bernoulli trials up to the first rejection), and gamma is set to the value maximising the expected
walltime improvement of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192, Theorem 3.8)

    (1 - alpha^(gamma + 1)) / ((1 - alpha) (gamma c + 1)),

``c`` being the draft's cost per token relative to a target forward (the source's estimate: bytes
read per step, the memory-bound model of MagicDec, Chen et al. 2024, arXiv 2408.11049; at least
:data:`MIN_DRAFT_COST`). With a verification cost ``v`` per drafted token (``verify_cost``) the
denominator is ``gamma (c + v) + 1``. A source that sizes its own proposals (prompt lookup, from the
length of its match) gets ``max_gamma`` as a cap instead. Either depends on the acceptances only, never
on timings, so a seeded run is reproducible.
"""

from __future__ import annotations

from attnkit.validate import whole

# Floor of the relative draft cost in the adaptive-gamma model: python and kernel-launch overhead make
# even a free draft (prompt lookup) cost something per verified token.
MIN_DRAFT_COST = 0.05


class GammaController:
    """Fixed gamma, or adaptive from the observed acceptance (see the module docstring)."""

    def __init__(self, gamma: int = 4, adaptive: bool = False, max_gamma: int | None = None, cost: float = 0.0,
                 prior_alpha: float = 0.6, decay: float = 0.9, verify_cost: float = 0.0):
        whole("gamma", gamma, 1, what=" (drafted tokens per round)")
        max_gamma = max(2 * gamma, 8) if max_gamma is None else max_gamma
        whole("max_gamma", max_gamma, gamma, what=" (at least gamma)")
        self.gamma, self.adaptive, self.max_gamma = gamma, adaptive, max_gamma
        self.cost = max(MIN_DRAFT_COST, float(cost))
        self.verify_cost = float(verify_cost)
        self.decay = decay
        self._accepted, self._trials = 2 * prior_alpha, 2.0  # a weak prior worth two trials

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        trials = accepted + (accepted < drafted)  # the drafts examined: accepted ones and the first rejection
        self._accepted = self.decay * self._accepted + accepted
        self._trials = self.decay * self._trials + trials
        if self.adaptive:
            self.gamma = best_gamma(self.alpha, self.cost, self.max_gamma, self.verify_cost)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens a round emits with per-token acceptance `alpha` (Leviathan et al., eq. 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, cost: float, max_gamma: int, verify_cost: float = 0.0) -> int:
    """The gamma in 1..max_gamma maximising expected tokens per unit time, ``E / (gamma (c + v) + 1)``
    (Leviathan et al.'s Theorem 3.8 denominator ``gamma c + 1`` plus `verify_cost` ``v`` per drafted
    token: the target's forward over gamma + 1 tokens is not free where it is compute-bound, e.g. on a
    CPU); the smallest gamma within 1% of the best (extra drafts that barely help still cost)."""
    scores = [expected_tokens(alpha, g) / (g * (cost + verify_cost) + 1.0) for g in range(1, max_gamma + 1)]
    best = max(scores)
    return next(g for g, s in enumerate(scores, start=1) if s >= 0.99 * best)
