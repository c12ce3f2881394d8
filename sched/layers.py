"""How a model's layers split across pipeline stages: the one rule the scheduler costs and the
trainer builds.

`split_layers` is the scheduler's form (counts per stage under memory caps, and the shortfall);
`layer_ranges` is the trainer's (contiguous `[start, end)` ranges, no caps), the same split.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["layer_ranges", "split_layers"]


def split_layers(layers: int, speeds: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, int]:
    """Layer counts per stage minimising max(count / speed), each in [1, cap]; and the shortfall.

    Greedy water-filling: each layer goes to the stage whose time after taking it is lowest,
    which is optimal for this min-max objective. Ties go to the lower stage index.
    """
    n = len(speeds)
    counts = np.ones(n, dtype=np.int64)
    heap = [((2.0) / speeds[s], s) for s in range(n) if caps[s] > 1]
    heapq.heapify(heap)
    left = layers - n
    while left > 0 and heap:
        _, s = heapq.heappop(heap)
        counts[s] += 1
        left -= 1
        if counts[s] < caps[s]:
            heapq.heappush(heap, ((counts[s] + 1) / speeds[s], s))
    shortfall = max(left, 0) + int(np.maximum(counts - caps, 0).sum())
    return counts, shortfall


def layer_ranges(n_layer: int, stages: int, speeds: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` layer ranges for `stages` stages, at least one layer each.

    The counts are `split_layers`' with no memory cap: they minimise the slowest stage's
    count / speed, so a stage twice as fast gets about twice the layers; without speeds the
    split is as even as possible, larger stages first. Raises ValueError for an impossible split.
    """
    n_layer, stages = operator.index(n_layer), operator.index(stages)
    if stages < 1 or n_layer < stages:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages of at least one layer")
    v = np.ones(stages) if speeds is None else np.asarray([float(x) for x in speeds])
    if v.shape != (stages,) or not all(math.isfinite(x) and x > 0 for x in v):
        raise ValueError(f"need {stages} positive, finite stage speeds, got {speeds!r}")
    counts, _ = split_layers(n_layer, v, np.full(stages, n_layer))
    ends = np.cumsum(counts).tolist()
    return list(zip([0] + ends[:-1], ends))
