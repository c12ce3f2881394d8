"""The GPipe iteration simulator on cases whose timing is known in closed form."""

import numpy as np
import pytest

from dtfm.sched import CostModel, Workload
from dtfm.sched.simulate import simulate


def net(n, ms, gbps):
    delay = np.full((n, n), float(ms))
    bw = np.full((n, n), float(gbps))
    np.fill_diagonal(delay, 0)
    np.fill_diagonal(bw, np.inf)
    return delay, bw


@pytest.mark.parametrize("M", [1, 4, 16])
def test_communication_alone_pipelines_the_transfers(M):
    delay, bw = net(3, 20, 1.0)
    wl = Workload(stages=3, dp=1, layers=3, grad_gb_total=1.0, act_gb=0.5, micro_batches=M)
    r = simulate(CostModel(delay, bw, wl), np.array([[0], [1], [2]]))
    hold = 0.5 * 8 / 1.0 / M  # one micro-batch holds a link this long
    # each direction: M transfers queue on the first link, the last one then crosses the second
    one_way = (M + 1) * hold + 2 * 0.020
    assert r.iteration_s == pytest.approx(2 * one_way)
    if M == 1:  # no pipelining: exactly the paper's 2 x PPcost of this single pipeline
        assert r.iteration_s == pytest.approx(2 * 2 * (0.020 + 0.5 * 8 / 1.0))
    assert r.allreduce_s == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("S,M", [(1, 5), (3, 1), (4, 8)])
def test_compute_alone_is_the_gpipe_formula(S, M):
    delay, bw = net(S, 0, 1e15)
    wl = Workload(stages=S, dp=1, layers=2 * S, grad_gb_total=0.0, act_gb=0.0, micro_batches=M, layer_compute_s=0.3)
    r = simulate(CostModel(delay, bw, wl), np.arange(S)[:, None])
    step = 2 * 0.3  # two layers per stage
    assert r.iteration_s == pytest.approx((M + S - 1) * step)
    assert r.compute_busy_s == pytest.approx(M * step)


def test_allreduce_follows_the_backward_pass_and_overlaps():
    delay, bw = net(4, 10, 2.0)
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=2.0, act_gb=0.0, micro_batches=2, layer_compute_s=1.0)
    model = CostModel(delay, bw, wl)
    X = np.array([[0, 1], [2, 3]])
    r = simulate(model, X)
    ar = 2 * (0.010 + 1.0 * 8 / (2 * 2.0))  # one other member, a 1 GB stage gradient, D = 2
    assert r.allreduce_s == pytest.approx((ar, ar))
    hop = 0.010  # no activation volume: latency only
    # stage 1 finishes its backward first; stage 0 one backward step and a hop later
    last = r.pipeline_s
    assert r.iteration_s == pytest.approx(last + ar)
    assert r.stage_done_s[1] < r.stage_done_s[0]
    serial = simulate(model, X, overlap_allreduce=False)
    assert serial.iteration_s == pytest.approx(last + ar)
    assert serial.stage_done_s[1] == pytest.approx(serial.stage_done_s[0])
    assert hop > 0


def test_a_slow_peer_slows_every_pipeline_sharing_its_allreduce():
    delay, bw = net(4, 5, 10.0)
    wl = Workload(stages=2, dp=2, layers=2, grad_gb_total=0.1, act_gb=0.01, micro_batches=4, layer_compute_s=0.1)
    X = np.array([[0, 1], [2, 3]])
    even = simulate(CostModel(delay, bw, wl), X)
    slow = simulate(CostModel(delay, bw, wl, compute=np.array([1, 1, 1, 0.5])), X)
    assert slow.iteration_s > even.iteration_s + 4 * 0.1 * 0.9


def test_engine_syncs_norm_overlaps_the_next_step_without_acknowledgements():
    delay, bw = net(2, 20, 1.0)
    wl = Workload(stages=2, dp=1, layers=2, grad_gb_total=0.0, act_gb=0.5, micro_batches=1)
    model = CostModel(delay, bw, wl)
    X = np.array([[0], [1]])
    plain = simulate(model, X)
    assert plain.iteration_s == pytest.approx(2 * (4.0 + 0.020))  # forward then backward transfer
    r = simulate(model, X, engine_syncs=True)
    # stage 0 has the gradient at 8.04 and starts the next step; its norm reaches stage 1 at
    # 8.06, long before the next activation (12.06): back to back, a step takes 8.04
    assert r.iteration_s == pytest.approx(8.04)
    assert r.pipeline_s == plain.pipeline_s


