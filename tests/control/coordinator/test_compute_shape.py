"""Each peer's compute in the scheduler (control/compute.py) and the shape search with spares
(`choose_shape`): the units a training peer reports are the simulator's, the shape leaves out
peers when that is faster, a slow peer gets no stage."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from machine_trace import alloc, start_op

from dtfm.control.compute import (GAUGE_SKIP_STEPS, ComputeGauge, MachineNow, peer_compute, pipeline_seqs, reference_block_flops,
                                  sched_spec, training_block_ms, with_fresh_compute,
                                  with_training_compute)
from dtfm.control.coordinator.reshape import reshape
from dtfm.control.planner import asked_start
from dtfm.control.coordinator.schedule import (choose_shape, compression_options_of, compute_busy_fraction, random_shape,
                                               shape_space)
from dtfm.gossip import NetworkView
from dtfm.sched import CostModel, FastestShape, ScheduleInputs, simulate_iteration
from dtfm.train import Plan, TrainConfig, get_compression, get_preset

SPEC = get_preset("tiny")
CFG = TrainConfig(global_batch_seqs=16, micro_batches=4)


def view_of(delay_ms: np.ndarray, compute_ms, bandwidth_gbps: float = 10.0) -> NetworkView:
    n = len(delay_ms)
    ids = tuple(bytes([k]) * 32 for k in range(n))
    bw = np.full((n, n), bandwidth_gbps)
    np.fill_diagonal(bw, np.inf)
    return NetworkView(ids, np.asarray(delay_ms, dtype=float), bw, np.asarray(compute_ms, dtype=float), True)


def two_sites(n: int, far_ms: float, near_ms: float = 0.5) -> np.ndarray:
    site = np.arange(n) % 2
    d = np.where(site[:, None] == site[None, :], near_ms, far_ms)
    np.fill_diagonal(d, 0.0)
    return d


def test_a_training_peers_figure_is_what_the_simulator_then_costs():
    """A peer that reports `training_block_ms` of its step's compute seconds is costed by the
    simulator at those seconds: the units round-trip (middle and last stage, any shape)."""
    for S, D, s in ((2, 2, 0), (2, 2, 1), (4, 1, 3), (1, 2, 0)):
        layers = SPEC.n_layer // S
        compute_s = 0.8
        ms = training_block_ms(SPEC, CFG, D, layers, s == S - 1, compute_s)
        n = S * D
        view = view_of(np.zeros((n, n)), np.full(n, ms))
        pc = peer_compute(view)
        assert pc.speeds.tolist() == [1.0] * n
        mspec = sched_spec(SPEC, CFG, D, reference_tflops=pc.reference_tflops)
        wl = mspec.workload(S, D)
        per_mb = wl.compute_layers(np.full(S, layers))[s] * wl.layer_compute_s
        assert math.isclose(per_mb * CFG.micro_batches, compute_s, rel_tol=1e-9)


def test_a_pipelines_own_sequences_are_counted_and_the_simulator_costs_the_largest():
    """16 sequences over 3 pipelines are 5, 5 and 6 (the trainer's split): a peer reports by
    its own pipeline's, and the simulator costs each pipeline at the largest's."""
    assert [pipeline_seqs(CFG, 3, d) for d in range(3)] == [5, 5, 6] and pipeline_seqs(CFG, 3) == 6
    per_seq_s = 0.1  # one peer's compute of one sequence through the whole model
    figures = [training_block_ms(SPEC, CFG, 3, SPEC.n_layer, True, per_seq_s * pipeline_seqs(CFG, 3, d), pipeline=d)
               for d in range(3)]
    assert figures[0] == pytest.approx(figures[2]) and figures[1] == pytest.approx(figures[2])  # one speed
    view = view_of(np.zeros((3, 3)), figures)
    inputs = peer_compute(view)
    wl = inputs.spec(SPEC, CFG, 3).workload(1, 3)
    r = simulate_iteration(CostModel(view.delay_ms, view.bandwidth_gbps, wl, compute=inputs.speeds),
                           np.array([[0, 1, 2]]), micro_batches=CFG.micro_batches)
    assert r.compute_busy_s == pytest.approx(6 * per_seq_s)


def test_the_coordinators_machine_is_timed_now_its_peers_ratios_kept():
    view = view_of(np.zeros((4, 4)), [10.0, 20.0, 40.0, 5.0])
    here, there = b"\x01" * 8, b"\x02" * 8
    view = replace(view, hosts=(here, here, there, b""))
    fresh = with_fresh_compute(view, here, 30.0)  # this machine's two peers: median 15 ms, now 30 ms
    assert fresh.compute_ms.tolist() == [20.0, 40.0, 40.0, 5.0]
    assert with_fresh_compute(view, b"", 30.0) is view and with_fresh_compute(view, there, math.nan) is view
    assert with_fresh_compute(view, b"\x03" * 8, 30.0) is view  # no peer of that machine


def test_a_reconfiguration_costs_idle_peers_no_faster_than_their_machines_training_peers():
    """Two peers of this machine trained and report 60 and 80 ms from their own steps; its idle
    peers' start-up probes (35 ms, 90 ms) said faster and slower: the faster is raised to the
    trained peers' median (70 ms), the slower kept. Another machine's idle peer, with no training
    peer there, and a peer without a host keep theirs; a view with no training peer is unchanged."""
    here, there = b"\x01" * 8, b"\x02" * 8
    view = view_of(np.zeros((6, 6)), [60.0, 80.0, 35.0, 90.0, 20.0, 10.0])
    view = replace(view, hosts=(here, here, here, here, there, b""),
                   compute_share=np.array([0.6, 0.8, np.nan, np.nan, np.nan, np.nan]))
    assert with_training_compute(view).compute_ms.tolist() == [60.0, 80.0, 70.0, 90.0, 20.0, 10.0]
    idle = replace(view, compute_share=np.full(6, np.nan))
    assert with_training_compute(idle) is idle


def test_a_figure_measured_in_training_beside_the_machines_other_peers_is_taken_at_a_whole_core():
    """Four peers of this machine trained (70 ms each, their compute at half a core: four stage
    threads on two cores), four did not (their start probe, 35 ms): one CPU, so all eight are
    scaled to the 30 ms timed now alike, and the contention is left to `MachineNow.slowdown`.
    A peer of another machine keeps its figure, share or not."""
    here, there = b"\x01" * 8, b"\x02" * 8
    view = view_of(np.zeros((9, 9)), [70.0] * 4 + [35.0] * 4 + [70.0])
    view = replace(view, hosts=(here,) * 8 + (there,), compute_share=np.array([0.5] * 4 + [np.nan] * 4 + [0.5]))
    fresh = with_fresh_compute(view, here, 30.0)
    assert fresh.compute_ms[:8] == pytest.approx([30.0] * 8) and fresh.compute_ms[8] == 70.0
    kept = replace(view, compute_share=np.full(9, np.nan))  # no share reported: the ratios stand
    assert with_fresh_compute(kept, here, 30.0).compute_ms[:8] == pytest.approx([40.0] * 4 + [20.0] * 4)



def test_the_peers_of_one_machine_computing_at_once_each_get_less_of_its_cores():
    alone = MachineNow(100.0, 0.45, 2)  # one busy thread got 0.45 of a core: 3.4 others share the 2
    assert alone.slowdown(1) == 1.0
    assert alone.slowdown(2) == pytest.approx((2 / 0.45 - 1 + 2) * 0.45 / 2)  # 1.23
    assert alone.slowdown(8) == pytest.approx((2 / 0.45 - 1 + 8) * 0.45 / 2)  # 2.57
    idle = MachineNow(10.0, 1.0, 2)  # a whole core: nothing else runs
    assert [idle.slowdown(k) for k in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    # stages that compute a quarter of each step: while one computes, 0.75 of the other three do
    assert idle.slowdown(4, 0.25) == 1.0 and idle.slowdown(8, 0.25) == pytest.approx((1 + 7 * 0.25) / 2)
    assert alone.slowdown(4, 0.25) == pytest.approx((2 / 0.45 + 0.75) * 0.45 / 2)
    with pytest.raises(ValueError):
        idle.slowdown(4, 1.5)
    # a share just below a whole core is partly the probe's own noise: the load read from it
    # fades to none at 1, not the cores - 1 threads a fair share would say
    near = MachineNow(10.0, 0.97, 2)
    assert near.slowdown(4) == pytest.approx(min(1, 2 / (1 + 0.3 * (2 / 0.97 - 1))) / (2 / (4 + 0.3 * (2 / 0.97 - 1))))
    assert MachineNow(10.0, 0.9999, 2).slowdown(4) == pytest.approx(2.0, rel=1e-3)  # (continuous at 1)
    assert MachineNow(10.0, 0.9, 2).slowdown(4) == pytest.approx((2 / 0.9 + 3) * 0.9 / 2)
    # computing slower, a stage computes for more of a step: the slowdown settles above the first round's
    once = idle.slowdown(8, 0.25)
    settled = idle.training_slowdown(8, 0.25)
    u = 0.25 * settled / (1 + 0.25 * (settled - 1))
    assert settled > once and settled == pytest.approx(idle.slowdown(8, u), rel=1e-6)
    assert idle.training_slowdown(4, 1.0) == 2.0 and idle.training_slowdown(1, 0.5) == 1.0
    for bad in ((0.0, 0.5, 2), (10.0, 0.0, 2), (10.0, 1.5, 2), (10.0, 0.5, 0), (math.nan, 0.5, 2)):
        with pytest.raises(ValueError):
            MachineNow(*bad)


def test_the_first_placement_times_this_machine_and_counts_its_placed_peers_competing():
    """Four peers of this machine, reported at 50 ms each, timed now at 100 ms with 0.5 of a
    core for one thread: the search runs on 100 ms figures, and again with the placed peers'
    slowdown; the plan handed out is the second's (its inputs say at what it costed them)."""
    from dtfm.control.config import PlaneConfig
    from dtfm.control.coordinator.request import TrainRequest
    from dtfm.control.planner import SchedulerPlanner

    here = b"\x01" * 8
    view = replace(view_of(np.zeros((4, 4)), np.full(4, 50.0)), hosts=(here,) * 4)
    machine = MachineNow(100.0, 0.5, 2)
    planner = SchedulerPlanner(replace(PlaneConfig.test(), schedule_time_s=0.2), fresh_compute=lambda: machine,
                               host=here)
    placement = planner.first_placement(view, TrainRequest(stages=4, dp=1), SPEC, CFG, {})
    assert placement.inputs is not None
    ms = reference_block_flops() / (placement.inputs.reference_tflops * 1e12) * 1e3
    # 4 placed (no link delay: each computes almost all of its step), as the first search found them
    roomy = SchedulerPlanner(replace(PlaneConfig.test(), schedule_time_s=0.2), host=here,
                             fresh_compute=lambda: MachineNow(100.0, 1.0, 64))  # (cores for all: no second search)
    first = roomy.first_placement(view, TrainRequest(stages=4, dp=1), SPEC, CFG, {})
    busy = compute_busy_fraction(with_fresh_compute(view, here, 100.0), first, SPEC, CFG)
    assert 0.5 < busy <= 1 and ms == pytest.approx(100.0 * machine.training_slowdown(4, busy))
    other = replace(view, hosts=(b"\x02" * 8,) * 4)  # peers of another machine: their figures stand
    placement = planner.first_placement(other, TrainRequest(stages=4, dp=1), SPEC, CFG, {})
    assert placement.inputs is not None
    assert reference_block_flops() / (placement.inputs.reference_tflops * 1e12) * 1e3 == pytest.approx(50.0)

    def broken() -> MachineNow:
        raise RuntimeError("the compute probe gave no figure")

    assert SchedulerPlanner(PlaneConfig.test(), fresh_compute=broken, host=here).machine_now(view) is None
    assert SchedulerPlanner(PlaneConfig.test(), fresh_compute=lambda: machine).machine_now(view) is None  # no host


def test_peer_compute_speeds_are_relative_to_the_median_and_unknown_is_the_median():
    pc = peer_compute(view_of(np.zeros((4, 4)), [10.0, 20.0, 40.0, np.nan]))
    assert pc.known == 3
    assert pc.speeds.tolist() == [2.0, 1.0, 0.5, 1.0]
    assert math.isclose(pc.reference_tflops, reference_block_flops() / 0.020 / 1e12)
    none = peer_compute(view_of(np.zeros((2, 2)), [np.nan, 0.0]))
    assert none.reference_tflops is None and none.speeds.tolist() == [1.0, 1.0]
    assert "not costed" in none.describe()


def test_the_gauge_leaves_out_an_epochs_first_steps_and_reports_the_median():
    g = ComputeGauge()
    out = [g.add((b"r", 1), v) for v in (100.0, 90.0, 10.0, 11.0, 12.0, 50.0)]
    assert out[:GAUGE_SKIP_STEPS + 2] == [None] * (GAUGE_SKIP_STEPS + 2)
    assert out[GAUGE_SKIP_STEPS + 2:] == [(11.0, None), (11.5, None)]
    assert g.add((b"r", 2), 5.0) is None  # a new epoch: its first steps are left out again
    assert g.add((b"r", 2), None) is None  # a step that says nothing adds nothing


def test_the_gauge_reports_the_median_share_of_a_core_when_every_step_kept_had_one():
    g = ComputeGauge()
    steps = [(100.0, 0.9), (90.0, 0.9), (70.0, 0.5), (72.0, 0.6), (68.0, 0.4)]
    out = [g.add((b"r", 1), v, share) for v, share in steps]
    assert out[-1] == (70.0, 0.5)
    assert g.add((b"r", 1), 71.0) == (70.5, None)  # a step without one: the share is not known


def test_shape_space_spans_every_pipeline_count_the_batch_allows():
    shapes = shape_space(8, SPEC, CFG)
    assert (1, 1) in shapes and (4, 2) in shapes and (2, 4) in shapes and (4, 1) in shapes
    assert all(SPEC.n_layer % S == 0 and S * D <= 8 and D <= CFG.global_batch_seqs // CFG.micro_batches
               for S, D in shapes)
    assert shape_space(8, SPEC, CFG, stages=2) == [(2, 4), (2, 3), (2, 2), (2, 1)]
    assert shape_space(8, SPEC, CFG, dp=2) == [(1, 2), (2, 2), (4, 2)]
    assert shape_space(8, SPEC, CFG, stages=3) == []
    assert shape_space(8, SPEC, CFG, stages=3, even_layers=False) == [(3, 2), (3, 1)]  # (the operator's count)
    # no peer's compute known (fewer peers would always look faster): the operator's stage
    # count at its widest; the scheduler's own choice at the widest of each count and one fewer;
    # a pipeline count the operator fixed, whatever the rest of the peers
    assert shape_space(8, SPEC, CFG, stages=2, compute_costed=False) == [(2, 4)]
    assert shape_space(8, SPEC, CFG, compute_costed=False) == [(1, 4), (1, 3), (2, 4), (2, 3), (4, 2), (4, 1)]
    assert shape_space(8, SPEC, CFG, dp=1, compute_costed=False) == [(1, 1), (2, 1), (4, 1)]


def test_far_apart_peers_train_on_one_site_and_the_rest_are_spares():
    """Across a 100 ms ocean a model this small is fastest on one site: the placement leaves
    the far site out, and its note says what every peer placed would have cost."""
    view = view_of(two_sites(8, far_ms=100.0), np.full(8, 30.0))
    p = choose_shape(view, SPEC, CFG, stages=None, dp=None, time_budget_s=0.5)
    placed = [view.peers.index(x) for pipe in p.pipelines for x in pipe]
    assert len({k % 2 for k in placed}) == 1  # one site
    assert len(p.spares) == 8 - len(placed) > 0
    assert "every peer placed" in p.shape_note and "spare" in p.shape_note
    full = [(S, D) for S, D in shape_space(8, SPEC, CFG) if S * D == 8]
    assert full
    # the prediction is the simulator's on the chosen allocation, faster than every peer placed
    m = float(p.shape_note.split("every peer placed")[1].split(")")[1].split()[0])
    assert p.predicted_iteration_s < m


def test_close_fast_peers_are_all_placed():
    """On one fast site with slow compute, spreading the model over every peer is fastest."""
    view = view_of(np.where(np.eye(8, dtype=bool), 0.0, 0.05), np.full(8, 200.0), bandwidth_gbps=100.0)
    p = choose_shape(view, SPEC, CFG, stages=None, dp=None, time_budget_s=0.5)
    assert len(p.layer_ranges) * len(p.pipelines) >= 6


@pytest.mark.parametrize("slow", [0, 3])
def test_a_peer_ten_times_slower_gets_no_stage(slow):
    compute = np.full(4, 50.0)
    compute[slow] = 500.0
    view = view_of(np.where(np.eye(4, dtype=bool), 0.0, 0.5), compute, bandwidth_gbps=100.0)
    p = choose_shape(view, SPEC, CFG, stages=None, dp=None, time_budget_s=0.5)
    assert view.peers[slow] in p.spares
    # asked for every peer (4 stages x 1), it still places it, with the simulator's honest prediction
    four = choose_shape(view, SPEC, CFG, stages=4, dp=1, time_budget_s=0.3)
    assert four.predicted_iteration_s > p.predicted_iteration_s


def test_the_shape_note_names_the_choice_the_full_shape_and_the_next():
    def note(tried, chosen, n):
        return FastestShape(SimpleNamespace(stages=chosen[0], dp=chosen[1]), 0.0, tuple(tried)).note(n)
    assert note([(1, 1, 0.2), (4, 2, 0.9), (2, 1, 0.3), (2, 4, 1.1)], (1, 1), 8) == (
        "1 x 1 (7 spares): predicted 0.200 s/step; every peer placed (4 x 2) 0.900 s; "
        "next 2 x 1 0.300 s (4 shapes tried)")
    assert note([(2, 2, 0.5)], (2, 2), 4) == "2 x 2: predicted 0.500 s/step (1 shape tried)"


def test_asked_stages_without_dp_search_every_pipeline_count():
    """--stages without --dp: the scheduler picks how many pipelines, spares allowed: across a
    100 ms ocean, 2 stages on one site, the other site's peers spares."""
    view = view_of(two_sites(8, far_ms=100.0), np.full(8, 30.0))
    p = choose_shape(view, SPEC, CFG, stages=2, dp=None, time_budget_s=0.5)
    placed = [view.peers.index(x) for pipe in p.pipelines for x in pipe]
    assert len(p.layer_ranges) == 2 and len({k % 2 for k in placed}) == 1 and len(p.spares) >= 4
    assert "every peer placed (2 x 4)" in p.shape_note


def test_a_compressed_run_is_shaped_by_time_to_loss_not_per_step():
    """A DP codec loses steps (DiLoCo: 0.8 of exact's progress per step), one pipeline has no
    DP group to lose them on: on this network 2 x 4 is the fastest per step, but 2 x 1 the
    fastest to the target loss, and a `slow-link` run gets 2 x 1; the note says why."""
    delay = np.full((8, 8), 20.0)
    np.fill_diagonal(delay, 0.0)
    view = view_of(delay, np.full(8, 10.0), bandwidth_gbps=1.0)
    opts = compression_options_of(get_compression("slow-link"))
    p = choose_shape(view, SPEC, CFG, stages=2, dp=None, time_budget_s=0.5, compression=opts)
    assert p.inputs.compression == opts  # what `dtfm-sched solve --view` replays
    found = p.inputs.solve(time_budget_s=0.5)
    per_step = {(S, D): t for S, D, t in found.tried}
    assert set(per_step) == {(2, 4), (2, 3), (2, 2), (2, 1)}
    assert {(S, D): e for S, D, e in found.efficiency} == {(2, 4): 0.8, (2, 3): 0.8, (2, 2): 0.8}
    assert min(per_step, key=per_step.__getitem__) != (2, 1)  # faster per step with more pipelines...
    assert len(p.pipelines) == 1 and len(p.spares) == 6  # ...but not to the loss
    assert per_step[(2, 1)] < min(t / 0.8 for (S, D), t in per_step.items() if D > 1)
    assert "per exact step at step efficiency 0.80" in p.shape_note


def test_a_compressed_runs_reconfiguration_weighs_time_to_loss_too():
    """The same network, a `slow-link` run of 2 x 1: growing to 2 x 4 is faster per step, but
    its DiLoCo groups would cost more steps than it saves; even when a reconfiguration must
    move (force), it stays one pipeline. Scores are the remaining steps' time to the target."""
    delay = np.full((8, 8), 20.0)
    np.fill_diagonal(delay, 0.0)
    view = view_of(delay, np.full(8, 10.0), bandwidth_gbps=1.0)
    cur = Plan(((view.peers[0], view.peers[1]),), ((0, 2), (2, 4)))
    plan = reshape(view, SPEC, CFG, current=cur, live=frozenset(view.peers), remaining_steps=1000,
                   time_budget_s=0.5, compression=compression_options_of(get_compression("slow-link")),
                   keep_stages=True, force=True)
    assert len(plan.placement.pipelines) == 1
    wider = [c for c in plan.candidates if c["shape"] != "2x1"]
    assert wider and min(c["predicted_s"] for c in wider) < plan.placement.predicted_iteration_s
    for c in plan.candidates:
        eff = 0.8 if c["shape"] != "2x1" else 1.0
        assert c["score"] == pytest.approx(c["predicted_s"] / eff * 1000 + c["move_s"])


def test_an_unmeasured_swarm_still_gets_a_shape():
    """No peer reported its compute: compute is not costed, and the note says so."""
    view = view_of(two_sites(4, far_ms=20.0), np.full(4, np.nan))
    p = choose_shape(view, SPEC, CFG, stages=2, dp=None, time_budget_s=0.3)
    assert len(p.layer_ranges) == 2 and len(p.pipelines) == 2
    assert "not costed" in p.shape_note


def test_random_shape_costs_compute_too():
    """The baseline allocation is predicted with the same compute: slower peers, slower step."""
    fast = random_shape(view_of(np.zeros((4, 4)), np.full(4, 10.0)), SPEC, CFG, stages=2, dp=2)
    slow = random_shape(view_of(np.zeros((4, 4)), np.full(4, 100.0)), SPEC, CFG, stages=2, dp=2)
    free = random_shape(view_of(np.zeros((4, 4)), np.full(4, np.nan)), SPEC, CFG, stages=2, dp=2)
    assert free.predicted_iteration_s < fast.predicted_iteration_s < slow.predicted_iteration_s
    assert math.isclose(slow.predicted_iteration_s - free.predicted_iteration_s,
                        10 * (fast.predicted_iteration_s - free.predicted_iteration_s), rel_tol=0.05)


def test_a_reconfiguration_searches_every_shape_unless_the_operator_fixed_the_stages():
    """With compute costed, a running 4 x 2 across an ocean is reshaped onto one site (other
    stage counts, spares); when the operator asked for 4 stages, the stage count stays."""
    view = view_of(two_sites(8, far_ms=100.0), np.full(8, 30.0))
    cur = Plan(tuple(tuple(view.peers[k] for k in pipe) for pipe in ((0, 1, 2, 3), (4, 5, 6, 7))),
               tuple((s, s + 1) for s in range(4)))
    live = frozenset(view.peers)
    free = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.5)
    assert free.kind == "restage" and len(free.placement.layer_ranges) < 4 and free.placement.spares
    placed = [view.peers.index(x) for pipe in free.placement.pipelines for x in pipe]
    assert len({k % 2 for k in placed}) == 1
    kept = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.5,
                   keep_stages=True)
    assert len(kept.placement.layer_ranges) == 4
    assert kept.placement.predicted_iteration_s > free.placement.predicted_iteration_s


