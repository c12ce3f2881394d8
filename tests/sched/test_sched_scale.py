"""The scheduler at scale, on small instances: the hierarchy against the flat search, the
evolution's share of the budget (counted in clock readings, not seconds), the block-wise cost."""

import numpy as np
import pytest

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL, CommSpec, CostModel, SearchConfig, evaluate, solve
from dtfm.sched.construct import constructions
from dtfm.sched.cost import paper_breakdown
from dtfm.sched.hierarchy import LinkBlocks, cluster_peers, solve_hierarchy
from dtfm.sched.search import ShapeSearch

# the hierarchy may cost this much more than the flat search on the same instance
HIERARCHY_FACTOR = 1.1


def jittered_world(n, seed):
    """worldwide scaled to n peers, every link +-20 % (symmetric), as a measured view."""
    sc = load_scenario("worldwide").scaled(n)
    rng = np.random.default_rng(seed)
    j1, j2 = rng.uniform(0.8, 1.2, (2, n, n))
    return sc, sc.delay_ms() * (j1 + j1.T) / 2, sc.bandwidth_gbps() * (j2 + j2.T) / 2


def paper_volumes(S, D):
    return CommSpec(f"paper-volumes-{S}", layers=S, grad_gb_total=0.65 * S,
                    act_gb_global=PAPER_GPT3_XL.act_gb_global / 8 * D)


def assert_valid(alloc, n, S, D):
    assert alloc.stages == S and alloc.dp == D
    placed = [p for pipe in alloc.pipelines for p in pipe]
    assert all(len(pipe) == S for pipe in alloc.pipelines) and len(alloc.pipelines) == D
    assert sorted(placed + list(alloc.spares)) == list(range(n))


@pytest.mark.parametrize("n, S, D, regions", [(64, 8, 8, True), (96, 8, 8, False)])  # (100 x 12: below)
def test_hierarchy_valid_and_within_a_factor_of_the_flat_search(n, S, D, regions):
    sc, dl, bw = jittered_world(n, seed=n)
    spec = paper_volumes(S, D)
    labels = sc.peer_regions() if regions else None
    # without labels: clusters of at most 32 peers, found by k-center on the hop times
    cfg = SearchConfig(time_budget_s=300, generations=1, population=4, cluster_max_peers=32)
    flat = solve(dl, bw, spec, stages=S, dp=D, regions=labels, seed=1, config=cfg, hierarchical=False)
    tree = solve(dl, bw, spec, stages=S, dp=D, regions=labels, seed=1, config=cfg, hierarchical=True)
    assert tree.stats["hierarchy"] and "hierarchy" not in flat.stats
    for alloc in (flat, tree):
        assert_valid(alloc, n, S, D)
        assert evaluate(dl, bw, spec, alloc.pipelines) == alloc.cost  # the cost of the printed pipelines
    assert tree.cost.paper_s <= HIERARCHY_FACTOR * flat.cost.paper_s
    if not regions:
        assert tree.stats["clusters"] >= 3


def test_hierarchy_on_the_paper_scenario_finds_one_region_per_pipeline():
    sc = load_scenario("worldwide")
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    cfg = SearchConfig(time_budget_s=300, generations=2, population=4)
    tree = solve(dl, bw, PAPER_GPT3_XL, stages=8, dp=8, regions=sc.peer_regions(), config=cfg, hierarchical=True)
    assert tree.stats["layout"] == "pipeline"
    assert tree.cost.paper_s == pytest.approx(49.218, abs=5e-4)  # docs/figures.md, the flat search's


def test_hierarchy_reads_float32_blocks_and_costs_them_like_the_model():
    sc, dl, bw = jittered_world(100, seed=5)
    spec = paper_volumes(12, 8)
    wl = spec.workload(12, 8)
    res = solve_hierarchy(dl.astype(np.float32), bw.astype(np.float32), wl, regions=sc.peer_regions(),
                          deadline_s=float("inf"), config=SearchConfig(generations=1, population=4))
    model = CostModel(dl, bw, wl)
    assert paper_breakdown(dl, bw, wl, res.X) == model.breakdown(res.X)  # float64: bit for bit
    assert paper_breakdown(dl.astype(np.float32), bw.astype(np.float32), wl, res.X).paper_s == pytest.approx(
        model.breakdown(res.X).paper_s, rel=1e-6)
    assert sorted(res.X.ravel().tolist() + res.spares.tolist()) == list(range(100))


def test_k_center_separates_distant_sites():
    rng = np.random.default_rng(3)
    site = np.repeat(np.arange(3), [20, 30, 25])
    n = len(site)
    delay = np.where(site[:, None] == site[None, :], 2.0, 80.0) * rng.uniform(0.9, 1.1, (n, n))
    bw = np.full((n, n), 1.0)
    np.fill_diagonal(delay, 0)
    clusters = cluster_peers(LinkBlocks(delay, bw, 0.5), n, None, max_peers=30, min_peers=8)
    assert sorted(sorted(site[c].tolist()) for c in clusters) == sorted(
        [[0] * 20, [1] * 30, [2] * 25])


