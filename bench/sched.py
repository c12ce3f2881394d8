"""Scheduler benchmark: the paper scenarios, scale, and exactness on small instances.

    .venv/bin/python bench/sched.py            # full run (about 4 minutes, one core)
    .venv/bin/python bench/sched.py --quick    # short budgets, for a smoke test

Prints one line per measurement and one JSON object as its last line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the targets are stated
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from dtfm.scenarios import load_scenario  # noqa: E402
from dtfm.sched import PAPER_GPT3_XL, CommSpec, SearchConfig, solve  # noqa: E402
from dtfm.sched.construct import consecutive, dp_aligned, locality_order, pp_aligned, random_allocation  # noqa: E402
from dtfm.sched.search import ShapeSearch  # noqa: E402
from dtfm.sched.simulate import simulate  # noqa: E402
from dtfm.sched.solve import cost_model  # noqa: E402

SCENARIOS = ("datacenter", "spot", "universities", "regional", "worldwide")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def baselines(model, S, D, regions, samples, seed):
    order = locality_order(model.hop, regions)
    realize = ShapeSearch(model, S, D, SearchConfig(), seed, float("inf")).realize
    rng = np.random.default_rng(seed)
    best = min((random_allocation(model.n, S, D, rng)[0] for _ in range(samples)), key=model.total)
    return {
        "random_best": best,
        "region_per_dp_group": realize(dp_aligned(order, S, D)[0]),
        "region_per_pipeline": pp_aligned(order, S, D)[0],
        "homogeneous": consecutive(model.n, S, D)[0],
    }


def paper_scenarios(budget_s, samples, seed):
    out = {}
    for name in SCENARIOS:
        sc = load_scenario(name)
        dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
        alloc = solve(dl, bw, PAPER_GPT3_XL, stages=8, dp=8, regions=sc.peer_regions(), seed=seed,
                      time_budget_s=budget_s)
        model = cost_model(dl, bw, PAPER_GPT3_XL, 8, 8)
        rows = {"search": alloc.matrix, **baselines(model, 8, 8, sc.peer_regions(), samples, seed)}
        res = {k: {"cost_s": round(model.total(X), 4), "simulated_s": round(simulate(model, X).iteration_s, 4)}
               for k, X in rows.items()}
        res["search_elapsed_s"] = round(alloc.elapsed_s, 2)
        res["random_over_search"] = round(res["random_best"]["cost_s"] / res["search"]["cost_s"], 3)
        best_region = min(res["region_per_dp_group"]["cost_s"], res["region_per_pipeline"]["cost_s"])
        res["search_le_region_aligned"] = res["search"]["cost_s"] <= best_region + 1e-9
        log(f"{name}: {json.dumps(res)}")
        out[name] = res
    return out


def jittered(sc, n, seed):
    """A scaled scenario as a measured view: every link +-20 % (symmetric), like real probes."""
    sc = sc.scaled(n)
    rng = np.random.default_rng(seed)
    j1, j2 = rng.uniform(0.8, 1.2, (2, n, n))
    return sc, sc.delay_ms() * (j1 + j1.T) / 2, sc.bandwidth_gbps() * (j2 + j2.T) / 2


def scale(S, D, budget_s, seed):
    sc, dl, bw = jittered(load_scenario("worldwide"), S * D, seed)
    # the paper's per-stage volumes, whatever the number of stages
    spec = CommSpec(f"paper-volumes-{S}", layers=S, grad_gb_total=0.65 * S, act_gb_global=PAPER_GPT3_XL.act_gb_global / 8 * D)
    t0 = time.perf_counter()
    alloc = solve(dl, bw, spec, stages=S, dp=D, regions=sc.peer_regions(), seed=seed, time_budget_s=budget_s)
    elapsed = time.perf_counter() - t0
    model = cost_model(dl, bw, spec, S, D)
    base = baselines(model, S, D, sc.peer_regions(), 200, seed)
    res = {"peers": S * D, "shape": [S, D], "elapsed_s": round(elapsed, 2), "search_cost_s": round(alloc.cost.paper_s, 3),
           **{f"{k}_cost_s": round(model.total(X), 3) for k, X in base.items()}, "stats": alloc.stats}
    res["improves_on_constructions"] = alloc.cost.paper_s < min(
        res["region_per_dp_group_cost_s"], res["region_per_pipeline_cost_s"], res["homogeneous_cost_s"]) - 1e-9
    log(f"scale {S}x{D}: {json.dumps(res)}")
    return res


def small_network(rng, n):
    site = rng.integers(0, 3, n)
    base = rng.random((3, 3)) * 150
    delay = (base + base.T)[site][:, site] / 2 + rng.random((n, n)) * 10
    delay = (delay + delay.T) / 2
    bw = 0.3 + rng.random((n, n)) * 2
    bw = (bw + bw.T) / 2
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    return delay, bw


def brute(model, S, D):
    """Optimum over every partition into S groups of D, each realized by exact matchings and path
    (checked against full permutation enumeration in tests/test_sched_exact.py)."""
    n = S * D
    realize = ShapeSearch(model, S, D, SearchConfig(), 0, float("inf")).realize

    def parts(rest):
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for comb in itertools.combinations(others, D - 1):
            left = [p for p in others if p not in comb]
            for tail in parts(left):
                yield [[first, *comb], *tail]

    return min(model.total(realize(np.array(g))) for g in parts(list(range(n))))


def exactness(trials, generations, seed):
    out = {}
    for S, D in ((2, 4), (4, 2), (3, 4)):
        rng = np.random.default_rng(seed)
        hits = 0
        for k in range(trials):
            delay, bw = small_network(rng, S * D)
            spec = CommSpec("small", layers=3 * S, grad_gb_total=0.65 * S, act_gb_global=0.47 * D)
            alloc = solve(delay, bw, spec, stages=S, dp=D, seed=k, generations=generations, time_budget_s=120)
            hits += abs(alloc.cost.paper_s - brute(cost_model(delay, bw, spec, S, D), S, D)) < 1e-9
        out[f"{S}x{D}"] = {"optimal": hits, "trials": trials, "generations": generations}
        log(f"exact {S}x{D}: {hits}/{trials}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    q = args.quick
    t0 = time.perf_counter()
    result = {
        "bench": "sched",
        "paper_scenarios_8x8": paper_scenarios(2.0 if q else 20.0, 500 if q else 5000, args.seed),
        "scale": [scale(16, 16, 2.0 if q else 9.0, args.seed), scale(32, 32, 5.0 if q else 55.0, args.seed)],
        "exactness": exactness(3 if q else 10, 30, args.seed),
    }
    result["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
