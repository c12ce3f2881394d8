"""The coordinator machine (control/coordinator/machine.py) through its public API:
`handle(event, now)`, `phase`, `next_deadline()`, `status()`; `next_council`; the step log
(control/coordinator/steplog.py).

A test plays the shell around one coordinator, n0 (tests/coordinator_fixtures.py's `Node`): it
feeds events at times it picks, answers the machine's requests (`Ask`) with what each peer says
and runs its `Compute`. n0's own answers to ALLOCATION, START and STOP come from its own epoch
machine, as in the daemon. The scenarios told as transcripts (one line per input, the actions
under it, and the phase when it changes) are data files, tests/data/coordinator/*.txt, played
by tests/transcripts.py; the tests here check what a transcript does not show. The protocol is
in docs/control.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import msgpack
import pytest
import transcripts
from coordinator_fixtures import (
    D01,
    D23,
    ME,
    PLACEMENT,
    TIMINGS,
    WALL,
    Node,
    reschedule_op,
    resume_op,
    stage_report,
    state,
    stop_op,
)
from machine_trace import (
    DATA_HASH,
    DATA_NAME,
    INTRUDER,
    OPERATOR,
    RUN,
    N,
    alloc,
    label,
    named,
    report,
    start_op,
)

from dtfm.control import Placement, RunEnd, SignedAllocation, SignedOp, hf_preset, sign_op
from dtfm.train import PRESETS, TrainConfig
from dtfm.control.actions import Ask, Compute, Emit, LogLine, Reply
from dtfm.control.messages import ControlMsg
from dtfm.control.coordinator.machine import (
    Elected,
    PeerLeaving,
    Phase,
    Reschedule,
    StartRun,
    StepFailed,
    StepReported,
    SteppedDownEvent,
    StopRun,
    ResumeRun,
    resume_refusal,
    Trigger,
    first_council,
    next_council,
)
from dtfm.control.coordinator.allocate import MIN_REBUILDERS
from dtfm.control.coordinator.failures import FailedSteps
from dtfm.control.coordinator.steplog import GAP_ATTEMPTS, REORDER_STEPS, STEP_WINDOW, StepLog
from dtfm.control.epoch.runstate import PeerRunState
from dtfm.control.refusals import Refusals
from dtfm.net import short_id
from dtfm.train import LinkCodecs, parse_compression
from dtfm.control.epoch.machine import (
    EpochDone,
    EpochPhase,
    RunnerEnded,
)


# ---- step reports -----------------------------------------------------------------------------------


def acted(n: Node) -> list[str]:
    """What the machine did since the last call (its actions and answers, not the inputs)."""
    out = [x.strip() for x in n.lines if x.startswith("  ") or " answers " in x]
    n.lines.clear()
    return out


def test_steps_are_logged_once_every_peer_reported_them_and_lost_reports_are_filled_from_the_peers():
    # Step 1's reports all went missing: the steps after it wait for them (reports may come out
    # of order) until a step REORDER_STEPS later has every report; then step 1 is passed over,
    # the coordinator asks the peers for the reports they keep and logs it from them. Step 5's
    # report lost at n3: once step 6 has every report, its line is partial. Reports of another
    # run, from a peer with no stage in the epoch, of another epoch: refused.
    n = Node()
    n.training(steps=0)
    for s in [0] + list(range(2, 1 + REORDER_STEPS)):
        for p in N[:4]:
            n.feed(StepReported(p, RUN, stage_report(p, 1, s)), 1.0 + s)
    assert acted(n) == ["log step 0 loss 5.0 epoch 1"]  # steps 2.. wait for step 1's reports
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 1 + REORDER_STEPS)), 5.0)
    kept = state((0, 2), 5, running=True, reports=[report(1, s) for s in range(5)])
    n.answer("gaps 1", everyone=kept, at=5.1)
    assert acted(n) == [f"log step {s} loss {report(1, s).loss} epoch 1" for s in range(2, 2 + REORDER_STEPS)] + [
        "ask gaps 1: RUN_STATE query -> n0 n1 n2 n3",
        "5.1 answers gaps 1: n0 0-2@5 running, n1 0-2@5 running, n2 0-2@5 running, n3 0-2@5 running",
        "log step 1 loss 4.9 epoch 1 backfilled"]
    for p in N[:3]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 5)), 6.0)
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 6)), 7.0)
    n.feed(StepReported(N[1], b"o" * 16, report(1, 7)), 8.0)  # another run
    n.feed(StepReported(N[4], RUN, report(1, 7)), 8.0)  # not a peer of the epoch
    n.feed(StepReported(N[1], RUN, report(0, 7)), 8.0)  # another epoch
    assert acted(n) == ["log step 5 loss 4.5 epoch 1 partial", "log step 6 loss 4.4 epoch 1"]
    st = n.c.status()
    assert st.completed == 6 and [x["step"] for x in st.recent] == [0, 2, 3, 4, 1, 5, 6]
    counts = n.c.refusals.counts()
    assert [counts.get(c) for c in ("step-other-run", "step-not-peer", "step-other-epoch")] == [1, 1, 1]


def test_backfill_logs_each_step_once_from_its_newest_run():
    # Steps 0-3 from the peers' reports: step 2 ran in epochs 1 and 3 (re-run after a rollback),
    # the epoch-3 run is logged; step 1 is logged already; step 3 has no report.
    log = StepLog(alloc(epoch=4, start_step=4), {1}, started_at=0.0)
    known = {1: alloc(epoch=1), 3: alloc(epoch=3, start_step=2)}.get
    reports = [(N[1], r) for r in (report(1, 0), report(1, 1), report(1, 2), report(3, 2, loss=9.0))]
    lines = log.backfill(reports, {0, 1, 2, 3}, known)
    assert [(x["step"], x["epoch"], x["loss"], x["backfilled"]) for x in lines] == [
        (0, 1, report(1, 0).loss, True), (2, 3, 9.0, True)]
    assert log.logged == {0, 1, 2} and log.backfill(reports, {0, 2}, known) == []


def _gap_at_step_1(n: Node) -> None:
    """Every report of step 1 lost: once step 1 + REORDER_STEPS has every report, step 1 is a
    gap and the peers are asked for the reports they keep (`gaps 1`)."""
    n.training(steps=0)
    for s in [0] + list(range(2, 2 + REORDER_STEPS)):
        for p in N[:4]:
            n.feed(StepReported(p, RUN, stage_report(p, 1, s)), 1.0 + s)
    assert acted(n)[-1] == "ask gaps 1: RUN_STATE query -> n0 n1 n2 n3"
    assert n.c.steplog.gaps == {1}


def test_a_gap_is_asked_for_again_while_peers_do_not_answer_and_logged_once_one_does():
    # The first queries' answers are lost but n0's (a first stage: no loss): asked again at
    # once, GAP_ATTEMPTS times in all, then after one check interval, two, four; the loss-less
    # line is not logged while a last stage may still answer. Then n1 (a last stage) answers:
    # step 1 is logged, from its report, and nothing more is asked.
    n = Node()
    _gap_at_step_1(n)
    first_stage = {N[0]: state((0, 2), 5, running=True, reports=[stage_report(N[0], 1, s) for s in range(5)])}
    t = 6.0
    for attempt in range(1, GAP_ATTEMPTS):
        n.answer("gaps 1", first_stage, at=t)
        assert acted(n)[-1] == "ask gaps 1: RUN_STATE query -> n0 n1 n2 n3", attempt  # asked again at once
    asked = [t]
    for _ in range(3):
        n.answer("gaps 1", {}, at=asked[-1])  # nobody answers
        while "gaps 1" not in n.asks:  # (the machine's own checks tick meanwhile)
            n.tick()
        asked.append(n.now)
    assert [b - a for a, b in zip(asked, asked[1:])] == [2.0, 4.0, 8.0]  # check intervals, doubling
    t = asked[-1]
    assert n.c.status().completed == 1 + REORDER_STEPS and 1 not in n.c.logged[RUN]
    n.answer("gaps 1", {N[1]: state((2, 4), 5, running=True, reports=[report(1, s) for s in range(5)])}, at=t + 0.1)
    assert acted(n)[-1] == "log step 1 loss 4.9 epoch 1 backfilled"
    assert not n.asks and n.c.steplog.gaps == set() and n.c.next_deadline() != t + 0.1


def test_a_step_no_peer_kept_a_report_of_is_a_logged_counted_event_not_a_silent_hole(caplog):
    # Every peer of the epoch answers, none with a report of step 1 (their kept reports start
    # later): it cannot be logged. The coordinator says so (WARNING), counts it
    # (`steps_unlogged`) and records an `unlogged` event naming the step; nothing is asked again.
    n = Node()
    _gap_at_step_1(n)
    later = state((0, 2), 5, running=True, reports=[report(1, s) for s in range(2, 5)])
    with caplog.at_level(logging.WARNING):
        n.answer("gaps 1", everyone=later, at=6.0)
    assert acted(n)[1:] == ["emit unlogged term=1 epoch=1 trigger=step reports lost "
                            "reason=no peer keeps a report of steps 1"]
    assert "steps 1 of run" in caplog.text and "cannot be logged" in caplog.text
    assert n.c.status().counts.steps_unlogged == 1 and n.c.status().counts.to_wire()["steps_unlogged"] == 1
    assert not n.asks and n.c.next_deadline() > 6.0 and n.c.steplog.gaps == set()


def test_a_coordinator_that_stepped_down_asks_for_its_gaps_while_its_epoch_runs():
    # n0 steps down (n1 coordinates term 2) while step 1's questions go unanswered: its epoch
    # still runs here, so the next report after the wait asks again (its gap timer is a
    # coordinator's: none here), and the answer logs step 1. A deposed coordinator whose peer
    # runs another epoch leaves the steps to that epoch's coordinator: nothing asked.
    n = Node()
    _gap_at_step_1(n)
    n.election.coordinator, n.election.term = N[1], 2
    for t in (5.5, 5.6, 5.7, 5.8):  # (after the fourth, the next question waits a check interval)
        n.answer("gaps 1", {}, at=t)
    assert not n.asks and n.c.next_deadline() != 7.8
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 2 + REORDER_STEPS)), 9.0)
    assert "gaps 1" in n.asks
    n.answer("gaps 1", everyone=state((2, 4), 6, running=True, reports=[report(1, 1)]), at=9.1)
    assert acted(n)[-1] == "log step 1 loss 4.9 epoch 1 backfilled"

    n = Node()
    _gap_at_step_1(n)
    n.election.coordinator, n.election.term = N[1], 2
    n.answer("gaps 1", {}, at=5.5)
    n.answer("gaps 1", {}, at=5.6)
    n.local_epoch(alloc(epoch=2, term=2, issuer=N[1], start_step=6))  # n1's next epoch
    acted(n)
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 2 + REORDER_STEPS)), 9.0)
    n.answer("gaps 1", {}, at=9.1)
    assert not n.asks and n.c.steplog.gaps == {1}


def test_a_gap_left_when_the_epoch_ends_is_asked_for_by_the_next_epochs_log():
    # Step 1 is a gap when the operator's reschedule starts: the peers' answers to the hand-out's
    # questions carry no reports (the back-fill covers nothing), and step 5, run up to the stop
    # boundary, was never reported either. The new epoch's log takes both over: it asks for them
    # and logs them from epoch 1's reports, each once.
    n = Node()
    _gap_at_step_1(n)
    n.answer("gaps 1", {}, at=5.5)  # (asked again at once)
    n.feed(Reschedule(("op", "r"), reschedule_op(6.0)), 6.0)
    n.answer("states", {p: state(n.held(p)["layers"], 6, running=True) for p in N[:4]}, at=6.1)
    n.answer("stop", everyone={"stopped": True}, at=6.2)
    n.tick()
    n.answer("poll", {p: state(n.held(p)["layers"], 6) for p in N[:4]}, at=n.now + 0.1)
    n.compute("plan", at=n.now + 0.1)
    for layers, digest in (("0-2", D01), ("2-4", D23)):
        n.answer(f"offer {layers}", everyone={"digest": digest, "bytes": 1}, at=n.now + 0.1)
    assert n.c.steplog.alloc.epoch == 2 and n.c.steplog.gaps == {1, 5}
    kept = {p: state(n.held(p)["layers"], 6, epoch=2, reports=[stage_report(p, 1, s) for s in range(6)])
            for p in N[:4]}
    n.answer("gaps 1", {}, at=n.now + 0.1)  # (epoch 1's question: its log is gone, nothing changes)
    acted(n)
    n.answer("gaps 2", kept, at=n.now + 0.1)
    assert [x for x in acted(n) if x.startswith("log")] == ["log step 1 loss 4.9 epoch 1 backfilled",
                                                             "log step 5 loss 4.5 epoch 1 backfilled"]
    assert n.c.logged[RUN] == set(range(6)) and n.c.steplog.gaps == set()


# ---- reconfiguration --------------------------------------------------------------------------------


def test_a_coordinator_that_stepped_down_mid_reconfiguration_hands_nothing_out():
    # As in tests/data/coordinator/a_reconfiguration_goes_through_its_phases_in_order.txt, but the
    # election deposes n0 while the offers are out: it hands out no allocation (it would carry no
    # certificate of its own, or its successor's).
    n = Node()
    n.training(steps=2)
    n.swarm.live.discard(N[3])
    n.feed(Trigger("peer n3 is dead"), 5.0)
    n.tick()
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2)}, 5.8)
    n.compute("plan", 6.6)
    n.answer("offer 0-2", {N[0]: {"digest": D01, "bytes": 1}, N[2]: {"digest": D01, "bytes": 1}}, 6.7)
    n.election.term, n.election.coordinator = 2, N[1]
    n.feed(SteppedDownEvent(1, "a voter is in term 2"), 6.75)
    n.answer("offer 2-4", {N[1]: {"digest": D23, "bytes": 1}}, 6.8)
    assert "alloc" not in n.asks and n.c.phase is not Phase.HANDING_OUT
    assert n.election.last_applied == (1, 1)


def test_a_minority_of_voters_does_not_reconfigure_and_waits_for_the_others():
    # Only n0 and n1 of the four voters answer: a side without a quorum pauses (a partition is
    # not a failed attempt: it counts toward no limit, however long it lasts), asks the peers out
    # of reach at each check, and goes on once n2 answers again.
    n = Node()
    n.training()
    n.feed(Trigger("peer n3 is dead"), 5.0)
    n.tick()
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2)}, 6.0)
    assert n.c.phase is Phase.PAUSED
    probes = 0
    while n.now < 200.0:  # many checks, and the paused retries of paused_retry_s
        n.tick()
        for what in ("probe holders", "states"):
            if what in n.asks:
                probes += what == "probe holders"
                n.answer(what, {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2)} if what == "states" else {})
    assert probes > n.c.timings.max_reconfig_attempts and n.c.phase is Phase.PAUSED and not n.epoch.run_over()
    while "probe holders" not in n.asks:
        n.tick()
    n.answer("probe holders", {N[2]: state((0, 2), 2)})
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2)})
    assert "plan" in n.computes and n.c.phase is Phase.PLANNING


def test_reconfigurations_that_keep_failing_stop_the_run():
    # Every attempt finds no holder of layers 2-4 that offers them: after max_reconfig_attempts
    # the run stops, and the coordinator does nothing more.
    n = Node()
    n.training()
    n.feed(Trigger("peer n3 is dead"), 5.0)
    for _ in range(n.c.timings.max_reconfig_attempts):
        n.tick()
        if "states" not in n.asks:
            n.tick()
        n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2)})
        n.compute("plan")
        n.answer("offer 0-2", everyone={"digest": D01, "bytes": 1})
        n.answer("offer 2-4", {})
    assert n.c.phase is Phase.STOPPED
    assert n.c.reason == (f"{n.c.timings.max_reconfig_attempts} reconfigurations failed, the last: no holder of layers "
                          "(2, 4) could offer them at step 2")
    n.tick(40.0)
    assert n.epoch.run_over() and n.epoch.over_without_finishing(RUN)
    assert n.c.next_deadline() == 42.0  # it looks, and does nothing: the run is over


def holders_out_of_reach(n: Node) -> None:
    """Training 2 x 2, then n1 and n3 stop answering (restarting, or cut off): with two of the
    four voters reachable, the run pauses until a peer out of reach answers."""
    n.training()
    n.feed(StepFailed(N[1], RUN, 1, "connection lost"), 4.9)
    n.answer("probe failed", {N[0]: state((0, 2), 2), N[2]: state((0, 2), 2)}, 5.0)
    n.tick()
    n.answer("states", {N[0]: state((0, 2), 2), N[2]: state((0, 2), 2)}, 5.6)


def _costly(actions) -> list:
    """The actions that do work or ask peers: none may follow a refused operation."""
    return [a for a in actions if isinstance(a, Ask | Compute)]


START_REFUSALS = [
    # (what, the signed start (at the machine's time 10), words of the refusal)
    ("unsigned", None, "none was given"),
    ("signed by a key the swarm does not name", start_op(b"s" * 16, at_s=WALL + 10, key=INTRUDER),
     "not an operator of this swarm"),
    ("a forged signature", dataclasses.replace(start_op(b"s" * 16, at_s=WALL + 10), signature=bytes(64)),
     "bad operator signature"),
    ("the operator's stop", sign_op(OPERATOR, "stop", now_s=WALL + 10, run_id=b"s" * 16), "carries an operator's stop"),
    ("signed long ago", start_op(b"s" * 16, at_s=WALL + 10 - 301), "signed 301 s ago, more than the 300 s"),
    ("dated in the future", start_op(b"s" * 16, at_s=WALL + 10 + 400), "400 s in the future"),
    ("a replay of the run's start", start_op(at_s=WALL + 10), "run 72727272 was started already"),
    ("for other data", start_op(b"s" * 16, at_s=WALL + 10, data_hash="cd" * 32), "the coordinator holds"),
]


@pytest.mark.parametrize("what, op, words", START_REFUSALS, ids=[r[0] for r in START_REFUSALS])
def test_a_start_not_signed_by_an_operator_now_is_refused_before_any_work(what, op, words):
    # The run of the replayed start was started and stopped: nothing is in progress, so only the
    # operation itself is refused; no scheduler runs and no peer is asked.
    n = Node(wall=WALL)
    n.training()
    n.feed(StopRun(("op", "stop"), stop_op(5.0, wall=WALL)), 5.0)
    [asked] = [k for k in n.asks if k.startswith("opstop")]
    n.answer(asked, everyone={"stopped": True}, at=5.1)
    n.epoch.handle(RunnerEnded(1, RunEnd(1, "stopped", False), 5.2), 5.2)  # n0's own runner ends
    n.epoch.handle(EpochDone(1), 5.2)
    n.lines.clear()
    out = n.feed(StartRun(("op", "new"), op, DATA_HASH, DATA_NAME), 10.0)
    assert _costly(out) == [] and n.planner.firsts == [n.planner.firsts[0]]
    [reply] = out
    assert isinstance(reply, Reply) and reply.error is not None and words in named(reply.error), reply.error
    out = n.feed(StartRun(("op", "ok"), start_op(b"s" * 16, at_s=WALL + 10), DATA_HASH, DATA_NAME), 10.0)
    assert [label(a.key) for a in _costly(out)] == ["first"]  # the operator's own start goes on


def test_a_start_is_refused_before_any_work_while_another_is_in_progress_or_by_a_follower():
    n = Node(wall=WALL)
    first = n.feed(StartRun(("op", "a"), start_op(b"a" * 16, at_s=WALL), DATA_HASH, DATA_NAME), 0.0)
    assert [label(a.key) for a in _costly(first)] == ["first"]
    out = n.feed(StartRun(("op", "b"), start_op(b"b" * 16, at_s=WALL), DATA_HASH, DATA_NAME), 0.1)
    assert _costly(out) == [] and [r.error for r in out] == [
        "another train start is in progress: try again once it is answered"]
    n.election.coordinator = N[1]
    out = n.feed(StartRun(("op", "c"), start_op(b"c" * 16, at_s=WALL), DATA_HASH, DATA_NAME), 0.2)
    assert _costly(out) == [] and [r.error for r in out] == ["this peer is no longer the coordinator"]


def test_a_start_signed_before_its_min_peers_wait_is_taken_within_that_wait():
    n = Node(wall=WALL)
    late = start_op(b"s" * 16, at_s=WALL - 1000, min_peers=4, wait_s=900.0)
    out = n.feed(StartRun(("op", "late"), late, DATA_HASH, DATA_NAME), 0.0)
    assert [label(a.key) for a in _costly(out)] == ["first"]


def test_reschedules_not_signed_by_an_operator_for_this_run_now_are_refused_before_any_work():
    n = Node(wall=WALL)
    n.training()
    refused = [
        (None, "none was given"),
        (reschedule_op(3.0, key=INTRUDER, wall=WALL), "not an operator of this swarm"),
        (reschedule_op(3.0, run=b"o" * 16, wall=WALL), "not run 72727272"),
        (stop_op(3.0, wall=WALL), "carries an operator's stop"),
        (reschedule_op(3.0 - 400, wall=WALL), "signed 400 s ago"),
    ]
    for k, (op, words) in enumerate(refused):
        out = n.feed(Reschedule(("op", k), op), 3.0)
        assert _costly(out) == [] and len(out) == 1 and words in named(out[0].error), (words, out)
    ok = reschedule_op(3.0, wall=WALL)
    assert [label(a.key) for a in _costly(n.feed(Reschedule(("op", "ok"), ok), 3.0))] == ["states"]
    for k, op in enumerate((ok, reschedule_op(2.0, wall=WALL))):  # the same again, or an older one: a replay
        out = n.feed(Reschedule(("op", "again", k), op), 3.1)
        assert _costly(out) == [] and "was taken already" in out[0].error
    out = n.feed(Reschedule(("op", "newer"), reschedule_op(3.2, wall=WALL)), 3.2)
    assert out == []  # newer: it waits for the reconfiguration in progress
    out = n.feed(Reschedule(("op", "more"), reschedule_op(3.3, wall=WALL)), 3.3)
    assert _costly(out) == [] and "another reschedule is waiting" in out[0].error
    assert len(n.planner.calls) == 0


def _reconfiguring() -> Node:
    """A 2 x 2 run reconfiguring for a joined n4, its run states answered (at 3.6): it plans."""
    n = Node(wall=WALL)
    n.training()
    n.feed(Trigger("peer n4 joined"), 3.0)
    n.tick()
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2),
                        N[3]: state((2, 4), 2)}, 3.6)
    return n


def test_an_operators_stop_taken_during_a_reconfiguration_ends_the_run_and_nothing_is_handed_out():
    # A chaos soak's last `train stop` arrived while the coordinator planned a reconfiguration:
    # the planned epoch was handed out anyway and the run trained on. The stop is taken at once
    # (STOP to the peers), and the procedure in flight hands nothing out after it.
    n = _reconfiguring()
    n.feed(StopRun(("op", "stop"), stop_op(3.7, wall=WALL)), 3.7)
    n.answer("opstop 2", everyone={"stopped": True}, at=3.8)
    n.compute("plan", 3.9)
    n.answer("offer 0-2", everyone={"digest": D01}, at=4.0)
    out = n.answer("offer 2-4", everyone={"digest": D23}, at=4.0)
    assert "alloc" not in n.asks and not any(isinstance(a, Ask) for a in out)
    assert n.epoch.run_over() and n.c.status().phase is Phase.STOPPED
    assert _costly(n.tick(60.0)) == []  # nobody reconfigures it after all


def test_an_operators_stop_during_a_hand_out_waits_for_it_then_ends_the_new_epoch():
    # The new epoch's allocation is out (peers building their stages) when the stop arrives:
    # taken at once it would end the old epoch on the peers the allocation had not reached yet,
    # and the new epoch, applied after it, would start the run again on the others (a new epoch
    # of a stopped run resumes it). It waits for the hand-out, then ends the new epoch.
    n = _reconfiguring()
    n.compute("plan", 3.7)
    n.answer("offer 0-2", everyone={"digest": D01}, at=3.8)
    n.answer("offer 2-4", everyone={"digest": D23}, at=3.8)
    assert "alloc" in n.asks and n.c.phase is Phase.HANDING_OUT
    out = n.feed(StopRun(("op", "stop"), stop_op(3.9, wall=WALL)), 3.9)
    assert out == [] and not n.epoch.run_over()
    out = n.feed(StopRun(("op", "again"), stop_op(3.95, wall=WALL)), 3.95)
    assert "another stop is waiting" in out[0].error
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=4.0)
    n.answer("start", everyone={"started": True}, at=4.1)
    [stop] = [k for k in n.asks if k.startswith("opstop")]
    assert n.asks[stop].body["final"] and n.epoch.run_over() and n.epoch.current.epoch == 2
    out = n.answer(stop, everyone={"stopped": True}, at=4.2)
    [reply] = [a for a in out if isinstance(a, Reply)]
    assert reply.key == ("op", "stop") and reply.error is None
    assert _costly(n.tick(60.0)) == []  # nobody reconfigures it after all


def test_a_resume_without_a_complete_checkpoint_goes_back_to_the_initial_weights_and_says_so():
    # n1 and n3 lost layers 2-4 (no checkpoint of them) while the run was stopped: the resume
    # goes on from step 0, which every peer of the run can rebuild, and the event says so. The
    # peers asked to rebuild layers 2-4 are those the new allocation puts on them, and one more
    # (MIN_REBUILDERS): not every peer of the run (each peer asked builds and encodes the stage).
    n = Node(wall=WALL)
    n.training()
    n.feed(StopRun(("op", "stop"), stop_op(3.0, wall=WALL)), 3.0)
    n.answer("opstop 1", everyone={"stopped": True}, at=3.1)
    n.lines.clear()
    n.feed(ResumeRun(("op", "resume"), resume_op(4.0, wall=WALL)), 4.0)
    restarted = state(None, None)
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: restarted, N[2]: state((0, 2), 2), N[3]: restarted}, 4.1)
    n.compute("plan", 4.2)
    asked = {r: n.asks[f"offer {r}"].peers for r in ("0-2", "2-4")}
    assert n.asks["offer 2-4"].body["step"] == 0
    assert all(len(p) == MIN_REBUILDERS and set(p) < set(N[:4]) for p in asked.values())
    n.answer("offer 0-2", everyone={"digest": D01}, at=4.3)
    n.answer("offer 2-4", everyone={"digest": D23}, at=4.3)
    a = SignedAllocation.from_wire(n.asks["alloc"].body).open()
    assert a.layer_ranges == ((0, 2), (2, 4))
    assert {p[0] for p in a.pipelines} < set(asked["0-2"]) and {p[1] for p in a.pipelines} < set(asked["2-4"])
    n.answer("alloc", everyone={"accepted": True}, at=4.4)
    out = n.answer("start", everyone={"started": True}, at=4.5)
    [reply] = [a for a in out if isinstance(a, Reply)]
    assert reply.error is None and reply.value["resume_step"] == 0
    assert reply.value["restored_from"] == "initial" and reply.value["steps_lost"] == 2
    assert n.c.phase is Phase.TRAINING and not n.epoch.over_without_finishing(RUN)


def _stopped_then_resumed(n: Node, stop: SignedOp, resume: SignedOp) -> SignedAllocation:
    """n0 trains, takes the operator's `stop` at 3, the `resume` at 4 and hands out epoch 2 of
    the run; the resumed epoch's signed allocation."""
    n.training()
    n.feed(StopRun(("op", "stop"), stop), 3.0)
    n.answer("opstop 1", everyone={"stopped": True}, at=3.1)
    n.feed(ResumeRun(("op", "resume"), resume), 4.0)
    held = {p: state(((0, 2), (2, 4))[k % 2], 2) for k, p in enumerate(N[:4])}
    n.answer("states", held, 4.1)
    n.compute("plan", 4.2)
    n.answer("offer 0-2", everyone={"digest": D01}, at=4.3)
    n.answer("offer 2-4", everyone={"digest": D23}, at=4.3)
    signed = SignedAllocation.from_wire(n.asks["alloc"].body)
    n.answer("alloc", everyone={"accepted": True}, at=4.4)
    n.answer("start", everyone={"started": True}, at=4.5)
    assert n.c.phase is Phase.TRAINING and n.epoch.current.epoch == 2
    return signed


