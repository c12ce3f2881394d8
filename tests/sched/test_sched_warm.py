"""solve(..., initial=): the warm start a coordinator uses when it re-plans."""

import inspect

import numpy as np
import pytest

from dtfm.scenarios import load_scenario
from dtfm.sched import PAPER_GPT3_XL, SEARCH_PROFILES, cost_model, evaluate, solve

TEST = SEARCH_PROFILES["test"]

# What solve returned before the warm start existed (same seed, the "test" profile): the default
# path must not change.
BEFORE = {
    ("regional", 16, 4, 4): (((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)), (), 37.34213177807689),
    ("worldwide", 12, 3, 3): (((10, 9, 2), (3, 4, 0), (11, 5, 1)), (6, 7, 8), 60.0227658955622),
    ("spot", 10, 2, None): (((0, 5), (1, 6), (2, 7), (3, 8), (4, 9)), (), 36.27518408203125),
}


def _net(name, n):
    sc = load_scenario(name).scaled(n)
    return sc.delay_ms(), sc.bandwidth_gbps(), sc.peer_regions()


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_default_unchanged(key):
    name, n, stages, dp = key
    delay, bw, regions = _net(name, n)
    a = solve(delay, bw, PAPER_GPT3_XL, stages=stages, dp=dp, regions=regions, seed=3, config=TEST)
    pipelines, spares, cost = BEFORE[key]
    assert a.pipelines == pipelines
    assert a.spares == spares
    assert a.cost.total_s == pytest.approx(cost, rel=1e-12)
    # initial=None is the default: the call above is the path without a warm start
    assert inspect.signature(solve).parameters["initial"].default is None


@pytest.mark.parametrize("seed", range(4))
def test_warm_start_no_worse_than_initial(seed):
    delay, bw, _ = _net("worldwide", 12)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(12)
    initial = [list(map(int, perm[3 * d:3 * d + 3])) for d in range(3)]  # 3 pipelines of 3 stages
    init_cost = evaluate(delay, bw, PAPER_GPT3_XL, initial).total_s
    for gens in (0, 2):
        cfg = type(TEST)(time_budget_s=60.0, generations=gens, population=4)
        a = solve(delay, bw, PAPER_GPT3_XL, stages=3, dp=3, seed=seed, config=cfg, initial=initial)
        assert a.cost.total_s <= init_cost + 1e-12
        model = cost_model(delay, bw, PAPER_GPT3_XL, 3, 3)
        assert model.total(a.matrix) == pytest.approx(a.cost.total_s)


def test_warm_start_from_the_optimum_stays_there():
    # a region-aligned optimum has many equally cheap relabellings: the warm start keeps its own
    delay, bw, regions = _net("regional", 16)
    a = solve(delay, bw, PAPER_GPT3_XL, stages=4, dp=4, regions=regions, seed=0, config=TEST)
    initial = [p[::-1] for p in a.pipelines]  # the same groups, stage order reversed: as cheap here
    assert evaluate(delay, bw, PAPER_GPT3_XL, initial).total_s == pytest.approx(a.cost.total_s)
    b = solve(delay, bw, PAPER_GPT3_XL, stages=4, dp=4, regions=regions, seed=0, config=TEST, initial=initial)
    assert b.cost.total_s <= a.cost.total_s + 1e-12
    assert [set(g) for g in b.matrix] == [set(g) for g in np.array(initial).T]  # every peer keeps its stage


def test_warm_start_with_auto_uses_its_shape():
    delay, bw, _ = _net("worldwide", 12)
    initial = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    a = solve(delay, bw, PAPER_GPT3_XL, stages="auto", seed=0, config=TEST, initial=initial)
    assert a.cost.total_s <= evaluate(delay, bw, PAPER_GPT3_XL, initial).total_s + 1e-12


@pytest.mark.parametrize("initial, match", [
    ([[0, 1, 2], [3, 4]], "every pipeline as long"),
    ([[0, 1, 2], [3, 4, 99]], "outside"),
    ([[0, 1, 2], [3, 4, 2]], "twice"),
    ([[0, 1], [2, 3], [4, 5]], "does not try"),
])
def test_bad_initial(initial, match):
    delay, bw, _ = _net("worldwide", 12)
    with pytest.raises(ValueError, match=match):
        solve(delay, bw, PAPER_GPT3_XL, stages=3, dp=2, seed=0, config=TEST, initial=initial)
