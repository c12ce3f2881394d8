"""Scheduling many peers by hierarchy: clusters of peers first, then the peers inside them.

A flat search over 10,000 peers holds several N x N matrices (800 MB each in float64) and
scores every swap partner of a peer (O(N D) each); it cannot finish in a minute. The
hierarchy reads only blocks of the (N, N) delay and bandwidth matrices it is handed (float32
is enough, and they may be memory-mapped) and never builds an N x N array of its own:

1. clusters: the region labels when given; else the natural clusters of the delays
   (farthest-point centres while the covering radius still falls sharply, each peer joining
   its nearest centre: what network coordinates would group); any cluster larger than
   `cluster_max_peers` is split by the same k-center clustering until every cluster fits;
2. DP groups per cluster: floor(peers / D) each (the largest clusters first while the S
   groups last), so a DP group - the heaviest traffic - stays inside one cluster;
3. each cluster is solved by the flat search (`ShapeSearch`) on its own block as a pipeline
   of its groups; the peers it leaves out, with the clusters too small for a group, form a
   pool for the remaining groups, solved the same way (its leftovers are the spares);
4. the coarse level: each solved cluster is a segment of consecutive stages; the order of the
   segments and the direction of each is the cheapest open path over them, edge weights the
   bottleneck matching values between a segment's end group and the next one's start group
   (Held-Karp up to 14 segments), directions fixed along the path by dynamic programming;
5. pipelines: bottleneck matchings between consecutive groups along the whole order.

Only the paper objective with an even split (no compute, memory, uneven layers or compression):
`solve` takes this path for it from `SearchConfig.hierarchy_min_peers` peers on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .construct import constructions
from .cost import CostModel, paper_breakdown
from .matching import bottleneck_matching, bottleneck_value
from .path import open_path
from .search import SearchConfig, ShapeSearch
from .spec import Workload

__all__ = ["HierarchyResult", "LinkBlocks", "cluster_peers", "solve_hierarchy"]

_ASSEMBLY_SHARE = 0.1  # of the time, kept for the coarse level and the matchings
_MARGIN = 0.03  # of the time, for overrunning a part's deadline (a step under way is finished)
_NATURAL_DROP = 2.0  # natural clusters: the covering radius must fall by this factor at the cut
_BOTH_WITHIN = 1.1  # both layouts are searched when their constructions cost within this factor


@dataclass(frozen=True)
class HierarchyResult:
    X: np.ndarray  # (S, D) global peer indices
    spares: np.ndarray
    stats: dict


class LinkBlocks:
    """Blocks of the hop time a + c_act / b, read from the matrices as they were handed in."""

    def __init__(self, delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, act_gb: float) -> None:
        self.delay, self.bw, self.act_gb = delay_ms, bandwidth_gbps, act_gb

    def hop(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(rows), len(cols)) hop times, seconds (zero from a peer to itself)."""
        ix = np.ix_(rows, cols)
        a = np.asarray(self.delay[ix], dtype=float) / 1e3
        b = np.asarray(self.bw[ix], dtype=float)
        same = rows[:, None] == cols[None, :]
        out = a + self.act_gb * 8.0 / np.where(same, np.inf, b)
        out[same] = 0.0
        return out

    def distance(self, centre: int, members: np.ndarray) -> np.ndarray:
        """Symmetrised delay (ms) between one peer and each member: the clustering's metric, as
        network coordinates place peers (latency is what locates a peer; a link's bandwidth
        says more about its ends' access than about where they are)."""
        row = np.asarray(self.delay[centre, members], dtype=float)
        col = np.asarray(self.delay[members, centre], dtype=float)
        return (row + col) / 2