def test_a_copied_stop_cannot_end_the_run_once_it_was_resumed():
    # Security review 2026-11-28, N4: after `train stop` and `train resume`, anyone holding the
    # old stop's bytes (every peer of the run received them) replayed it and the resumed run
    # ended. The resumed epoch's allocation carries the resume's signed time; a stop signed
    # before it is refused before any peer is asked, and the run trains on.
    n = Node(wall=WALL)
    stop, resume = stop_op(3.0, wall=WALL), resume_op(4.0, wall=WALL)
    signed = _stopped_then_resumed(n, stop, resume)
    out = n.feed(StopRun(("op", "copy"), stop), 5.0)  # (n0 took it too: either reason refuses it)
    assert _costly(out) == [] and "sign a new one" in out[0].error
    assert not n.epoch.run_over() and n.c.phase is Phase.TRAINING
    assert signed.open().last_op_ms == resume.open().issued_at_ms  # signed by the issuer, for any successor
    # the operator's own stop, signed now, still ends it; its copy is then refused as taken
    n.feed(StopRun(("op", "stop 2"), stop_op(6.0, wall=WALL)), 6.0)
    [asked] = [k for k in n.asks if k.startswith("opstop")]
    n.answer(asked, everyone={"stopped": True}, at=6.1)
    assert n.epoch.run_over()
    # a copy of the resume (taken once) does not resume the run the operator stopped again
    out = n.feed(ResumeRun(("op", "resume copy"), resume), 7.0)
    assert _costly(out) == [] and "this resume was taken already" in out[0].error
    assert n.epoch.over_without_finishing(RUN)


