"""The coordinator as a core that owns its parts (control/coordinator/): the one decision of what
a run is in a word (`run_word`, `run_over`, phase.py) as a table, the run-over fact told to the
epoch machine only by its events (`RunClosed`, `RunReopened`), the typed request keys, the
operator queue's leaving peers as a query that changes nothing, and the parts' sizes."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dtfm.control.coordinator.keys import Drift, Fence, Gaps, Keep, OperatorStop, Probe, ProbeKey, ProcStep, Step
from dtfm.control.actions import Reply
from dtfm.control.coordinator.machine import PeerLeaving, Reschedule, StopRun
from dtfm.control.coordinator.phase import CoordinatorStatus, Phase, run_over, run_word
from dtfm.control.epoch.machine import EpochMachine, EpochPhase, EpochStatus, OperationTaken, RunClosed, RunReopened
from dtfm.control.epoch.report import RunEnd

from coordinator_fixtures import Node, reschedule_op, stop_op
from machine_trace import N, RUN, FakeElection, alloc
from paths import ROOT

COORDINATOR = ROOT / "control" / "coordinator"
OTHER_RUN = b"o" * 16


def epoch_status(*, run: bytes | None = RUN, stopped: bool = False, end: str | None = None) -> EpochStatus:
    a = alloc(run_id=run) if run is not None else None
    return EpochStatus(phase=EpochPhase.TRAINING if a is not None else None, alloc=a, step=None, fetched_bytes=0,
                       last_report=None, last_end=None, end=RunEnd(9, end, False) if end is not None else None,
                       run_stopped=stopped)


def coordinator_status(phase: Phase, run: bytes | None = RUN) -> CoordinatorStatus:
    return CoordinatorStatus(phase=phase, run_id=run, epoch=1, reason="", completed=None, end_step=100, recent=(),
                             started_at=None, last_reconfig=None)


@pytest.mark.parametrize("epoch, phase, run, word, over", [
    # the coordinator's phase, while this peer's epoch machine holds the run going
    (epoch_status(), Phase.TRAINING, RUN, "training", False),
    (epoch_status(), Phase.PAUSED, RUN, "paused", False),
    (epoch_status(), Phase.REFUSED, RUN, "refused", False),
    (epoch_status(), Phase.FINISHED, RUN, "finished", True),
    # a finished phase of another run is not this run's end
    (epoch_status(), Phase.FINISHED, OTHER_RUN, "finished", False),
    # over without finishing (an operator's stop, a run that cannot go on): stopped, whatever the procedure
    (epoch_status(stopped=True), Phase.TRAINING, RUN, "stopped", True),
    (epoch_status(stopped=True), Phase.PLANNING, RUN, "stopped", True),
    (epoch_status(stopped=True), Phase.STOPPED, RUN, "stopped", True),
    # a phase that says the run is over stays what it says
    (epoch_status(stopped=True), Phase.FINISHED, RUN, "finished", True),
    # its stage ran the last step, or no run here: over, stopped unless the coordinator logged the end
    (epoch_status(end="finished"), Phase.TRAINING, RUN, "stopped", True),
    (epoch_status(run=None), Phase.HANDING_OUT, RUN, "stopped", True),
    (epoch_status(end="stopped"), Phase.TRAINING, RUN, "training", False),
])
def test_the_run_word_and_whether_the_run_is_over_are_one_decision(epoch, phase, run, word, over):
    c = coordinator_status(phase, run)
    assert run_word(epoch, c) == word
    assert run_over(epoch, c) is over


def test_the_epoch_machine_alone_keeps_that_a_run_is_over_and_hears_it_by_events():
    m = EpochMachine(N[0], FakeElection(N[0], voters=tuple(N[:4]), coordinator=N[0]), heartbeat_wait_s=1.0,
                     coordinator_lost_after_s=5.0)
    m.restore(RUN, 1, 1, alloc(), ())
    assert not m.run_over() and not m.status().run_stopped
    assert m.handle(RunClosed(RUN, "an operator stopped the run after step 3"), 1.0) == []
    assert m.over_without_finishing(RUN) and m.run_over() and m.status().run_stopped
    m.handle(RunReopened(OTHER_RUN), 2.0)  # another run's resume changes nothing here
    assert m.over_without_finishing(RUN)
    m.handle(RunReopened(RUN), 3.0)
    assert not m.over_without_finishing(RUN) and not m.run_over()
    assert not any(hasattr(m, name) for name in ("mark_stopped", "resume", "stopped_by_operator"))


def _fed(n: Node) -> list:
    """The events the coordinator feeds `n`'s epoch machine from now on."""
    fed: list = []
    handle = n.epoch.handle
    n.epoch.handle = lambda ev, now: fed.append(ev) or handle(ev, now)  # type: ignore[method-assign]
    return fed


def test_an_operators_stop_reaches_this_peers_epoch_machine_as_its_event():
    n = Node()
    n.training(steps=2)
    fed = _fed(n)
    n.feed(StopRun(("op", "stop"), stop_op(3.0)), 3.0)
    assert [type(ev) for ev in fed] == [RunClosed]
    assert n.epoch.over_without_finishing(RUN) and n.c.status().phase is Phase.STOPPED


def test_a_reschedule_taken_reaches_this_peers_epoch_machine_as_its_event():
    n = Node()
    n.training(steps=2)
    fed = _fed(n)
    op = reschedule_op(3.0)
    n.feed(Reschedule(("op", "r"), op), 3.0)
    assert [type(ev) for ev in fed] == [OperationTaken] and n.epoch.taken.taken(op, RUN)
    [reply] = [a for a in n.feed(Reschedule(("op", "again"), op), 3.5) if isinstance(a, Reply)]
    assert reply.error is not None and "taken" in reply.error  # (a replay is refused before any work)


def test_request_keys_are_typed_values_that_print_as_the_transcripts_name_them():
    shown = [str(k) for k in (ProcStep(3, Step.STATES), ProcStep(3, Step.OFFER, (0, 2)), ProcStep(4, Step.FIRST),
                             ProbeKey(Probe.DEADLINE), Gaps(2), OperatorStop(5), Drift(), Fence(1), Keep(2))]
    assert shown == ["states", "offer 0-2", "first", "probe deadline", "gaps 2", "opstop 5", "drift", "fence 1",
                     "keep 2"]
    assert ProcStep(3, Step.STATES) != ProcStep(4, Step.STATES)  # a failed procedure's late answers go nowhere
    assert len({ProcStep(3, Step.OFFER, (0, 2)), ProcStep(3, Step.OFFER, (2, 4)), ProbeKey(Probe.EPOCH)}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        ProcStep(3, Step.STATES).proc = 4  # type: ignore[misc]


def test_the_leaving_peers_are_a_query_that_changes_nothing():
    n = Node()
    n.feed(PeerLeaving(("leave", 1), N[5]), 1.0)  # (a peer outside the run: answered at once)
    kept = n.c.timings.leaving_kept_s
    assert n.c.leaving(1.0 + kept + 1) == frozenset()  # past its time
    assert n.c.leaving(2.0) == {N[5]}  # asking about a later time forgot nothing


def _classes():
    for path in sorted(COORDINATOR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                yield f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_part_of_the_coordinator_grows_into_the_machine_it_was_split_from():
    sizes = dict(_classes())
    assert {"machine.py:Coordinator", "operator_queue.py:OperatorQueue", "procedure.py:Procedures",
            "handout.py:HandOut", "watch.py:RunWatch"} <= set(sizes)
    assert {name: lines for name, lines in sizes.items() if lines > 450} == {}