def test_an_asked_pipeline_count_comes_back_when_the_peers_do():
    """A 2 x 2 run shrank to 2 x 1 when a peer died; on a slow network more pipelines cost more
    than they save, so with the peer back the scheduler keeps one pipeline and a spare... unless
    the operator asked for two (`--dp 2`): then it grows back to 2 x 2, the returned peers
    fetching their stages. Short of S x D live peers, the asked count is not forced."""
    view = view_of(np.full((4, 4), 5.0) - 5.0 * np.eye(4), np.full(4, 1.0), bandwidth_gbps=0.05)
    cur = Plan(((view.peers[0], view.peers[1]),), ((0, 2), (2, 4)))
    live = frozenset(view.peers)
    free = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.3,
                   keep_stages=True)
    assert len(free.placement.pipelines) == 1 and len(free.placement.spares) == 2
    asked = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.3,
                    keep_stages=True, keep_dp=2)
    assert len(asked.placement.pipelines) == 2 and not asked.placement.spares
    assert asked.placement.predicted_iteration_s > free.placement.predicted_iteration_s
    assert asked.moves and {c["shape"] for c in asked.candidates} == {"2x2"}
    # the planner reads the asked counts off the operator's signed start, which every allocation carries
    both = asked_start(alloc(operator_start=start_op(stages=2, dp=2).encode()))
    stages = asked_start(alloc(operator_start=start_op(stages=2).encode()))
    assert both is not None and (both.stages, both.dp) == (2, 2)
    assert stages is not None and (stages.stages, stages.dp) == (2, None)
    assert asked_start(alloc(operator_start=b"not a signed start")) is None
    three = frozenset(view.peers[:3])
    short = reshape(view, SPEC, CFG, current=cur, live=three, remaining_steps=1000, time_budget_s=0.3,
                    keep_stages=True, keep_dp=2)
    assert len(short.placement.pipelines) == 1