def test_a_new_coordinator_refuses_copies_of_the_operations_its_predecessor_took():
    # L2 of the same review: the replay records were one coordinator's memory. n1 took a resume
    # (at 4) and a reschedule (at 6) and handed out epoch 3 carrying the reschedule's time; n0,
    # elected after n1 died, never saw either operation, yet refuses a copy of each, and of the
    # stop from before the resume, signed within the skew window as they all are.
    n = Node(wall=WALL)
    n.election.coordinator = N[1]
    rescheduled = reschedule_op(6.0, wall=WALL)
    n.local_epoch(alloc(issuer=N[1], epoch=3, start_step=4, last_op_ms=rescheduled.open().issued_at_ms))
    n.swarm.live.discard(N[1])
    n.election.term, n.election.coordinator = 2, ME
    n.feed(Elected(2), 10.0)
    for k, op in enumerate((rescheduled, reschedule_op(5.0, wall=WALL))):
        out = n.feed(Reschedule(("op", "re", k), op), 10.0)
        assert _costly(out) == [] and "not newer than the run's last resume or reschedule" in out[0].error
    out = n.feed(StopRun(("op", "stop"), stop_op(3.0, wall=WALL)), 10.0)
    assert _costly(out) == [] and "not newer than the run's last resume or reschedule" in out[0].error
    assert not n.epoch.run_over()
    out = n.feed(Reschedule(("op", "new"), reschedule_op(10.0, wall=WALL)), 10.0)
    assert [label(a.key) for a in _costly(out)] == ["states"]  # the operator's new one is taken


