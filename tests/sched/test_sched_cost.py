"""The DT-FM cost model against hand-computed cases and a literal re-reading of COSTMODEL.md."""

import math

import numpy as np
import pytest

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL, CommSpec, CostModel, ModelSpec, evaluate, layer_ranges, split_layers


def paper_cost_literal(delay_ms, bandwidth_gbps, pipelines, c_grad_gb, c_act_gb):
    """COSTMODEL.md word for word, with loops: seconds = ms / 1e3 + GB * 8 / Gbps."""
    D, S = len(pipelines), len(pipelines[0])

    def a(i, j):
        return delay_ms[i][j] / 1e3

    def t(gb, i, j):
        return gb * 8 / bandwidth_gbps[i][j]

    dp = 0.0
    for s in range(S):
        group = [pipelines[p][s] for p in range(D)]
        for i in group:
            dp = max(dp, sum(2 * (a(i, j) + t(c_grad_gb, i, j) / D) for j in group if j != i))
    pp = 0.0
    for s in range(S - 1):
        pp += max(a(pipelines[p][s], pipelines[p][s + 1]) + t(c_act_gb, pipelines[p][s], pipelines[p][s + 1])
                  for p in range(D))
    return dp, pp, dp + 2 * pp


def test_paper_preset_units_are_the_authors():
    wl = PAPER_GPT3_XL.workload(8, 8)
    assert wl.grad_gb(3) == pytest.approx(1.3e9 * 4 * 3 / 24 / 1e9, rel=1e-15)
    assert wl.grad_gb(3) == pytest.approx(0.65, rel=1e-15)
    assert wl.act_gb == pytest.approx(2024 * 2048 * 2 * (1.25e5 / 2048) / 2**30, rel=1e-15)
    assert wl.act_gb == pytest.approx(0.47125, abs=1e-5)
    assert wl.layers // wl.stages == 3


def test_two_by_two_by_hand():
    # peers 0,1 in one site, 2,3 in another; 10 ms / 1 Gbps inside, 100 ms / 0.5 Gbps across
    delay = np.array([[0, 10, 100, 100], [10, 0, 100, 100], [100, 100, 0, 10], [100, 100, 10, 0]], float)
    bw = np.array([[np.inf, 1, .5, .5], [1, np.inf, .5, .5], [.5, .5, np.inf, 1], [.5, .5, 1, np.inf]])
    spec = CommSpec("hand", layers=2, grad_gb_total=2.0, act_gb_global=1.0)  # 1 GB per stage, 0.5 per pipeline
    # pipelines (0 -> 2) and (1 -> 3): DP groups {0,1} and {2,3} are local
    cost = evaluate(delay, bw, spec, [[0, 2], [1, 3]])
    dp = 2 * (0.010 + 1.0 * 8 / (2 * 1))  # one other member: 2 (a + c_grad / (D b))
    pp = 0.100 + 0.5 * 8 / 0.5  # the single boundary crosses sites
    assert cost.dp_s == pytest.approx(dp)
    assert cost.pp_s == pytest.approx(pp)
    assert cost.paper_s == pytest.approx(dp + 2 * pp)
    # pipelines (0 -> 1) and (2 -> 3): DP crosses sites, PP stays local
    cost = evaluate(delay, bw, spec, [[0, 1], [2, 3]])
    assert cost.dp_s == pytest.approx(2 * (0.100 + 8 / (2 * 0.5)))
    assert cost.pp_s == pytest.approx(0.010 + 0.5 * 8 / 1)
    assert cost.total_s == cost.paper_s  # no extensions given


def test_matches_the_literal_definition_on_every_scenario():
    rng = np.random.default_rng(0)
    for name in ("worldwide", "regional", "datacenter", "spot", "universities"):
        sc = load_scenario(name)
        dl, bw = sc.delay_ms(), sc.bandwidth_gbps()
        wl = PAPER_GPT3_XL.workload(8, 8)
        for _ in range(3):
            pipes = rng.permutation(64).reshape(8, 8).tolist()
            got = evaluate(dl, bw, PAPER_GPT3_XL, pipes)
            dp, pp, total = paper_cost_literal(dl, bw, pipes, wl.grad_gb(3), wl.act_gb)
            assert got.dp_s == pytest.approx(dp, rel=1e-12)
            assert got.pp_s == pytest.approx(pp, rel=1e-12)
            assert got.paper_s == pytest.approx(total, rel=1e-12)