def _k_center(links: LinkBlocks, members: np.ndarray, k: int, natural: bool = False) -> list[np.ndarray]:
    """Farthest-point centres, each member to its nearest. natural: of the first k centres keep
    those up to the last at which the covering radius falls by _NATURAL_DROP or more (sites far
    apart compared with their own spread come out as one cluster each); else all k."""
    centres = [int(members[0])]
    near = links.distance(centres[0], members)
    dist = [near]
    radius = []  # radius[c - 1]: farthest member from the first c centres
    for _ in range(1, k + (1 if natural else 0)):
        far = int(np.argmax(near))
        radius.append(float(near[far]))
        nxt = int(members[far])
        if nxt in centres:
            break
        centres.append(nxt)
        d = links.distance(nxt, members)
        dist.append(d)
        near = np.minimum(near, d)
    if natural:
        radius.append(float(near.max()))
        r = np.array(radius[:k])
        keep = 1
        if len(r) > 1:
            drop = r[:-1] / np.maximum(r[1:], 1e-12)  # drop[c - 1]: radius with c centres over c + 1
            big = np.flatnonzero(drop > _NATURAL_DROP)
            keep = int(big[-1]) + 2 if len(big) else 1
        centres, dist = centres[:keep], dist[:keep]
    label = np.argmin(np.stack(dist), axis=0)
    return [members[label == c] for c in range(len(centres)) if np.any(label == c)]