def test_a_stop_signed_outside_the_skew_window_is_refused():
    # docs/operator.md promised it (review LOW 4): a stop more than operator_skew_s off the
    # coordinator's clock is refused, before any peer is asked.
    n = Node(wall=WALL)
    n.training()
    for k, (at, words) in enumerate([(3.0 - 301, "signed 301 s ago"), (3.0 + 400, "400 s in the future")]):
        out = n.feed(StopRun(("op", k), stop_op(at, wall=WALL)), 3.0)
        assert _costly(out) == [] and words in out[0].error, out
    assert not n.epoch.run_over()
    out = n.feed(StopRun(("op", "now"), stop_op(3.0 - 299, wall=WALL)), 3.0)
    assert [label(a.key) for a in _costly(out)] == ["opstop 1"]


@pytest.mark.parametrize("asked, last, stopped, over, words", [
    (RUN, RUN, True, True, None),
    (RUN, None, False, True, "this swarm has run nothing yet"),
    (b"o" * 16, RUN, True, True, "only the swarm's last run (72727272)"),
    (RUN, RUN, False, True, "finished its 100 steps"),
    (RUN, RUN, False, False, "is still running"),
])
def test_which_runs_may_be_resumed(asked, last, stopped, over, words):
    refusal = resume_refusal(asked, last, stopped=stopped, over=over, end_step=100)
    assert (refusal is None) if words is None else (words in refusal)


# ---- who may report what ----------------------------------------------------------------------------


def _epoch(pipelines=((N[0], N[1]), (N[2], N[3]))):
    return alloc(pipelines=pipelines, layer_ranges=((0, 2), (2, 4)) if len(pipelines[0]) == 2 else ((0, 4),))


@pytest.mark.parametrize("reporters, stopped, unanswered, epoch, triggers", [
    ((N[1],), (), (), _epoch(), False),  # everyone steps: contradicted
    ((N[1],), (N[1],), (), _epoch(), False),  # only the reporter says it stopped
    ((N[1],), (N[1], N[0]), (), _epoch(), True),  # its neighbour stopped too
    ((N[1],), (), (N[2],), _epoch(), True),  # a peer of the epoch does not answer
    ((N[1], N[3]), (N[1], N[3]), (), _epoch(), False),  # two reporters alone
    ((N[0], N[1], N[2], N[3]), (), (), _epoch(), True),  # every peer of the epoch reported
    ((N[0],), (N[0],), (), _epoch(((N[0],),)), True),  # a one-peer epoch: its word is all there is
])
def test_which_run_states_confirm_a_failed_step(reporters, stopped, unanswered, epoch, triggers):
    failures = FailedSteps(Refusals())
    for p in reporters:
        assert failures.add(p, epoch, RUN, 1, "failed", 5, 0.0) is None
    assert failures.due(epoch, 5)
    states = {p: PeerRunState(RUN, 1, 1, epoch.layer_ranges[0], 6, 5, p not in stopped)
              for p in epoch.peers if p not in unanswered}
    assert bool(failures.judge(epoch, states, 6, 1.0, 10.0)) is triggers
    assert failures.due(epoch, 5) is not triggers  # a contradicted report stays pending


def test_a_contradicted_failed_step_stands_once_the_epoch_completes_no_step_for_a_while():
    # A peer built but never started (its START lost) says it steps: the reporters' word stands
    # once the epoch completed no step for stall_s since the report; a completed step meanwhile
    # keeps it contradicted.
    epoch = _epoch()
    stepping = {p: PeerRunState(RUN, 1, 1, (0, 2), 6, 5, p != N[1]) for p in epoch.peers}
    for completed, now, triggers in ((5, 9.0, False), (5, 10.0, True), (6, 10.0, False)):
        failures = FailedSteps(Refusals())
        failures.add(N[1], epoch, RUN, 1, "a neighbour's step failed", 5, 0.0)
        assert bool(failures.judge(epoch, stepping, completed, now, 10.0)) is triggers


def test_the_loss_is_taken_only_from_the_last_stages():
    # n0 and n2 (first stages) report a loss: never logged. Step 1's last-stage reports are lost:
    # instead of a line with a first stage's loss, the step waits for them, then (a step
    # REORDER_STEPS later complete) is filled from the reports the peers keep: n1's, a last stage's.
    n = Node()
    n.training(steps=0)
    for s in range(0, 2 + REORDER_STEPS):
        for p in (N[0], N[2]):
            n.feed(StepReported(p, RUN, report(1, s, loss=0.0123)), 1.0 + s)
        if s != 1:
            for p in (N[1], N[3]):
                n.feed(StepReported(p, RUN, report(1, s, loss=4.0)), 1.0 + s)
    kept = {N[0]: state((0, 2), 5, running=True, reports=[report(1, 1, loss=0.0123)]),
            N[1]: state((2, 4), 5, running=True, reports=[report(1, 1, loss=3.9)])}
    n.answer("gaps 1", kept, 5.1)
    assert acted(n) == ["log step 0 loss 4.0 epoch 1"] + [f"log step {s} loss 4.0 epoch 1"
                                                          for s in range(2, 2 + REORDER_STEPS)] + [
        "ask gaps 1: RUN_STATE query -> n0 n1 n2 n3",
        "5.1 answers gaps 1: n0 0-2@5 running, n1 2-4@5 running, n2 -, n3 -",
        "log step 1 loss 3.9 epoch 1 backfilled"]
    assert n.c.refusals.counts()["loss-not-last-stage"] == 2 * (2 + REORDER_STEPS) - 1  # and n0's kept one


def test_last_stages_that_disagree_on_the_loss_are_flagged(caplog):
    # The review's attack: n1, a last stage, reports the loss 0.0123; n3, the other last stage,
    # the true one. The value is one global sum, so they must agree: the line says they do not.
    n = Node()
    n.training(steps=0)
    n.feed(StepReported(N[1], RUN, report(1, 0, loss=0.0123)), 1.0)
    n.feed(StepReported(N[0], RUN, stage_report(N[0], 1, 0)), 1.0)
    n.feed(StepReported(N[2], RUN, stage_report(N[2], 1, 0)), 1.0)
    [line] = [a.line for a in n.feed(StepReported(N[3], RUN, report(1, 0, loss=4.0)), 1.0) if isinstance(a, LogLine)]
    assert line["loss_disagreement"] == {short_id(N[1]): 0.0123, short_id(N[3]): 4.0}
    # one against one: no majority, so no loss is logged (the first pipeline's was, review LOW 1)
    assert line["loss"] is None and line["loss_no_majority"] is True
    assert "the last stages disagree on the loss with no majority" in caplog.text
    for p, loss in ((N[0], None), (N[1], 3.9), (N[2], None), (N[3], 3.9)):  # agreeing: no flag
        out = n.feed(StepReported(p, RUN, dataclasses.replace(report(1, 1), loss=loss)), 2.0)
    [line] = [a.line for a in out if isinstance(a, LogLine)]
    assert line["loss"] == 3.9 and "loss_disagreement" not in line
    for p, loss in ((N[0], None), (N[1], math.nan), (N[2], None), (N[3], math.nan)):  # a diverged run agrees too
        out = n.feed(StepReported(p, RUN, dataclasses.replace(report(1, 2), loss=loss)), 3.0)
    [line] = [a.line for a in out if isinstance(a, LogLine)]
    assert math.isnan(line["loss"]) and "loss_disagreement" not in line


@pytest.mark.parametrize("losses, logged", [
    ((0.0123, 4.0, 4.0), 4.0),  # two of three last stages: a strict majority
    ((4.0, 0.0123, None), None),  # one of the two that reported against the other
    ((0.0123, 0.0123, 4.0, 4.0), None),  # two against two
    ((0.0123, 4.0, 4.0, 4.0), 4.0),
    ((math.nan, 4.0, 4.0), 4.0),
])
def test_the_logged_loss_is_a_strict_majority_of_the_last_stages_or_none(losses, logged):
    dp = len(losses)
    # one stage per pipeline: every peer is a last stage
    a = alloc(pipelines=tuple((N[d],) for d in range(dp)), layer_ranges=((0, 4),),
              train=TrainConfig(global_batch_seqs=48))
    log = StepLog(a, set(), started_at=0.0)
    lines = []
    for d, loss in enumerate(losses):
        lines += log.add(N[d], dataclasses.replace(report(1, 0), loss=loss))
    [line] = lines
    assert line["loss"] == logged and len(line["loss_disagreement"]) == sum(x is not None for x in losses)
    assert line.get("loss_no_majority", False) is (logged is None)


def test_far_future_step_reports_keep_the_step_log_bounded():
    # The review's stall: n1, a peer of the run, follows its report with 1,500 reports of random
    # far-future steps. The log keeps at most STEP_WINDOW steps of reports and one number per
    # peer; the next honest step is logged.
    n = Node()
    n.train_start(PLACEMENT, steps=10**9)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 0)), 1.0)
    rng = random.Random(6)
    for _ in range(1500):
        n.c.handle(StepReported(N[1], RUN, report(1, rng.randrange(2, 10**9))), 1.5)
    log = n.c.steplog
    assert log is not None and log.completed == 0
    assert len(log.reports) <= STEP_WINDOW and sum(map(len, log.reports.values())) <= STEP_WINDOW
    assert len(log.highest) == 4 and not log.gaps
    assert n.c.refusals.counts()["step-ahead"] >= 1500 - STEP_WINDOW
    n.lines.clear()
    for p in N[:4]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 1)), 2.0)
    assert n.lines[-1] == "  log step 1 loss 4.9 epoch 1" and log.completed == 1
    assert n.c.refusals.counts().get("loss-not-last-stage") is None


def to_offers(n: Node) -> None:
    """Training 2 x 2 at step 2; n3 dies and the reconfiguration gets to the offers."""
    n.training()
    n.swarm.live.discard(N[3])
    n.feed(Trigger("peer n3 is dead"), 5.0)
    n.tick()
    n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2)}, 5.6)
    n.compute("plan", 5.7)
    n.answer("offer 0-2", everyone={"digest": D01}, at=5.8)
    n.lines.clear()


