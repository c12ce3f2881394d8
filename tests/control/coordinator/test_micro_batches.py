"""The micro-batch count left to the scheduler (`--micro-batches auto`): the signed start says
"auto", the first placement and the reconfigurations choose M with the shape, the allocation
carries it, peers accept another M than the start's only for an auto start and within bounds,
and a stage rebuilt at another M is the same stage."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from machine_trace import CFG, OPERATORS, alloc, start_op

from dtfm.control import TrainError, TrainRequest, check_operator_start
from dtfm.control.compute import peer_compute
from dtfm.control.config import PlaneConfig
from dtfm.control.dataplane.config import CommConfig
from dtfm.control.coordinator.allocate import train_of
from dtfm.control.coordinator.reshape import reshape
from dtfm.control.coordinator.schedule import choose_shape
from dtfm.control.epoch.recovery import RecoveryError
from dtfm.control.epoch.relayout import assemble_stage
from dtfm.control.planner import SchedulerPlanner, asked_start
from dtfm.gossip import NetworkView
from dtfm.sched import (MAX_MICRO_BATCHES, TRAINER_WINDOW_MESSAGES, UPDATE_KIND, CostModel, micro_batch_options,
                        simulate_iteration)
from dtfm.train import (GPTSpec, LocalCluster, Plan, StageState, TrainConfig, TransferReceiver, encode_transfer,
                        get_preset, load_corpus, reference_state, reference_step, stage_from_tensors, stage_tensors)

SPEC = get_preset("tiny")
DATA = "ab" * 32
BASE = {"preset": "tiny", "steps": 10, "seed": 3, "data_hash": DATA, "data_name": "d"}
FIXED = TrainConfig(global_batch_seqs=16, micro_batches=4)


def view_of(one_way_ms: float, n: int = 4, compute_ms: float = 30.0) -> NetworkView:
    ids = tuple(bytes([k + 1]) * 32 for k in range(n))
    d = np.full((n, n), one_way_ms)
    np.fill_diagonal(d, 0.0)
    bw = np.full((n, n), 10.0)
    np.fill_diagonal(bw, np.inf)
    return NetworkView(ids, d, bw, np.full(n, compute_ms), True)


# ---- the signed start ------------------------------------------------------------------------------


def test_auto_is_signed_as_auto_and_a_count_given_exactly():
    auto = TrainRequest.from_args({**BASE, "micro_batches": "auto"})
    assert auto.auto_micro_batches and auto.config.micro_batches == TrainConfig().micro_batches
    assert auto.to_args()["micro_batches"] == "auto" and TrainRequest.from_args(auto.to_args()) == auto
    fixed = TrainRequest.from_args({**BASE, "micro_batches": 8})
    assert not fixed.auto_micro_batches and fixed.config.micro_batches == 8 and fixed.to_args()["micro_batches"] == 8
    plain = TrainRequest.from_args(BASE)  # no key: TrainConfig's count, fixed (what a start signed before auto)
    assert not plain.auto_micro_batches and "micro_batches" not in plain.to_args()
    # the search starts within what the batch allows
    small = TrainRequest.from_args({**BASE, "micro_batches": "auto", "global_batch_seqs": 2})
    assert small.config.micro_batches == 2 and small.auto_micro_batches
    # (and for the asked pipelines: a random placement runs the count the search starts at)
    wide = TrainRequest.from_args({**BASE, "micro_batches": "auto", "stages": 1, "dp": 8, "placement": "random"})
    assert wide.config.micro_batches == 2 and TrainRequest.from_args(wide.to_args()) == wide
    with pytest.raises(TrainError, match="too small for 8 pipelines"):
        TrainRequest.from_args({**BASE, "micro_batches": "auto", "global_batch_seqs": 4, "stages": 1, "dp": 8})
    with pytest.raises(TrainError, match="micro_batches must be an integer"):
        TrainRequest.from_args({**BASE, "micro_batches": "many"})


AUTO_STARTS = [
    # (what, the start's knobs, the allocation's TrainConfig (2 pipelines), refused)
    ("a fixed start, its count", {}, CFG, False),
    ("a fixed start, another count", {}, dataclasses.replace(CFG, micro_batches=4), True),
    ("an auto start, the scheduler's count", {"micro_batches": "auto"}, dataclasses.replace(CFG, micro_batches=1), False),
    ("an auto start, one sequence per micro-batch", {"micro_batches": "auto"}, dataclasses.replace(CFG, micro_batches=4),
     False),
    ("an auto start, the bound", {"micro_batches": "auto", "global_batch_seqs": 512},
     dataclasses.replace(CFG, global_batch_seqs=512, micro_batches=MAX_MICRO_BATCHES), False),
    ("an auto start, past the bound", {"micro_batches": "auto", "global_batch_seqs": 512},
     dataclasses.replace(CFG, global_batch_seqs=512, micro_batches=MAX_MICRO_BATCHES + 1), True),
    ("an auto start, another knob", {"micro_batches": "auto"}, dataclasses.replace(CFG, micro_batches=1, lr=0.5), True),
]


@pytest.mark.parametrize("what, knobs, train, refused", AUTO_STARTS, ids=[k[0] for k in AUTO_STARTS])
def test_peers_accept_another_count_only_from_an_auto_start_and_within_bounds(what, knobs, train, refused):
    a = alloc(train=train, operator_start=start_op(**knobs).encode())
    refusal = check_operator_start(a, OPERATORS)
    if not refused:
        assert refusal is None
        asked = asked_start(a)
        assert asked is not None and asked.auto_micro_batches == ("micro_batches" in knobs)
    else:
        assert refusal is not None and refusal.code == "no-operator"
        assert ("micro_batches" if "lr" not in what and "knob" not in what else "lr") in refusal.reason


def test_an_allocation_whose_count_leaves_a_micro_batch_without_a_sequence_does_not_exist():
    """(checked before any start is: `Allocation` refuses it, and so does its decoder)"""
    with pytest.raises(ValueError, match="every micro-batch needs a sample"):
        alloc(train=dataclasses.replace(CFG, micro_batches=5), operator_start=start_op(micro_batches="auto").encode())


# ---- the first placement -----------------------------------------------------------------------------


def test_the_first_placement_chooses_the_count_and_the_allocation_carries_it():
    view = view_of(100.0)
    fixed = choose_shape(view, SPEC, FIXED, stages=4, dp=1, time_budget_s=0.3)
    assert fixed.micro_batches is None and train_of(FIXED, fixed) is FIXED
    assert "micro-batch" not in fixed.shape_note
    auto = choose_shape(view, SPEC, FIXED, stages=4, dp=1, time_budget_s=0.3, auto_micro_batches=True)
    assert auto.micro_batches in micro_batch_options(16, 1)
    assert f"{auto.micro_batches} micro-batch" in auto.shape_note
    assert train_of(FIXED, auto) == dataclasses.replace(FIXED, micro_batches=auto.micro_batches)
    assert auto.inputs is not None and auto.inputs.chosen["micro_batches"] == auto.micro_batches
    # the prediction is the simulator's at the chosen count, the fastest of them on this placement
    X = np.array([[view.peers.index(p) for p in pipe] for pipe in auto.pipelines]).T
    pc = peer_compute(view)

    def predicted(m: int) -> float:
        model = CostModel(auto.inputs.delay_ms, auto.inputs.bandwidth_gbps,
                          pc.spec(SPEC, dataclasses.replace(FIXED, micro_batches=m), 1).workload(4, 1),
                          compute=pc.speeds)
        return float(simulate_iteration(model, X, micro_batches=m, engine_syncs=True,
                                        window_messages=TRAINER_WINDOW_MESSAGES).iteration_s)

    times = {m: predicted(m) for m in micro_batch_options(16, 1)}
    assert math.isclose(auto.predicted_iteration_s, times[auto.micro_batches], rel_tol=1e-9)
    assert auto.micro_batches == min(times, key=times.get)
    assert auto.predicted_iteration_s <= fixed.predicted_iteration_s * (1 + 1e-9)


def test_the_planner_probes_the_layer_at_every_micro_batch_an_auto_run_may_use():
    asked = []

    def probe(spec, batches):
        asked.append(batches)
        return {b: 1.0 for b in batches}

    planner = SchedulerPlanner(PlaneConfig.test(), kind_probe=probe)
    planner.kind(SPEC, FIXED, 4)
    planner.kind(SPEC, FIXED, 4, auto_micro_batches=True)
    # fixed M = 4, D = 1..4: 4, 2, 1 (and 1); auto, D = 1..4 and every divisor count: 3 pipelines
    # of one micro-batch run 5 sequences at a time; and the optimizer's update (UPDATE_KIND) each time
    assert asked == [(UPDATE_KIND, 1, 2, 4), (UPDATE_KIND, 1, 2, 4, 5, 8, 16)]


# ---- reconfigurations ---------------------------------------------------------------------------------


def test_a_reconfiguration_keeps_a_fixed_count_and_chooses_an_auto_one():
    view = view_of(100.0, n=5)
    cur = Plan(((view.peers[0], view.peers[1]), (view.peers[2], view.peers[3])), ((0, 2), (2, 4)))
    live = frozenset(view.peers) - {view.peers[3]}  # a peer of pipeline 1 died
    kept = reshape(view, SPEC, FIXED, current=cur, live=live, remaining_steps=100, time_budget_s=0.3)
    assert kept.placement.micro_batches is None and {c["micro_batches"] for c in kept.candidates} == {4}
    auto = reshape(view, SPEC, FIXED, current=cur, live=live, remaining_steps=100, time_budget_s=0.3,
                   auto_micro_batches=True)
    chosen = next(c for c in auto.candidates if c["chosen"])
    assert auto.placement.micro_batches == chosen["micro_batches"]
    D = len(auto.placement.pipelines)
    assert auto.placement.micro_batches in set(micro_batch_options(16, D)) | {4}
    assert auto.placement.predicted_iteration_s <= kept.placement.predicted_iteration_s * (1 + 1e-9)
    # across 100 ms links a count past the window pays round trips: no candidate takes one
    assert all(c["micro_batches"] <= TRAINER_WINDOW_MESSAGES for c in auto.candidates)


# ---- the stage at another count ---------------------------------------------------------------------


def test_a_stage_trained_at_one_count_is_rebuilt_at_another_and_nothing_else_changes():
    """A part offered at M = 4 is assembled into a stage of a run now at M = 8 (relayout's
    check ignores the count, nothing else); a part of another learning rate is refused."""
    cfg4, cfg8 = dataclasses.replace(CFG, micro_batches=4), dataclasses.replace(CFG, micro_batches=2)
    old = StageState(SPEC, cfg4, (0, 2))
    old.step = old.optim.step_count = 3
    manifest, chunks = encode_transfer(old, 1 << 16)

    def part() -> TransferReceiver:
        r = TransferReceiver(manifest)
        for i, c in enumerate(chunks):
            r.feed(i, c)
        return r

    new = assemble_stage(SPEC, cfg8, (0, 2), [part()], 3, 3)
    assert new.cfg == cfg8 and new.step == 3
    for n, p in old.params.items():
        assert torch.equal(new.params[n], p)
    with pytest.raises(RecoveryError, match="another model, config or step"):
        assemble_stage(SPEC, dataclasses.replace(cfg8, lr=0.5), (0, 2), [part()], 3, 3)
    # the daemon's own copy is rebuilt the same way (control/epoch/stages.py `_on_device`)
    again = stage_from_tensors(SPEC, cfg8, (0, 2), stage_tensors(old), 3, 3)
    assert again.cfg == cfg8 and all(torch.equal(again.params[n], p) for n, p in old.params.items())


# ---- the math of a step -----------------------------------------------------------------------------


def test_a_run_whose_count_changes_between_epochs_trains_the_single_process_model():
    """2 steps at M = 4, then every stage rebuilt at M = 8 as a peer does for an epoch at the new
    count, 3 more: the losses and the weights are the single-process run's (the step's batch
    and its gradient are the global batch's whatever M), and the step count runs on."""
    spec = GPTSpec("oracle", n_layer=4, n_embd=32, n_head=4, seq_len=16)
    cfg4 = TrainConfig(global_batch_seqs=16, micro_batches=4, lr=3e-3, comm_timeout_s=20.0)
    cfg8 = dataclasses.replace(cfg4, micro_batches=8)
    corpus = load_corpus(max_bytes=256 << 10)
    ref = reference_state(spec, cfg4)
    want = [reference_step(ref, corpus) for _ in range(5)]
    plan = Plan.grid(4, 2, 2)
    with LocalCluster(spec, cfg4, plan, corpus) as cl:
        got = cl.run(2)
        cl.settle()
        states = {p: stage_from_tensors(spec, cfg8, st.layer_range, stage_tensors(st), st.step, st.optim.step_count)
                  for p, st in cl.states.items()}
    with LocalCluster(spec, cfg8, plan, corpus, states=states) as cl:
        assert cl.step_index == 2
        got += cl.run(3)
        params = {n: p.detach() for peer in plan.pipeline(0) for n, p in cl.states[peer].params.items()}
        assert cl.step_index == 5
    assert got == pytest.approx(want, rel=1e-5)
    names = sorted(ref.params)
    w = torch.cat([ref.params[n].detach().reshape(-1) for n in names])
    g = torch.cat([params[n].reshape(-1) for n in names])
    assert float((g - w).norm() / w.norm()) <= 1e-5


def test_the_simulators_window_is_the_data_planes_and_the_view_file_keeps_the_swarms():
    assert TRAINER_WINDOW_MESSAGES == CommConfig().window_messages
    view = view_of(100.0)
    small = choose_shape(view, SPEC, FIXED, stages=4, dp=1, time_budget_s=0.3, auto_micro_batches=True,
                         window_messages=CommConfig.test().window_messages)
    assert small.inputs is not None and small.inputs.window_messages == 4
    assert small.micro_batches <= 4  # past a window of 4, every micro-batch across 100 ms pays round trips
