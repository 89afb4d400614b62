"""Labels in a column beside a plot, each as near its point as the others allow, none overlapping.

Point labels placed at their points overlap once points crowd (40 recipes on one score-vs-speed plot). Here the
labels stand in a column at the plot's side, joined to their points by thin lines: along the column, label ``i``
wants the height of its point, ``y_i``, and two labels must be at least one line apart. The heights that move the
labels least (sum of squared moves) under that constraint follow from one isotonic regression: with labels sorted
by ``y`` and ``w_k = z_k - k * gap``, the constraint is that ``w`` does not decrease, solved exactly by pool
adjacent violators (Ayer, Brunk, Ewing, Reid, Silverman, 1955, "An Empirical Distribution Function for Sampling
with Incomplete Information", Ann. Math. Statist. 26(4)); bounds on the column clip ``w``. Deterministic, with no
iterations to tune, unlike force-directed placement (adjustText), which may also leave overlaps in a dense cluster.
"""

from __future__ import annotations


def spread(desired: list[float], gap: float, low: float, high: float) -> list[float]:
    """Positions, in the order of `desired`, at least `gap` apart and within [`low`, `high`] where they fit
    (else from `low` up, still `gap` apart), moving each label as little as possible from its desired position."""
    n = len(desired)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (desired[i], i))
    blocks: list[list[float]] = []  # [sum, count] of runs pooled to their mean
    for k, i in enumerate(order):
        blocks.append([desired[i] - k * gap, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    w = [total / count for total, count in blocks for _ in range(int(count))]
    top = max(low, high - (n - 1) * gap)
    out = [0.0] * n
    for k, i in enumerate(order):
        out[i] = min(max(w[k], low), top) + k * gap
    return out
