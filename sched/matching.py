"""Bottleneck perfect matching between two DP groups, and the coarsened graph of all groups.

The edge A -> B of the coarsened graph is the smallest value t such that A's members can be
paired one-to-one with B's members using only hops of at most t. It is found by a binary search
over the distinct hop values, each step a perfect-matching test (an assignment problem on the
0/1 matrix "hop > t", solved exactly by scipy's linear_sum_assignment).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bottleneck_matching", "bottleneck_value", "coarse_graph", "linear_assignment"]


def linear_assignment(cost: np.ndarray, maximize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of an optimal assignment of `cost` (scipy's linear_sum_assignment). scipy
    is imported on the first call: a daemon that never schedules does not load it (about 40 MiB)."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(cost, maximize=maximize)


def _perfect_at(m: np.ndarray, t: float) -> np.ndarray | None:
    over = m > t
    rows, cols = linear_assignment(over)
    if over[rows, cols].any():
        return None
    return cols


def _search(m: np.ndarray) -> float:
    """The smallest t at which m has a perfect matching using only entries <= t."""
    lb = max(m.min(axis=1).max(), m.min(axis=0).max())  # every row and column needs a partner
    values = np.unique(m[m >= lb])
    lo, hi = 0, len(values) - 1
    if _perfect_at(m, values[0]) is not None:
        hi = 0
    else:
        lo = 1
        while lo < hi:  # values[hi] is always feasible (it is the maximum)
            mid = (lo + hi) // 2
            if _perfect_at(m, values[mid]) is not None:
                hi = mid
            else:
                lo = mid + 1
    return float(values[hi])


def bottleneck_value(m: np.ndarray) -> float:
    """The value of `bottleneck_matching(m)` without the tie-breaking pairing (about 2.5 times
    faster: the coarsened graph needs only the values)."""
    m = np.asarray(m, dtype=float)
    if m.shape[0] == 1:
        return float(m[0, 0])
    return _search(m)


def bottleneck_matching(m: np.ndarray) -> tuple[float, np.ndarray]:
    """(value, cols): row i pairs with column cols[i]; value = max m[i, cols[i]], minimal.

    Among the matchings with that bottleneck, cols has the least total, so ties are broken
    towards cheaper hops everywhere else.
    """
    m = np.asarray(m, dtype=float)
    if m.shape[0] == 1:
        return float(m[0, 0]), np.zeros(1, dtype=np.int64)
    t = _search(m)
    cost = np.where(m <= t, m, m.max() * m.size + 1.0)
    _, cols = linear_assignment(cost)
    return float(t), cols.astype(np.int64)


def coarse_graph(hop: np.ndarray, groups: np.ndarray, symmetric: bool) -> np.ndarray:
    """(S, S) bottleneck-matching values between the rows of groups ((S, D) peer indices)."""
    S = groups.shape[0]
    E = np.zeros((S, S))
    for a in range(S):
        for b in range(a + 1 if symmetric else 0, S):
            if a == b:
                continue
            E[a, b] = bottleneck_value(hop[np.ix_(groups[a], groups[b])])
            if symmetric:
                E[b, a] = E[a, b]
    return E