def test_an_asked_pipeline_count_is_the_only_shape_searched_and_gets_the_whole_budget(monkeypatch):
    """With `keep_dp` and enough live peers, the scheduler runs only for S x keep_dp (grow to it,
    reschedule at it): no search of other widths or stage counts takes a share of the budget
    only to be set aside."""
    from dtfm.control.coordinator import reshape as mod

    asked_shapes: list[tuple[int, int, float]] = []
    real = mod._Planner.schedule

    def schedule(self, peers, S, D, budget_s, initial=None, local=False):
        asked_shapes.append((S, D, budget_s))
        return real(self, peers, S, D, budget_s, initial=initial, local=local)

    monkeypatch.setattr(mod._Planner, "schedule", schedule)
    view = view_of(np.full((6, 6), 5.0) - 5.0 * np.eye(6), np.full(6, 1.0), bandwidth_gbps=0.05)
    cur = Plan(((view.peers[0], view.peers[1]),), ((0, 2), (2, 4)))
    live = frozenset(view.peers)
    free = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.3)
    assert {(S, D) for S, D, _ in asked_shapes} - {(2, 1), (2, 2), (2, 3)}  # other stage counts too
    asked_shapes.clear()
    asked = reshape(view, SPEC, CFG, current=cur, live=live, remaining_steps=1000, time_budget_s=0.3, keep_dp=2)
    assert {(S, D) for S, D, _ in asked_shapes} == {(2, 1), (2, 2)}  # the grow's new pipeline, the reschedules
    grow = [b for S, D, b in asked_shapes if D == 1]
    assert len(grow) == 1 and grow[0] == pytest.approx(0.3 / 3)  # one grow, two reschedules at 2 share it all
    assert {c["shape"] for c in asked.candidates} == {"2x2"} and len(asked.placement.pipelines) == 2
    assert len({c["shape"] for c in free.candidates}) > 1