def test_a_holder_that_fails_to_offer_its_stage_does_not_end_the_run():
    n = Node()
    to_offers(n)
    n.answer("offer 2-4", at=10.8)  # n1 did not answer within accept_timeout_s
    assert n.c.phase is not Phase.STOPPED and not n.epoch.run_over(), n.lines


def test_a_malformed_offer_is_left_out():
    n = Node()
    to_offers(n)
    n.answer("offer 2-4", {N[1]: {"digest": "not a digest", "bytes": 1}}, 5.9)


def test_a_run_state_running_without_a_step_does_not_break_the_coordinator():
    # every peer restarted (no stage), and n1 claims to be stepping
    n = Node()
    n.training()
    n.feed(Trigger("peer n3 is dead"), 5.0)
    n.tick()
    n.answer("states", {N[0]: state(None, None), N[1]: state(None, None, running=True), N[2]: state(None, None)},
             5.6)


def test_a_programming_error_inside_handle_propagates():
    # The machine catches only its own procedure failures; a bug (here in what it reads of the
    # swarm) reaches the shell, which stops the run and logs it.
    n = Node()
    n.training()

    def broken(candidates):
        raise KeyError("a bug")
    n.swarm.measured_view = broken  # type: ignore[method-assign]
    n.feed(Trigger("peer n3 is dead"), 5.0)
    n.tick()
    with pytest.raises(KeyError, match="a bug"):
        n.answer("states", {N[0]: state((0, 2), 2), N[1]: state((2, 4), 2), N[2]: state((0, 2), 2)}, 5.6)
    with pytest.raises(TypeError):
        n.c.handle(object(), 6.0)  # type: ignore[arg-type]


# ---- the next configuration ----------------------------------------------------------------------


A, B, C, D, E, F = N


R = {A: "us", B: "us", C: "eu", D: "eu", E: "ap", F: "ap"}


@pytest.mark.parametrize("old, candidates, live, size, me, new", [
    # two voters gone: one leaves now, the other at a later epoch
    ((A, B, C, D), {A, B}, {A, B}, 5, A, (A, B, D)),
    # below its size: the candidate of the region the council has fewest voters of comes in, one at a time
    ((A, B, C), {A, B, C, D, E, F}, set(R), 5, A, "ap"),
    ((A, B, C, E), {A, B, C, D, E}, set(R), 5, A, (A, B, C, D, E)),
    # at its size: nothing to change, however many peers there are (never every peer)
    ((A, B, C, D, E), {A, B, C, D, E, F}, set(R), 5, B, (A, B, C, D, E)),
    # a gone voter leaves before a new one joins
    ((A, B, C), {A, B, D}, {A, B, D}, 5, A, (A, B)),
    # above its size (a smaller root): a voter of the region it has most of leaves, never the issuer
    ((A, B, C, D), {A, B, C, D}, {A, B, C, D}, 3, A, (A, C, D)),
    # no candidate: unchanged
    ((A, B, C), set(), {A, B, C}, 5, A, (A, B, C)),
])
def test_the_next_council_changes_one_voter_at_a_time_toward_its_size_spread_over_regions(
        old, candidates, live, size, me, new):
    got = next_council(old, set(candidates), set(live), R, size, me)
    if isinstance(new, str):  # the one that came in is of that region
        assert len(got) == len(old) + 1 and R[(set(got) - set(old)).pop()] == new
    else:
        assert got == new
    assert len(set(old) ^ set(got)) <= 1 and me in got


def test_a_first_council_is_this_peer_and_live_peers_spread_over_the_regions():
    got = first_council(A, set(R), R, 5)
    assert len(got) == 5 and A in got and {R[p] for p in got} == {"us", "eu", "ap"}
    assert first_council(A, {A, B}, R, 5) == (A, B)
    assert len(first_council(A, set(R), R, 3)) == 3


def test_the_next_deadline():
    n = Node()
    assert n.c.next_deadline() == 0.0
    n.train_start(PLACEMENT)
    assert n.c.next_deadline() == math.inf  # waiting for answers, not for time


def test_a_step_line_sums_the_bytes_its_reports_sent_per_axis():
    # Every peer of the epoch (n0-n3, last stages n1 and n3) reports its bytes per axis; the
    # step's line carries their sums. Reports without counts (older peers) leave the line as before.
    log = StepLog(alloc(), set(), started_at=0.0)
    sent = {N[0]: (100, 0, 7, 8), N[1]: (0, 100, 7, 16), N[2]: (200, 0, 7, 8), N[3]: (0, 200, 7, 16)}
    lines = []
    for p, b in sent.items():
        r = report(1, 0, loss=2.5 if p in (N[1], N[3]) else None)
        lines += log.add(p, dataclasses.replace(r, bytes_sent=b))
    for p in sent:
        lines += log.add(p, report(1, 1, loss=2.0 if p in (N[1], N[3]) else None))
    [first, second] = [x for x in lines if x["step"] in (0, 1)]
    assert first["bytes_sent"] == {"pp_fwd": 300, "pp_bwd": 300, "dp": 28, "other": 48}
    assert "bytes_sent" not in second


# ---- a planned leave ------------------------------------------------------------------------------


@pytest.mark.parametrize("spare", [False, True])
def test_a_leave_of_a_spare_or_a_peer_outside_the_run_is_answered_at_once(spare):
    n = Node(live=N[1:5] if spare else N[1:4])
    if spare:  # n4 is the run's spare: no step waits for it
        n.train_start(dataclasses.replace(PLACEMENT, spares=(N[4],)))
        n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
        n.answer("start", everyone={"started": True}, at=0.2)
        assert n.epoch.current.spares == (N[4],)
    else:
        n.training(steps=1)
        n.swarm.live.add(N[4])  # a peer outside the run, as gossip sees it until it left
    n.asks.clear()
    out = n.feed(PeerLeaving(("leave", 1), N[4]), 3.0)
    assert [(type(a).__name__, getattr(a, "value", None)) for a in out if isinstance(a, Reply)] == [
        ("Reply", {"handed_off": False})]
    assert [a.event for a in out if isinstance(a, Emit)] == ["leave"] and n.c.phase is Phase.TRAINING
    assert not n.asks  # no reconfiguration, and no probe of n4 as a joined peer
    n.tick(4.0)
    assert "probe joined" not in n.asks


@pytest.mark.parametrize("coordinator, busy, answered", [
    (False, False, "this peer is no longer the coordinator"),  # asked of a peer that is not the coordinator
    (True, True, None),  # a reconfiguration runs: the leave waits for it (then the next one leaves n3 out)
])
def test_a_leave_is_refused_by_a_follower_and_waits_for_a_procedure_in_progress(coordinator, busy, answered):
    n = Node()
    n.training(steps=1)
    if busy:
        n.feed(Reschedule(("op", "r"), reschedule_op(2.0)), 2.0)
        assert n.c.busy
    n.election.coordinator = ME if coordinator else N[1]
    out = n.feed(PeerLeaving(("leave", 1), N[3]), 2.5)
    errors = [a.error for a in out if isinstance(a, Reply)]
    assert errors == ([answered] if answered else [])
    if busy:
        assert "states" in n.asks and not any(isinstance(a, Ask) for a in out)  # (the reschedule's, asked before)


def test_a_coordinator_that_handed_itself_off_reconfigures_nothing_more():
    # n0 leaves: its last allocation leaves itself out (named in `absent`, so the peers whose
    # gossip still counts it alive accept it); its own gossip saying it left, or a failed step
    # as it goes, triggers nothing: the next coordinator takes the run over.
    n = Node()
    n.training(steps=2)
    n.feed(PeerLeaving(("leave", 0), ME), 3.0)
    n.answer("states", {p: state(r, 2, running=True) for p, r in zip(N[:4], [(0, 2), (2, 4), (0, 2), (2, 4)])}, 3.1)
    n.answer("stop", everyone={"stopped": True}, at=3.2)
    n.tick()
    n.answer("poll", {p: state(r, 2) for p, r in zip(N[:4], [(0, 2), (2, 4), (0, 2), (2, 4)])}, 3.5)
    n.compute("plan", 3.6)
    assert n.planner.calls[-1]["live"] == N[1:4]
    n.answer("offer 0-2", {N[0]: {"digest": D01}, N[2]: {"digest": D01}}, 3.7)
    n.answer("offer 2-4", {N[1]: {"digest": D23}, N[3]: {"digest": D23}}, 3.8)
    handout = n.asks["alloc"]
    a = SignedAllocation.from_wire(handout.body).open()
    assert ME not in a.peers + a.spares and ME in a.absent and ME not in handout.peers
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=4.0)
    out = n.answer("start", everyone={"started": True}, at=4.1)
    assert [r.value["handed_off"] for r in out if isinstance(r, Reply)] == [True]
    n.asks.clear()
    n.feed(Trigger(f"peer {short_id(ME)} is left"), 5.0)
    n.tick(6.0)
    n.tick(9.0)
    assert not n.asks and n.c.phase is Phase.TRAINING


# ---- what status says about the run (control/status.py PlaneStatus, peer/status.py) -----------


def plane_status(n: Node, *, now: float = 0.0) -> dict:
    from pathlib import Path

    from dtfm.control.status import PlaneStatus
    return PlaneStatus(ME, {"role": "coordinator", "term": 1, "coordinator": ME.hex()}, True, n.epoch.status(),
                       n.c.status(), Path("train.jsonl"), None, 1, now=now).to_wire()


