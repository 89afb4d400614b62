"""95 % intervals for scores, and whether a difference between two methods holds.

- An accuracy (every per-sample score 0 or 1) gets the Wilson score interval: E. B. Wilson, 1927, "Probable
  Inference, the Law of Succession, and Statistical Inference", Journal of the American Statistical Association
  22(158), 209-212. Unlike the normal approximation it stays inside [0, 1] and is not empty at 0/n or n/n.
- Any other mean (edit similarity, F1, ROUGE, bits per byte, fractions of references found) gets the percentile
  bootstrap: B. Efron, 1979, "Bootstrap Methods: Another Look at the Jackknife", The Annals of Statistics 7(1),
  1-26; B. Efron and R. Tibshirani, 1993, "An Introduction to the Bootstrap", ch. 13.
- A difference between a method and full attention (or two methods) on the same samples is judged on the paired
  per-sample differences with the same bootstrap; it *holds* when its interval excludes 0.

Every resampling draws from a generator seeded with :data:`BOOTSTRAP_SEED` (and the data's size), so the same
scores always give the same interval. The samples of a cell are treated as independent; several questions about
one context (multi-query) are not, so their intervals are somewhat too narrow, as the report says.
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def _clean(scores) -> list[float]:
    return [float(s) for s in scores if s is not None and not (isinstance(s, float) and math.isnan(s))]


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for `successes` out of `n` (Wilson 1927)."""
    if n <= 0:
        raise ValueError("the Wilson interval needs n >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in 0..{n}, got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _generator(n: int, seed: int | None) -> np.random.Generator:
    return np.random.default_rng([BOOTSTRAP_SEED if seed is None else seed, n])


def bootstrap_mean(scores, resamples: int = BOOTSTRAP_RESAMPLES, seed: int | None = None,
                   level: float = 0.95) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `scores` (Efron 1979); deterministic for a given seed."""
    x = np.asarray(_clean(scores), dtype=np.float64)
    if x.size == 0:
        raise ValueError("the bootstrap needs at least one score")
    if x.size == 1 or np.all(x == x[0]):
        return float(x[0]), float(x[0])
    idx = _generator(x.size, seed).integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def is_binary(scores) -> bool:
    values = _clean(scores)
    return bool(values) and all(v in (0.0, 1.0) for v in values)


def score_interval(scores) -> tuple[float, float, str] | None:
    """``(low, high, how)``: the 95 % interval of the mean of `scores` (None values ignored), by ``"wilson"``
    for 0/1 scores, else ``"bootstrap"``; None when there is no score."""
    values = _clean(scores)
    if not values:
        return None
    if is_binary(values):
        low, high = wilson(int(sum(values)), len(values))
        return low, high, "wilson"
    low, high = bootstrap_mean(values)
    return low, high, "bootstrap"


def paired_difference(a, b, resamples: int = BOOTSTRAP_RESAMPLES, seed: int | None = None) -> dict | None:
    """The mean of ``a[i] - b[i]`` over the samples both scored, its 95 % bootstrap interval, and whether it
    holds (the interval excludes 0). None when no sample has both scores."""
    pairs = [(float(x), float(y)) for x, y in zip(a, b) if x is not None and y is not None
             and not (isinstance(x, float) and math.isnan(x)) and not (isinstance(y, float) and math.isnan(y))]
    if not pairs:
        return None
    d = [x - y for x, y in pairs]
    low, high = bootstrap_mean(d, resamples, seed)
    return {"diff": sum(d) / len(d), "low": low, "high": high, "n": len(d), "holds": low > 0 or high < 0}


def ratio_interval(cells: list[tuple[list, list]], higher_is_better: list[bool], resamples: int = BOOTSTRAP_RESAMPLES,
                   seed: int | None = None) -> tuple[float, float] | None:
    """The 95 % interval of a column's mean score relative to full over several cells: each resample draws every
    cell's samples with replacement (the same draw for the method and full: they scored the same samples), takes
    the cell's ratio of means (oriented so below 1 is worse) and averages the ratios over cells. `cells` holds
    ``(method scores, full scores)`` per cell. None when no cell has a ratio."""
    usable = []
    for (ms, fs), higher in zip(cells, higher_is_better):
        pairs = np.asarray([(float(x), float(y)) for x, y in zip(ms, fs) if x is not None and y is not None],
                           dtype=np.float64)
        if pairs.size and pairs[:, 1 if higher else 0].mean() != 0:  # as score_rel_full: no ratio to a zero
            usable.append((pairs, higher))
    if not usable:
        return None
    total = sum(p.shape[0] for p, _ in usable)
    rng = _generator(total, seed)
    ratios = np.zeros((resamples, len(usable)))
    valid = np.ones((resamples, len(usable)), dtype=bool)
    for c, (pairs, higher) in enumerate(usable):
        idx = rng.integers(0, pairs.shape[0], size=(resamples, pairs.shape[0]))
        m, f = pairs[idx, 0].mean(axis=1), pairs[idx, 1].mean(axis=1)
        num, den = (m, f) if higher else (f, m)
        valid[:, c] = den != 0
        ratios[:, c] = np.divide(num, den, out=np.zeros_like(num), where=den != 0)
    keep = valid.all(axis=1)
    if not keep.any():
        return None
    means = ratios[keep].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
