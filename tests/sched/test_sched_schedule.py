"""Pipeline schedules of the 1F1B family in the simulator (sched/simulate.py): each stage's
order of forwards and backwards (`stage_program`), the merged order (`stage_order`), the
warm-up counts' checks, and what a schedule buys on a link that is busy both ways."""

from __future__ import annotations

import numpy as np
import pytest
from test_sched_micro import spec_at, uniform

from dtfm.sched import CostModel, check_warmups, fitted_warmups, simulate_iteration, stage_program
from dtfm.sched.simulate import stage_order


def test_a_stage_runs_its_warm_up_then_one_forward_and_one_backward_then_the_rest():
    F, B = False, True
    assert stage_program(0, 4, 1) == [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)]
    assert stage_program(1, 3, 0) == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]
    gpipe = stage_program(0, 3, 3)
    assert gpipe == [(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)] == stage_program(0, 3, 9)
    # the merged order puts each input first: a forward after the one before it upstream, a
    # backward after the one after it downstream
    order = stage_order(3, 4, (2, 1, 0))
    assert sorted(order) == sorted((s, b, m) for s in range(3) for b in (F, B) for m in range(4))
    at = {op: k for k, op in enumerate(order)}
    for s, b, m in order:
        if not b and s > 0:
            assert at[(s - 1, F, m)] < at[(s, F, m)]
        if b and s < 2:
            assert at[(s + 1, B, m)] < at[(s, B, m)]


def test_warm_ups_must_not_rise_along_the_pipeline():
    assert check_warmups(None, 3, 4) == (4, 4, 4)
    assert check_warmups((9, 2, 0), 3, 4) == (4, 2, 0)  # (a count past M: every forward first)
    with pytest.raises(ValueError, match="one per stage"):
        check_warmups((1, 0), 3, 4)
    with pytest.raises(ValueError, match="may not warm up with more forwards"):
        check_warmups((0, 1, 0), 3, 4)
    with pytest.raises(ValueError, match="must be in"):
        check_warmups((-1, -1, -1), 3, 4)


def test_a_link_busy_both_ways_carries_gradients_back_while_activations_still_flow():
    """Two stages, compute and latency free, each micro-batch holding the link one unit each
    way: GPipe sends every activation, then every gradient (2M units); 1F1B sends gradient m
    while activation m + 1 travels (M + 1)."""
    X = np.arange(2).reshape(2, 1)
    M = 8
    d, bw = uniform(2, 0.0, gbps=1.0)
    model = CostModel(d, bw, spec_at(M, layer_s=None).workload(2, 1))
    unit = model.sim_s_per_gb[0, 1] * model.workload.act_gb / M
    gpipe = simulate_iteration(model, X, micro_batches=M).pipeline_s
    one_f_one_b = simulate_iteration(model, X, micro_batches=M, warmups=(1, 0)).pipeline_s
    assert gpipe == pytest.approx(2 * M * unit) and one_f_one_b == pytest.approx((M + 1) * unit)
    assert simulate_iteration(model, X, micro_batches=M, warmups=(M, M)).pipeline_s == pytest.approx(gpipe)
    fit = fitted_warmups(model, X, M, engine_syncs=False)
    assert fit.iteration_s == pytest.approx((M + 1) * unit) and fit.gpipe_s == pytest.approx(gpipe)
    assert fit.warmups is not None and fit.warmups[-1] == 0
    with pytest.raises(ValueError, match="may not warm up"):
        simulate_iteration(model, X, micro_batches=M, warmups=(0, 1))


def test_far_links_need_warm_ups_that_cover_their_round_trip():
    """Across a 100 ms hop a stage that may have only one micro-batch in flight waits a round
    trip for each: plain 1F1B is slower than GPipe there, the fitted warm-up is not."""
    X = np.arange(2).reshape(2, 1)
    M = 8
    d, bw = uniform(2, 100.0, gbps=0.05)
    model = CostModel(d, bw, spec_at(M).workload(2, 1))
    gpipe = simulate_iteration(model, X, micro_batches=M, window_messages=8).iteration_s
    plain = simulate_iteration(model, X, micro_batches=M, window_messages=8, warmups=(1, 0)).iteration_s
    fitted = fitted_warmups(model, X, M, 8).iteration_s
    assert plain > gpipe and fitted <= gpipe and fitted < plain
