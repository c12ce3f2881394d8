"""Search behaviour: exact incremental scores, determinism, constructions as floor, spares, shapes."""

import numpy as np
import pytest

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL, CommSpec, CostModel, ModelSpec, SearchConfig, candidate_shapes, evaluate, solve
from dtfm.sched.construct import consecutive, dp_aligned, locality_order, pp_aligned
from dtfm.sched.local import SwapSearch


@pytest.mark.parametrize("symmetric", [True, False])
def test_incremental_swap_scores_equal_rescoring(symmetric):
    rng = np.random.default_rng(7 + symmetric)
    for S, D, spare in [(4, 3, 2), (3, 2, 0), (6, 1, 1), (1, 4, 1), (2, 2, 0)]:
        n = S * D + spare
        delay, bw = rng.random((n, n)) * 100, rng.random((n, n)) * 2 + 0.1
        if symmetric:
            delay, bw = (delay + delay.T) / 2, (bw + bw.T) / 2
        model = CostModel(delay, bw, PAPER_GPT3_XL.workload(S, D))
        search = SwapSearch(model, rng, lambda: False)
        perm = rng.permutation(n)
        search._load(perm[:S * D].reshape(S, D), perm[S * D:])
        for s in range(S):
            for p in range(D):
                net, _, kind, ts, qs = search._candidates(s, p)
                for k in np.flatnonzero(np.isfinite(net)):
                    X, _ = search._apply(s, p, "spare" if kind[k] else "swap", int(ts[k]), int(qs[k]))
                    assert net[k] == pytest.approx(model.total(X), rel=1e-12, abs=1e-12)


def small_world(n=16):
    sc = load_scenario("worldwide").scaled(n)
    return sc, sc.delay_ms(), sc.bandwidth_gbps()


def test_same_seed_same_allocation():
    sc, dl, bw = small_world(10)
    spec = CommSpec("t", layers=4, grad_gb_total=2.6, act_gb_global=0.47 * 4)
    a = solve(dl, bw, spec, stages=4, dp=2, seed=3, generations=6, time_budget_s=60)
    b = solve(dl, bw, spec, stages=4, dp=2, seed=3, generations=6, time_budget_s=60)
    assert a.pipelines == b.pipelines and a.cost == b.cost


def test_never_worse_than_the_constructions_and_cost_is_of_the_printed_pipelines():
    sc, dl, bw = small_world()
    spec = CommSpec("t", layers=4, grad_gb_total=2.6, act_gb_global=0.47 * 4)
    alloc = solve(dl, bw, spec, stages=4, dp=4, regions=sc.peer_regions(), generations=3, time_budget_s=60)
    order = locality_order(np.zeros((16, 16)), sc.peer_regions())
    for X, _ in (dp_aligned(order, 4, 4), pp_aligned(order, 4, 4), consecutive(16, 4, 4)):
        assert alloc.cost.paper_s <= evaluate(dl, bw, spec, X.T).paper_s + 1e-12
    assert evaluate(dl, bw, spec, alloc.pipelines) == alloc.cost
    used = sorted(p for pipe in alloc.pipelines for p in pipe)
    assert used == list(range(16)) and alloc.spares == ()


def test_a_badly_connected_peer_is_left_out_as_spare():
    # 9 peers, 8 of them close; peer 4 sits behind a slow, far link
    n = 9
    delay = np.full((n, n), 5.0)
    bw = np.full((n, n), 2.0)
    delay[4, :] = delay[:, 4] = 200.0
    bw[4, :] = bw[:, 4] = 0.1
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    alloc = solve(delay, bw, PAPER_GPT3_XL, stages=2, dp=4, generations=2, time_budget_s=60)
    assert alloc.spares == (4,)
    with pytest.raises(ValueError):
        solve(delay, bw, PAPER_GPT3_XL, stages=2, dp=4, allow_spares=False)


def test_slow_gpu_is_spared_or_given_fewer_layers():
    n = 5
    delay = np.full((n, n), 5.0)
    bw = np.full((n, n), 10.0)
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    compute = np.array([1.0, 1.0, 0.2, 1.0, 1.0])
    spec = ModelSpec("m", layers=8, hidden=128, heads=4, seq_len=64, vocab=100, micro_batch_size=2,
                     global_batch_seqs=16, reference_tflops=0.05)
    alloc = solve(delay, bw, spec, stages=2, dp=2, compute=compute, generations=2, time_budget_s=60)
    assert alloc.spares == (2,)
    # with every peer needed, the slow one's stage gets fewer layers
    even = solve(delay[:4, :4], bw[:4, :4], spec, stages=2, dp=2, compute=compute[[0, 1, 2, 3]],
                 generations=1, time_budget_s=60)
    uneven = solve(delay[:4, :4], bw[:4, :4], spec, stages=2, dp=2, compute=compute[[0, 1, 2, 3]],
                   uneven_layers=True, generations=1, time_budget_s=60)
    slow_stage = next(s for s in range(2) if any(p[s] == 2 for p in uneven.pipelines))
    assert uneven.layers[slow_stage] < uneven.layers[1 - slow_stage]
    assert uneven.cost.total_s < even.cost.total_s


