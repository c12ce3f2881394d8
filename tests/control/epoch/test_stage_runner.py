"""The stage runner (control/epoch/runner.py): one peer's stage stepped in a worker thread,
its checkpoints written with the step reports of the steps they hold."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import trio
from stage_replicas import CFG, CORPUS, PEERS, SPEC, run_replicas, steps

from dtfm.control.epoch.runner import (COMM_TIMEOUT_MAX_S, COMM_TIMEOUT_STEPS, REPORTS_NOTE, RunEnd, StageRunner,
                                      StepReport, comm_timeout_for, end_checkpoint_due, params_sha256)
from dtfm.net import ProtocolError
from dtfm.train import (Corpus, InMemoryHub, Plan, StageState, checkpoint_notes,
                        list_checkpoints, load_checkpoint, parse_compression, run_step, stage_tensors)



@pytest.mark.parametrize("end, level", [
    (RunEnd(99, "finished", False), logging.INFO),
    (RunEnd(57, "stopped", False), logging.INFO),
    # the swarm heals these by itself: a peer died, or the coordinator aborted the step to
    # reconfigure (the walkthrough's healthy peer logged this at ERROR on every heal)
    (RunEnd(25, "peer b846add1 failed while this peer waited for the data-parallel gradient sync of step 27 "
            "(epoch 1): connection lost", True),
     logging.WARNING),
    (RunEnd(25, "communicator closed while waiting for the data-parallel gradient sync of step 27 (epoch 1) "
                "from 5c2ac64c: aborted for a "
                "reconfiguration", True), logging.WARNING),
    (RunEnd(-1, "step 0 failed on this peer: MemoryError", True, on_this_peer=True), logging.ERROR),
])
def test_an_epoch_ended_by_another_peer_is_a_warning_one_ended_by_this_peers_own_failure_an_error(end, level):
    assert end.log_level == level


def test_a_checkpoint_keeps_the_reports_of_the_steps_it_holds(tmp_path):
    # One peer holds the whole model (1 x 1): it runs steps 2-5 of epoch 4 after epochs whose
    # reports it kept (history), and checkpoints every 2 steps. Each checkpoint holds the
    # reports of the steps before it, the earlier epochs' ones included, at most `keep_reports`.
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=4)
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    state.step = 2
    history = [StepReport(3, s, 9.0, 0.1, 0.05, 0.03, 0.02) for s in range(2)]
    seen: list[StepReport] = []
    runner = StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=6,
                         checkpoint_every=2, checkpoint_dir=tmp_path, on_step=seen.append, history=history,
                         keep_reports=4)
    end = trio.run(runner.run)
    assert (end.completed, end.reason, end.failed) == (5, "finished", False)
    assert [(r.epoch, r.step) for r in seen] == [(4, 2), (4, 3), (4, 4), (4, 5)]
    assert all(r.loss is not None for r in seen)  # the last stage: it computes the loss
    first, second = list_checkpoints(tmp_path, (0, SPEC.n_layer))
    assert load_checkpoint(first).step == 4 and load_checkpoint(second).step == 6
    held = [StepReport.from_wire(w) for w in checkpoint_notes(first)[REPORTS_NOTE]]
    assert held == [*history, *seen[:2]]
    held = [StepReport.from_wire(w) for w in checkpoint_notes(second)[REPORTS_NOTE]]
    assert held == seen  # the four newest


def test_the_heap_is_given_back_every_few_dozen_steps_and_where_the_run_ends_not_after_every_step(monkeypatch):
    # A return of the C heap's free pages after every step made the next step fault each page
    # of its small tensors in again (a 1 x 1 `tiny` step 20-30 % slower in a daemon than in one
    # process). The runner gives them back every HEAP_RELEASE_STEPS steps and where the run ends.
    import dtfm.control.epoch.runner as runner_mod

    given: list[int] = []
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    monkeypatch.setattr(runner_mod, "release_heap", lambda: given.append(state.step) or True)
    monkeypatch.setattr(runner_mod, "HEAP_RELEASE_STEPS", 3)
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=1)
    runner = StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=7)
    end = trio.run(runner.run)
    assert (end.completed, end.failed) == (6, False)
    assert given == [3, 6, 7]  # after steps 0-2 and 3-5, and once the run ended


def test_the_heap_is_given_back_once_where_a_release_and_the_runs_end_meet(monkeypatch, tmp_path):
    """A run ending on the step of a periodic release, or with its end checkpoint (which gives
    the heap back itself), does not give it back twice."""
    import dtfm.control.epoch.runner as runner_mod

    given: list[int] = []
    monkeypatch.setattr(runner_mod, "HEAP_RELEASE_STEPS", 3)
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=1)
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    monkeypatch.setattr(runner_mod, "release_heap", lambda: given.append(state.step) or True)
    end = trio.run(StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=6).run)
    assert end.completed == 5 and given == [3, 6]
    given.clear()
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    end = trio.run(StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=2,
                               checkpoint_dir=tmp_path).run)
    assert end.completed == 1 and given == [2]  # the end checkpoint's release, not the end's again


def test_an_error_of_this_peers_own_ends_the_run_not_the_daemon(tmp_path):
    # A step that fails on this peer for its own reason (here a data set too short for a
    # sequence; out of memory alike) ends the run as failed, with the reason, and leaves the
    # stage as it was: the coordinator reconfigures; before, the error ended the daemon.
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=1)
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    before = params_sha256(state)
    short = Corpus(np.zeros(SPEC.seq_len // 2, dtype=np.uint8), "short.txt")
    runner = StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), short, end_step=3)
    end = trio.run(runner.run)
    assert (end.completed, end.failed) == (-1, True)
    assert "step 0 failed on this peer: ValueError" in end.reason and "too few" in end.reason
    assert end.log_level == logging.ERROR
    assert state.step == 0 and params_sha256(state) == before == end.params_sha256


@pytest.mark.parametrize("reason, final_stop, step, saved, due", [
    ("finished", False, 10, None, True),  # the run's last step: kept
    ("finished", False, 10, 10, False),  # a periodic checkpoint saved that step already
    ("finished", False, 10, 8, True),
    ("stopped", True, 7, None, True),  # an operator's stop: kept where it ends
    ("stopped", True, 7, 7, False),
    ("stopped", False, 7, None, False),  # a reconfiguration's stop: the stage stays in memory
    ("stopped", True, 0, None, False),  # stopped before any step: nothing trained to keep
])
def test_which_ends_are_checkpointed(reason, final_stop, step, saved, due):
    assert end_checkpoint_due(reason, final_stop=final_stop, step=step, saved_step=saved) is due


def _runner(tmp_path, end_step, on_step=None):
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=1)
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    return StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=end_step,
                       checkpoint_every=0, checkpoint_dir=tmp_path, on_step=on_step)


@pytest.mark.parametrize("final", [True, False])
def test_an_operator_stop_is_checkpointed_at_the_boundary_where_the_run_ends(tmp_path, final):
    # No periodic checkpoints (0); stopped after step 2 completed, before step 3: an operator's
    # stop saves step 3 (the weights after steps 0-2), a reconfiguration's stop saves nothing.
    runner = _runner(tmp_path, 50, on_step=lambda rep: runner.stop_at(3, final=final) if rep.step == 1 else None)
    end = trio.run(runner.run)
    assert (end.completed, end.reason, end.failed) == (2, "stopped", False)
    saved = list_checkpoints(tmp_path, (0, SPEC.n_layer))
    if not final:
        assert saved == []
        return
    [path] = saved
    loaded = load_checkpoint(path)
    assert loaded.step == 3 and loaded.optim.step_count == runner.state.optim.step_count
    assert all(np.array_equal(loaded.params[k].detach().numpy(), v.detach().numpy())
               for k, v in runner.state.params.items())
    assert [StepReport.from_wire(w).step for w in checkpoint_notes(path)[REPORTS_NOTE]] == [0, 1, 2]
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # no half-written file


def test_a_finished_run_is_checkpointed_at_its_last_step(tmp_path):
    end = trio.run(_runner(tmp_path, 3).run)
    assert (end.completed, end.reason) == (2, "finished")
    assert [load_checkpoint(p).step for p in list_checkpoints(tmp_path, (0, SPEC.n_layer))] == [3]


def test_a_cancelled_runner_still_leaves_a_whole_checkpoint_or_none(tmp_path):
    # The daemon is cancelled (it leaves) right after the operator's stop: the worker thread is
    # waited for, not abandoned, so the stop's checkpoint is whole (it loads, its hash checks)
    # and no temporary file is left beside it.
    async def main():
        token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            def on_step(rep):
                if rep.step == 1:
                    runner.stop_at(3, final=True)
                    token.run_sync_soon(scope.cancel)
            runner = _runner(tmp_path, 50, on_step=on_step)
            await runner.run()
        assert scope.cancel_called and not runner.running

    trio.run(main)
    [path] = list_checkpoints(tmp_path, (0, SPEC.n_layer))
    assert load_checkpoint(path).step == 3
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_compressed_replicas_stay_identical_report_their_bytes_and_roll_back_with_their_compression_state(tmp_path):
    # Two DP replicas of one stage (2 x 1) run DiLoCo (H = 2) through their stage runners: every
    # synchronisation leaves them bit-identical; each report carries the bytes sent per axis (the
    # compressed payload on synchronisation steps only); the checkpoint and the one-step-back
    # snapshot hold the compression state (residual, anchor, outer momentum): a replica rebuilt
    # from its snapshot and re-run reaches the very same bits, so a rollback loses nothing.
    comp = parse_compression("diloco,inner_steps=2,dp_ramp_syncs=0")  # (every H = 2 steps from the first)
    r = run_replicas(tmp_path, comp)
    peers, plan, states, runners, ends, seen = PEERS, r.plan, r.states, r.runners, r.ends, r.seen
    assert {(e.completed, e.failed) for e in ends.values()} == {(3, False)}
    assert ends[peers[0]].params_sha256 == ends[peers[1]].params_sha256
    payload = states[peers[0]].compress.payload_bytes()
    for p in peers:
        assert [r.bytes_sent[:3] for r in seen[p]] == [(0, 0, 0), (0, 0, payload), (0, 0, 0), (0, 0, payload)]
        assert all(r.bytes_sent[3] == 8 for r in seen[p])  # the loss, one float64 to the other replica
        assert StepReport.from_wire(seen[p][1].to_wire()) == seen[p][1]
        [ck] = list_checkpoints(tmp_path / p.hex(), (0, SPEC.n_layer))
        saved = load_checkpoint(ck)
        assert saved.compress.config == comp
        for k, v in states[p].compress.state_tensors().items():
            assert torch.equal(saved.compress.state_tensors()[k], v), k

    # back one step: each replica from its snapshot (step 3), re-run together
    back = {p: runners[p].snapshot_state() for p in peers}
    assert all(b.step == 3 and b.compress.config == comp for b in back.values())
    assert not torch.equal(back[peers[0]].compress.buffers["ef"], states[peers[0]].compress.buffers["ef"])
    steps(back, plan, 1)
    for p in peers:
        for k, v in stage_tensors(states[p]).items():
            assert torch.equal(stage_tensors(back[p])[k], v), (p, k)


def test_exact_replicas_keep_one_copy_for_the_snapshot_and_a_failed_step_leaves_it_alone():
    # Two exact DP replicas (2 x 1): the snapshot is copied inside each step just before the
    # update, one copy of the stage (weights and moments), and the runner reports the stage's
    # memory so. Replica p1 ends after 2 steps; p0 goes on, and its step 2 fails (the hub is
    # closed once p1 is done): p0's stage stays after step 1 and its snapshot before step 1,
    # equal to p1's. Both snapshots, re-run through step 1, reach the final weights bit for bit.
    peers = (b"p0", b"p1")
    plan = Plan(tuple((p,) for p in peers), ((0, SPEC.n_layer),), epoch=1)
    hub = InMemoryHub()
    states = {p: StageState(SPEC, CFG, (0, SPEC.n_layer)) for p in peers}
    runners = {p: StageRunner(states[p], plan, p, hub.endpoint(p), CORPUS, end_step=3 if p == b"p0" else 2)
               for p in peers}
    ends = {}

    async def run_all():
        async def one(p):
            ends[p] = await runners[p].run()
            if p == b"p1":
                hub.abort()
        async with trio.open_nursery() as n:
            for p in peers:
                n.start_soon(one, p)
    trio.run(run_all)
    assert (ends[b"p1"].completed, ends[b"p1"].failed) == (1, False)
    assert (ends[b"p0"].completed, ends[b"p0"].failed) == (1, True)
    assert ends[b"p0"].params_sha256 == ends[b"p1"].params_sha256
    for p in peers:
        mem = runners[p].memory
        weights = sum(t.numel() * t.element_size() for t in states[p].params.values())
        assert mem.weights == mem.grads == weights and mem.optimizer == 2 * weights
        assert mem.snapshot == 3 * weights  # one copy: weights and both moments
        assert mem.activations > 0 and mem.total == 7 * weights + mem.activations
        assert runners[p].snapshot_step == 1
    back = {p: runners[p].snapshot_state() for p in peers}
    assert all(b.step == 1 and b.optim.step_count == 1 for b in back.values())
    for k, v in stage_tensors(back[b"p0"]).items():
        assert torch.equal(stage_tensors(back[b"p1"])[k], v), k
    hub = InMemoryHub()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(run_step, back[p], plan, p, hub.endpoint(p), CORPUS) for p in peers]:
            f.result(timeout=60)
    for p in peers:
        assert back[p].step == states[p].step == 2
        for k, v in stage_tensors(states[p]).items():
            assert torch.equal(stage_tensors(back[p])[k], v), (p, k)


def test_step_reports_carry_the_computes_cpu_time_and_its_share_of_a_core():
    rep = StepReport(2, 5, 1.5, 0.1, 0.05, 0.03, 0.02, compute_cpu_s=0.02)
    assert StepReport.from_wire(rep.to_wire()) == rep
    assert rep.core_share == pytest.approx(0.4)
    assert StepReport(2, 5, 1.5, 0.1, 0.05, 0.03, 0.02, compute_cpu_s=0.06).core_share == 1.0  # (a clock's grain)
    plain = StepReport(2, 5, 1.5, 0.1, 0.05, 0.03, 0.02)
    assert "compute_cpu_s" not in plain.to_wire() and plain.core_share is None  # not measured: as before
    assert StepReport(2, 5, 1.5, 0.1, 0.0, 0.03, 0.02, compute_cpu_s=0.01).core_share is None  # no compute
    for bad in (-0.1, float("nan"), float("inf"), 2e9, "0.1", None, [0.1]):
        with pytest.raises(ProtocolError, match="compute_cpu_s"):
            StepReport.from_wire({**rep.to_wire(), "compute_cpu_s": bad})


def test_step_reports_bytes_are_checked():
    rep = StepReport(2, 5, 1.5, 0.1, 0.05, 0.03, 0.02, (10, 20, 30, 40))
    assert StepReport.from_wire(rep.to_wire()) == rep
    assert "bytes" not in StepReport(2, 5, 1.5, 0.1, 0.05, 0.03, 0.02).to_wire()  # none counted: as before
    for bad in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, -4], [1, 2, 3, 2**60], [1, 2, 3, 4.0], "1234", None):
        with pytest.raises(ProtocolError, match="bytes"):
            StepReport.from_wire({**rep.to_wire(), "bytes": bad})


def test_the_wait_for_a_message_is_the_runs_floor_or_ten_steps_whichever_is_longer():
    assert comm_timeout_for(60.0, None) == 60.0
    assert comm_timeout_for(60.0, 0.0) == 60.0  # an allocation without a prediction
    assert comm_timeout_for(60.0, 2.0) == 60.0  # fast steps: a frozen neighbour fails within the floor
    assert comm_timeout_for(60.0, 30.0) == 30.0 * COMM_TIMEOUT_STEPS  # minutes a step: not every step failed
    assert comm_timeout_for(60.0, 2.0, [40.0, 50.0, 45.0]) == 45.0 * COMM_TIMEOUT_STEPS  # measured, median
    assert comm_timeout_for(60.0, 30.0, [1.0]) == 30.0 * COMM_TIMEOUT_STEPS  # the longer of the two
    assert comm_timeout_for(60.0, 1e9) == COMM_TIMEOUT_MAX_S  # an allocation's figure is held to the cap
    assert comm_timeout_for(60.0, float("nan"), [float("inf"), -1.0]) == 60.0


def test_the_runner_raises_the_wait_for_the_steps_it_measures(monkeypatch):
    """A stage whose steps take long (here a clock that moves 20 s a step) waits ten of them
    for a message, from its own steps' median, after the allocation's prediction."""
    import dtfm.control.epoch.runner as runner_mod

    clock = iter(range(0, 10_000, 20))
    monkeypatch.setattr(runner_mod, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    plan = Plan(((b"me",),), ((0, SPEC.n_layer),), epoch=1)
    state = StageState(SPEC, CFG, (0, SPEC.n_layer))
    waits: list[float] = []
    runner = StageRunner(state, plan, b"me", InMemoryHub().endpoint(b"me"), CORPUS, end_step=3,
                         predicted_step_s=9.0, on_step=lambda rep: waits.append(state.comm_timeout_s))
    assert state.comm_timeout_s == 9.0 * COMM_TIMEOUT_STEPS  # from the prediction, before any step
    end = trio.run(runner.run)
    assert end.completed == 2 and waits == [20.0 * COMM_TIMEOUT_STEPS] * 3


def test_a_step_waits_for_a_message_as_long_as_the_stage_says():
    """The worker's waits are the stage's `comm_timeout_s` (which the runner raises), not the
    run's configuration: a neighbour that never sends fails the step after that long."""
    plan = Plan(((b"me", b"other"),), ((0, 1), (1, SPEC.n_layer)), epoch=1)
    state = StageState(SPEC, CFG, (1, SPEC.n_layer))
    runner = StageRunner(state, plan, b"other", InMemoryHub().endpoint(b"other"), CORPUS, end_step=1)
    state.comm_timeout_s = 0.2
    t0 = time.monotonic()
    end = trio.run(runner.run)
    assert end.failed and end.completed == -1
    assert time.monotonic() - t0 < CFG.comm_timeout_s / 2