def test_solve_takes_the_hierarchy_from_the_configured_size_for_the_paper_objective_only():
    sc, dl, bw = jittered_world(64, seed=2)
    spec = paper_volumes(8, 8)
    cfg = SearchConfig(time_budget_s=300, generations=1, population=4, hierarchy_min_peers=64)
    assert solve(dl, bw, spec, stages=8, dp=8, regions=sc.peer_regions(), config=cfg).stats.get("hierarchy")
    slow = np.ones(64)
    slow[0] = 0.5
    flat = solve(dl, bw, spec, stages=8, dp=8, config=cfg, compute=slow)  # an extension: flat search
    assert "hierarchy" not in flat.stats
    with pytest.raises(ValueError, match="paper objective alone"):
        solve(dl, bw, spec, stages=8, dp=8, config=cfg, compute=slow, hierarchical=True)


class Ticks:
    """A clock that advances by one tick per reading: a budget counts the search's steps."""

    def __init__(self, tick: float) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


def budgeted_search(n, S, D, **config):
    sc, dl, bw = jittered_world(n, seed=9)
    model = CostModel(dl, bw, paper_volumes(S, D).workload(S, D))
    cfg = SearchConfig(**config)
    clock = Ticks(1e-3)
    search = ShapeSearch(model, S, D, cfg, seed=0, deadline_s=cfg.time_budget_s, clock=clock)
    seeds = constructions(model, S, D, sc.peer_regions(), np.random.default_rng(1),
                          cfg.random_seeds if n < cfg.lean_min_peers else 0)
    cost, X, Z = search.run(seeds)
    return search, cost, X, Z, model


@pytest.mark.parametrize("lean, budget, rounds", [(True, 2.0, 3), (False, 5.0, 2)])
def test_the_search_runs_generations_within_its_budget(lean, budget, rounds):
    # a budget of 1,000 clock readings per second; the starts may take half of them, evolution
    # has the rest (a lean round polishes few peers: more rounds fit)
    kw = {"time_budget_s": budget, "lean_min_peers": 32 if lean else 256}
    search, cost, X, Z, model = budgeted_search(96, 8, 12, **kw)
    assert search.lean == lean
    assert search.generations >= rounds
    assert cost == model.total(X)
    assert sorted(X.ravel().tolist() + Z.tolist()) == list(range(96))
    # the code path before: every start polished while time lasts, none left for evolution
    before, *_ = budgeted_search(96, 8, 12, start_share=1.0, **kw)
    assert before.generations == 0


def test_lean_rounds_nudge_neighbouring_stages_only():
    sc, dl, bw = jittered_world(40, seed=4)
    model = CostModel(dl, bw, paper_volumes(6, 6).workload(6, 6))
    search = ShapeSearch(model, 6, 6, SearchConfig(lean_min_peers=8), seed=0, deadline_s=float("inf"))
    X0 = np.arange(36).reshape(6, 6)
    Z0 = np.arange(36, 40)
    stage_of = {int(p): s for s in range(6) for p in X0[s]}
    for _ in range(50):
        X, Z, moved = search.nudge(X0, Z0, 1)
        assert sorted(X.ravel().tolist() + Z.tolist()) == list(range(40))
        a, b = (int(v) for v in moved)
        if a in stage_of and b in stage_of:
            assert abs(stage_of[a] - stage_of[b]) == 1


def test_many_peers_start_from_the_hierarchy_and_never_end_above_it():
    sc, dl, bw = jittered_world(72, seed=6)
    spec = paper_volumes(8, 8)
    cfg = SearchConfig(time_budget_s=300, generations=2, population=4, lean_min_peers=64)
    alloc = solve(dl, bw, spec, stages=8, dp=8, regions=sc.peer_regions(), seed=0, config=cfg)
    start = alloc.stats["hierarchy_start"]
    # (on this instance the search from the other starts alone ends above the hierarchy's)
    assert alloc.cost.paper_s <= start["cost_s"] + 1e-12
    assert alloc.stats["generations"] == 2 and start["generations"] >= 1
    assert_valid(alloc, 72, 8, 8)
    # not with an extension: the hierarchy costs the paper objective only
    slow = np.ones(72)
    slow[3] = 0.5
    starts_only = SearchConfig(time_budget_s=300, generations=0, population=4, lean_min_peers=64)
    assert "hierarchy_start" not in solve(dl, bw, spec, stages=8, dp=8, seed=0, config=starts_only, compute=slow).stats
