"""The search's allocation refined on the simulator (`refine_by_simulation`): swaps of placed
peers and spares kept while the simulated iteration falls, kicks out of local optima; on the
paper's worldwide network it finds what the paper's cost misses."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dtfm.scenarios import load_scenario
from dtfm.sched import REFERENCE_CODEC_SPEED, CompressionOptions, CostModel, ModelSpec, solve, wire_codecs
from dtfm.sched.fastest import refine_by_simulation
from dtfm.sched.simulate import simulate
from dtfm.train import get_preset
from dtfm.train.compress import parse_compression


def misplaced(target: np.ndarray):
    """An objective whose optimum is `target`: the count of cells holding another peer."""
    return lambda X: float((np.asarray(X) != target).sum()) + 1.0


def test_descends_to_the_optimum_through_placed_peers_and_spares():
    rng = np.random.default_rng(0)
    peers = rng.permutation(10)
    target = peers[:8].reshape(4, 2)
    start = np.concatenate([peers[2:8], peers[8:10]]).reshape(4, 2)  # two of the target's peers are spares
    spares = [int(p) for p in peers[:2]]
    X, Z, stats = refine_by_simulation(misplaced(target), start, spares, max_evaluations=2000)
    assert np.array_equal(X, target)
    assert Z == tuple(sorted(int(p) for p in peers[8:10]))
    assert stats["from_s"] > stats["to_s"] == 1.0 and stats["moves"] >= 1


@pytest.mark.parametrize("budget", [1, 7, 50])
def test_never_worse_than_its_start_and_within_its_evaluations(budget):
    rng = np.random.default_rng(budget)
    target = rng.permutation(8).reshape(4, 2)
    start = rng.permutation(8).reshape(4, 2)
    f = misplaced(target)
    X, Z, stats = refine_by_simulation(f, start, [], max_evaluations=budget)
    assert stats["evaluations"] <= budget
    assert f(X) == stats["to_s"] <= f(start) == stats["from_s"]
    assert sorted(X.ravel()) == list(range(8)) and Z == ()


def tiny(dp: int, layer_compute_s: float) -> ModelSpec:
    g = get_preset("tiny")
    spec = ModelSpec(g.name, layers=g.n_layer, hidden=g.n_embd, heads=g.n_head, seq_len=g.seq_len, vocab=g.vocab,
                     micro_batch_size=2, global_batch_seqs=16, act_bytes=4)
    at_one = replace(spec, reference_tflops=1.0).workload(1, dp).layer_compute_s
    return replace(spec, reference_tflops=at_one / layer_compute_s)


def test_on_the_worldwide_network_it_finds_what_the_papers_cost_misses():
    """Compressed tiny, 4 x 2 on the paper's eight cities at the swarm bench's bandwidth: the
    search's allocation, best by the paper's cost, is not a local optimum of the simulator (the
    GPipe schedule's latency across the oceans, the trainer's round trips); refined, it is,
    and 5 % or more faster."""
    sc = load_scenario("worldwide").scaled(8)
    delay, bw = sc.delay_ms(), sc.bandwidth_gbps() * 0.011
    pp, dp = wire_codecs(parse_compression("auto"))
    opts = CompressionOptions((type(pp)(), pp), (type(dp)(), dp), REFERENCE_CODEC_SPEED)
    spec = tiny(2, 0.005)
    alloc = solve(delay, bw, spec, stages=4, dp=2, regions=sc.peer_regions(), seed=0, generations=3,
                  time_budget_s=60.0, compression=opts)
    model = CostModel(delay, bw, spec.workload(4, 2), compression=opts)

    def iteration_s(X: np.ndarray) -> float:
        return float(simulate(model, X, micro_batches=4, engine_syncs=True).iteration_s)

    X, _, stats = refine_by_simulation(iteration_s, alloc.matrix, alloc.spares, max_evaluations=300)
    assert stats["from_s"] == pytest.approx(iteration_s(alloc.matrix))
    assert stats["to_s"] == pytest.approx(iteration_s(X)) and stats["to_s"] < 0.95 * stats["from_s"]
    for s, d in np.ndindex(*X.shape):  # a local optimum: no swap of two placed peers is faster
        for t, q in np.ndindex(*X.shape):
            if (t, q) > (s, d):
                Y = X.copy()
                Y[s, d], Y[t, q] = X[t, q], X[s, d]
                assert iteration_s(Y) >= stats["to_s"] * (1 - 1e-9)