def test_status_after_an_operators_stop_says_stopped_everywhere_not_training():
    # The review's screen: `training  stopped, run ...` above `issued run ...: training,
    # completed 122 of 200 steps`. The run an operator stopped is stopped in the run this
    # coordinator issued, with the step it stops before, and in the header once this peer's
    # runner reached that step (stopping until then); a start meanwhile is told to wait.
    from dtfm.peer.status import format_training
    n = Node(wall=WALL)
    n.training(steps=2)
    n.feed(StopRun(("op", "stop"), stop_op(3.0, wall=WALL)), 3.0)
    st = plane_status(n)  # the peers still run up to the stop's step: this one is stopping
    assert (st["state"], st["issued"]["state"]) == ("stopping", "stopped")
    assert "is stopping at a step boundary" in n.c.start_refusal()
    assert st["issued"]["reason"] == "an operator stopped the run after step 2 (train stop)"
    # `train status --follow` waits for the steps up to there (peer/follow.py)
    assert (n.c.operator_stop_step(RUN), n.c.operator_stop_step(b"o" * 16)) == (2, None)
    n.answer("opstop 1", everyone={"stopped": True}, at=3.1)
    n.epoch.handle(RunnerEnded(1, RunEnd(1, "stopped", False), WALL + 4.0), 4.0)  # n0's runner ends there
    st = plane_status(n, now=WALL + 4.0)
    assert (st["state"], st["issued"]["state"], st.get("run_stopped")) == ("stopped", "stopped", True)
    assert "stalled_s" not in st["issued"]
    lines = format_training(st, now=WALL + 5.0)
    assert lines[0].startswith("training  stopped, run 72727272")
    assert "issued run 72727272: stopped, 2 of 100 steps done (an operator stopped the run after step 2 " \
           "(train stop))" in " ".join(lines)
    assert "          epoch 1 ended after step 2: the run was stopped" in lines
    assert not any("training," in line for line in lines[1:])


def test_a_stopped_run_leaves_the_machine_no_deadline_in_the_past():
    # After `train stop` a coordinator of a 2-core test swarm spun at 80 % of a core: its step
    # watch still had the next step due (it never comes), and each tick at that time did nothing.
    n = Node(wall=WALL, timings=transcripts.WATCHED)
    n.training(steps=2)
    n.feed(StopRun(("op", "stop"), stop_op(3.0, wall=WALL)), 3.0)
    n.answer("opstop 1", everyone={"stopped": True}, at=3.1)
    n.epoch.handle(RunnerEnded(1, RunEnd(1, "stopped", False), WALL + 4.0), 4.0)
    for t in (10.0, 60.0, 600.0):
        n.tick(t)
        assert n.c.next_deadline() > t, (t, n.c.next_deadline())


def test_status_of_a_finished_run_counts_every_step():
    # Steps 0..end_step-1 all done: "all 2 steps done", never "completed 1 of 2".
    from dtfm.peer.status import format_training
    n2 = Node()
    n2.train_start(PLACEMENT, steps=2)
    n2.answer("alloc", everyone={"accepted": True}, at=0.1)
    n2.answer("start", everyone={"started": True}, at=0.2)
    for s in (0, 1):
        for p in N[:4]:
            n2.feed(StepReported(p, RUN, report(1, s)), 1.0 + s)
    n2.epoch.handle(RunnerEnded(1, RunEnd(1, "finished", False), 3.0), 3.0)
    st = plane_status(n2)
    assert st["issued"]["state"] == "finished" and st["issued"]["completed"] == 1 and st["issued"]["steps_done"] == 2
    assert st["state"] == "finished"
    lines = format_training(st, now=3.0)
    assert "          issued run 72727272: finished, all 2 steps done, step log train.jsonl" in lines
    assert "          epoch 1 ended after step 2: the run finished" in lines


def test_status_of_a_paused_run_on_its_coordinator_says_paused_not_stopped():
    # n0's own epoch ended when its neighbours went out of reach; the run it issued pauses
    # without a quorum: the header says paused, like the run, not "stopped".
    n = Node()
    holders_out_of_reach(n)
    n.epoch.handle(RunnerEnded(1, RunEnd(1, "peer n1 failed: connection lost", True), 5.6), 5.6)
    assert n.c.phase is Phase.PAUSED
    st = plane_status(n, now=6.0)
    assert (st["state"], st["issued"]["state"]) == ("paused", "paused")
    from dtfm.peer.status import format_training
    lines = format_training(st, now=6.0)
    assert lines[0].startswith("training  paused,")
    assert "          epoch 1 was cut short after step 2: peer n1 failed: connection lost" in lines


# ---- training knobs and model folders ------------------------------------------------------------


def _start_of(at_s: float, **args) -> SignedOp:
    request = {"steps": 100, "seed": 0, "checkpoint_every": 0, "placement": "scheduler", "data_hash": DATA_HASH,
               "data_name": DATA_NAME, **args}
    return sign_op(OPERATOR, "start", now_s=at_s, run_id=RUN, args=request)


def test_a_start_hands_out_its_training_knobs_and_the_model_folder_it_names():
    # The allocation's TrainConfig is the start's knobs (TrainConfig's defaults for the rest), and
    # a start from a model folder trains the shape the shell found in this peer's copy of it.
    digest = "ef" * 32
    spec = dataclasses.replace(PRESETS["tiny"], name=hf_preset(digest), bias=True, activation="gelu_tanh")
    op = _start_of(0.0, init_from=digest, init_name="gpt2-test", lr=0.02, warmup_steps=3, global_batch_seqs=8,
                   micro_batches=2, wire_dtype="bfloat16", weight_decay=0.0, grad_clip_norm=0.25)
    n = Node()
    n.planner.first = PLACEMENT
    out = n.feed(StartRun(("op", "start"), op, DATA_HASH, DATA_NAME, spec), 0.0)
    n.compute("first", 0.0)
    alloc = SignedAllocation.from_wire(n.asks["alloc"].body).open()
    assert alloc.preset == hf_preset(digest) and alloc.model == spec
    assert alloc.train == TrainConfig(seed=0, lr=0.02, warmup_steps=3, global_batch_seqs=8, micro_batches=2,
                                      wire_dtype="bfloat16", weight_decay=0.0, grad_clip_norm=0.25)
    assert msgpack.unpackb(alloc.encode(), strict_map_key=False)[0] == 6  # the knobs ride in the train map
    assert [label(a.key) for a in out] == ["first"]


def test_a_start_from_a_model_folder_the_coordinator_does_not_hold_is_refused_before_any_work():
    n = Node()
    out = n.feed(StartRun(("op", "start"), _start_of(0.0, init_from="ef" * 32, init_name="gpt2-test"),
                          DATA_HASH, DATA_NAME), 0.0)
    assert _costly(out) == []
    [reply] = out
    assert "model folder 'gpt2-test' (sha256 efefefefefef), which the coordinator does not hold" in reply.error
    assert "--model-dir" in reply.error


def test_a_per_link_run_hands_out_the_planners_choice_of_links_in_the_signed_allocation(caplog):
    # `--compress auto`: the planner's placement carries which links and DP groups compress; the
    # allocation (format 5) carries the same, the peers accept it (the operator signed a per-link
    # compression), and the start event and the coordinator's INFO line say which and why.
    n = Node()
    links = LinkCodecs(((True, False),), (False, True))
    note = "links compressed: p0 s0->s1 int4+hadamard/64 (saves 0.400 s/iter); exact links: 1 (hidden)"
    n.planner.first = dataclasses.replace(PLACEMENT, links=links, links_note=note)
    caplog.set_level(logging.INFO, logger="dtfm.control.coordinator")
    n.feed(StartRun(("op", "start"), start_op(steps=100, at_s=n.wall, compress="auto"), DATA_HASH, DATA_NAME), 0.0)
    n.compute("first", 0.0)
    a = SignedAllocation.from_wire(n.asks["alloc"].body).open()
    assert a.compress_links == links and a.compression == parse_compression("auto")
    assert a.plan().link_compressed(0, 0) and not a.plan().link_compressed(0, 1) and a.plan().group_compressed(1)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    out = n.answer("start", everyone={"started": True}, at=0.2)
    assert n.epoch.current is not None and n.epoch.current.compress_links == links  # n0 accepted it too
    start = next(x.record for x in out if isinstance(x, Emit))
    assert start.to_wire()["compress_links"] == note
    assert any(f"epoch 1 compresses per link: {note}" in r.getMessage() for r in caplog.records)


def test_a_per_link_run_whose_planner_chose_nothing_compresses_every_link():
    n = Node()
    n.train_start(PLACEMENT)  # (a placement without links: every link and group takes the run's codec)
    assert "alloc" in n.asks and SignedAllocation.from_wire(n.asks["alloc"].body).open().compress_links is None
    n = Node()
    n.planner.first = PLACEMENT
    n.feed(StartRun(("op", "start"), start_op(at_s=n.wall, compress="pp-int4,per_link=true"), DATA_HASH,
                    DATA_NAME), 0.0)
    n.compute("first", 0.0)
    a = SignedAllocation.from_wire(n.asks["alloc"].body).open()
    assert a.compress_links == LinkCodecs.uniform(2, 2) and a.compression.per_link


# ---- refusing peers (control/coordinator/leftout.py) ---------------------------------------------

BUSY = {"accepted": False, "code": "busy", "reason": "an insider refuses every allocation"}


def named_in(handed) -> list[float]:
    """The times of the hand-outs that name n4."""
    return [t for t, ask in handed if N[4] in ask.peers]


@pytest.mark.parametrize("refusal", [
    BUSY,
    {"accepted": False, "code": "stale", "reason": f"term 1 is older than this peer's term {2**62}"},
    {"reason": "no answer within 5 s"},  # (the shell's answer for a peer that did not answer)
    {"accepted": False, "code": ["not", "a", "code"] * 300, "reason": {"not": "words"}},
])
def test_a_member_that_refuses_every_allocation_is_left_out_and_the_run_goes_on(refusal):
    # N2 of the 2026-11-28 review: n4 joins a 2 x 2 run and refuses every allocation (whatever
    # it says, or nothing). Each refusal leaves it out of the next attempts for a back-off that
    # doubles (30, 60, 120, ... s); it counts toward no limit, so the run never stops; the next
    # attempt goes on over n0..n3 at once; n4's joins start a reconfiguration only when its
    # back-off ends.
    n = Node()
    n.training()
    n.swarm.live.add(N[4])
    handed = n.autopilot(1000.0, {N[4]: refusal})
    assert n.c.phase is Phase.TRAINING and not n.epoch.run_over()
    tried = named_in(handed)
    assert len(tried) == 6  # at 2.2, then after 30, 60, 120, 240 and 480 s (the next, after 600 s, is past 1000 s)
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    assert [round(g / 30) for g in gaps] == [1, 2, 4, 8, 16], gaps
    # every refused hand-out is followed by one without n4, which every other peer accepts
    after = [next(ask for t, ask in handed if t > x) for x in tried]
    assert all(N[4] not in ask.peers for ask in after)
    assert n.epoch.current is not None and set(n.epoch.current.peers) == set(N[:4])
    st = n.c.status()
    assert [x.peer for x in st.left_out] == [N[4]] and st.left_out[0].refusals == 6
    assert st.left_out[0].code == ("no-answer" if "code" not in refusal else
                                   refusal["code"] if isinstance(refusal["code"], str) else "malformed")
    assert st.left_out[0].until - st.left_out[0].since == pytest.approx(600.0)  # (the max back-off)
    events = [x for x in n.lines if x.startswith("  emit left-out")]
    assert len(events) == 6 and all(named(short_id(N[4])) in x for x in events)
    assert not any("emit stopped" in x or "emit paused" in x for x in n.lines)


