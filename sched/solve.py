"""The scheduler's entry point: from a (measured or scenario) network to an allocation.

    alloc = solve(delay_ms, bandwidth_gbps, PAPER_GPT3_XL, stages=8, dp=8, seed=0, time_budget_s=20)
    alloc.pipelines      # ((peer of stage 0, ..., peer of stage S-1), ...) one tuple per pipeline
    alloc.cost.paper_s   # DPcost + 2 PPcost of exactly these pipelines

`stages="auto"` tries every shape that fits the model and returns the cheapest. Peers left
out (when N is not S x D, or when leaving them out is cheaper) are reported as spares.
`initial=` warm-starts the search from an earlier allocation (a coordinator re-planning after
the swarm changed): it joins the starting population, first, so the result costs no more than
it under the search's objective and, among equally cheap allocations, stays close to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .construct import constructions, given
from .compression import CompressionOptions
from .cost import CostBreakdown, CostModel, paper_breakdown
from .hierarchy import solve_hierarchy
from .search import SearchConfig, ShapeSearch
from .spec import CommSpec, ModelSpec

__all__ = ["Allocation", "solve", "evaluate", "candidate_shapes", "cost_model"]

# one shape's result: (searched objective, how to cost an allocation, X, spares, statistics)
_Found = tuple[float, Callable[[np.ndarray], CostBreakdown], np.ndarray, np.ndarray, dict]


@dataclass(frozen=True)
class Allocation:
    stages: int
    dp: int
    pipelines: tuple[tuple[int, ...], ...]  # pipelines[p][s]: peer running stage s of pipeline p
    spares: tuple[int, ...]
    layers: tuple[int, ...]  # layers held by each stage
    cost: CostBreakdown
    elapsed_s: float = 0.0
    seed: int = 0
    stats: dict = field(default_factory=dict, compare=False)

    @property
    def matrix(self) -> np.ndarray:
        """(S, D) array: [s, p] is the peer of stage s in pipeline p."""
        return np.array(self.pipelines, dtype=np.int64).T

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, end) layer indices of each stage."""
        ends = np.cumsum(self.layers)
        return tuple((int(e - c), int(e)) for c, e in zip(self.layers, ends))

    def to_dict(self) -> dict:
        c = self.cost
        return {
            "stages": self.stages, "dp": self.dp,
            "pipelines": [list(p) for p in self.pipelines], "spares": list(self.spares),
            "layers": list(self.layers), "layer_ranges": [list(r) for r in self.layer_ranges],
            "cost": {"total_s": c.paper_s, "dp_s": c.dp_s, "pp_s": c.pp_s, "compute_s": c.compute_s,
                     "penalty_s": c.penalty_s, "objective_s": c.total_s},
            "elapsed_s": self.elapsed_s, "seed": self.seed, "stats": dict(self.stats),
        }


def cost_model(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec: CommSpec | ModelSpec, stages: int,
               dp: int, *, compute: np.ndarray | None = None, memory_gib: np.ndarray | None = None,
               uneven_layers: bool = False,
               compression: CompressionOptions | None = None) -> CostModel:
    return CostModel(delay_ms, bandwidth_gbps, spec.workload(stages, dp), compute=compute,
                     memory_gib=memory_gib, uneven_layers=uneven_layers, compression=compression)


def evaluate(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec: CommSpec | ModelSpec,
             pipelines: Iterable[Iterable[int]], *, compute: np.ndarray | None = None,
             memory_gib: np.ndarray | None = None, uneven_layers: bool = False,
             compression: CompressionOptions | None = None) -> CostBreakdown:
    """Cost of given pipelines (list of D lists of S peers)."""
    X = np.array(pipelines, dtype=np.int64).T
    return cost_model(delay_ms, bandwidth_gbps, spec, X.shape[0], X.shape[1], compute=compute,
                      memory_gib=memory_gib, uneven_layers=uneven_layers, compression=compression).breakdown(X)