def test_the_planner_asks_the_layer_probe_for_every_micro_batch_a_shape_may_use():
    from dtfm.control.config import PlaneConfig
    from dtfm.control.planner import SchedulerPlanner
    asked = []

    def probe(spec, batches):
        asked.append(batches)
        return {b: 1.5 for b in batches}

    planner = SchedulerPlanner(PlaneConfig.test(), kind_probe=probe)
    # D = 1..4: 4, 2, 1 (and 1) sequences, and the optimizer update (UPDATE_KIND, 0)
    assert planner.kind(SPEC, CFG, 8) == {0: 1.5, 1: 1.5, 2: 1.5, 4: 1.5}
    assert asked == [(0, 1, 2, 4)]

    def broken(spec, batches):
        raise RuntimeError("the layer probe failed")

    assert SchedulerPlanner(PlaneConfig.test(), kind_probe=broken).kind(SPEC, CFG, 8) == {}
    assert SchedulerPlanner(PlaneConfig.test()).kind(SPEC, CFG, 8) == {}


def test_the_inputs_a_placement_carries_replay_to_the_same_shape(tmp_path):
    """`dtfm-sched solve --view` replays the coordinator's search: the view file round-trips,
    and the same search on it chooses the same shape."""
    view = view_of(two_sites(8, far_ms=100.0), np.r_[np.full(4, 30.0), np.full(4, 60.0)])
    p = choose_shape(view, SPEC, CFG, stages=None, dp=None, time_budget_s=0.5, kind={4: 1.5, 2: 1.8})
    path = tmp_path / "view.json"
    path.write_text(p.inputs.to_json())
    back = ScheduleInputs.read(path)
    assert back.peers == tuple(x.hex() for x in view.peers) and back.kind == {2: 1.8, 4: 1.5}
    assert np.array_equal(back.delay_ms, view.delay_ms) and np.array_equal(back.speeds, p.inputs.speeds)
    assert back.chosen["note"] == p.shape_note
    again = back.solve(time_budget_s=0.5)
    assert (again.alloc.stages, again.alloc.dp) == (len(p.layer_ranges), len(p.pipelines))
    assert math.isclose(again.iteration_s, p.predicted_iteration_s, rel_tol=0.05)
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a dtfm view file"):
        ScheduleInputs.read(tmp_path / "bad.json")