def test_a_left_out_peers_back_off_ends_and_an_honest_peer_is_placed_again():
    # n4 joins and cannot build its stage once (a transient trouble): left out for 30 s, the run
    # goes on over n0..n3. When the back-off ends it is asked again, placed, and accepts: its
    # record is cleared (a refusal later would be a first one again).
    n = Node()
    n.training()
    n.swarm.live.add(N[4])
    handed = n.autopilot(10.0, {N[4]: {"accepted": False, "code": "build-failed", "reason": "no holder reachable"}})
    assert len(named_in(handed)) == 1 and [x.peer for x in n.c.status().left_out] == [N[4]]
    assert "n4 for 30 s" in named(n.c.status().reason) or n.c.phase is Phase.TRAINING
    handed = n.autopilot(60.0)
    tried = named_in(handed)
    assert len(tried) == 1 and 30.0 < tried[0] < 36.0, tried
    assert n.c.phase is Phase.TRAINING and n.c.status().left_out == ()
    assert N[4] in set(n.epoch.current.spares) | set(n.epoch.current.peers)


def test_a_peer_that_refused_once_and_restarted_is_placed_again_at_once_a_repeated_refuser_waits():
    # Gossip tells that n4 restarted (a higher incarnation): after one refusal it is placed at
    # the next check, not after its back-off. After a second refusal in a row a restart does not
    # shorten the back-off: a peer that bumps its incarnation at will forces no reconfiguration.
    n = Node()
    n.training()
    n.swarm.live.add(N[4])
    handed = n.autopilot(5.0, {N[4]: BUSY})
    assert len(named_in(handed)) == 1
    n.swarm.incarnation[N[4]] = 1
    handed = n.autopilot(10.0, {N[4]: BUSY})
    assert len(named_in(handed)) == 1 and named_in(handed)[0] < 8.0  # at the next check, not at 32 s
    n.swarm.incarnation[N[4]] = 2
    handed = n.autopilot(60.0, {N[4]: BUSY})
    assert named_in(handed) == []  # waits its 60 s
    assert n.c.status().left_out[0].refusals == 2


def test_a_membership_refusal_is_retried_once_then_the_peer_is_left_out():
    # "not-covered" (its gossip does not agree yet) is retried without leaving n4 out, as gossip
    # converges; the same refusal again leaves it out: a peer that says so forever stops nothing.
    n = Node()
    n.training()
    n.swarm.live.add(N[4])
    refusal = {"accepted": False, "code": "not-covered", "reason": "live peers with neither a stage nor a spare"}
    handed = n.autopilot(30.0, {N[4]: refusal})
    tried = named_in(handed)
    assert len(tried) == 2 and tried[1] - tried[0] < 5.0
    assert [x.peer for x in n.c.status().left_out] == [N[4]] and n.c.phase is Phase.TRAINING


def test_a_run_stops_when_no_layout_of_the_accepting_peers_exists_and_says_who_refused():
    # A 1 x 3 run over n0, n1 and n2, n3 a spare; n3 dies, and n1 refuses the next allocation
    # (the run could resume: n1 holds layers 1-2). With n1 left out no 3-stage layout of the
    # peers that accept exists: the run stops at once (waiting would only obey n1), saying which
    # peer refused and why.
    n = Node()
    n.train_start(Placement(((N[0], N[1], N[2]),), ((0, 1), (1, 2), (2, 4)), (N[3],), 1.0, 1.0))
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    n.swarm.live.discard(N[3])
    n.feed(Trigger("peer n3 is dead"), 5.0)
    refusal = {"accepted": False, "code": "data-mismatch", "reason": "another data set"}
    n.autopilot(20.0, {N[1]: refusal})
    assert n.c.phase is Phase.STOPPED and n.epoch.run_over()
    assert named(n.c.status().reason) == (
        "no layout of the peers that accept the allocation exists (no allocation fits the 2 live peers); "
        "left out: n1 refused (data-mismatch: another data set)")
    stopped = [x for x in n.lines if x.startswith("  emit stopped")]
    assert len(stopped) == 1 and "n1 refused" in stopped[0]
    assert [x.peer for x in n.c.status().left_out] == [N[1]]


def test_refusals_with_unhashable_codes_from_most_peers_count_and_raise_nothing():
    # (untrusted answers: a code that is a list or a map is "malformed", never looked up as is)
    n = Node()
    n.training()
    n.feed(Trigger("drift"), 5.0)
    odd = {"accepted": False, "code": ["dead-peer"], "reason": ["x"] * 3}
    n.autopilot(60.0, {N[1]: odd, N[2]: {**odd, "code": {"a": 1}}, N[3]: odd})
    assert n.c.phase is Phase.STOPPED and n.c.status().left_out == ()
    assert n.c.reason.startswith(f"{n.c.timings.max_reconfig_attempts} reconfigurations failed")


def test_a_refuser_of_two_peers_is_not_singled_out_and_the_failures_count():
    # A 1 x 2 run over n0 and n1: n1 refuses as many as accept (n0 alone), so its refusal may
    # be the allocation's fault: nobody is left out and the attempts count as before.
    n = Node(live=N[1:2], voters=N[:2])
    n.train_start(Placement(((N[0], N[1]),), ((0, 2), (2, 4)), (), 1.0, 1.0))
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    n.feed(Trigger("drift"), 5.0)
    n.autopilot(60.0, {N[1]: {"accepted": False, "code": "busy", "reason": "busy"}})
    assert n.c.phase is Phase.STOPPED and n.c.status().left_out == ()
    assert n.c.reason.startswith(f"{n.c.timings.max_reconfig_attempts} reconfigurations failed")


def test_when_every_other_peer_refuses_nobody_is_left_out_and_the_failures_count():
    # The allocation itself is refused (as a stale coordinator's would be): nobody is singled
    # out, and the failed attempts count toward max_reconfig_attempts as before.
    n = Node()
    n.training()
    n.feed(Trigger("drift"), 5.0)
    stale = {"accepted": False, "code": "stale", "reason": "term 1 is older than this peer's term 2"}
    n.autopilot(60.0, {p: stale for p in N[1:4]})
    assert n.c.phase is Phase.STOPPED and n.c.status().left_out == ()
    assert n.c.reason.startswith(f"{n.c.timings.max_reconfig_attempts} reconfigurations failed")


def test_a_start_waits_for_its_live_peers_links_then_places_the_measured_ones():
    from dtfm.control.coordinator.procedure import START_MEASURE_POLL_S, START_MEASURE_WAIT_S
    n = Node(live=N[1:5])
    n.swarm.unmeasured = {N[4]}
    n.planner.first = PLACEMENT
    out = n.feed(StartRun(("op", "start"), start_op(at_s=n.wall), DATA_HASH, DATA_NAME), 0.0)
    assert _costly(out) == [] and n.c.next_deadline() == START_MEASURE_POLL_S  # no placement on a partial view
    n.tick()
    assert "first" not in n.computes and n.c.next_deadline() == 2 * START_MEASURE_POLL_S
    n.swarm.unmeasured = set()  # gossip measured it: every live peer is placed
    n.tick()
    n.compute("first", n.now)
    assert n.planner.firsts[-1]["peers"] == sorted(N[:5])

    late = Node(live=N[1:5])
    late.swarm.unmeasured = {N[4]}
    late.planner.first = PLACEMENT
    late.feed(StartRun(("op", "start"), start_op(at_s=late.wall), DATA_HASH, DATA_NAME), 0.0)
    while "first" not in late.computes:
        assert late.c.next_deadline() <= START_MEASURE_WAIT_S
        late.tick()
    late.compute("first", late.now)  # still unmeasured when the wait ends: placed without it
    assert late.now == START_MEASURE_WAIT_S and late.planner.firsts[-1]["peers"] == sorted(N[:4])


def test_a_peer_that_refused_a_start_is_left_out_of_the_next_start():
    n = Node(live=N[1:5])
    n.train_start(PLACEMENT)
    n.answer("alloc", {N[2]: {"accepted": False, "code": "data-mismatch", "reason": "another data set"}}, 0.1,
             everyone={"accepted": True, "role": "stage"})
    n.answer("unstop", everyone={"stopped": True}, at=0.2)
    n.feed(StartRun(("op", "again"), start_op(b"s" * 16, at_s=1.0), DATA_HASH, DATA_NAME), 1.0)
    n.compute("first", 1.0)
    assert n.planner.firsts[-1]["peers"] == sorted([N[0], N[1], N[3], N[4]])


def test_left_out_back_offs_double_per_refusal_in_a_row_and_end():
    from dtfm.control.coordinator.leftout import LeftOut
    lo = LeftOut(30.0, 100.0, membership_codes={"not-covered"})
    a, b = N[1], N[2]
    assert lo.refused(a, "busy", "x", 0.0, 0) and lo.out(0.0) == {a}
    assert lo.out(29.9) == {a} and lo.out(30.0) == frozenset()  # (placed again when it ends)
    assert lo.refused(a, None, "no answer within 5 s", 31.0, 0)  # again: 60 s, code "no-answer"
    assert [(x.code, x.until - x.since, x.refusals) for x in lo.snapshot(31.0)] == [("no-answer", 60.0, 2)]
    assert lo.refused(a, "busy", "x", 100.0, 0) and lo.snapshot(100.0)[0].until == 200.0  # (capped at 100 s)
    assert not lo.refused(b, "not-covered", "x", 0.0, None) and lo.out(0.0) == {a}  # a first membership refusal
    assert lo.refused(b, "not-covered", "x", 1.0, None) and lo.out(1.0) == {a, b}  # ... and the second
    lo.accepted([b])
    assert lo.out(2.0) == {a}
    assert lo.out(401.0) == frozenset() and lo.refused(a, "busy", "x", 401.0, 0)  # forgotten: a first refusal again
    assert lo.snapshot(401.0)[0].refusals == 1
    assert lo.out(402.0, {a: 1}) == frozenset()  # a restart after one refusal: placed again at once
    lo.refused(a, "busy", "x", 403.0, 1)
    assert lo.out(404.0, {a: 9}) == {a}  # after two in a row it waits
    lo.clear()
    assert lo.out(404.0) == frozenset()


