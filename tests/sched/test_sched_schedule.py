"""Pipeline schedules of the 1F1B family in the simulator (sched/simulate.py): each stage's
order of forwards and backwards (`stage_program`), the merged order (`stage_order`), the
warm-up counts' checks, and what a schedule buys on a link that is busy both ways."""

from __future__ import annotations

import numpy as np
import pytest
from dataclasses import replace

from test_sched_micro import KIND, TINY, spec_at, uniform

from dtfm.sched import (SCHEDULE_GAIN_BOUND, CostModel, ScheduleInputs, check_warmups, fit_in_order, fitted_warmups,
                        simulate_iteration, stage_program)
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


def four_peers(one_way_ms: float = 5.0, gbps: float = 0.05, tflops: float = 0.05) -> ScheduleInputs:
    """Four peers on equal links, one pipeline of any stage count, eight micro-batches."""
    d, bw = uniform(4, one_way_ms, gbps)
    return ScheduleInputs(tuple(str(i) for i in range(4)), ("",) * 4, d, bw, np.ones(4), tflops, KIND,
                          replace(TINY, micro_batches=8), stages=None, dp=1, time_budget_s=0.3)


def test_shapes_are_ranked_under_the_schedule_fitted_to_each():
    """One stage beats two split by a slow link in GPipe, which pays the link's transfers one
    way and then the other; with each shape's fitted 1F1B the two stages win, and the result
    names their schedule: what the simulator gives under it, and the GPipe figure beside it."""
    inputs = four_peers()
    paper = inputs.solve()
    found = replace(inputs, fit_schedules=True).solve()
    assert (paper.alloc.stages, paper.alloc.dp) == (1, 1) and not paper.scheduled and paper.warmups is None
    assert (found.alloc.stages, found.alloc.dp) == (2, 1) and found.warmups is not None
    X = found.alloc.matrix
    model = CostModel(inputs.delay_ms, inputs.bandwidth_gbps, inputs.spec_of(1).workload(2, 1), compute=inputs.speeds)
    fit = fitted_warmups(model, X, 8, inputs.window_messages)
    assert found.warmups == fit.warmups and found.scheduled_s == fit.iteration_s
    assert found.iteration_s == fit.gpipe_s > paper.iteration_s > found.scheduled_s
    # GPipe's winner was fitted too (one stage has no schedule to change), and lost
    assert (1, 1, 8, paper.iteration_s, None) in found.scheduled
    assert found.note(4).startswith(f"2 x 1 (2 spares): predicted {fit.iteration_s:.3f} s/step in 1F1B "
                                    f"(GPipe {fit.gpipe_s:.3f} s)")
    assert "schedules fitted" in found.note(4) and "schedules fitted" not in paper.note(4)


def test_a_view_file_says_how_its_shapes_were_ranked(tmp_path):
    """The inputs' file keeps whether shapes were ranked under fitted schedules; a file that
    does not say (written before) replays GPipe's ranking; a value it cannot be is refused."""
    import json

    inputs = replace(four_peers(), fit_schedules=True)
    path = tmp_path / "view.json"
    path.write_text(inputs.to_json())
    assert ScheduleInputs.read(path).fit_schedules is True
    d = json.loads(inputs.to_json())
    del d["pipeline_schedule"]
    path.write_text(json.dumps(d))
    assert ScheduleInputs.read(path).fit_schedules is False
    d["pipeline_schedule"] = "zigzag"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="pipeline_schedule"):
        ScheduleInputs.read(path)


def test_candidates_are_fitted_in_order_while_a_schedule_could_still_make_them_win():
    """The first is always fitted; the next while its GPipe time is below the bound times the
    best fitted so far; past `always`, only before the deadline."""
    asked: list[int] = []

    def fit(i: int) -> float:
        asked.append(i)
        return [1.0, 0.9, 3.0, 5.0][i]

    gpipe = [1.5, 1.6, 1.7, 0.9 * SCHEDULE_GAIN_BOUND]
    assert fit_in_order(gpipe, fit) == [1.0, 0.9, 3.0] and asked == [0, 1, 2]  # (the 4th: at the bound)
    asked.clear()
    assert fit_in_order(gpipe, fit, deadline_s=0.0) == [1.0] and asked == [0]  # (the deadline passed)
    asked.clear()
    assert fit_in_order(gpipe, fit, deadline_s=0.0, always=2) == [1.0, 0.9] and asked == [0, 1]