def test_a_compressed_runs_view_file_replays_with_its_codecs(tmp_path, capsys):
    """A compressed run's first placement was searched knowing its codecs and their coding
    speeds: the view file keeps them, and the replay ranks the shapes as the coordinator did,
    by time to the target loss (2 x 4 is the fastest per step, 2 x 1 to the loss)."""
    from dtfm.sched import CodecSpeed
    from dtfm.sched.cli import main as sched_main
    delay = np.full((8, 8), 20.0)
    np.fill_diagonal(delay, 0.0)
    view = view_of(delay, np.full(8, 10.0), bandwidth_gbps=1.0)
    opts = replace(compression_options_of(get_compression("slow-link")),
                   peer_speeds=tuple(CodecSpeed(int4_encode_ns_per_elem=float(k)) for k in range(8)))
    p = choose_shape(view, SPEC, CFG, stages=2, dp=None, time_budget_s=0.5, compression=opts)
    path = tmp_path / "schedule.json"
    path.write_text(p.inputs.to_json())
    back = ScheduleInputs.read(path)
    assert back.compression == opts
    assert sched_main(["solve", "--view", str(path), "--time-budget", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stages"], out["dp"]) == (2, 1) == (len(p.layer_ranges), len(p.pipelines))
    assert "per exact step at step efficiency 0.80" in out["note"]
    assert math.isclose(out["simulated_iteration_s"], p.predicted_iteration_s, rel_tol=0.05)
    exact = choose_shape(view, SPEC, CFG, stages=2, dp=None, time_budget_s=0.5)
    assert exact.inputs.compression is None and "per exact step" not in exact.shape_note
    bad = json.loads(path.read_text())
    bad["compression"]["peer_speeds"] = bad["compression"]["peer_speeds"][:3]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="3 coding speeds for 8 peers"):
        ScheduleInputs.read(path)


def test_dtfm_sched_replays_a_view_file(tmp_path, capsys):
    from dtfm.sched.cli import main as sched_main
    view = view_of(two_sites(6, far_ms=80.0), np.full(6, 40.0))
    p = choose_shape(view, SPEC, CFG, stages=None, dp=None, time_budget_s=0.3)
    path = tmp_path / "schedule.json"
    path.write_text(p.inputs.to_json())
    assert sched_main(["solve", "--view", str(path), "--time-budget", "0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["stages"], out["dp"]) == (len(p.layer_ranges), len(p.pipelines))
    assert out["coordinator"]["note"] == p.shape_note and len(out["tried"]) == len(shape_space(6, SPEC, CFG))
    assert sched_main(["solve", "--view", str(path), "--time-budget", "0.3"]) == 0
    text = capsys.readouterr().out
    assert "shape: " in text and "the coordinator chose: " in text
    assert sched_main(["solve", "--view", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