def test_engine_syncs_sum_the_loss_across_pipelines_before_the_allreduce():
    delay, bw = net(2, 20, 1.0)
    wl = Workload(stages=1, dp=2, layers=1, grad_gb_total=1.0, act_gb=0.0, micro_batches=1)
    model = CostModel(delay, bw, wl)
    X = np.array([[0, 1]])
    plain = simulate(model, X)
    r = simulate(model, X, engine_syncs=True)
    ar = r.allreduce_s[0]
    assert plain.iteration_s == pytest.approx(ar)
    assert r.iteration_s == pytest.approx(0.020 + ar)  # the loss sum first: the other's value, one way


def test_compute_counts_the_workloads_sequences_over_the_micro_batches_simulated():
    """A workload of 6 micro-batches of its micro_batch_size (16 sequences over 3 pipelines:
    the largest pipeline's 6) simulated in M = 4: each of the 4 carries 1.5 of them."""
    delay, bw = net(1, 0, 1e15)
    wl = Workload(stages=1, dp=1, layers=2, grad_gb_total=0.0, act_gb=0.0, micro_batches=6, layer_compute_s=0.1)
    r = simulate(CostModel(delay, bw, wl), np.array([[0]]), micro_batches=4)
    assert r.iteration_s == pytest.approx(6 * 2 * 0.1)
    assert r.compute_busy_s == pytest.approx(6 * 2 * 0.1)
    same = simulate(CostModel(delay, bw, wl), np.array([[0]]))  # M = the workload's own
    assert same.iteration_s == pytest.approx(r.iteration_s)


@pytest.mark.parametrize("engine_syncs", [False, True])
def test_each_peer_updates_its_stage_after_the_all_reduce_at_its_speed(engine_syncs):
    """The update: the stage's parameters (its share of the gradient's elements) at
    update_s_per_param, divided by the peer's speed, after its group's all-reduce; the step
    waits for the slowest."""
    delay, bw = net(2, 0, 1e15)
    # one stage of 2 layers; 4 GB of fp32 gradient is 1e9 parameters
    base = dict(stages=1, dp=2, layers=2, grad_gb_total=4.0, act_gb=0.0, micro_batches=2, layer_compute_s=0.5)
    plain = Workload(**base)
    upd = Workload(**base, update_s_per_param=1e-9)
    assert upd.update_s(np.array([2])) == pytest.approx([1.0])  # 1e9 parameters x 1 ns
    speed = np.array([1.0, 0.5])  # peer 1 computes and updates in twice the time
    X = np.array([[0, 1]])
    without = simulate(CostModel(delay, bw, plain, compute=speed), X, engine_syncs=engine_syncs)
    with_update = simulate(CostModel(delay, bw, upd, compute=speed), X, engine_syncs=engine_syncs)
    assert with_update.iteration_s == pytest.approx(without.iteration_s + 2.0)
    assert with_update.compute_busy_s == pytest.approx(without.compute_busy_s + 2.0)


def test_the_search_objective_counts_the_slowest_update():
    delay, bw = net(2, 0, 1e15)
    wl = Workload(stages=2, dp=1, layers=4, grad_gb_total=4.0, act_gb=0.0, micro_batches=2, layer_compute_s=0.5,
                  update_s_per_param=1e-9)
    speed = np.array([1.0, 0.25])
    model = CostModel(delay, bw, wl, compute=speed)
    # GPipe: (M + S - 1) x the slowest stage's micro-batch (2 layers at 0.5 s / 0.25), plus 5e8 x 1 ns / 0.25
    assert model.compute_time(np.array([[0], [1]]), np.array([2, 2])) == pytest.approx(3 * 4.0 + 2.0)


def test_update_seconds_per_parameter_from_the_layer_figures():
    from dtfm.sched import UPDATE_KIND, update_s_per_param
    assert update_s_per_param({UPDATE_KIND: 500.0, 1: 1.4}, 0.05) == pytest.approx(500.0 / 0.05e12)
    assert update_s_per_param({1: 1.4}, 0.05) == 0.0  # not measured: not counted
    assert update_s_per_param({UPDATE_KIND: 500.0}, None) == 0.0  # compute not costed
    with pytest.raises(ValueError):
        Workload(stages=1, dp=1, layers=1, grad_gb_total=0.0, act_gb=0.0, update_s_per_param=-1.0)