def cluster_peers(links: LinkBlocks, n: int, regions: Sequence[str] | None, max_peers: int, min_peers: int = 1) -> list[np.ndarray]:
    """Peer indices per cluster: region labels (first appearance order), or without them the
    natural clusters of the delays (at most n // min_peers); then k-center splits of any
    cluster over max_peers."""
    if regions is not None:
        if len(regions) != n:
            raise ValueError(f"{len(regions)} region labels for {n} peers")
        first: dict = {}
        labels = np.array([first.setdefault(r, len(first)) for r in regions])
        todo = [np.flatnonzero(labels == c) for c in range(len(first))]
    else:
        todo = _k_center(links, np.arange(n), max(1, n // max(min_peers, 1)), natural=True)
    out = []
    while todo:
        members = todo.pop(0)
        if len(members) <= max_peers:
            out.append(members)
            continue
        parts = _k_center(links, members, -(-len(members) // max_peers))
        if len(parts) == 1:  # no spread to split on: cut in index order
            parts = [members[i:i + max_peers] for i in range(0, len(members), max_peers)]
        todo = parts + todo
    return out


def _shares(clusters: list[np.ndarray], unit: int, total: int) -> list[int]:
    """Units (groups of D, or pipelines of S peers) per cluster: as many as fit, the largest
    clusters first, while the total lasts."""
    fits = [len(c) // unit for c in clusters]
    out = [0] * len(clusters)
    left = total
    for k in sorted(range(len(clusters)), key=lambda k: (-fits[k], k)):
        out[k] = min(fits[k], left)
        left -= out[k]
    return out


def _sub_workload(wl: Workload, groups: int, by_pipeline: bool) -> Workload:
    """The workload of a cluster's part: every stage of some pipelines (the full workload; the
    DP cost counts the members inside the cluster), or `groups` consecutive stages of every
    pipeline (the same per-stage volumes)."""
    if by_pipeline:
        return wl
    per = wl.layers // wl.stages
    return Workload(groups, wl.dp, per * groups, wl.grad_gb_total * groups / wl.stages, wl.act_gb)


def _solve_part(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, wl: Workload, peers: np.ndarray, units: int, by_pipeline: bool,
                seed: int, deadline_s: float, config: SearchConfig,
                clock: Callable[[], float]) -> tuple[np.ndarray, np.ndarray, dict]:
    """The flat search on the block of `peers`: (groups, D) or (S, pipelines) global indices, and
    the peers left out."""
    S, D = (wl.stages, units) if by_pipeline else (units, wl.dp)
    ix = np.ix_(peers, peers)
    model = CostModel(np.asarray(delay_ms[ix], dtype=float), np.asarray(bandwidth_gbps[ix], dtype=float),
                      _sub_workload(wl, units, by_pipeline))
    search = ShapeSearch(model, S, D, config, seed, deadline_s, clock=clock)
    count = config.random_seeds if model.n < config.lean_min_peers else 0
    seeds = constructions(model, S, D, None, np.random.default_rng([seed, 1]), count)
    _, X, Z = search.run(seeds)
    stats = {"generations": search.generations, "realized": search.realized, "swaps": search.local.moves}
    return peers[X], peers[Z], stats


def _chain(links: LinkBlocks, groups: list[np.ndarray]) -> np.ndarray:
    """Pipelines through the groups in this order: bottleneck matchings between neighbours."""
    out = [groups[0]]
    for g in groups[1:]:
        _, cols = bottleneck_matching(links.hop(out[-1], g))
        out.append(g[cols])
    return np.stack(out)


def _segment_order(links: LinkBlocks, segments: list[np.ndarray]) -> list[np.ndarray]:
    """Segments ((g, D) arrays) ordered and directed for the cheapest crossings between them."""
    K = len(segments)
    if K == 1:
        return segments
    ends = [(seg[0], seg[-1]) for seg in segments]  # (start, end) when run forwards
    # W[b, o, c, p]: segment b leaves in direction o (0: forwards, leaves from its end), c entered in p
    W = np.zeros((K, 2, K, 2))
    for b in range(K):
        for c in range(K):
            if b == c:
                continue
            for o in range(2):
                for p in range(2):
                    W[b, o, c, p] = bottleneck_value(links.hop(ends[b][1 - o], ends[c][p]))
    _, order = open_path(W.min(axis=(1, 3)))
    # directions along the order: Viterbi over two states per segment
    cost = np.zeros(2)
    back = []
    for k in range(1, K):
        b, c = order[k - 1], order[k]
        step = cost[:, None] + W[b, :, c, :]  # (previous direction, this direction)
        back.append(step.argmin(axis=0))
        cost = step.min(axis=0)
    dirs = [int(np.argmin(cost))]
    for bk in reversed(back):
        dirs.append(int(bk[dirs[-1]]))
    dirs.reverse()
    return [segments[b] if d == 0 else segments[b][::-1] for b, d in zip(order, dirs)]


def _assemble(links: LinkBlocks, parts: list[np.ndarray], by_pipeline: bool) -> np.ndarray:
    """The (S, D) allocation from the parts' allocations."""
    if by_pipeline:
        X = np.concatenate(parts, axis=1)
        return _chain(links, list(X))
    ordered = _segment_order(links, parts)
    return _chain(links, [g for seg in ordered for g in seg])


def _pool_peers(links: LinkBlocks, pool: np.ndarray, keep: int, seed: int) -> np.ndarray:
    """At most `keep` of the pool's peers: those best connected to the others."""
    cand = np.sort(pool)
    if len(cand) <= keep:
        return cand
    sample = cand[np.random.default_rng([seed, 2]).choice(len(cand), size=min(256, len(cand)), replace=False)]
    score = links.hop(cand, sample).mean(axis=1)
    return cand[np.sort(np.argsort(score, kind="stable")[:keep])]


def _layout(links: LinkBlocks, clusters: list[np.ndarray], wl: Workload, by_pipeline: bool,
            keep: int, seed: int) -> tuple[list[int], int, np.ndarray]:
    """(units per cluster, units left for the pool, the layout's plain construction: each
    cluster's units from its peers in index order, the pool's likewise)."""
    S, D = wl.stages, wl.dp
    unit, total = (S, D) if by_pipeline else (D, S)
    shares = _shares(clusters, unit, total)
    left = total - sum(shares)
    parts, pool = [], []
    for c, k in zip(clusters, shares):
        if k:
            block = c[:k * unit]
            parts.append(block.reshape(k, S).T if by_pipeline else block.reshape(k, D))
        pool.append(c[k * unit:])
    if left:
        rest = _pool_peers(links, np.concatenate(pool), max(keep, left * unit), seed)[:left * unit]
        parts.append(rest.reshape(left, S).T if by_pipeline else rest.reshape(left, D))
    return shares, left, _assemble(links, parts, by_pipeline)


def _solve_layout(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, wl: Workload, links: LinkBlocks, clusters: list[np.ndarray],
                  by_pipeline: bool, screen: tuple, seed: int, deadline_s: float, config: SearchConfig,
                  clock: Callable[[], float]) -> tuple[float, np.ndarray, np.ndarray, list[dict], bool]:
    """Each cluster's part searched flat, the pool's too, then assembled: (cost, X, spares,
    per-part statistics, by_pipeline)."""
    n = delay_ms.shape[0]
    screen_cost, shares, left, X0 = screen
    unit = wl.stages if by_pipeline else wl.dp
    keep = max(config.cluster_max_peers, left * unit)
    budget = max(deadline_s - clock(), 0.0) * (1 - _ASSEMBLY_SHARE)
    pool_size = n - unit * sum(shares)
    weight = sum(len(c) for c, k in zip(clusters, shares) if k) + (min(pool_size, keep) if left else 0)
    parts, pool, stats_parts = [], [], []
    for c, k in zip(clusters, shares):
        if k == 0:
            pool.append(c)
            continue
        t = clock()
        X, Z, st = _solve_part(delay_ms, bandwidth_gbps, wl, c, k, by_pipeline, seed,
                               t + budget * len(c) / weight, config, clock)
        parts.append(X)
        pool.append(Z)
        stats_parts.append({"peers": len(c), "units": k, "budget_s": round(budget * len(c) / weight, 3),
                            "time_s": round(clock() - t, 3), **st})
    spares = np.concatenate(pool) if pool else np.zeros(0, dtype=np.int64)
    if left:  # groups (or pipelines) of several clusters, from the peers no cluster placed
        cand = _pool_peers(links, spares, keep, seed)
        t = clock()
        part_s = max(deadline_s - t, 0.0) * (1 - _ASSEMBLY_SHARE)
        X, Z, st = _solve_part(delay_ms, bandwidth_gbps, wl, cand, left, by_pipeline, seed, t + part_s,
                               config, clock)
        parts.append(X)
        spares = np.setdiff1d(spares, X.ravel())
        stats_parts.append({"peers": len(cand), "units": left, "mixed": True, "budget_s": round(part_s, 3),
                            "time_s": round(clock() - t, 3), **st})
    X = _assemble(links, parts, by_pipeline)
    cost = paper_breakdown(delay_ms, bandwidth_gbps, wl, X).total_s
    if screen_cost < cost:  # the searched parts ignore the links between clusters: keep the construction
        X, cost = X0, screen_cost
        spares = np.setdiff1d(np.arange(n), X0.ravel())
    return cost, X, spares, stats_parts, by_pipeline


def solve_hierarchy(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, wl: Workload, *,
                    regions: Sequence[str] | None = None, seed: int = 0,
                    deadline_s: float, config: SearchConfig,
                    clock: Callable[[], float] = time.perf_counter) -> HierarchyResult:
    """An allocation of wl.stages x wl.dp peers of the (N, N) matrices, by hierarchy (see above)."""
    S, D = wl.stages, wl.dp
    if not wl.uniform_layers:
        raise ValueError("the hierarchical search needs an even split of the layers")
    n = delay_ms.shape[0]
    if S * D > n:
        raise ValueError(f"{S} stages x {D} pipelines needs {S * D} peers, the network has {n}")
    t0 = clock()
    deadline_s = t0 + (deadline_s - t0) * (1 - _MARGIN)
    links = LinkBlocks(delay_ms, bandwidth_gbps, wl.act_gb)
    clusters = cluster_peers(links, n, regions, config.cluster_max_peers, min(S, D))
    keep = config.cluster_max_peers
    # the layout: DP groups inside clusters, or pipelines inside clusters, by their plain constructions
    screens = {}
    for by_pipeline in (False, True):
        shares, left, X0 = _layout(links, clusters, wl, by_pipeline, keep, seed)
        screens[by_pipeline] = (paper_breakdown(delay_ms, bandwidth_gbps, wl, X0).total_s, shares, left, X0)
    t1 = clock()
    lo, hi = sorted(screens, key=lambda k: (screens[k][0], k))
    layouts = [lo, hi] if screens[hi][0] < _BOTH_WITHIN * screens[lo][0] else [lo]
    best = None
    tried = {}
    for k, by_pipeline in enumerate(layouts):
        share = max(deadline_s - clock(), 0.0) / (len(layouts) - k)
        found = _solve_layout(delay_ms, bandwidth_gbps, wl, links, clusters, by_pipeline, screens[by_pipeline],
                              seed, clock() + share, config, clock)
        tried["pipeline" if by_pipeline else "dp-group"] = round(found[0], 6)
        if best is None or found[0] < best[0] - 1e-12:
            best = found
    assert best is not None
    cost, X, spares, stats_parts, by_pipeline = best
    stats = {"clusters": len(clusters), "layout": "pipeline" if by_pipeline else "dp-group",
             "layout_cost_s": tried,
             "parts": stats_parts, "screen_s": {"dp-group": screens[False][0], "pipeline": screens[True][0]},
             "generations": sum(p["generations"] for p in stats_parts),
             "screen_time_s": round(t1 - t0, 3), "search_time_s": round(clock() - t1, 3)}
    return HierarchyResult(X, np.sort(spares).astype(np.int64), stats)