def test_the_operators_next_start_tries_again_a_peer_left_out_of_the_last_run():
    # n2 refused the first run's hand-out and is left out (30 s). The operator stops that run
    # and starts another within the back-off: a new run, so n2 is tried again (and would be left
    # out again if it refused again); a reconfiguration of a run keeps it out.
    n = Node(live=N[1:5], wall=WALL)
    n.train_start(PLACEMENT)
    n.answer("alloc", {N[2]: {"accepted": False, "code": "data-mismatch", "reason": "another data set"}}, 0.1,
             everyone={"accepted": True, "role": "stage"})
    n.answer("unstop", everyone={"stopped": True}, at=0.2)
    n.compute("first", 0.3)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.4)
    n.answer("start", everyone={"started": True}, at=0.5)
    assert [x.peer for x in n.c.status().left_out] == [N[2]]
    n.feed(StopRun(("op", "stop"), stop_op(3.0, wall=WALL)), 3.0)
    [stop] = [k for k in n.asks if k.startswith("opstop")]
    n.answer(stop, everyone={"stopped": True}, at=3.1)
    n.epoch.handle(RunnerEnded(2, RunEnd(0, "stopped", False), WALL + 4.0), 4.0)
    assert n.c.start_refusal() is None, n.c.start_refusal()
    n.planner.first = PLACEMENT
    other = b"o" * 16
    n.feed(StartRun(("op", "start 2"), start_op(other, at_s=WALL + 5.0), DATA_HASH, DATA_NAME), 5.0)
    assert n.c.status().left_out == ()
    n.compute("first", 5.0)
    alloc = SignedAllocation.from_wire(n.asks["alloc"].body).open()
    assert N[2] in alloc.peers  # placed again in the new run


# ---- the transcripts (tests/data/coordinator/*.txt, played by tests/transcripts.py) -----------------


@pytest.mark.parametrize("path", transcripts.files("coordinator"), ids=lambda p: p.stem)
def test_transcript(path):
    transcripts.check(path)


def test_a_wave_of_joined_peers_once_taken_in_leaves_none_waiting():
    play = transcripts.check(transcripts.DATA / "coordinator" / "joined_peers_are_taken_in_as_a_wave_once_joins_settle.txt")
    assert play.n.c.joins.wait_s(8.4) == math.inf  # (the reconfiguration takes every live peer)


def test_a_changed_transcript_fails_and_recording_writes_the_machines_output_back(tmp_path, monkeypatch):
    recorded = transcripts.DATA / "coordinator" / "a_reconfiguration_goes_through_its_phases_in_order.txt"
    text = recorded.read_text()
    changed = tmp_path / recorded.name
    changed.write_text(text.replace("STOP at_step=4 abort=True", "STOP at_step=5 abort=True", 1))
    monkeypatch.setattr(transcripts, "RECORD", False)  # (also while the suite records)
    with pytest.raises(AssertionError, match=r"(?s)answer states at=5.8.*-  ask stop: STOP at_step=5"):
        transcripts.check(changed)
    monkeypatch.setattr(transcripts, "RECORD", True)
    transcripts.check(changed)
    assert changed.read_text() == text  # the output as the machine wrote it, the file otherwise as it was


def test_a_coordinator_left_out_as_a_spare_checks_for_drift_while_the_run_trains():
    """The scheduler may leave the coordinator out of the run (a spare): its drift checks
    still re-estimate the run's step and look for a faster allocation, at the epoch's first
    check and every drift_check_s after."""
    timings = dataclasses.replace(TIMINGS, drift_check_s=30.0, first_drift_steps=5)
    n = Node(live=N[1:5], timings=timings)
    spare = Placement(((N[1], N[2]), (N[3], N[4])), ((0, 2), (2, 4)), (N[0],), 1.0, 1.0)
    n.train_start(spare)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    assert n.epoch.status().phase is EpochPhase.SPARE and n.c.phase is Phase.TRAINING
    n.planner.kind = "keep"
    n.tick(9.9)
    assert "drift" not in n.computes
    n.tick(12.0)  # (5 predicted steps of 1 s and 5 s after the start at 0.2, at the next check)
    assert "drift" in n.computes
    n.compute("drift", 12.5)
    n.tick(40.0)
    assert "drift" not in n.computes
    n.tick(42.1)
    assert "drift" in n.computes


def test_a_coordinator_left_out_as_a_spare_refuses_a_second_start_while_the_run_trains():
    """A coordinator the scheduler left out of the run holds no stage, yet the run it handed out
    trains: another start waits until that run is stopped or over."""
    n = Node(live=N[1:5], wall=WALL)
    n.train_start(Placement(((N[1], N[2]), (N[3], N[4])), ((0, 2), (2, 4)), (N[0],), 1.0, 1.0), at=0.0)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    assert n.epoch.status().phase is EpochPhase.SPARE and n.c.phase is Phase.TRAINING
    out = n.feed(StartRun(("op", "b"), start_op(b"b" * 16, at_s=WALL + 1), DATA_HASH, DATA_NAME), 1.0)
    assert _costly(out) == [] and [r.error for r in out] == ["a run is in progress: `train stop` it first"]


@pytest.mark.parametrize("landed", ["steps", "stop_timeout"])
def test_a_coordinator_left_out_as_a_spare_takes_a_new_start_once_the_stopped_run_reached_its_boundary(landed):
    """An operator's stop ends the run before the same step on every peer, a few steps on: a
    spare coordinator refuses a new start until the step log reaches that boundary (its new
    allocation would end the peers' epoch before it), or until `stop_timeout_s` passes (a peer
    lost on the way never completes those steps)."""
    n = Node(live=N[1:5], wall=WALL)
    n.train_start(Placement(((N[2], N[1]), (N[4], N[3])), ((0, 2), (2, 4)), (N[0],), 1.0, 1.0), at=0.0)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    assert n.epoch.status().phase is EpochPhase.SPARE
    for p in N[1:5]:
        n.feed(StepReported(p, RUN, stage_report(p, 1, 0)), 1.0)
    n.feed(StopRun(("op", "stop"), stop_op(1.5, wall=WALL)), 1.5)
    at = n.c.operator_stop_step(RUN)
    assert at == 3  # (two steps past the logged step 0)
    [stop] = [k for k in n.asks if k.startswith("opstop")]
    n.answer(stop, everyone={"stopped": True}, at=1.6)
    start = StartRun(("op", "b"), start_op(b"b" * 16, at_s=WALL + 2.0), DATA_HASH, DATA_NAME)
    out = n.feed(start, 2.0)
    assert [r.error for r in out] == [f"run {RUN.hex()[:8]} is stopping at a step boundary: start again once it "
                                      "has ended (`dtfm-peer train status`)"]
    assert n.c.start_refusal() is not None
    if landed == "steps":
        for s in (1, 2):
            for p in N[1:5]:
                n.feed(StepReported(p, RUN, stage_report(p, 1, s)), 2.0 + s)
        now = 4.5
    else:
        n.tick(1.5 + TIMINGS.stop_timeout_s - 0.1)
        assert n.c.start_refusal() is not None
        now = 1.5 + TIMINGS.stop_timeout_s
        n.tick(now)
    assert n.c.start_refusal() is None
    n.planner.first = PLACEMENT
    n.feed(StartRun(("op", "c"), start_op(b"c" * 16, at_s=WALL + now), DATA_HASH, DATA_NAME), now)
    assert "first" in n.computes


def test_a_stop_during_the_hand_out_leaves_a_spare_coordinators_next_start_free():
    """A stop while the peers are being started (none steps to a boundary: each ends its stage
    at once) leaves the next start free."""
    n = Node(live=N[1:5], wall=WALL)
    n.train_start(Placement(((N[2], N[1]), (N[4], N[3])), ((0, 2), (2, 4)), (N[0],), 1.0, 1.0), at=0.0)
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    out = n.feed(StopRun(("op", "stop"), stop_op(0.15, wall=WALL)), 0.15)
    assert [a.msg for a in out if isinstance(a, Ask)] == [ControlMsg.STOP]
    assert n.c.start_refusal() is None, n.c.start_refusal()


def test_a_voter_that_left_the_swarm_without_a_stage_is_taken_out_of_the_council_by_a_reconfiguration():
    """A spare voter dies: nothing reconfigures for it, yet a council of five needs four votes,
    so one more voter lost would leave the swarm with no election. Once gossip has counted it
    dead for VOTER_GONE_SETTLE_S, a reconfiguration takes it out of the council, once."""
    from dtfm.control.coordinator.watch import VOTER_GONE_SETTLE_S

    n = Node(live=N[1:5], voters=N[:5])
    n.train_start(dataclasses.replace(PLACEMENT, spares=(N[4],)))
    assert set(SignedAllocation.from_wire(n.asks["alloc"].body).open().voters) == set(N[:5])
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    n.swarm.live.discard(N[4])
    n.tick(5.0)
    assert n.autopilot(5.0 + VOTER_GONE_SETTLE_S - 1.0) == []  # (gossip's word of it settles first)
    handed = n.autopilot(5.0 + VOTER_GONE_SETTLE_S + 5.0)
    assert len(handed) == 1
    alloc = SignedAllocation.from_wire(handed[0][1].body).open()
    assert set(alloc.voters) == set(N[:4]) and alloc.pipelines == PLACEMENT.pipelines
    assert "voter" in alloc.reason and "council takes it out" in alloc.reason
    n.election.voters = alloc.voters  # (the election applies it)
    assert n.autopilot(200.0) == []  # (the council as it is now: nothing more to take out)


def test_a_council_change_the_election_cannot_make_is_not_asked_for_again():
    from dtfm.control.coordinator.watch import VOTER_GONE_SETTLE_S

    n = Node(live=N[1:5], voters=N[:5])
    n.train_start(dataclasses.replace(PLACEMENT, spares=(N[4],)))
    n.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
    n.answer("start", everyone={"started": True}, at=0.2)
    n.election.council_for = lambda voters, epoch: n.election.council if tuple(sorted(voters)) == n.election.council.voters else None
    n.swarm.live.discard(N[4])
    n.tick(5.0)
    handed = n.autopilot(5.0 + VOTER_GONE_SETTLE_S + 5.0)
    assert len(handed) == 1 and set(SignedAllocation.from_wire(handed[0][1].body).open().voters) == set(N[:5])
    assert n.autopilot(300.0) == []
