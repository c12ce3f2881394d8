"""Memetic search for one shape (S stages x D pipelines): evolution over DP-group partitions,
each candidate polished by swap local search and by the exact matching + path step.

`realize` turns unordered DP groups into the best pipelines for them: bottleneck matchings
between every pair of groups give the coarsened graph, the open path through it gives the stage
order, and the matchings along the path give the pipelines (exact up to 14 stages).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .cost import CostModel, nearly_symmetric
from .local import SwapSearch
from .matching import bottleneck_matching, bottleneck_value
from .path import EXACT_MAX_NODES, open_path

__all__ = ["SearchConfig", "SEARCH_PROFILES", "ShapeSearch"]


# On the worldwide network, 8-12 peers found nothing better after the starts in 100-300 rounds;
# 16 peers improved after up to 35 rounds without (of 100-150 in 20 s): 4 per peer waits longer.
STALL_ROUNDS_PER_PEER = 4


@dataclass(frozen=True)
class SearchConfig:
    time_budget_s: float = 20.0  # anytime: the best allocation found so far is returned
    generations: int | None = None  # cap on evolution rounds; with a cap and ample time, runs repeat exactly
    population: int = 10  # partitions kept; more explores more, each round costs the same
    mutation_swaps: int = 3  # random swaps applied to each child before local search
    exact_path_max_stages: int = EXACT_MAX_NODES  # Held-Karp up to here, 2-opt/or-opt beyond
    random_seeds: int = 2  # random starting partitions besides the constructions
    regroup_max_peers: int = 32  # up to here, also try every swap, and every re-split of two groups,
    #                              with pipelines re-matched exactly (slow, but escapes more local optima)
    warm_only: bool = False  # with solve(initial=): start from it alone (no constructions, no random
    #                          starts); with generations=0 a local repair that stays near it
    start_share: float = 0.5  # share of a shape's time that polishing the starting allocations may
    #                           take (the cheapest start is polished first); the rest is evolution's
    lean_min_peers: int = 512  # from here on, evolution rounds perturb neighbouring stages and polish
    #                            only the critical and perturbed peers, and no random partitions are
    #                            drawn (polishing one costs as much as many rounds); below, as before
    cpu_clock: bool = False  # count the budget in this process's CPU seconds, not wall-clock: on a
    #                          shared machine, the time the search itself was given
    lean_sweeps: int = 1  # rounds of critical-then-moved sweeps polishing a lean round's child
    hierarchy_seed_share: float = 0.4  # from lean_min_peers on, for the paper objective: this share of
    #                                    a shape's time builds a start by hierarchy (often the best start)
    hierarchy_min_peers: int = 4096  # from here on, solve() schedules by hierarchy (sched/hierarchy.py)
    #                                  when the objective is the paper's; fewer: one flat search
    cluster_max_peers: int = 2048  # the hierarchy's largest cluster, searched flat (its matrices are
    #                                cluster_max_peers^2 floats each)
    patience: int = 32  # without a generation cap, evolution ends once this many rounds in a row
    #                     (or 4 per peer, if more) found nothing better: a small swarm's search
    #                     converges long before its budget, which a coordinator would otherwise
    #                     spend on the CPU its stages share. 0: every search runs to its budget

    def clock(self) -> Callable[[], float]:
        return time.process_time if self.cpu_clock else time.perf_counter

    def __post_init__(self) -> None:
        if self.time_budget_s <= 0:
            raise ValueError("time_budget_s must be positive")
        if not 0 < self.start_share <= 1:
            raise ValueError("start_share must lie in (0, 1]")
        if self.lean_min_peers < 1:
            raise ValueError("lean_min_peers must be positive")
        if not 0 <= self.hierarchy_seed_share < 1:
            raise ValueError("hierarchy_seed_share must lie in [0, 1)")
        if self.lean_sweeps < 1:
            raise ValueError("lean_sweeps must be positive")
        if self.hierarchy_min_peers < 1 or self.cluster_max_peers < 2:
            raise ValueError("hierarchy_min_peers must be positive and cluster_max_peers at least 2")
        if self.population < 2:
            raise ValueError("population must be at least 2")
        if self.generations is not None and self.generations < 0:
            raise ValueError("generations must be non-negative")
        if self.patience < 0:
            raise ValueError("patience must be non-negative")

    def stall_rounds(self, n: int) -> int | None:
        """Rounds in a row without a better allocation after which evolution of n peers ends
        (None: it runs to its budget or its generation cap)."""
        if self.patience == 0 or self.generations is not None:
            return None
        return max(self.patience, STALL_ROUNDS_PER_PEER * n)


SEARCH_PROFILES = {
    "default": SearchConfig(),  # offline planning, as the benchmark runs it
    "quick": SearchConfig(time_budget_s=2.0),  # a coordinator rescheduling between steps
    "test": SearchConfig(time_budget_s=60.0, generations=2, population=4),  # repeatable, bounded
}


class ShapeSearch:
    def __init__(self, model: CostModel, S: int, D: int, config: SearchConfig, seed: int,
                 deadline_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.m = model
        self.S, self.D = S, D
        self.cfg = config
        self.rng = np.random.default_rng(seed)
        self.clock = clock
        self.deadline_s = deadline_s
        self.phase_deadline_s = deadline_s  # the end of the current phase (starts, then evolution)
        self.lean = model.n >= config.lean_min_peers
        self.symmetric = nearly_symmetric(model.hop)
        self._pairs: dict[tuple[bytes, bytes], float] = {}  # bottleneck value of two groups
        self._realized: dict[bytes, np.ndarray] = {}  # partition -> its realized pipelines
        self.local = SwapSearch(model, self.rng, self.out_of_time)
        self.generations = 0
        self.improved_at = 0  # the evolution round that last found a better allocation (0: the starts)
        self.realized = 0

    def out_of_time(self) -> bool:
        return self.clock() >= min(self.deadline_s, self.phase_deadline_s)

    # -- matchings and path ---------------------------------------------------------------
    def _edge(self, a: np.ndarray, b: np.ndarray) -> float:
        key = (np.sort(a).tobytes(), np.sort(b).tobytes())
        if self.symmetric and key[1] < key[0]:
            key = (key[1], key[0])
        v = self._pairs.get(key)
        if v is None:
            v = bottleneck_value(self.m.hop[np.ix_(a, b)])
            if len(self._pairs) > 200_000:
                self._pairs.clear()
            self._pairs[key] = v
        return v

    def realize(self, X: np.ndarray) -> np.ndarray:
        """The best stage order and pipelines for the DP groups in X's rows (X itself when time
        runs out while the coarsened graph is built)."""
        S = self.S
        if S == 1:
            return X.copy()
        key = b"".join(sorted(np.sort(X, axis=1).tobytes()[k * X.itemsize * self.D:(k + 1) * X.itemsize * self.D]
                              for k in range(S)))
        hit = self._realized.get(key)
        if hit is not None:
            return hit.copy()
        self.realized += 1
        E = np.zeros((S, S))
        for a in range(S):
            if self.lean and self.out_of_time():
                return X.copy()
            for b in range(S):
                if a != b and (not self.symmetric or b > a):
                    E[a, b] = self._edge(X[a], X[b])
                    if self.symmetric:
                        E[b, a] = E[a, b]
        _, order = open_path(E, self.cfg.exact_path_max_stages, stop=self.out_of_time if self.lean else None)
        out = np.empty_like(X)
        out[0] = X[order[0]]
        for k in range(1, S):
            group = X[order[k]]
            _, cols = bottleneck_matching(self.m.hop[np.ix_(out[k - 1], group)])
            out[k] = group[cols]
        if len(self._realized) > 20_000:
            self._realized.clear()
        self._realized[key] = out.copy()
        return out

    def polish(self, X: np.ndarray, Z: np.ndarray,
               focus: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
        """Local search and realize, alternated while either improves. focus: peers whose swaps
        are tried besides the critical ones (the rest are left alone); None: every peer."""
        best = self.m.total(X)
        while True:
            R = self.realize(X)
            r = self.m.total(R)
            if r < best - 1e-12:
                X, best = R, r
            if self.out_of_time():
                return best, X, Z
            X2, Z2 = self.local.run(X, Z, max_sweeps=50 if focus is None else self.cfg.lean_sweeps, focus=focus)
            c = self.m.total(X2)
            if c < best - 1e-12:
                X, Z, best = X2, Z2, c
                continue
            if self.m.n > self.cfg.regroup_max_peers:
                return best, X, Z
            found = self._regroup(X, Z, best) or self._split_pairs(X, Z, best)
            if found is None:
                return best, X, Z
            best, X, Z = found

    def _split_pairs(self, X: np.ndarray, Z: np.ndarray, best: float) -> tuple[float, np.ndarray, np.ndarray] | None:
        """First re-split of the 2D members of two groups into two new groups that lowers the cost."""
        S, D = X.shape
        if D > 6:
            return None  # C(2D, D) / 2 splits per pair: 462 at D = 6
        for a in range(S):
            for b in range(a + 1, S):
                union = np.concatenate((X[a], X[b]))
                for rest in itertools.combinations(range(1, 2 * D), D - 1):
                    if self.out_of_time():
                        return None
                    mask = np.zeros(2 * D, dtype=bool)
                    mask[[0, *rest]] = True
                    X2 = X.copy()
                    X2[a], X2[b] = union[mask], union[~mask]
                    X2 = self.realize(X2)
                    c = self.m.total(X2)
                    if c < best - 1e-12:
                        return c, X2, Z
        return None

    def _regroup(self, X: np.ndarray, Z: np.ndarray, best: float) -> tuple[float, np.ndarray, np.ndarray] | None:
        """First swap between groups (or with a spare) that lowers the cost once re-matched."""
        S, D = X.shape
        cells = [(s, p) for s in range(S) for p in range(D)]
        for a, (s, p) in enumerate(cells):
            partners = [("swap", t, q) for (t, q) in cells[a + 1:] if t != s]
            partners += [("spare", k, 0) for k in range(len(Z))]
            for kind, t, q in partners:
                if self.out_of_time():
                    return None
                X2, Z2 = X.copy(), Z.copy()
                if kind == "spare":
                    X2[s, p], Z2[t] = Z2[t], X2[s, p]
                else:
                    X2[s, p], X2[t, q] = X2[t, q], X2[s, p]
                X2 = self.realize(X2)
                c = self.m.total(X2)
                if c < best - 1e-12:
                    return c, X2, Z2
        return None

    # -- evolution ------------------------------------------------------------------------
    def _fill(self, groups: list[list[int]], pool: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Complete partial groups from the pool, each time adding the peer closest to the group."""
        pool_arr = np.array(sorted(pool), dtype=np.int64)
        free = np.ones(len(pool_arr), dtype=bool)
        w = self.m.dp_a + self.m.dp_b * self.m.uniform_grad_gb()
        for grp in groups:
            while len(grp) < self.D:
                cand = np.flatnonzero(free)
                if grp:
                    score = w[np.ix_(pool_arr[cand], np.asarray(grp, dtype=np.int64))].max(axis=1)
                    k = cand[int(np.argmin(score))]
                else:
                    k = cand[int(self.rng.integers(len(cand)))]
                free[k] = False
                grp.append(int(pool_arr[k]))
        return np.array(groups, dtype=np.int64), pool_arr[free]

    def crossover(self, A: np.ndarray, B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        S = self.S
        keep = self.rng.permutation(S)[: S // 2]
        groups = [list(map(int, A[k])) for k in keep]
        used = {p for g in groups for p in g}
        partial = []
        for k in self.rng.permutation(S):
            rest = [int(p) for p in B[k] if int(p) not in used]
            if rest:
                partial.append(rest)
        partial.sort(key=len, reverse=True)
        groups += partial[: S - len(groups)]
        groups += [[] for _ in range(S - len(groups))]
        used = {p for g in groups for p in g}
        pool = [p for p in range(self.m.n) if p not in used]
        return self._fill(groups, pool)

    def mutate(self, X: np.ndarray, Z: np.ndarray, swaps: int) -> tuple[np.ndarray, np.ndarray]:
        X, Z = X.copy(), Z.copy()
        S, D = X.shape
        for _ in range(swaps):
            s, p = int(self.rng.integers(S)), int(self.rng.integers(D))
            if len(Z) and self.rng.random() < 0.2:
                k = int(self.rng.integers(len(Z)))
                X[s, p], Z[k] = Z[k], X[s, p]
            elif S > 1:
                t = int(self.rng.integers(S - 1))
                t += t >= s
                q = int(self.rng.integers(D))
                X[s, p], X[t, q] = X[t, q], X[s, p]
        return X, Z

    def nudge(self, X: np.ndarray, Z: np.ndarray, swaps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Random swaps between neighbouring stages (or with a spare): a perturbation that stays
        near a good allocation of many peers, where a swap across the whole allocation would
        mostly be undone. Returns the new X, spares and the peers moved."""
        X, Z = X.copy(), Z.copy()
        S, D = X.shape
        moved = []
        for _ in range(swaps):
            s, p = int(self.rng.integers(S)), int(self.rng.integers(D))
            if len(Z) and (S == 1 or self.rng.random() < 0.2):
                k = int(self.rng.integers(len(Z)))
                moved += [int(X[s, p]), int(Z[k])]
                X[s, p], Z[k] = Z[k], X[s, p]
            elif S > 1:
                t = s + 1 if s == 0 or (s < S - 1 and self.rng.random() < 0.5) else s - 1
                q = int(self.rng.integers(D))
                moved += [int(X[s, p]), int(X[t, q])]
                X[s, p], X[t, q] = X[t, q], X[s, p]
        return X, Z, np.array(moved, dtype=np.int64)

    def run(self, seeds: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, np.ndarray, np.ndarray]:
        """Polish the seeds, then evolve; returns the best (cost, X, spares) found in time.

        The starts may take `start_share` of the time; the cheapest is polished first. Rounds
        alternate between a child of two members of the population (crossover of their DP
        groups, then a few random swaps) and a random kick of the best allocation so far; every
        fourth round starts afresh from a random partition. With many peers (`lean_min_peers`)
        kicks swap peers of neighbouring stages, each round polishes only the critical and the
        moved peers, and the fourth round kicks another member of the population instead.
        """
        t0 = self.clock()
        self.phase_deadline_s = t0 + self.cfg.start_share * (self.deadline_s - t0)
        pop: list[tuple[float, np.ndarray, np.ndarray]] = []
        # every construction, as given and re-matched, is a candidate; the cheapest are polished first
        starts = []
        # with many peers, re-matching every start would take the time of polishing one
        realize_until = t0 + self.cfg.start_share * (self.deadline_s - t0) / 2 if self.lean else np.inf
        for k, (X, Z) in enumerate(seeds):
            start = (self.m.total(X), k, X, Z)
            if not self.out_of_time() and (k == 0 or self.clock() < realize_until):
                R = self.realize(X)
                start = min(start, (self.m.total(R), k, R, Z), key=lambda c: c[0])
            starts.append(start)
        starts.sort(key=lambda c: (c[0], c[1]))
        best = (starts[0][0], starts[0][2], starts[0][3])
        for _, k, X, Z in starts:
            if self.out_of_time() and pop:
                if self.lean:  # unpolished, still material for crossover
                    pop.append((self.m.total(X), X, Z))
                    continue
                break
            cand = self.polish(X, Z)
            pop.append(cand)
            if cand[0] < best[0] - 1e-12:
                best = cand
        pop.sort(key=lambda c: c[0])
        self.phase_deadline_s = self.deadline_s
        stall = self.cfg.stall_rounds(self.m.n)
        while not self.out_of_time():
            if self.cfg.generations is not None and self.generations >= self.cfg.generations:
                break
            if stall is not None and self.generations - self.improved_at >= stall:
                break  # converged: further rounds would only spend the budget
            self.generations += 1
            focus = None
            if self.lean:  # mutation and selection only: a crossover of two allocations of many
                #            peers mixes layouts that do not fit together, and polishing it costs many rounds
                if self.generations % 2 == 0 and len(pop) > 1:  # another member: keeps exploring
                    _, X0, Z0 = pop[int(self.rng.integers(1, len(pop)))]
                else:
                    _, X0, Z0 = best
                X, Z, focus = self.nudge(X0, Z0, int(self.rng.integers(2, 9)))
            elif self.generations % 4 == 0:  # restart from a random partition: keeps exploring
                perm = self.rng.permutation(self.m.n).astype(np.int64)
                X, Z = perm[:self.S * self.D].reshape(self.S, self.D), perm[self.S * self.D:]
            elif self.generations % 2 or len(pop) < 2:  # iterated local search: kick the best
                kicks = int(self.rng.integers(2, max(3, self.m.n // 4) + 1))
                X, Z = self.mutate(best[1], best[2], kicks)
            else:
                i, j = self.rng.choice(len(pop), size=2, replace=False)
                a, b = sorted((int(i), int(j)))  # the better of two picks leads (pop is sorted)
                X, Z = self.crossover(pop[a][1], pop[b][1])
                X, Z = self.mutate(X, Z, self.cfg.mutation_swaps)
            cand = self.polish(X, Z, focus)
            if cand[0] < best[0] - 1e-12:
                best = cand
                self.improved_at = self.generations
            if any(abs(cand[0] - c[0]) <= 1e-12 for c in pop):
                continue  # keep the population diverse
            pop.append(cand)
            pop.sort(key=lambda c: c[0])
            del pop[self.cfg.population:]
        return best
