"""dtfm-sched: schedule a scenario, or compare the search with baselines.

    dtfm-sched solve --scenario worldwide --model gpt3-xl-paper --stages 8 --dp 8 --json
    dtfm-sched compare --scenario worldwide --model gpt3-xl-paper --time-budget 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dtfm.scenarios import ScenarioError, load_scenario

from .construct import consecutive, dp_aligned, locality_order, pp_aligned, random_allocation
from .search import SearchConfig, ShapeSearch
from .simulate import simulate
from .solve import cost_model, solve
from .spec import PRESETS, get_preset

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    defaults = SearchConfig()
    p = argparse.ArgumentParser(prog="dtfm-sched", description="DT-FM allocation scheduler")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("solve", "search an allocation"), ("compare", "the search against baselines")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--scenario", required=True, help="built-in scenario name or TOML file")
        c.add_argument("--model", default="gpt3-xl-paper", choices=sorted(PRESETS), help="model preset")
        c.add_argument("--stages", default=None, help="pipeline stages, or 'auto' (default: the preset's)")
        c.add_argument("--dp", type=int, default=None, help="pipelines (default: peers // stages)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--time-budget", type=float, default=defaults.time_budget_s, help="seconds of search")
        c.add_argument("--generations", type=int, default=None, help="cap evolution rounds (repeatable runs)")
        c.add_argument("--no-spares", action="store_true", help="every peer must take part")
        c.add_argument("--uneven-layers", action="store_true", help="let faster stages hold more layers")
        c.add_argument("--peers", type=int, default=None, help="scale the scenario to this many peers")
        c.add_argument("--json", action="store_true", help="print JSON")
        c.add_argument("--plot", default=None, metavar="FILE.png", help="draw the allocation (matplotlib)")
        if name == "compare":
            c.add_argument("--random-samples", type=int, default=5000, help="random allocations to sample")
    return p


def _inputs(args):
    sc = load_scenario(args.scenario)
    if args.peers:
        sc = sc.scaled(args.peers)
    spec = get_preset(args.model)
    memory = None
    if all(r.memory_gib is not None for r in sc.regions):
        memory = np.array([r.memory_gib for r in sc.regions for _ in range(r.peers)])
    stages = args.stages
    if stages not in (None, "auto"):
        stages = int(stages)
    return sc, spec, sc.compute_scale(), memory, stages


def _solve(args) -> int:
    sc, spec, compute, memory, stages = _inputs(args)
    alloc = solve(sc.delay_ms(), sc.bandwidth_gbps(), spec, stages=stages, dp=args.dp, compute=compute,
                  memory_gib=memory, regions=sc.peer_regions(), seed=args.seed, time_budget_s=args.time_budget,
                  generations=args.generations, allow_spares=not args.no_spares, uneven_layers=args.uneven_layers)
    model = cost_model(sc.delay_ms(), sc.bandwidth_gbps(), spec, alloc.stages, alloc.dp, compute=compute,
                       memory_gib=memory, uneven_layers=args.uneven_layers)
    sim = simulate(model, alloc.matrix)
    out = {"scenario": sc.name, "model": spec.name, **alloc.to_dict(), "simulated_iteration_s": sim.iteration_s}
    if args.json:
        print(json.dumps(out))
    else:
        c = alloc.cost
        print(f"{sc.name}: {alloc.stages} stages x {alloc.dp} pipelines, {len(alloc.spares)} spares")
        print(f"cost {c.paper_s:.4f} s (DP {c.dp_s:.4f} + 2 x PP {c.pp_s:.4f}); objective {c.total_s:.4f} s; "
              f"simulated iteration {sim.iteration_s:.4f} s; searched {alloc.elapsed_s:.1f} s")
        regions = sc.peer_regions()
        for p, pipe in enumerate(alloc.pipelines):
            print(f"pipeline {p}: " + " -> ".join(f"{i}({regions[i]})" for i in pipe))
        if alloc.spares:
            print("spares: " + ", ".join(f"{i}({regions[i]})" for i in alloc.spares))
    if args.plot:
        _plot(args.plot, sc, alloc.matrix, alloc.spares, f"{sc.name}: cost {alloc.cost.paper_s:.2f} s")
    return 0


def _compare(args) -> int:
    sc, spec, compute, memory, stages = _inputs(args)
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    t0 = time.perf_counter()
    alloc = solve(dl, bw, spec, stages=stages, dp=args.dp, compute=compute, memory_gib=memory,
                  regions=sc.peer_regions(), seed=args.seed, time_budget_s=args.time_budget,
                  generations=args.generations, allow_spares=not args.no_spares, uneven_layers=args.uneven_layers)
    search_s = time.perf_counter() - t0
    S, D, n = alloc.stages, alloc.dp, sc.n_peers
    model = cost_model(dl, bw, spec, S, D, compute=compute, memory_gib=memory, uneven_layers=args.uneven_layers)
    order = locality_order(model.hop, sc.peer_regions())
    matcher = ShapeSearch(model, S, D, SearchConfig(), args.seed, float("inf"))
    rows = {"search": alloc.matrix}
    rng = np.random.default_rng(args.seed)
    best_rand, best_cost = None, np.inf
    for _ in range(args.random_samples):
        X, _ = random_allocation(n, S, D, rng)
        c = model.total(X)
        if c < best_cost:
            best_rand, best_cost = X, c
    rows[f"random (best of {args.random_samples})"] = best_rand
    rows["region per DP group"] = matcher.realize(dp_aligned(order, S, D)[0])
    rows["region per pipeline"] = pp_aligned(order, S, D)[0]
    rows["homogeneous (consecutive)"] = consecutive(n, S, D)[0]
    table = []
    for name, X in rows.items():
        bd = model.breakdown(X)
        table.append({"method": name, "cost_s": bd.paper_s, "dp_s": bd.dp_s, "pp_s": bd.pp_s,
                      "objective_s": bd.total_s, "simulated_s": simulate(model, X).iteration_s})
    out = {"scenario": sc.name, "model": spec.name, "stages": S, "dp": D, "search_s": search_s, "rows": table}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{sc.name}: {S} stages x {D} pipelines, model {spec.name}, search {search_s:.1f} s")
        print(f"{'method':32s} {'cost s':>10s} {'DP s':>9s} {'PP s':>9s} {'simulated s':>12s}")
        for r in table:
            print(f"{r['method']:32s} {r['cost_s']:10.3f} {r['dp_s']:9.3f} {r['pp_s']:9.3f} {r['simulated_s']:12.3f}")
    if args.plot:
        _plot(args.plot, sc, alloc.matrix, alloc.spares, f"{sc.name}: search {alloc.cost.paper_s:.2f} s")
    return 0


def _plot(path, sc, X, spares, title) -> None:
    try:
        from .plot import plot_allocation
    except ImportError:
        print("--plot needs matplotlib: pip install 'dtfm[plot]'", file=sys.stderr)
        return
    plot_allocation(path, sc.delay_ms(), sc.peer_regions(), X, spares, title)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "solve":
            return _solve(args)
        return _compare(args)
    except (ScenarioError, ValueError) as e:
        print(f"dtfm-sched: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