def test_auto_shape_tries_the_fitting_factorizations():
    shapes = candidate_shapes(12, PAPER_GPT3_XL, allow_spares=False)
    assert shapes == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert (8, 1) not in candidate_shapes(12, PAPER_GPT3_XL, allow_spares=False)
    sc, dl, bw = small_world(8)
    shapes = candidate_shapes(8, PAPER_GPT3_XL, allow_spares=False)
    assert shapes == [(1, 8), (2, 4), (4, 2), (8, 1)]
    alloc = solve(dl, bw, PAPER_GPT3_XL, stages="auto", generations=1, time_budget_s=60, allow_spares=False)
    assert (alloc.stages, alloc.dp) in shapes
    for S, D in shapes:
        fixed = solve(dl, bw, PAPER_GPT3_XL, stages=S, dp=D, generations=1, time_budget_s=60)
        assert alloc.cost.total_s <= fixed.cost.total_s + 1e-12


def test_layer_ranges_cover_the_model():
    sc, dl, bw = small_world(8)
    alloc = solve(dl, bw, PAPER_GPT3_XL, stages=4, dp=2, generations=1, time_budget_s=60)
    assert alloc.layer_ranges == ((0, 6), (6, 12), (12, 18), (18, 24))
    d = alloc.to_dict()
    assert d["cost"]["total_s"] == pytest.approx(d["cost"]["dp_s"] + 2 * d["cost"]["pp_s"])


def test_aligned_blocks_span_the_constructions():
    from dtfm.sched.construct import aligned_blocks

    order = np.arange(16)
    regions = ["a"] * 4 + ["b"] * 4 + ["c"] * 8
    X1, _ = aligned_blocks(order, regions, 4, 4, 1)
    assert (X1 == dp_aligned(order, 4, 4)[0]).all()
    X4, _ = aligned_blocks(order, regions, 4, 4, 4)
    assert (X4 == pp_aligned(order, 4, 4)[0]).all()
    X2, spares = aligned_blocks(order, regions, 4, 4, 2)
    # region a's two segments sit at stages 0-1 of pipelines 0 and 1
    assert X2[:2, 0].tolist() == [0, 1] and X2[:2, 1].tolist() == [2, 3] and len(spares) == 0
    assert sorted(X2.ravel().tolist()) == list(range(16))


def test_spot_instances_host_whole_stage_blocks():
    # four-GPU machines take four stages of one pipeline, single GPUs the other four
    sc = load_scenario("spot")
    dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
    alloc = solve(dl, bw, PAPER_GPT3_XL, stages=8, dp=8, regions=sc.peer_regions(), generations=0, time_budget_s=60)
    regions = sc.peer_regions()
    inst = [i for i in range(64) if regions[i] != "standalone"]
    single = [i for i in range(64) if regions[i] == "standalone"]
    by_hand = evaluate(dl, bw, PAPER_GPT3_XL, [inst[4 * k:4 * k + 4] + single[4 * k:4 * k + 4] for k in range(8)])
    assert alloc.cost.paper_s <= by_hand.paper_s + 1e-9


def test_a_converged_search_ends_before_its_budget_with_what_running_on_finds():
    """Without a generation cap the evolution ends once `patience` rounds in a row found nothing
    better (4 per peer past 8 peers): a 10-peer search given 10 minutes returns in seconds, and
    running the same rounds under a cap finds the same allocation."""
    sc, dl, bw = small_world(10)
    spec = CommSpec("t", layers=4, grad_gb_total=2.6, act_gb_global=0.47 * 4)
    cfg = SearchConfig(time_budget_s=600, cpu_clock=True)
    stall = cfg.stall_rounds(10)
    assert stall == 40 and SearchConfig(patience=50).stall_rounds(10) == 50
    assert SearchConfig(patience=0).stall_rounds(10) is None and SearchConfig(generations=5).stall_rounds(10) is None
    a = solve(dl, bw, spec, stages=4, dp=2, regions=sc.peer_regions(), seed=1, config=cfg)
    assert a.stats["generations"] - a.stats["improved_at"] == stall
    capped = solve(dl, bw, spec, stages=4, dp=2, regions=sc.peer_regions(), seed=1,
                   config=SearchConfig(time_budget_s=600, generations=a.stats["generations"]))
    assert capped.pipelines == a.pipelines and capped.cost == a.cost
    with pytest.raises(ValueError, match="patience"):
        SearchConfig(patience=-1)
