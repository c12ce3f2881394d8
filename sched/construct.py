"""Starting allocations: region-aligned constructions, the homogeneous-cluster layout, random.

Each returns an (S, D) array X (X[s, p]: peer of stage s in pipeline p) and the spares.
"Locality order" lists peers so that peers of one region (or, on a measured view without
region labels, peers close to each other) are adjacent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from .cost import CostModel

__all__ = [
    "aligned_blocks",
    "constructions",
    "consecutive",
    "dp_aligned",
    "given",
    "locality_order",
    "pp_aligned",
    "random_allocation",
]


def locality_order(hop: np.ndarray, regions: Sequence[str] | None = None) -> np.ndarray:
    """Peers grouped by region label (first appearance order), or a nearest-neighbour chain."""
    n = hop.shape[0]
    if regions is not None:
        first: dict = {}
        for i, r in enumerate(regions):
            first.setdefault(r, len(first))
        return np.array(sorted(range(n), key=lambda i: (first[regions[i]], i)), dtype=np.int64)
    dist = hop + hop.T
    seen = np.zeros(n, dtype=bool)
    order = [0]
    seen[0] = True
    for _ in range(n - 1):
        row = np.where(seen, np.inf, dist[order[-1]])
        nxt = int(np.argmin(row))
        order.append(nxt)
        seen[nxt] = True
    return np.array(order, dtype=np.int64)


def dp_aligned(order: np.ndarray, S: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """One region per DP group: consecutive runs of D peers in locality order form the groups."""
    return order[:S * D].reshape(S, D).copy(), order[S * D:].copy()


def pp_aligned(order: np.ndarray, S: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """One region per pipeline: consecutive runs of S peers in locality order form the pipelines."""
    return order[:S * D].reshape(D, S).T.copy(), order[S * D:].copy()


def consecutive(n: int, S: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """What a scheduler assuming a uniform network does: peers p*S .. p*S+S-1 form pipeline p."""
    return np.arange(S * D, dtype=np.int64).reshape(D, S).T.copy(), np.arange(S * D, n, dtype=np.int64)


def random_allocation(n: int, S: int, D: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    perm = rng.permutation(n).astype(np.int64)
    return perm[:S * D].reshape(S, D).copy(), perm[S * D:].copy()


def aligned_blocks(order: np.ndarray, regions: Sequence[str] | None, S: int, D: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Pipelines built from segments of `block` consecutive stages, each segment inside one region
    where the region has room, segment k going to pipeline k mod D at stage block k // D, so
    segments of one region line up at the same stages. block = 1 gives one region per DP group,
    block = S one region per pipeline; in between, e.g. four-GPU machines each hosting four
    stages of one pipeline, next to single-GPU peers hosting the other four."""
    if S % block:
        raise ValueError(f"block {block} does not divide {S} stages")
    labels = [None] * len(order) if regions is None else [regions[i] for i in order]
    segments, leftover = [], []
    k = 0
    while k < len(order):
        j = k
        while j < len(order) and labels[j] == labels[k]:
            j += 1
        run = list(order[k:j])
        cut = len(run) - len(run) % block
        segments += [run[i:i + block] for i in range(0, cut, block)]
        leftover += run[cut:]
        k = j
    segments += [leftover[i:i + block] for i in range(0, len(leftover) - len(leftover) % block, block)]
    need = D * (S // block)
    used = [p for seg in segments[:need] for p in seg]
    X = np.empty((S, D), dtype=np.int64)
    for k, seg in enumerate(segments[:need]):
        p, b = k % D, k // D
        X[b * block:(b + 1) * block, p] = seg
    spares = np.array(sorted(set(order.tolist()) - set(used)), dtype=np.int64)
    return X, spares


def given(pipelines: Iterable[Iterable[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """An allocation handed in as D pipelines of S peer indices (a warm start), checked: every
    pipeline as long, peers distinct and in [0, n). The peers left out are the spares."""
    pipes = [[int(v) for v in p] for p in pipelines]
    if not pipes or not pipes[0] or any(len(p) != len(pipes[0]) for p in pipes):
        raise ValueError("an initial allocation needs at least one pipeline of at least one stage, "
                         "every pipeline as long")
    X = np.array(pipes, dtype=np.int64).T  # (S, D)
    if X.min() < 0 or X.max() >= n:
        raise ValueError(f"an initial allocation names peers outside 0..{n - 1}")
    if len(np.unique(X)) != X.size:
        raise ValueError("an initial allocation places a peer twice")
    return X.copy(), np.setdiff1d(np.arange(n, dtype=np.int64), X.ravel())


def constructions(model: CostModel, S: int, D: int, regions: Sequence[str] | None, rng: np.random.Generator,
                  count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The starting allocations of a search: every construction above for the locality order,
    the same over peers sorted fastest first when speeds differ, and `count` random ones."""
    order = locality_order(model.hop, regions)
    seeds = [dp_aligned(order, S, D), pp_aligned(order, S, D), consecutive(model.n, S, D)]
    seeds += [aligned_blocks(order, regions, S, D, b) for b in range(2, S) if S % b == 0]
    if model.compute_on and np.ptp(model.speed) > 0:
        # fastest first: the slowest peers become spares, and groups of like speed let the
        # uneven split give slow groups fewer layers
        fast = order[np.argsort(-model.speed[order], kind="stable")]
        seeds += [dp_aligned(fast, S, D), pp_aligned(fast, S, D)]
    seeds += [random_allocation(model.n, S, D, rng) for _ in range(count)]
    return seeds
