"""Cheapest open Hamiltonian path (open-loop TSP, any start, any end) through the coarsened graph.

Exact by Held-Karp dynamic programming up to EXACT_MAX_NODES nodes, vectorised over all
subsets of one size at a time; beyond that, nearest-neighbour starts improved by 2-opt and
or-opt until neither finds a gain. Edge weights may be asymmetric: E[a, b] is the cost of
visiting b right after a.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["open_path", "path_cost", "EXACT_MAX_NODES"]

EXACT_MAX_NODES = 14


def path_cost(E: np.ndarray, order: ArrayLike) -> float:
    order = np.asarray(order)
    return float(E[order[:-1], order[1:]].sum())


@lru_cache(maxsize=None)
def _masks_by_size(n: int) -> tuple[np.ndarray, ...]:
    masks = np.arange(1 << n, dtype=np.int64)
    sizes = np.zeros(1 << n, dtype=np.int64)
    for j in range(n):
        sizes += (masks >> j) & 1
    return tuple(masks[sizes == k] for k in range(n + 1))


def _held_karp(E: np.ndarray) -> tuple[float, list[int]]:
    n = E.shape[0]
    full = (1 << n) - 1
    dp = np.full((1 << n, n), np.inf)
    parent = np.full((1 << n, n), -1, dtype=np.int64)
    for j in range(n):
        dp[1 << j, j] = 0.0
    bits = 1 << np.arange(n, dtype=np.int64)
    by_size = _masks_by_size(n)
    for k in range(1, n):
        masks = by_size[k]
        vals = dp[masks]  # (m, n): best path over mask ending at each node
        total = vals[:, :, None] + E[None, :, :]  # (m, last, next)
        best_last = total.argmin(axis=1)  # (m, next)
        best = np.take_along_axis(total, best_last[:, None, :], axis=1)[:, 0, :]
        outside = (masks[:, None] & bits[None, :]) == 0  # (m, next)
        mi, nj = np.nonzero(outside)
        target = masks[mi] | bits[nj]
        dp[target, nj] = best[mi, nj]  # each (target, next) comes from exactly one mask
        parent[target, nj] = best_last[mi, nj]
    end = int(np.argmin(dp[full]))
    cost = float(dp[full, end])
    order = [end]
    mask = full
    while True:
        prev = int(parent[mask, order[-1]])
        if prev < 0:
            break
        mask ^= 1 << order[-1]
        order.append(prev)
    return cost, order[::-1]


def _two_opt(E: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Reverse segments while any reversal lowers the cost (first the best one each round)."""
    n = len(order)
    idx_i, idx_j = np.triu_indices(n, k=1)
    while True:
        o = order
        fwd = E[o[:-1], o[1:]]  # (n-1,) edge k: o[k] -> o[k+1]
        bwd = E[o[1:], o[:-1]]
        flip = np.concatenate(([0.0], np.cumsum(bwd - fwd)))  # change of inner edges k < j
        inner = flip[idx_j] - flip[idx_i]
        before = o[np.maximum(idx_i - 1, 0)]  # node ahead of the segment (unused when i = 0)
        after = o[np.minimum(idx_j + 1, n - 1)]  # node behind it (unused when j = n - 1)
        left = np.where(idx_i > 0, E[before, o[idx_j]] - E[before, o[idx_i]], 0.0)
        right = np.where(idx_j < n - 1, E[o[idx_i], after] - E[o[idx_j], after], 0.0)
        gain = inner + left + right
        k = int(np.argmin(gain))
        if gain[k] >= -1e-12:
            return order
        i, j = idx_i[k], idx_j[k]
        order = np.concatenate((o[:i], o[i:j + 1][::-1], o[j + 1:]))


def _or_opt(E: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, bool]:
    """Move one segment of 1 to 3 nodes elsewhere (possibly reversed) if that lowers the cost."""
    n = len(order)
    base = path_cost(E, order)
    for length in (1, 2, 3):
        for i in range(n - length + 1):
            seg = order[i:i + length]
            rest = np.concatenate((order[:i], order[i + length:]))
            rest_cost = path_cost(E, rest)
            links = E[rest[:-1], rest[1:]]
            for cand in (seg, seg[::-1]):
                inner = path_cost(E, cand)
                # insert before rest[k], k = 0..len(rest)
                into = np.empty(len(rest) + 1)
                into[0] = E[cand[-1], rest[0]]
                into[-1] = E[rest[-1], cand[0]]
                into[1:-1] = E[rest[:-1], cand[0]] + E[cand[-1], rest[1:]] - links
                total = rest_cost + inner + into
                k = int(np.argmin(total))
                if total[k] < base - 1e-12:
                    return np.concatenate((rest[:k], cand, rest[k:])), True
    return order, False


def _heuristic(E: np.ndarray, starts: int = 8, stop: Callable[[], bool] | None = None) -> tuple[float, list[int]]:
    n = E.shape[0]
    best_cost, best = np.inf, None
    for start in range(min(starts, n)):
        if best is not None and stop is not None and stop():
            break
        seen = np.zeros(n, dtype=bool)
        order = [start]
        seen[start] = True
        for _ in range(n - 1):
            row = np.where(seen, np.inf, E[order[-1]])
            nxt = int(np.argmin(row))
            order.append(nxt)
            seen[nxt] = True
        o = np.array(order)
        while True:
            o = _two_opt(E, o)
            o, moved = _or_opt(E, o)
            if not moved:
                break
        c = path_cost(E, o)
        if c < best_cost - 1e-12:
            best_cost, best = c, o
    if best is None:
        raise ValueError("a path needs at least one node")
    return best_cost, [int(v) for v in best]


def open_path(E: np.ndarray, exact_max_nodes: int = EXACT_MAX_NODES,
              stop: Callable[[], bool] | None = None) -> tuple[float, list[int]]:
    """(cost, order): the cheapest open path visiting every node once (exact up to the limit).
    stop: beyond the limit, once it returns True no further nearest-neighbour start is tried."""
    E = np.asarray(E, dtype=float)
    n = E.shape[0]
    if n == 1:
        return 0.0, [0]
    if n <= exact_max_nodes:
        return _held_karp(E)
    return _heuristic(E, stop=stop)
