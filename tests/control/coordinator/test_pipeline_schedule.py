"""The pipeline schedule the coordinator hands out (control/coordinator/schedule.py
`fit_schedule`): on links where a step is bandwidth-bound, 1F1B with warm-ups fitted to each
hop's round trip, so gradients flow back while activations still flow forward; its prediction
is the simulator's under that schedule; `pipeline_schedule = "gpipe"` keeps the paper's."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
from machine_trace import start_op

from dtfm.control import Allocation
from dtfm.control.compute import peer_compute
from dtfm.control.config import PlaneConfig
from dtfm.control.coordinator.allocate import train_of
from dtfm.control.coordinator.request import TrainRequest
from dtfm.control.planner import SchedulerPlanner
from dtfm.gossip import NetworkView
from dtfm.sched import CostModel, fitted_warmups, simulate_iteration
from dtfm.train import PRESETS, TrainConfig

SPEC = PRESETS["tiny"]
CFG = TrainConfig(global_batch_seqs=16, micro_batches=8)


def line_view(delay_ms: float = 40.0, gbps: float = 0.02) -> NetworkView:
    """Four peers, every link slow and far: a 4-stage pipeline over them is bandwidth-bound."""
    n = 4
    ids = tuple(bytes([k + 1]) * 32 for k in range(n))
    d = np.full((n, n), delay_ms)
    np.fill_diagonal(d, 0.0)
    bw = np.full((n, n), gbps)
    np.fill_diagonal(bw, np.inf)
    return NetworkView(ids, d, bw, np.full(n, 30.0), True)


def planner(schedule: str = "fitted") -> SchedulerPlanner:
    return SchedulerPlanner(replace(PlaneConfig.test(), schedule_time_s=0.3, pipeline_schedule=schedule))


def test_a_bandwidth_bound_pipeline_gets_1f1b_fitted_to_its_links_and_is_predicted_faster():
    view = line_view()
    req = TrainRequest(stages=4, dp=1)
    fitted = planner().first_placement(view, req, SPEC, CFG, {})
    gpipe = planner("gpipe").first_placement(view, req, SPEC, CFG, {})
    assert gpipe.warmups is None and fitted.pipelines == gpipe.pipelines
    w = fitted.warmups
    assert w is not None and len(w) == 4 and w[-1] == 0 and list(w) == sorted(w, reverse=True)
    assert w != (CFG.micro_batches,) * 4  # (not GPipe)
    assert fitted.predicted_iteration_s < 0.85 * gpipe.predicted_iteration_s
    # the allocation carries it, signed, in its training config; every peer reads the same counts
    cfg = train_of(CFG, fitted)
    assert cfg.warmups(4) == w and train_of(CFG, gpipe) == CFG
    a = Allocation(epoch=1, term=1, issuer=fitted.pipelines[0][0], run_id=bytes(16), pipelines=fitted.pipelines,
                   layer_ranges=fitted.layer_ranges, preset="tiny", model=SPEC, train=cfg,
                   data_hash=hashlib.sha256(b"d").hexdigest(), data_name="d", start_step=0, end_step=10)
    assert Allocation.decode(a.encode()).train.warmups(4) == w
    # a reconfiguration fits its own (here the same pipeline again)
    a = replace(a, operator_start=start_op(stages=4, dp=1).encode())
    nxt = planner().reshape(view, a, live=frozenset(view.peers), remaining_steps=100, regions={}, seed=1, force=True)
    assert nxt.placement.warmups is not None and nxt.placement.warmups[-1] == 0


def test_the_fitted_schedule_is_the_simulators_fastest_of_those_it_tries_and_never_slower_than_gpipe():
    view = line_view()
    X = np.arange(4)[:, None]
    pc = peer_compute(view)
    model = CostModel(np.asarray(view.delay_ms), np.asarray(view.bandwidth_gbps),
                      pc.spec(SPEC, CFG, 1).workload(4, 1), compute=pc.speeds)
    gpipe = simulate_iteration(model, X, micro_batches=8, engine_syncs=True, window_messages=8).iteration_s
    w, t, g = fitted_warmups(model, X, 8, 8)
    assert w is not None and t == simulate_iteration(model, X, micro_batches=8, engine_syncs=True, window_messages=8,
                                                     warmups=w).iteration_s
    assert t < gpipe == g and w != (8,) * 4
    # on links with no latency and endless bandwidth no order beats GPipe's, which it then keeps
    fast = CostModel(np.zeros((4, 4)), np.full((4, 4), np.inf), pc.spec(SPEC, CFG, 1).workload(4, 1),
                     compute=pc.speeds)
    assert fitted_warmups(fast, X, 8, 8).warmups is None


def test_dtfm_sched_replays_the_coordinators_schedule_from_its_view_file(tmp_path, capsys):
    """`dtfm-sched solve --view FILE` fits the schedule to the replayed allocation as the
    coordinator did: the same warm-ups and prediction."""
    import json

    from dtfm.sched.cli import main as sched_main
    view = line_view()
    fitted = planner().first_placement(view, TrainRequest(stages=4, dp=1), SPEC, CFG, {})
    assert fitted.inputs is not None and fitted.warmups is not None
    path = tmp_path / "schedule.json"
    path.write_text(fitted.inputs.to_json())
    assert sched_main(["solve", "--view", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline_warmups"] == list(fitted.warmups)
    assert out["scheduled_iteration_s"] == pytest.approx(fitted.predicted_iteration_s, rel=1e-9)
    assert out["scheduled_iteration_s"] < out["simulated_iteration_s"]
    assert sched_main(["solve", "--view", str(path)]) == 0
    assert f"pipeline schedule: 1F1B with warm-ups {fitted.warmups_text()}" in capsys.readouterr().out


def test_the_first_placement_and_a_reconfiguration_rank_shapes_under_their_fitted_schedules():
    """On links where one stage computes about as fast as two stages split by a slow link in
    GPipe, 1F1B makes the two-stage pipeline faster: the fitted swarm's scheduler ranks shapes
    under the schedule each would run and takes two stages, where the paper's GPipe keeps one;
    a forced reconfiguration weighs its candidates the same way. A gain within the simulator's
    error (`SCHEDULE_MARGIN`) leaves GPipe's choice."""
    req = TrainRequest()
    close = line_view(5.0, 0.1)  # (two stages in 1F1B predicted 7 % faster than one)
    kept = planner().first_placement(close, req, SPEC, CFG, {})
    assert len(kept.layer_ranges) == 1 and "schedules fitted" in kept.shape_note
    view = line_view(5.0, 0.15)  # (... and 24 % faster here)
    gpipe = planner("gpipe").first_placement(view, req, SPEC, CFG, {})
    fitted = planner().first_placement(view, req, SPEC, CFG, {})
    assert len(gpipe.layer_ranges) == 1 and gpipe.warmups is None
    assert len(fitted.layer_ranges) == 2 and fitted.warmups is not None
    assert fitted.predicted_iteration_s < gpipe.predicted_iteration_s
    assert "in 1F1B (GPipe" in fitted.shape_note and "schedules fitted" in fitted.shape_note
    # the shape search's GPipe figure of the two stages was above one stage's: the schedule decided
    assert fitted.inputs is not None and gpipe.inputs is not None and fitted.inputs.fit_schedules
    by_gpipe = dict(((s, d), t) for s, d, t in replace(fitted.inputs, fit_schedules=False).solve().tried)
    assert by_gpipe[(2, 1)] > by_gpipe[(1, 1)]

    # a run on the GPipe placement, reconfigured by force: the fitted planner moves it to two stages
    a = Allocation(epoch=1, term=1, issuer=gpipe.pipelines[0][0], run_id=bytes(16), pipelines=gpipe.pipelines,
                   layer_ranges=gpipe.layer_ranges, preset="tiny", model=SPEC, train=train_of(CFG, gpipe),
                   data_hash=hashlib.sha256(b"d").hexdigest(), data_name="d", start_step=0, end_step=1000,
                   operator_start=start_op().encode())
    live = frozenset(view.peers)
    by_fit = planner().reshape(view, a, live=live, remaining_steps=1000, regions={}, seed=1, force=True)
    by_paper = planner("gpipe").reshape(view, a, live=live, remaining_steps=1000, regions={}, seed=1, force=True)
    assert len(by_paper.placement.layer_ranges) == 1
    assert len(by_fit.placement.layer_ranges) == 2 and by_fit.placement.warmups is not None
    chosen = next(c for c in by_fit.candidates if c["chosen"])
    assert chosen["pipeline_warmups"] == by_fit.placement.warmups
    assert chosen["predicted_s"] == pytest.approx(by_fit.placement.predicted_iteration_s, rel=1e-9)