def candidate_shapes(n: int, spec: CommSpec | ModelSpec, *, allow_spares: bool = True,
                     uneven_layers: bool = False, memory_gib: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(S, D) shapes worth trying for n peers: S divides the layers (unless uneven), fits memory."""
    shapes = []
    for S in range(1, min(spec.layers, n) + 1):
        if spec.layers % S and not uneven_layers:
            continue
        Ds = [n // S] if n % S == 0 or allow_spares else []
        if allow_spares and n // S > 1:
            Ds.append(n // S - 1)  # one peer per stage to spare: drops the worst-placed peers
        for D in Ds:
            wl = spec.workload(S, D)
            if memory_gib is not None and wl.layer_memory_gib is not None:
                caps = np.sort((np.asarray(memory_gib) - wl.base_memory_gib) // wl.layer_memory_gib)[::-1]
                need = -(-spec.layers // S)
                if (caps[:S * D].min() < need and not uneven_layers) or caps[:S * D].clip(0).sum() < spec.layers * D:
                    continue
            shapes.append((S, D))
    return shapes


def _solve_shape(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec: CommSpec | ModelSpec, S: int, D: int,
                 *, compute: np.ndarray | None, memory_gib: np.ndarray | None, uneven_layers: bool,
                 regions: Sequence[str] | None, seed: int, deadline_s: float, config: SearchConfig,
                 initial: tuple[np.ndarray, np.ndarray] | None = None,
                 compression: CompressionOptions | None = None, hierarchy_seed: bool = False) -> _Found:
    model = cost_model(delay_ms, bandwidth_gbps, spec, S, D, compute=compute, memory_gib=memory_gib,
                       uneven_layers=uneven_layers, compression=compression)
    clock = config.clock()
    tree = None
    if hierarchy_seed and model.n >= config.lean_min_peers and config.hierarchy_seed_share > 0:
        now = clock()
        tree = solve_hierarchy(delay_ms, bandwidth_gbps, model.workload, regions=regions, seed=seed,
                               deadline_s=now + config.hierarchy_seed_share * max(deadline_s - now, 0.0),
                               config=config, clock=clock)
    search = ShapeSearch(model, S, D, config, seed, deadline_s, clock=clock)
    count = config.random_seeds if model.n < config.lean_min_peers else 0
    seeds = constructions(model, S, D, regions, np.random.default_rng([seed, 1]), count)
    if tree is not None:  # a construction like the others (first: on a tie it wins)
        seeds = [(tree.X, tree.spares)] + seeds
    if initial is not None:  # first: on a tie with a construction the warm start wins
        seeds = [initial] if config.warm_only else [initial] + seeds
    cost, X, Z = search.run(seeds)
    stats: dict[str, object] = {"generations": search.generations, "improved_at": search.improved_at, "realized": search.realized,
             "swaps": search.local.moves, "scored": search.local.scored}
    if tree is not None:
        stats["hierarchy_start"] = {"cost_s": model.total(tree.X), "generations": tree.stats["generations"]}
    return cost, model.breakdown, X, Z, stats


def _solve_shape_by_hierarchy(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec: CommSpec | ModelSpec,
                              S: int, D: int, *, regions: Sequence[str] | None, seed: int, deadline_s: float,
                              config: SearchConfig) -> _Found:
    wl = spec.workload(S, D)
    res = solve_hierarchy(delay_ms, bandwidth_gbps, wl, regions=regions, seed=seed, deadline_s=deadline_s,
                          config=config, clock=config.clock())

    def score(X: np.ndarray) -> CostBreakdown:
        return paper_breakdown(delay_ms, bandwidth_gbps, wl, X)

    return score(res.X).total_s, score, res.X, res.spares, {"hierarchy": True, **res.stats}


def _paper_objective_only(spec: CommSpec | ModelSpec, shapes: list[tuple[int, int]], *,
                          compute: np.ndarray | None, memory_gib: np.ndarray | None, uneven_layers: bool,
                          compression: CompressionOptions | None, initial: object) -> bool:
    """True when the hierarchy computes the same objective the flat search would."""
    if compute is not None or memory_gib is not None or uneven_layers or initial is not None:
        return False
    if compression is not None and not compression.exact:
        return False
    return all(spec.workload(S, D).uniform_layers and spec.workload(S, D).layer_compute_s is None
               for S, D in shapes)


def solve(delay_ms: np.ndarray, bandwidth_gbps: np.ndarray, spec: CommSpec | ModelSpec, *,
          stages: int | str | None = None, dp: int | None = None, compute: np.ndarray | None = None,
          memory_gib: np.ndarray | None = None, regions: Sequence[str] | None = None, seed: int = 0,
          time_budget_s: float = 20.0, generations: int | None = None, allow_spares: bool = True,
          uneven_layers: bool = False, config: SearchConfig | None = None,
          initial: Iterable[Iterable[int]] | None = None,
          compression: CompressionOptions | None = None, hierarchical: bool | None = None) -> Allocation:
    """Search an allocation of the N peers of the (N, N) matrices for the model in `spec`.

    stages: an int, "auto" (every shape in candidate_shapes, best returned), or None (the
    spec's default shape when it fits, else "auto"). dp: pipelines; default N // stages.
    regions: optional per-peer labels, used only to build the region-aligned starting points.
    initial: optional warm start, D pipelines of S peer indices (e.g. the allocation in use,
    with its lost peers replaced): it starts the search of the shape it has (with stages="auto",
    only that shape's; ValueError if no shape tried has it). None (the default) changes nothing.
    compression: the codecs each link and DP group may use (the cost of a link or group is its
    cheapest allowed codec's); None: exact, the paper's objective.
    hierarchical: schedule by hierarchy (clusters of peers, then inside them: sched/hierarchy.py);
    None: from `config.hierarchy_min_peers` peers on, when the objective is the paper's alone
    (no compute, memory, uneven layers, compression or warm start); True with any of these is a
    ValueError. The delay and bandwidth matrices may then be float32: only blocks are read.
    """
    wall = time.perf_counter()
    n = np.asarray(delay_ms).shape[0]
    warm = None if initial is None else given(initial, n)
    cfg = config or SearchConfig(time_budget_s=time_budget_s, generations=generations)
    clock = cfg.clock()
    start = clock()
    if stages is None:
        d = getattr(spec, "default_stages", 0) * getattr(spec, "default_dp", 0)
        stages = getattr(spec, "default_stages") if 0 < d <= n else "auto"
        dp = getattr(spec, "default_dp", None) if stages != "auto" and dp is None else dp
    if stages == "auto":
        shapes = candidate_shapes(n, spec, allow_spares=allow_spares, uneven_layers=uneven_layers,
                                  memory_gib=memory_gib)
        if dp is not None:
            shapes = [(S, D) for S, D in shapes if D == dp]
        if not shapes:
            raise ValueError(f"no shape of {n} peers fits a model of {spec.layers} layers")
    else:
        S = int(stages)
        if S < 1:
            raise ValueError(f"stages must be at least 1, got {S}")
        if S > n:
            raise ValueError(f"{S} stages need at least {S} peers, the network has {n}")
        if S > spec.layers:
            raise ValueError(f"{S} stages cannot split a model of {spec.layers} layers")
        D = int(dp) if dp is not None else n // S
        if D < 1 or S * D > n:
            raise ValueError(f"{S} stages x {D} pipelines needs {S * D} peers, the network has {n}")
        if S * D < n and not allow_spares:
            raise ValueError(f"{n} peers do not form {S} x {D}: allow spares or change the shape")
        shapes = [(S, D)]
    if warm is not None and warm[0].shape not in shapes:
        S0, D0 = warm[0].shape
        raise ValueError(f"the initial allocation is {S0} stages x {D0} pipelines, a shape this search "
                         f"does not try ({', '.join(f'{a} x {b}' for a, b in shapes)})")
    paper_only = _paper_objective_only(spec, shapes, compute=compute, memory_gib=memory_gib,
                                       uneven_layers=uneven_layers, compression=compression, initial=initial)
    if hierarchical and not paper_only:
        raise ValueError("the hierarchical search schedules the paper objective alone, with an even split: "
                         "no compute, memory, uneven layers, compression or initial allocation")
    by_hierarchy = paper_only if hierarchical is None and n >= cfg.hierarchy_min_peers else bool(hierarchical)
    best = None
    for k, (S, D) in enumerate(shapes):
        share = (cfg.time_budget_s - (clock() - start)) / (len(shapes) - k)
        deadline = clock() + max(share, 0.0)
        if by_hierarchy:
            found = _solve_shape_by_hierarchy(delay_ms, bandwidth_gbps, spec, S, D, regions=regions, seed=seed,
                                              deadline_s=deadline, config=cfg)
            if best is None or found[0] < best[0] - 1e-12:
                best = found
            continue
        found = _solve_shape(delay_ms, bandwidth_gbps, spec, S, D, compute=compute, memory_gib=memory_gib,
                             uneven_layers=uneven_layers, regions=regions, seed=seed,
                             deadline_s=deadline, config=cfg, compression=compression, hierarchy_seed=paper_only,
                             initial=warm if warm is not None and warm[0].shape == (S, D) else None)
        if best is None or found[0] < best[0] - 1e-12:
            best = found
    if best is None:
        raise ValueError("no shape to search")
    _, score, X, Z, stats = best
    pipelines = tuple(tuple(int(v) for v in col) for col in X.T)
    # the cost of the printed pipelines, computed as `evaluate` computes it from them
    bd = score(np.array(pipelines, dtype=np.int64).T)
    stats["shapes_tried"] = len(shapes)
    if cfg.cpu_clock:
        stats["cpu_s"] = clock() - start
    return Allocation(stages=X.shape[0], dp=X.shape[1], pipelines=pipelines,
                      spares=tuple(sorted(int(z) for z in Z)), layers=bd.layers, cost=bd,
                      elapsed_s=time.perf_counter() - wall, seed=seed, stats=stats)
