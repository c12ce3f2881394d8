"""The DT-FM cost model (COSTMODEL.md) on matrices, plus the optional compute and memory terms.

An allocation is held as an (S, D) integer array X: X[s, p] is the peer running stage s of
pipeline p; row s is the DP group of stage s. The paper objective is

    DPcost + 2 * PPcost,  DPcost = max_s max_{i in G_s} sum_{j in G_s} 2 (a_ij + c_grad / (D b_ij)),
                          PPcost = sum_s max_p a + c_act / b  over the hop P[p][s] -> P[p][s+1].

The extensions, each off unless its inputs are given:
- compute: a stage runs at the speed of its slowest member; an iteration of GPipe takes
  (M + S - 1) times the slowest stage's time per micro-batch.
- memory: a peer holds no more layers than fit; a shortfall is a penalty, not a crash.
- uneven layers: stages may hold different layer counts, faster groups more; a stage's gradient
  volume follows its layer count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layers import split_layers
from .spec import Workload

__all__ = ["CostModel", "CostBreakdown", "INFEASIBLE_PENALTY_S"]

# Cost added per layer that does not fit in memory: large enough that any feasible allocation wins.
INFEASIBLE_PENALTY_S = 1e4


@dataclass(frozen=True)
class CostBreakdown:
    dp_s: float  # the paper's DPcost
    pp_s: float  # the paper's PPcost (one direction)
    compute_s: float  # the compute term; 0 when compute is off
    penalty_s: float  # memory shortfall penalty; 0 when every stage fits
    layers: tuple[int, ...]  # layers per stage, in stage order
    dp_stage_s: tuple[float, ...] = field(default=(), repr=False)  # DP cost of each stage's group
    boundary_s: tuple[float, ...] = field(default=(), repr=False)  # bottleneck hop of each boundary

    @property
    def paper_s(self) -> float:
        """DPcost + 2 PPcost: the objective of the paper, whatever the extensions."""
        return self.dp_s + 2 * self.pp_s

    @property
    def total_s(self) -> float:
        """The objective the search minimises: the paper's plus the enabled extensions."""
        return self.paper_s + self.compute_s + self.penalty_s

    @property
    def feasible(self) -> bool:
        return self.penalty_s == 0


class CostModel:
    """Cost of allocations on one network for one workload.

    delay_ms and bandwidth_gbps are (N, N) in scenario units (one-way ms, Gbps, bandwidth
    infinite or ignored on the diagonal). compute: per-peer relative speed (1.0 = the speed the
    workload's layer_compute_s refers to). memory_gib: per-peer memory.
    """

    def __init__(self, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, workload: Workload, *,
                 compute: np.ndarray | None = None, memory_gib: np.ndarray | None = None,
                 uneven_layers: bool = False) -> None:
        delay_ms = np.asarray(delay_ms, dtype=float)
        bandwidth_gbps = np.asarray(bandwidth_gbps, dtype=float)
        n = delay_ms.shape[0]
        if delay_ms.shape != (n, n) or bandwidth_gbps.shape != (n, n):
            raise ValueError("delay and bandwidth must be square matrices of the same size")
        if np.any(delay_ms < 0) or np.any(np.isnan(delay_ms)):
            raise ValueError("delays must be non-negative")
        off = ~np.eye(n, dtype=bool)
        if np.any(~(bandwidth_gbps[off] > 0)):
            raise ValueError("bandwidths must be positive")
        self.n = n
        self.workload = wl = workload
        a = delay_ms / 1e3
        inv_b = np.zeros((n, n))
        inv_b[off] = 8.0 / bandwidth_gbps[off]  # seconds per GB
        a[~off] = 0.0
        self.hop = a + wl.act_gb * inv_b  # (N, N) one boundary hop, seconds
        self.dp_a = 2 * a  # DP pair cost = dp_a + grad_gb * dp_b
        self.dp_b = 2 * inv_b / wl.dp
        self.compute = None if compute is None else np.asarray(compute, dtype=float)
        self.memory = None if memory_gib is None else np.asarray(memory_gib, dtype=float)
        for name, v in (("compute", self.compute), ("memory_gib", self.memory)):
            if v is not None and (v.shape != (n,) or np.any(~(v > 0))):
                raise ValueError(f"{name} must be {n} positive numbers")
        self.uneven_layers = uneven_layers
        self.memory_on = self.memory is not None and wl.layer_memory_gib is not None
        self.compute_on = wl.layer_compute_s is not None
        self.speed = self.compute if self.compute is not None else np.ones(n)
        if self.memory_on:
            room = (self.memory - wl.base_memory_gib) / wl.layer_memory_gib
            self.layer_cap = np.floor(np.maximum(room, 0) + 1e-9).astype(np.int64)
        else:
            self.layer_cap = np.full(n, wl.layers, dtype=np.int64)
        # The fast search path is exact only for the paper objective with an even split.
        self.extensions = self.compute_on or self.memory_on or uneven_layers or not wl.uniform_layers

    # -- per-group quantities -------------------------------------------------------------
    def group_layers(self, X: np.ndarray) -> tuple[np.ndarray, int]:
        """Layers per group (row of X) and the memory shortfall in layers."""
        S = X.shape[0]
        wl = self.workload
        caps = self.layer_cap[X].min(axis=1)
        if self.uneven_layers:
            speeds = self.speed[X].min(axis=1) if self.compute_on else np.ones(S)
            return split_layers(wl.layers, speeds, caps)
        counts, _ = split_layers(wl.layers, np.ones(S), np.full(S, wl.layers))
        return counts, int(np.maximum(counts - caps, 0).sum())

    def dp_rows(self, X: np.ndarray, layers: np.ndarray) -> np.ndarray:
        """(S, D) DP cost of every member of every group."""
        g = np.array([self.workload.grad_gb(c) for c in layers])
        A = self.dp_a[X[:, :, None], X[:, None, :]].sum(axis=2)
        B = self.dp_b[X[:, :, None], X[:, None, :]].sum(axis=2)
        return A + g[:, None] * B

    def hops(self, X: np.ndarray) -> np.ndarray:
        """(S-1, D) hop time of every pipeline at every boundary."""
        return self.hop[X[:-1], X[1:]]

    def compute_time(self, X: np.ndarray, layers: np.ndarray) -> float:
        if not self.compute_on:
            return 0.0
        wl = self.workload
        per_mb = layers * wl.layer_compute_s / self.speed[X].min(axis=1)
        return float((wl.micro_batches + X.shape[0] - 1) * per_mb.max())

    def breakdown(self, X: np.ndarray) -> CostBreakdown:
        X = np.asarray(X, dtype=np.int64)
        layers, shortfall = self.group_layers(X)
        dp_stage = self.dp_rows(X, layers).max(axis=1)
        bound = self.hops(X).max(axis=1) if X.shape[0] > 1 else np.zeros(0)
        return CostBreakdown(
            dp_s=float(dp_stage.max()), pp_s=float(bound.sum()),
            compute_s=self.compute_time(X, layers), penalty_s=INFEASIBLE_PENALTY_S * shortfall,
            layers=tuple(int(c) for c in layers),
            dp_stage_s=tuple(float(v) for v in dp_stage), boundary_s=tuple(float(v) for v in bound))

    def total(self, X: np.ndarray) -> float:
        return self.breakdown(X).total_s

    def uniform_grad_gb(self) -> float:
        wl = self.workload
        return wl.grad_gb(wl.layers / wl.stages)