def test_split_layers_gives_faster_stages_more():
    counts, short = split_layers(6, np.array([1.0, 2.0]), np.array([6, 6]))
    assert counts.tolist() == [2, 4] and short == 0
    counts, short = split_layers(6, np.array([1.0, 2.0]), np.array([6, 3]))
    assert counts.tolist() == [3, 3] and short == 0
    counts, short = split_layers(6, np.array([1.0, 1.0]), np.array([2, 2]))
    assert sum(counts) == 4 and short == 2


def test_layer_ranges_are_split_layers_as_contiguous_ranges():
    assert layer_ranges(6, 2, [1.0, 2.0]) == [(0, 2), (2, 6)]
    assert layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    speeds = np.array([0.5, 3.0, 1.0, 2.0])
    counts, _ = split_layers(23, speeds, np.full(4, 23))
    assert [b - a for a, b in layer_ranges(23, 4, speeds)] == counts.tolist()
    with pytest.raises(ValueError, match="cannot split"):
        layer_ranges(3, 4)
    with pytest.raises(ValueError, match="speeds"):
        layer_ranges(4, 2, [1.0, 2.0, 3.0])


def _flat(n, ms=10.0, gbps=1.0):
    dl = np.full((n, n), ms)
    np.fill_diagonal(dl, 0)
    bw = np.full((n, n), gbps)
    np.fill_diagonal(bw, np.inf)
    return dl, bw


def test_slow_peer_slows_the_compute_term():
    spec = ModelSpec("m", layers=4, hidden=64, heads=4, seq_len=32, vocab=100, micro_batch_size=2,
                     global_batch_seqs=16, reference_tflops=1.0)
    dl, bw = _flat(4)
    fast = CostModel(dl, bw, spec.workload(2, 2), compute=np.ones(4)).breakdown(np.array([[0, 1], [2, 3]]))
    slow = CostModel(dl, bw, spec.workload(2, 2), compute=np.array([1, 1, 1, .25])).breakdown(np.array([[0, 1], [2, 3]]))
    wl = spec.workload(2, 2)
    assert fast.compute_s == pytest.approx((wl.micro_batches + 1) * 2 * wl.layer_compute_s)
    assert slow.compute_s == pytest.approx(4 * fast.compute_s)
    assert slow.paper_s == fast.paper_s
    uneven = CostModel(dl, bw, wl, compute=np.array([1, 1, 1, .25]), uneven_layers=True).breakdown(np.array([[0, 1], [2, 3]]))
    assert uneven.layers == (3, 1)  # the slow peer's stage takes fewer layers
    assert uneven.compute_s < slow.compute_s


def test_memory_shortfall_is_penalised_not_fatal():
    spec = ModelSpec("m", layers=4, hidden=64, heads=4, seq_len=32, vocab=100, micro_batch_size=2,
                     global_batch_seqs=16, with_memory=True)
    wl = spec.workload(2, 2)
    need = wl.base_memory_gib + 2 * wl.layer_memory_gib
    dl, bw = _flat(4)
    ok = CostModel(dl, bw, wl, memory_gib=np.full(4, need * 1.01)).breakdown(np.array([[0, 1], [2, 3]]))
    assert ok.feasible
    tight = np.array([need * 1.01] * 3 + [need * 0.6])
    bad = CostModel(dl, bw, wl, memory_gib=tight).breakdown(np.array([[0, 1], [2, 3]]))
    assert not bad.feasible and bad.total_s > ok.total_s
    fits = CostModel(dl, bw, wl, memory_gib=tight * 1.5, uneven_layers=True).breakdown(np.array([[0, 1], [2, 3]]))
    assert fits.feasible and fits.layers == (3, 1)


def test_rejects_bad_matrices():
    dl, bw = _flat(3)
    bw[0, 1] = 0
    with pytest.raises(ValueError):
        CostModel(dl, bw, PAPER_GPT3_XL.workload(1, 3))
    with pytest.raises(ValueError):
        CostModel(dl[:2], bw, PAPER_GPT3_XL.workload(1, 3))
    assert math.isinf(_flat(2)[1][0, 0])
