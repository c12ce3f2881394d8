"""The epoch machine (control/epoch/machine.py) through its public API: `handle(event, now)`
and its queries. A peer is driven through its part in epochs and what it did is compared with
a transcript (one line per event, its actions indented under it; see tests/machine_trace.py);
the refusals of an allocation are a table. The protocol is in docs/control.md."""

from __future__ import annotations

import dataclasses

import pytest
from machine_trace import (
    DATA_HASH,
    INTRUDER,
    OPERATOR,
    OPERATORS,
    RUN,
    TINY,
    FakeElection,
    N,
    alloc,
    context,
    describe,
    named,
    report,
    same_transcript,
    show,
    start_op,
)

from dtfm.control import Allocation, RunEnd, sign_op
from dtfm.control.actions import Reply
from dtfm.control.epoch.access import fetch_refusal
from dtfm.control.epoch.machine import (
    RESTORED_ASK_S,
    AllocationOffered,
    ApplyToElection,
    BuildFailed,
    BuildStage,
    EpochDone,
    EpochMachine,
    EpochPhase,
    MemberGone,
    RunnerEnded,
    StageBuilt,
    StartAsked,
    StepDone,
    StopAsked,
    StopRunnerAt,
    EpochTick as Tick,
    RunClosed,
    WaitForCoordinator,
)
from dtfm.control.epoch.taken import MAX_OPS_PER_RUN, MAX_RUNS, TakenOps, load_taken, save_taken
from dtfm.control.refusals import Refused
from dtfm.train import parse_compression

HEARTBEAT_WAIT_S = 1.4
LOST_AFTER_S = 6.0
STOP = sign_op(OPERATOR, "stop", now_s=3.0, run_id=RUN)  # the operator's stop of RUN


class Peer:
    """One peer's epoch machine under an election the test sets, playing the shell's part for
    ApplyToElection (the election takes the applied (term, epoch) and voters); everything the
    machine did is in `lines`."""

    def __init__(self, me: bytes = N[1], *, coordinator: bytes | None = N[0], term: int = 1):
        self.me = me
        self.election = FakeElection(me, term=term, coordinator=coordinator, voters=tuple(N[:4]))
        self.m = EpochMachine(me, self.election, heartbeat_wait_s=HEARTBEAT_WAIT_S,
                              coordinator_lost_after_s=LOST_AFTER_S, operators=OPERATORS)
        self.lines: list[str] = []
        self._keys = 0

    def key(self, what: str) -> tuple:
        self._keys += 1
        return (what, self._keys)

    def feed(self, event, now: float = 0.0) -> list:
        actions = self.m.handle(event, now)
        self.lines.append(f"{now:g} {describe(event)}")
        for a in actions:
            if isinstance(a, ApplyToElection):
                self.election.apply(a)
            if isinstance(a, Reply):  # the answer to this event's request
                assert a.key == event.key, (a, event)
            self.lines.append("  " + show(a, keys=False))
        return actions

    def offer(self, a: Allocation, now: float = 0.0, **ctx) -> list:
        return self.feed(AllocationOffered(self.key("a"), a, context(self.me, **ctx)), now)

    def accept(self, a: Allocation, now: float = 0.0) -> None:
        """Offered, built at its start step and started by its issuer."""
        [build] = [x for x in self.offer(a, now) if isinstance(x, BuildStage)]
        self.feed(StageBuilt(build.key, a.epoch, a.start_step), now)
        self.feed(StartAsked(self.key("s"), a.issuer, a.run_id, a.epoch), now)

    def transcript(self, want: str) -> None:
        same_transcript(self.lines, want)
        self.lines.clear()


# ---- accepting an allocation ----------------------------------------------------------------------


def test_an_epoch_is_accepted_built_started_stepped_and_stopped():
    p = Peer(N[1])
    a = alloc()
    [*_, build] = p.offer(a, 0.0)
    assert p.m.status().phase is EpochPhase.BUILDING and p.m.current == a
    p.feed(StageBuilt(build.key, 1, 0), 0.5)
    p.feed(StartAsked(p.key("s"), N[2], RUN, 1), 1.0)
    p.feed(StartAsked(p.key("s"), N[0], RUN, 2), 1.0)
    p.feed(StartAsked(p.key("s"), N[0], RUN, 1), 1.0)
    p.feed(StartAsked(p.key("s"), N[0], RUN, 1), 1.1)
    p.feed(StepDone(report(1, 0)), 2.0)
    p.feed(StepDone(report(1, 1)), 3.0)
    p.feed(StopAsked(p.key("t"), N[1], b"o" * 16, 5), 3.5)
    p.feed(StopAsked(p.key("t"), N[5], RUN, 5), 3.5)
    p.feed(StopAsked(p.key("t"), N[3], RUN, 5), 3.5)
    p.feed(StopAsked(p.key("t"), N[0], RUN, 5), 3.5)
    assert not p.m.run_over() and not p.m.over_without_finishing(RUN)
    p.feed(StopAsked(p.key("t"), N[0], RUN, 4, final=True, op=STOP), 3.6)
    assert p.m.run_over() and p.m.over_without_finishing(RUN)
    p.feed(StepDone(report(1, 2)), 4.0)
    p.feed(StepDone(report(1, 3)), 5.0)
    p.feed(RunnerEnded(1, RunEnd(3, "stopped", False), 1e9), 5.0)
    p.feed(EpochDone(1), 5.0)
    p.transcript("""
        0 ALLOCATION term 1 epoch 1 from n0
          apply term 1 epoch 1 voters n0 n1 n2 n3
          persist term 1 epoch 1
          build epoch 1 from nothing
        0.5 stage of epoch 1 built at step 0
          reply: accepted=True role=stage stage=1 pipeline=0 fetched_bytes=0 fetch_s=0.0
        1 START epoch 1 from n2
          reply: started=False (only the issuer starts an epoch)
        1 START epoch 2 from n0
          reply: started=False (no such epoch accepted here)
        1 START epoch 1 from n0
          start runner of epoch 1
          reply: started=True
        1.1 START epoch 1 from n0
          reply: started=True
        2 step 0 of epoch 1 done
          send STEP to n0: epoch=1 step=0 loss=5.0
        3 step 1 of epoch 1 done
          send STEP to n0: epoch=1 step=1 loss=4.9
        3.5 STOP before step 5 from n1
          reply: stopped=False (not in that run)
        3.5 STOP before step 5 from n5
          reply: stopped=False (only the coordinator stops an epoch)
        3.5 STOP before step 5 from n3
          reply: stopped=False (only the coordinator stops an epoch)
        3.5 STOP before step 5 from n0
          stop runner of epoch 1 before step 5
          reply: stopped=True
        3.6 STOP before step 4 final (signed) from n0
          stop runner of epoch 1 before step 4
          reply: stopped=True
        4 step 2 of epoch 1 done
          send STEP to n0: epoch=1 step=2 loss=4.8
        5 step 3 of epoch 1 done
          send STEP to n0: epoch=1 step=3 loss=4.7
        5 runner of epoch 1 ended after step 3: stopped
        5 epoch 1 let go of its stage
    """)
    st = p.m.status()
    assert st.phase is EpochPhase.ENDED and st.step == 3 and st.last_report == report(1, 3)
    assert st.last_end is not None and st.last_end["completed"] == 3 and not st.last_end["failed"]
    assert p.election.last_applied == (1, 1) and p.m.applied == {RUN: (1, 1)}
    # the stage stays in memory for the next epoch, at its step and one step back
    assert p.m.held_at(RUN, (2, 4), 4) == ("stage", 1)
    assert p.m.held_at(RUN, (2, 4), 3) == ("snapshot", 1)
    assert p.m.held_at(RUN, (2, 4), 2) is None and p.m.held_at(RUN, (0, 2), 4) is None
    state = p.m.run_state(((2, 4, 2),))
    assert (state.run_id, state.term, state.epoch, state.layers, state.at, state.prev, state.running) == (
        RUN, 1, 1, (2, 4), 4, 3, False)
    assert state.checkpoints == ((2, 4, 2),) and [r.step for r in state.reports] == [0, 1, 2, 3]


def test_the_coordinator_of_a_newer_term_may_stop_a_run_it_did_not_issue():
    p = Peer(N[1])
    p.accept(alloc())
    p.lines.clear()
    p.election.term, p.election.coordinator = 2, N[4]  # n4 is in no pipeline of the run
    p.feed(StopAsked(p.key("t"), N[4], RUN, 7, abort=True), 1.0)
    p.transcript("""
        1 STOP before step 7 abort from n4
          abort runner (aborted for a reconfiguration)
          reply: stopped=True
    """)


def test_a_stop_of_another_epoch_is_refused():
    # A coordinator whose hand-out of epoch 1 was refused undoes it with a STOP naming epoch 1;
    # a peer that applied a newer epoch from the next coordinator meanwhile (here the same
    # peer's own deposed procedure, which outlived its term) must not stop that one.
    p = Peer(N[1])
    p.accept(alloc(epoch=2))
    p.lines.clear()
    p.feed(StopAsked(p.key("t"), N[1], RUN, 0, epoch=1), 1.0)
    p.feed(StopAsked(p.key("t"), N[0], RUN, 5, epoch=2), 2.0)
    p.transcript("""
        1 STOP before step 0 from n1
          reply: stopped=False (a stop of epoch 1, this peer is in epoch 2)
        2 STOP before step 5 from n0
          stop runner of epoch 2 before step 5
          reply: stopped=True
    """)


def test_a_stop_before_the_start_cancels_the_runner():
    p = Peer(N[1])
    [*_, build] = p.offer(alloc())
    p.feed(StageBuilt(build.key, 1, 0))
    p.lines.clear()
    p.feed(StopAsked(p.key("t"), N[0], RUN, 0))
    p.transcript("""
        0 STOP before step 0 from n0
          abort runner (stopped before it started)
          reply: stopped=True
    """)


REFUSALS = [
    # (what, the allocation's changes, what the peer knows, code, words of the reason)
    ("another data set", {"data_hash": "0" * 64, "data_name": "issuer.txt"}, {}, "data-mismatch",
     ["'issuer.txt'", "'mine.txt'", "--data"]),
    ("a peer unknown here", {"pipelines": ((N[0], N[1]), (N[2], N[4]))}, {"known": N[:4]}, "unknown-peer", ["n4"]),
    ("a peer dead here", {"pipelines": ((N[0], N[1]), (N[2], N[4]))}, {}, "dead-peer", ["n4"]),
    ("no place for this peer", {"pipelines": ((N[0], N[2]), (N[3], N[4]))}, {"live": N[:5]}, "not-member", ["n1"]),
    ("a live peer left out", {}, {"live": N[:5]}, "not-covered", ["n4"]),
    ("an unknown preset", {"preset": "huge"}, {}, "unknown-preset", ["'huge'"]),
    ("another model", {"model": dataclasses.replace(TINY, n_embd=64)}, {}, "preset-mismatch", ["n_embd"]),
    ("an older term", {"term": 0}, {}, "stale", ["term 0"]),
]


@pytest.mark.parametrize("what, changes, knows, code, words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_an_allocation_is_refused_with_the_reason(what, changes, knows, code, words):
    p = Peer(N[1])
    [reply] = p.offer(alloc(**changes), **knows)
    assert isinstance(reply, Reply) and reply.value["accepted"] is False and reply.value["code"] == code
    assert reply.error == reply.value["reason"]
    reason = p.lines[-1]  # the reply's line, peer ids by name
    for w in words:
        assert w in reason, (w, reason)
    assert p.m.current is None and p.m.applied == {} and p.election.last_applied == (0, 0)


OPERATOR_REFUSALS = [
    # (what, the allocation's operator start, words of the reason)
    ("no operator's start", b"", ["no operator's signed start"]),
    ("not a signed operation", b"\x92\xc4\x01x\xc4\x01y", ["operator start is malformed"]),
    ("signed by a key the swarm does not name", start_op(key=INTRUDER).encode(), ["not an operator of this swarm"]),
    ("the start of another run", start_op(b"o" * 16).encode(), ["for run 6f6f6f6f, not run 72727272"]),
    ("a stop, not a start", sign_op(OPERATOR, "stop", now_s=0.0, run_id=RUN).encode(), ["carries an operator's stop"]),
    ("a start of other data", start_op(data_hash="cd" * 32).encode(), ["differs from the operator's start in data"]),
    ("a start of other steps and seed", start_op(steps=7, seed=3).encode(), ["in steps, seed"]),
    ("a compressed start, an exact allocation", start_op(compress="diloco").encode(), ["in compression"]),
]


COMPRESSION_STARTS = [
    # (what, the operator's --compress, the allocation's, refused)
    ("both exact", None, "exact", False),
    ("the same preset", "slow-link", "slow-link", False),
    ("the same fields, written another way", "diloco,inner_steps=8", "exact,dp_method=diloco,dp_topk_fraction=1.0,"
     "dp_value_bits=2,outer_momentum=0.8,inner_steps=8", False),
    ("an exact start, a compressed allocation", None, "pp-int8", True),
    ("another preset", "pp-int4", "pp-int8", True),
    ("one field changed", "diloco", "diloco,inner_steps=17", True),
]


@pytest.mark.parametrize("what, signed, runs, refused", COMPRESSION_STARTS, ids=[c[0] for c in COMPRESSION_STARTS])
def test_the_allocation_runs_the_compression_the_operator_signed(what, signed, runs, refused):
    p = Peer(N[1])
    comp = parse_compression(runs)
    start = start_op(**({"compress": signed} if signed else {})).encode()
    out = p.offer(alloc(compression=comp, operator_start=start))
    if refused:
        [reply] = out
        assert reply.value["code"] == "no-operator" and "differs from the operator's start in compression" \
            in reply.value["reason"], reply
        assert p.m.current is None
    else:
        [build] = [x for x in out if isinstance(x, BuildStage)]
        assert build.alloc.compression == comp


@pytest.mark.parametrize("what, signed, words", OPERATOR_REFUSALS, ids=[r[0] for r in OPERATOR_REFUSALS])
def test_a_run_not_started_by_an_operator_is_refused(what, signed, words):
    # Every allocation carries its run's signed start; the first one of a new run (and any
    # later one) without a valid start by an operator of the swarm is refused before anything.
    p = Peer(N[1])
    [reply] = p.offer(alloc(operator_start=signed))
    assert isinstance(reply, Reply) and reply.value["code"] == "no-operator", reply
    for w in words:
        assert w in reply.value["reason"], (w, reply.value["reason"])
    assert p.m.current is None and p.m.applied == {} and p.election.last_applied == (0, 0)
    p.accept(alloc())  # the same allocation with the operator's start is taken
    assert p.m.current == alloc() and p.m.status().phase is EpochPhase.TRAINING


STOP_RULES = [
    # (what, sender, the coordinator the peer recognises, final, the signed stop, stopped, words)
    ("an epoch's stop from the coordinator", N[0], N[0], False, None, True, []),
    ("an epoch's stop from the epoch's issuer, no longer coordinator", N[0], N[4], False, None, True, []),
    ("an epoch's stop from a newer coordinator", N[4], N[4], False, None, True, []),
    ("an epoch's stop from a peer of the run", N[3], N[0], False, None, False, ["only the coordinator"]),
    ("the operator's stop from the coordinator", N[0], N[0], True, STOP, True, []),
    ("the operator's stop from a newer coordinator", N[4], N[4], True, STOP, True, []),
    ("the operator's stop from a peer of the run", N[3], N[0], True, STOP, False, ["recognises"]),
    ("the operator's stop from the old issuer", N[0], N[4], True, STOP, False, ["recognises"]),
    ("a final stop without the operator's", N[0], N[0], True, None, False, ["none was given"]),
    ("a stop signed by another key", N[0], N[0], True, sign_op(INTRUDER, "stop", now_s=0.0, run_id=RUN), False,
     ["not an operator of this swarm"]),
    ("the operator's stop of another run", N[0], N[0], True, sign_op(OPERATOR, "stop", now_s=0.0, run_id=b"o" * 16),
     False, ["not run 72727272"]),
    ("the operator's reschedule as a stop", N[0], N[0], True, sign_op(OPERATOR, "reschedule", now_s=0.0, run_id=RUN),
     False, ["carries an operator's reschedule"]),
    ("a forged signature", N[0], N[0], True, dataclasses.replace(STOP, signature=bytes(64)), False,
     ["bad operator signature"]),
]


@pytest.mark.parametrize("what, sender, coordinator, final, op, stopped, words", STOP_RULES,
                         ids=[r[0] for r in STOP_RULES])
def test_who_may_stop_an_epoch_and_end_the_run(what, sender, coordinator, final, op, stopped, words):
    # A run ends for everyone only by the operator's signed stop of that run, carried by the
    # coordinator this peer recognises; an epoch is stopped (for a reconfiguration) only by
    # that coordinator or the epoch's issuer. Peers of the run cannot end it.
    p = Peer(N[1])
    p.accept(alloc())
    p.election.coordinator = coordinator
    [*_, reply] = p.feed(StopAsked(p.key("t"), sender, RUN, 4, final=final, op=op), 1.0)
    assert reply.value["stopped"] is stopped, reply
    for w in words:
        assert w in reply.value["reason"], (w, reply.value["reason"])
    assert p.m.over_without_finishing(RUN) is (stopped and final)
    assert p.m.run_over() is (stopped and final)


@pytest.mark.parametrize("final, op", [(True, STOP), (False, None)])
def test_only_an_operators_stop_asks_the_runner_to_checkpoint_where_it_ends(final, op):
    # The run is over after an operator's stop: the runner saves its stage at the boundary (see
    # control/epoch/runner.py); a reconfiguration's stop keeps it in memory for the next epoch.
    p = Peer(N[1])
    [*_, build] = p.offer(alloc(), 0.0)
    p.feed(StageBuilt(build.key, 1, 0), 0.5)
    p.feed(StartAsked(p.key("s"), N[0], RUN, 1), 1.0)
    actions = p.feed(StopAsked(p.key("t"), N[0], RUN, 4, final=final, op=op), 2.0)
    assert [a for a in actions if isinstance(a, StopRunnerAt)] == [StopRunnerAt(1, 4, final=final)]


def test_a_new_epoch_of_a_run_the_operator_stopped_resumes_it():
    # `train resume`: the coordinator hands out epoch 2 of the stopped run; a peer that applies
    # it no longer counts the run as over (its coordinator may reconfigure it again).
    p = Peer(N[1])
    p.accept(alloc())
    p.feed(StopAsked(p.key("t"), N[0], RUN, 4, final=True, op=STOP), 1.0)
    p.feed(RunnerEnded(1, RunEnd(3, "stopped", False), 1e9), 2.0)
    assert p.m.run_over() and p.m.over_without_finishing(RUN)
    p.offer(alloc(epoch=2, start_step=4), 3.0)
    assert not p.m.run_over() and not p.m.over_without_finishing(RUN)


def test_a_copied_operators_stop_is_refused_after_the_runs_last_resume_out_of_its_time_or_taken_before(tmp_path):
    # The run was resumed by an operator's resume signed at 5 s (its allocation says so): the
    # stop from before it (a copy of the one that ended the run then) is refused, so is a stop
    # signed more than the skew window ago; the operator's new stop is taken once, and a copy
    # of it is refused, also by the same peer restarted with its operations.json.
    p = Peer(N[1])
    p.accept(alloc(epoch=2, start_step=4, last_op_ms=5_000))
    new = sign_op(OPERATOR, "stop", now_s=6.0, run_id=RUN)
    for op, now, words in [(STOP, 6.0, "not newer than the run's last resume or reschedule"),
                           (new, 6.0 + 301, "signed 301 s ago")]:
        [reply] = p.feed(StopAsked(p.key("t"), N[0], RUN, 8, final=True, op=op), now)
        assert reply.value["stopped"] is False and words in reply.value["reason"], reply
        assert not p.m.run_over()
    [*_, reply] = p.feed(StopAsked(p.key("t"), N[0], RUN, 8, final=True, op=new), 7.0)
    assert reply.value["stopped"] is True and p.m.over_without_finishing(RUN)
    [reply] = p.feed(StopAsked(p.key("t"), N[0], RUN, 8, final=True, op=new), 7.5)
    assert reply.value == {"stopped": False, "reason": "this stop was taken already: sign a new one"}
    save_taken(tmp_path, p.m.taken.to_json())
    again = Peer(N[1])
    again.m.restore_taken(load_taken(tmp_path))
    again.accept(alloc(epoch=2, start_step=4, last_op_ms=5_000))
    [reply] = again.feed(StopAsked(again.key("t"), N[0], RUN, 8, final=True, op=new), 8.0)
    assert reply.value == {"stopped": False, "reason": "this stop was taken already: sign a new one"}
    assert not again.m.run_over()


def test_the_operations_taken_are_bounded_and_a_damaged_file_is_ignored(tmp_path, caplog):
    t = TakenOps()
    ops = [sign_op(OPERATOR, "reschedule", now_s=float(k), run_id=RUN) for k in range(MAX_OPS_PER_RUN + 10)]
    for signed in ops:  # each within the skew window of the last: only the newest are kept
        t.take(signed.open(), signed, now_s=100.0, skew_s=300.0)
    assert t.floor_ms(RUN) == (MAX_OPS_PER_RUN + 9) * 1000
    kept = TakenOps.from_json(t.to_json())
    assert not kept.taken(ops[9], RUN) and kept.taken(ops[10], RUN) and kept.floor_ms(RUN) == t.floor_ms(RUN)
    late = sign_op(OPERATOR, "stop", now_s=1000.0, run_id=RUN)  # the others are out of the window now
    t.take(late.open(), late, now_s=1000.0, skew_s=300.0)
    assert [t.taken(s, RUN) for s in (ops[-1], late)] == [False, True] and t.floor_ms(RUN) == ops[-1].open().issued_at_ms
    for k in range(MAX_RUNS + 3):
        run = bytes([k]) * 16
        signed = sign_op(OPERATOR, "resume", now_s=1000.0, run_id=run)
        t.take(signed.open(), signed, now_s=1000.0, skew_s=300.0)
    assert len(t.to_json()["runs"]) == MAX_RUNS and t.floor_ms(RUN) == 0  # the runs touched last
    for damaged in ("{", '{"runs": 3}', '{"runs": [{"run": "zz", "floor_ms": 0, "ops": {}}]}',
                    '{"runs": [{"run": "' + "72" * 16 + '", "floor_ms": -1, "ops": {}}]}',
                    '{"runs": [{"run": "' + "72" * 16 + '", "floor_ms": 0, "ops": {"ab": 1}}]}'):
        (tmp_path / "operations.json").write_text(damaged)
        assert load_taken(tmp_path).to_json() == {"runs": []}
    assert "operations.json is damaged" in caplog.text
    assert load_taken(tmp_path / "nowhere").to_json() == {"runs": []}


def test_an_allocation_already_applied_is_refused_as_stale():
    p = Peer(N[1])
    p.accept(alloc())
    p.lines.clear()
    p.offer(alloc(), 1.0)
    p.offer(alloc(term=1, epoch=2, issuer=N[2], voters=(N[0], N[1], N[2], N[3])), 2.0)
    p.transcript("""
        1 ALLOCATION term 1 epoch 1 from n0
          reply: accepted=False code=stale (term 1 epoch 1 is not newer than term 1 epoch 1, already applied for this run)
        2 ALLOCATION term 1 epoch 2 from n2
          wait for the coordinator until 3.4
    """)


def test_an_allocation_of_an_unrecognised_coordinator_waits_then_is_refused():
    # This peer knows no coordinator of term 3 yet: the allocation waits for its first heartbeat
    # (offered again when the election changes), then is refused; nothing is applied. Its own
    # allocation is never waited for.
    p = Peer(N[1], coordinator=None)
    [wait] = p.offer(alloc(term=3, issuer=N[2]), 10.0)
    assert isinstance(wait, WaitForCoordinator) and wait.until == 10.0 + HEARTBEAT_WAIT_S
    [again] = p.feed(wait.offer, 10.5)  # the election changed, still no coordinator of term 3
    p.feed(again.offer, again.until)
    p.offer(alloc(term=3, issuer=N[1], pipelines=((N[1], N[0]), (N[2], N[3]))), 12.0)
    p.transcript("""
        10 ALLOCATION term 3 epoch 1 from n2
          wait for the coordinator until 11.4
        10.5 ALLOCATION term 3 epoch 1 from n2 (again, waited until 11.4)
          wait for the coordinator until 11.4
        11.4 ALLOCATION term 3 epoch 1 from n2 (again, waited until 11.4)
          reply: accepted=False code=not-coordinator (this peer knows no coordinator of term 3 yet)
        12 ALLOCATION term 3 epoch 1 from n1
          reply: accepted=False code=not-coordinator (this peer knows no coordinator of term 3 yet)
    """)
    assert p.m.current is None and p.election.last_applied == (0, 0)
    # the heartbeat comes within the wait: applied
    [wait] = p.offer(alloc(term=3, issuer=N[2], voters=(N[1], N[2], N[3])), 20.0)
    p.election.term, p.election.coordinator = 3, N[2]
    p.feed(wait.offer, 20.2)
    p.transcript("""
        20 ALLOCATION term 3 epoch 1 from n2
          wait for the coordinator until 21.4
        20.2 ALLOCATION term 3 epoch 1 from n2 (again, waited until 21.4)
          apply term 3 epoch 1 voters n1 n2 n3
          persist term 3 epoch 1
          build epoch 1 from nothing
    """)


def test_a_resumed_epoch_without_holders_fails_to_build_and_never_runs():
    # Starting at step 5 needs the stages' weights; with no holdings the shell cannot build
    # the stage (it never re-initialises weights): the allocation is refused, nothing starts.
    p = Peer(N[1])
    [*_, build] = p.offer(alloc(start_step=5), 0.0)
    p.feed(BuildFailed(build.key, 1, "build-failed", "n1: starting at step 5 ... names no holders"), 0.1)
    p.feed(StopAsked(p.key("t"), N[0], RUN, 0), 0.2)
    p.transcript("""
        0 ALLOCATION term 1 epoch 1 from n0
          apply term 1 epoch 1 voters n0 n1 n2 n3
          persist term 1 epoch 1
          build epoch 1 from nothing
        0.1 building epoch 1 failed: build-failed
          reply: accepted=False code=build-failed (n1: starting at step 5 ... names no holders)
        0.2 STOP before step 0 from n0
          abort runner (stopped before it started)
          reply: stopped=True
    """)
    assert p.m.status().phase is EpochPhase.REFUSED
    state = p.m.run_state()
    assert state.layers is None and state.at is None and not state.running
    assert p.m.held_at(RUN, (2, 4), 5) is None


def test_start_of_an_epoch_that_cannot_run_is_not_confirmed():
    p = Peer(N[1])
    [*_, build] = p.offer(alloc(), 0.0)
    p.feed(BuildFailed(build.key, 1, "connect-failed", "n1: no route"), 0.1)
    [reply] = p.feed(StartAsked(p.key("s"), N[0], RUN, 1), 0.2)
    assert reply.value["started"] is False


def test_a_new_epoch_replaces_the_running_one_and_builds_from_it():
    p = Peer(N[1])
    p.accept(alloc())
    for s in range(3):
        p.feed(StepDone(report(1, s)), 1.0 + s)
    p.lines.clear()
    second = alloc(epoch=2, start_step=3, pipelines=((N[0], N[1]),), spares=(N[2],), absent=(N[3],),
                   voters=(N[0], N[1], N[2]))
    [*_, build] = p.offer(second, 5.0, live=N[:3])
    assert p.m.current == second and p.m.prev is not None and p.m.prev.alloc.epoch == 1
    assert p.m.held_at(RUN, (2, 4), 3) is None  # the old epoch's worker has not let go yet
    p.feed(RunnerEnded(1, RunEnd(2, "replaced by epoch 2", True), 1e9), 5.1)
    p.feed(EpochDone(1), 5.1)
    assert p.m.held_at(RUN, (2, 4), 3) == ("stage", 1) and p.m.held_at(RUN, (2, 4), 2) == ("snapshot", 1)
    p.feed(StageBuilt(build.key, 2, 3), 5.5)
    p.transcript("""
        5 ALLOCATION term 1 epoch 2 from n0
          end epoch 1 (replaced by epoch 2)
          apply term 1 epoch 2 voters n0 n1 n2
          persist term 1 epoch 2
          build epoch 2 from epoch 1
        5.1 runner of epoch 1 ended after step 2: replaced by epoch 2
        5.1 epoch 1 let go of its stage
        5.5 stage of epoch 2 built at step 3
          reply: accepted=True role=stage stage=1 pipeline=0 fetched_bytes=0 fetch_s=0.0
    """)


def test_a_spare_accepts_without_a_stage():
    p = Peer(N[4])
    p.offer(alloc(spares=(N[4],)), 0.0, live=N[:5])
    p.transcript("""
        0 ALLOCATION term 1 epoch 1 from n0
          apply term 1 epoch 1 voters n0 n1 n2 n3 n4
          persist term 1 epoch 1
          reply: accepted=True role=spare
    """)
    assert p.m.status().phase is EpochPhase.SPARE and p.m.run_state().layers is None
    assert p.m.stop_boundary(None) == 2 and p.m.stop_boundary(6) == 9


# ---- losses: a neighbour, a step, the coordinator ---------------------------------------------


def test_a_lost_neighbour_fails_the_epochs_receives():
    p = Peer(N[1])
    [*_, build] = p.offer(alloc())
    p.feed(StageBuilt(build.key, 1, 0), 0.1)
    p.lines.clear()
    p.feed(MemberGone(N[3], "peer n3 is dead"), 1.0)  # accepted, not started: the runner is cancelled
    p.feed(MemberGone(N[4], "peer n4 is dead"), 1.0)  # not a peer of the epoch
    p.transcript("""
        1 n3 is gone
          fail neighbour n3 (peer n3 is dead)
          abort runner (peer n3 is dead)
        1 n4 is gone
    """)
    q = Peer(N[1])
    q.accept(alloc())
    q.lines.clear()
    q.feed(MemberGone(N[0], "peer n0 is dead"), 2.0)  # training: its receives fail, the step ends
    q.feed(RunnerEnded(1, RunEnd(-1, "CommError: n0 is gone", True), 1e9), 2.1)
    q.feed(EpochDone(1), 2.1)
    q.feed(MemberGone(N[2], "peer n2 is dead"), 2.2)  # the epoch is over: nothing to fail
    q.transcript("""
        2 n0 is gone
          fail neighbour n0 (peer n0 is dead)
        2.1 runner of epoch 1 ended after step -1: CommError: n0 is gone
          send STEP to n0: epoch=1 step=0 failed=CommError: n0 is gone
        2.1 epoch 1 let go of its stage
        2.2 n2 is gone
    """)


def test_a_failed_step_is_reported_to_the_coordinator_it_recognises():
    p = Peer(N[1])
    p.accept(alloc())
    p.feed(StepDone(report(1, 0)), 1.0)
    p.lines.clear()
    p.election.term, p.election.coordinator = 2, N[2]  # a new coordinator took over
    p.feed(RunnerEnded(1, RunEnd(0, "CommError: n3 is gone", True), 1e9), 2.0)
    p.transcript("""
        2 runner of epoch 1 ended after step 0: CommError: n3 is gone
          send STEP to n2: epoch=1 step=0 failed=CommError: n3 is gone
    """)
    assert p.m.status().end == RunEnd(0, "CommError: n3 is gone", True)


def test_a_peer_whose_coordinator_is_gone_stops_training():
    # The coordinator of the epoch is not heard for LOST_AFTER_S: the step is aborted. A
    # coordinator that comes back within it resets the wait.
    p = Peer(N[1])
    p.accept(alloc())
    p.lines.clear()
    p.feed(Tick(), 1.0)
    p.election.coordinator = None  # stepped down, cut off
    p.feed(Tick(), 2.0)
    p.election.coordinator = N[0]
    p.feed(Tick(), 7.0)
    p.election.term, p.election.coordinator = 2, N[2]  # replaced by another coordinator
    p.feed(Tick(), 8.0)
    p.feed(Tick(), 13.9)
    p.feed(Tick(), 14.0)
    p.transcript("""
        1 tick
        2 tick
        7 tick
        8 tick
        13.9 tick
        14 tick
          abort runner (the coordinator of epoch 1 (n0) is gone)
    """)


def test_a_stage_that_waits_without_a_next_epoch_is_kept_on_disk_once():
    # The coordinator is gone and the step aborted: the stage waits in memory. Once it has
    # waited LOST_AFTER_S without a next epoch, the peer writes it to disk, once; a crash while
    # the run waits then loses nothing. A finished run's stage is not written again.
    p = Peer(N[1])
    p.accept(alloc())
    p.lines.clear()
    p.election.coordinator = None
    p.feed(Tick(), 1.0)
    p.feed(Tick(), 8.0)
    p.feed(RunnerEnded(1, RunEnd(2, "aborted: the coordinator of epoch 1 (n0) is gone", True), 1e9), 8.5)
    p.feed(Tick(), 9.0)
    p.feed(Tick(), 14.9)
    p.feed(Tick(), 15.0)
    p.feed(Tick(), 30.0)
    p.transcript("""
        1 tick
        8 tick
          abort runner (the coordinator of epoch 1 (n0) is gone)
        8.5 runner of epoch 1 ended after step 2: aborted: the coordinator of epoch 1 (n0) is gone
          send STEP to n0: epoch=1 step=2 failed=aborted: the coordinator of epoch 1 (n0) is gone
        9 tick
        14.9 tick
        15 tick
          keep the stage of run 72727272 on disk
        30 tick
    """)
    done = Peer(N[1])
    done.accept(alloc())
    done.feed(RunnerEnded(1, RunEnd(9, "finished", False), 1e9), 1.0)
    done.lines.clear()
    done.feed(Tick(), 30.0)
    done.transcript("""
        30 tick
    """)


def test_the_coordinators_own_epoch_runs_while_it_is_the_coordinator():
    p = Peer(N[0], coordinator=N[0])
    p.accept(alloc())
    p.lines.clear()
    p.feed(Tick(), 1.0)
    p.election.coordinator = None
    p.feed(Tick(), 2.0)
    p.feed(Tick(), 8.0)
    p.transcript("""
        1 tick
        2 tick
        8 tick
          abort runner (the coordinator of epoch 1 (n0) is gone)
    """)


# ---- a restarted peer ---------------------------------------------------------------------------


def test_a_restarted_peer_knows_the_run_it_applied_and_tells_its_coordinator_it_lost_its_stage():
    a = alloc(term=2, epoch=3)
    p = Peer(N[1], coordinator=None, term=2)
    p.election.last_applied = (2, 3)  # the shell restores the election's applied (term, epoch) too
    p.m.restore(RUN, 2, 3, a)
    st = p.m.status()
    assert st.phase is EpochPhase.WAITING and st.alloc == a and st.step is None
    state = p.m.run_state()
    assert (state.run_id, state.term, state.epoch, state.layers, state.at, state.running) == (RUN, 2, 3, None, None,
                                                                                            False)
    assert not p.m.run_over() and p.m.stop_boundary(None) == 2 and p.m.stop_boundary(9) == 12
    p.feed(Tick(), 1.0)  # no coordinator known yet: told once there is one
    p.election.coordinator = N[0]
    p.feed(Tick(), 2.0)
    p.feed(Tick(), 3.0)
    p.offer(a, 4.0)
    p.offer(alloc(term=2, epoch=4, start_step=7), 5.0)
    p.transcript("""
        1 tick
        2 tick
          send STEP to n0: epoch=3 step=0 failed=restarted: holds no stage
        3 tick
        4 ALLOCATION term 2 epoch 3 from n0
          reply: accepted=False code=stale (term 2 epoch 3 is not newer than term 2 epoch 3, already applied for this run)
        5 ALLOCATION term 2 epoch 4 from n0
          apply term 2 epoch 4 voters n0 n1 n2 n3
          persist term 2 epoch 4
          build epoch 4 from nothing
    """)


def test_the_kept_step_reports_are_the_runs_own_restored_ones_included():
    # A restarted peer's reports come back from its checkpoints (the shell reads them) and go
    # out with its run state; a new epoch of the run keeps them, a new run starts afresh.
    p = Peer(N[1], coordinator=None, term=2)
    p.election.last_applied = (2, 3)
    p.m.restore(RUN, 2, 3, alloc(term=2, epoch=3), [report(3, 5), report(3, 4)])
    assert [(r.epoch, r.step) for r in p.m.run_state().reports] == [(3, 4), (3, 5)]
    p.election.coordinator = N[0]
    p.offer(alloc(term=2, epoch=4, start_step=6), 1.0)
    assert [r.step for r in p.m.run_state().reports] == [4, 5]
    p.offer(alloc(term=2, epoch=5, run_id=b"s" * 16, start_step=0), 2.0)
    assert p.m.run_state().reports == ()


def test_a_peer_restarted_after_its_run_finished_knows_it_finished():
    # Its stage's step reports, kept with the checkpoint written where the run ended, reach the
    # run's last step: the run finished before the restart. The peer does not wait for a stage,
    # does not tell a coordinator it lost one, and the run is over (nobody resumes it).
    a = alloc(term=2, epoch=3, end_step=6)
    p = Peer(N[1], coordinator=None, term=2)
    p.election.last_applied = (2, 3)
    p.m.restore(RUN, 2, 3, a, [report(3, 4), report(3, 5)])
    st = p.m.status()
    assert st.phase is EpochPhase.ENDED and st.end == RunEnd(5, "finished", False) and st.restored
    assert st.last_end is not None and (st.last_end["epoch"], st.last_end["completed"]) == (3, 5)
    assert p.m.run_over() and p.m.run_state().at is None
    p.election.coordinator = N[0]
    p.feed(Tick(), 1.0)
    p.transcript("1 tick")
    # one step short of the end: it waits, as before
    q = Peer(N[1], coordinator=None, term=2)
    q.election.last_applied = (2, 3)
    q.m.restore(RUN, 2, 3, a, [report(3, 3), report(3, 4)])
    assert q.m.status().phase is EpochPhase.WAITING and not q.m.run_over()


def test_a_restored_epoch_says_so_until_a_new_one_is_applied():
    p = Peer(N[1], coordinator=N[0], term=2)
    p.election.last_applied = (2, 3)
    p.m.restore(RUN, 2, 3, alloc(term=2, epoch=3), [report(3, 4)])
    st = p.m.status()
    assert st.restored and st.phase is EpochPhase.WAITING and not st.run_stopped
    p.m.handle(RunClosed(RUN, "stopped.json"), 0.0)  # the shell found stopped.json: an operator stopped the run
    assert p.m.status().run_stopped
    p.offer(alloc(term=2, epoch=4, start_step=5), 1.0)  # resumed
    st = p.m.status()
    assert not st.restored and not st.run_stopped and st.phase is EpochPhase.BUILDING


def test_a_restarted_peer_asks_its_coordinator_how_the_run_stands_and_learns_it_finished():
    # The run went on without this peer and finished while it was down (its checkpoints stop
    # at step 120 of 300): nothing on its disk says so. Once it knows a coordinator it asks,
    # every RESTORED_ASK_S until told; "finished" or "stopped" ends the run here too, any other
    # state changes nothing.
    a = alloc(term=1, epoch=2, end_step=300)
    p = Peer(N[1], coordinator=None, term=2)
    p.election.last_applied = (1, 2)
    p.m.restore(RUN, 1, 2, a, [report(2, 120)])
    assert p.m.restored_run_to_ask(0.0) == RUN  # no coordinator known yet: the ask finds it
    assert p.m.restored_run_to_ask(1.0) is None  # asked lately
    p.election.coordinator = N[0]
    assert p.m.restored_run_to_ask(RESTORED_ASK_S + 1.0) == RUN
    assert p.m.restored_run_to_ask(2 * RESTORED_ASK_S + 0.9) is None  # asked lately
    p.m.restored_run_heard(RUN, "training", 150)  # the coordinator reconfigures it: still waiting
    assert p.m.status().phase is EpochPhase.WAITING and not p.m.run_over()
    p.m.restored_run_heard(b"o" * 16, "finished", 300)  # another run's: nothing
    assert p.m.status().phase is EpochPhase.WAITING
    assert p.m.restored_run_to_ask(2 * RESTORED_ASK_S + 1.0) == RUN
    p.m.restored_run_heard(RUN, "finished", 300)
    st = p.m.status()
    assert st.phase is EpochPhase.ENDED and st.end == RunEnd(299, "finished", False) and p.m.run_over()
    assert st.heard == ("finished", 300)
    assert p.m.restored_run_to_ask(100.0) is None
    p.feed(Tick(), 101.0)
    p.transcript("101 tick")  # no "restarted: holds no stage" for a run that is over
    stopped = Peer(N[1], coordinator=N[0], term=2)
    stopped.m.restore(RUN, 1, 2, a, [report(2, 120)])
    stopped.m.restored_run_heard(RUN, "stopped", 130)
    assert stopped.m.status().run_stopped and stopped.m.restored_run_to_ask(50.0) is None
    coordinator = Peer(N[0], coordinator=N[0], term=2)  # the coordinator itself knows: it asks nobody
    coordinator.m.restore(RUN, 1, 2, a)
    assert coordinator.m.restored_run_to_ask(0.0) is None


def test_a_restarted_spare_or_a_peer_of_another_run_has_no_stage_to_report():
    spare = Peer(N[4])
    spare.m.restore(RUN, 1, 1, alloc(spares=(N[4],)))
    assert spare.m.status().phase is EpochPhase.SPARE
    other = Peer(N[1])
    other.m.restore(RUN, 1, 1, alloc(run_id=b"o" * 16))  # applied.json's allocation is of another run
    assert other.m.current is None and other.m.applied == {RUN: (1, 1)}
    for p in (spare, other):
        p.feed(Tick(), 1.0)
    assert spare.lines + other.lines == ["1 tick", "1 tick"]
    state = other.m.run_state()
    assert state.run_id is None and (state.term, state.epoch) == other.election.last_applied


def test_the_run_state_of_a_peer_without_a_run():
    p = Peer(N[1])
    p.election.last_applied = (4, 9)
    state = p.m.run_state()
    assert (state.run_id, state.term, state.epoch, state.layers, state.at, state.prev, state.running,
            state.checkpoints, state.reports) == (None, 4, 9, None, None, None, False, (), ())
    assert p.m.run_over() and p.m.status().phase is None


# ---- who may read the run state, ask for offers, fetch ---------------------------------------------


def test_the_run_state_is_answered_only_to_the_coordinator_and_the_peers_of_the_run():
    # n1 trains epoch 1 (n0's: [n0 n1 | n2 n3], voters n0..n3); n5 has no part in the run.
    p = Peer(N[1])
    p.accept(alloc())
    assert p.m.status().phase is EpochPhase.TRAINING
    for sender, refused in ((N[1], False), (N[0], False), (N[3], False), (N[5], True), (N[4], True)):
        assert (p.m.check_run_state_reader(sender) is not None) is refused, named(sender)
    p.election.coordinator = N[5]  # a coordinator it recognises may ask (a newer term's)
    assert p.m.check_run_state_reader(N[5]) is None
    assert p.m.refusals.counts() == {"run-state-outsider": 2}
    # a spare of the run and its voters are peers of it
    q = Peer(N[4])
    q.offer(alloc(spares=(N[4],), voters=(N[0], N[1], N[2], N[3], N[5])), known=N, live=N[:5])
    assert q.m.status().phase is EpochPhase.SPARE
    assert q.m.check_run_state_reader(N[5]) is None and q.m.check_run_state_reader(N[2]) is None


def test_a_peer_with_no_epoch_in_progress_answers_any_peer():
    # Nothing current to tell: a fresh peer, and one whose stage stopped (a peer the run left
    # out, found again by a coordinator it does not know yet).
    assert Peer(N[1]).m.check_run_state_reader(N[5]) is None
    p = Peer(N[1])
    p.accept(alloc())
    p.feed(RunnerEnded(1, RunEnd(3, "stopped", False), 0.0), 1.0)
    assert p.m.check_run_state_reader(N[5]) is None and p.m.refusals.counts() == {}


@pytest.mark.parametrize("end", ["operator stop", "finished", "could not go on"])
def test_after_its_run_is_over_a_peer_answers_only_the_peers_of_the_run(end):
    # Security review 2026-11-28, LOW 3: any key holder read the run id, epoch and kept step
    # reports of a run that was over (RUN_STATE query, and `progress` on its coordinator).
    p = Peer(N[1])
    p.accept(alloc())
    p.feed(StepDone(report(1, 0)), 1.0)
    if end == "operator stop":
        p.feed(StopAsked(p.key("t"), N[0], RUN, 2, final=True, op=STOP), 3.0)
        p.feed(RunnerEnded(1, RunEnd(1, "stopped", False), 0.0), 3.5)
    elif end == "finished":
        p.feed(RunnerEnded(1, RunEnd(99, "finished", False), 0.0), 3.5)
    else:
        p.m.handle(RunClosed(RUN, "no layout"), 0.0)  # (its coordinator stopped the run: no layout of the peers exists)
    p.feed(EpochDone(1), 4.0)
    assert p.m.run_over() and p.m.status().phase is EpochPhase.ENDED
    p.election.coordinator = None  # between runs: no coordinator recognised
    for sender, refused in ((N[1], False), (N[0], False), (N[3], False), (N[5], True), (N[4], True)):
        assert (p.m.check_run_state_reader(sender) is not None) is refused, named(sender)
    assert p.m.refusals.counts() == {"run-state-outsider": 2}
    p.election.coordinator = N[5]  # the coordinator it recognises (of the next run) may ask
    assert p.m.check_run_state_reader(N[5]) is None


def test_only_the_coordinator_asks_for_offers():
    p = Peer(N[1], coordinator=N[0])
    p.accept(alloc())
    assert p.m.check_offer_asker(N[0]) is None and p.m.check_offer_asker(N[1]) is None
    assert p.m.check_offer_asker(N[2]) is not None and p.m.check_offer_asker(N[5]) is not None
    assert p.m.refusals.counts() == {"offer-not-coordinator": 2}


@pytest.mark.parametrize("sender, current, previous, fetchers, allowed", [
    (N[2], alloc(), None, (), True),  # a stage peer of the current allocation
    (N[4], alloc(spares=(N[4],)), None, (), True),  # a spare of it
    (N[4], alloc(epoch=2), alloc(epoch=1, spares=(N[4],)), (), True),  # named by the previous one
    (N[5], alloc(), None, (N[5],), True),  # named by the coordinator with the offer (the next allocation)
    (N[5], alloc(), None, (), False),  # named by none
    (N[5], alloc(epoch=2), alloc(epoch=1), (N[4],), False),
    (N[2], alloc(run_id=b"o" * 16), None, (), False),  # a peer of another run
])
def test_a_stage_is_fetched_only_by_the_peers_an_allocation_names(sender, current, previous, fetchers, allowed):
    why = fetch_refusal(sender, RUN, allocations=(current, previous), fetchers=fetchers)
    assert (why is None) is allowed and (why in (None, Refused.FETCH_NOT_NAMED))


def test_an_unknown_event_is_an_error():
    with pytest.raises(TypeError):
        Peer().m.handle(object(), 0.0)  # type: ignore[arg-type]



# ---- a planned leave ------------------------------------------------------------------------------


@pytest.mark.parametrize("what, me, coordinator, applied, stopped, asks, words", [
    ("a stage peer asks its coordinator", N[1], N[0], True, False, N[0], ""),
    ("the coordinator hands off its own stage", N[0], N[0], True, False, N[0], ""),
    ("a spare asks too (it may be about to fetch a stage)", N[4], N[0], True, False, N[0], ""),
    ("no run was ever applied: nothing to tell", N[1], N[0], False, False, None, ""),
    ("the run was stopped: nothing to tell", N[1], N[0], True, True, None, ""),
    ("no coordinator is known", N[1], None, True, False, None, "no coordinator is known"),
])
def test_whom_a_leaving_peer_asks_to_hand_its_part_off(what, me, coordinator, applied, stopped, asks, words):
    p = Peer(me)
    if applied:
        p.offer(alloc(spares=(N[4],)), 0.0, live=N[:5])
    if stopped:
        p.m.handle(RunClosed(RUN, "stopped"), 0.0)
    p.election.coordinator = coordinator
    target, why = p.m.hand_off_to()
    assert target == asks and why.startswith(words) and bool(why) == bool(words)



def test_an_allocation_whose_council_is_no_operators_or_disagrees_with_gossip_is_refused_and_counted():
    # The council an allocation carries: its root must be an operator's (not one a peer made), its
    # voters the allocation's, and the change this allocation makes must agree with this peer's
    # gossip: a voter added is a live member, a voter dropped is not. Each refusal is counted.
    from machine_trace import KEY_OF, root_of

    from dtfm.control import council_arg, root_council
    from dtfm.control.election import Certificate, Council, CouncilLink, config_digest, vote_payload
    from dtfm.control.election.council import link_payload

    p = Peer(N[1])
    four = tuple(sorted(N[:4]))
    own = root_of(four)
    forged_op = sign_op(INTRUDER, "council", now_s=0.0, run_id=b"c" * 16,
                        args={"council": council_arg(four), "council_size": 5})
    forged = Council(forged_op.encode(), four, forged_op.open().issued_at_ms, 5)
    reply = p.offer(alloc(voters=four, council=forged.encode()))[-1].value
    assert reply["code"] == "bad-council" and "not an operator" in reply["reason"]
    assert p.m.refusals.counts() == {"bad-council": 1}

    def changed(after, epoch):
        after = tuple(sorted(after))
        payload = vote_payload(1, N[0], config_digest(own.voters))
        cert = Certificate.of(1, N[0], own.voters, {v: KEY_OF[v].sign(payload) for v in own.voters})
        return own.extended(CouncilLink(cert, after, KEY_OF[N[0]].sign(link_payload(1, epoch, own.voters, after)),
                                        epoch))

    grown = changed(four + (N[4],), 1)  # n4: not live in this peer's gossip (context: n0..n3)
    reply = p.offer(alloc(voters=grown.voters, council=grown.encode()))[-1].value
    assert reply["code"] == "bad-council" and "not a live member" in reply["reason"]
    dropped = changed(four[:3], 1)  # drops a voter this peer sees live
    reply = p.offer(alloc(voters=dropped.voters, council=dropped.encode()))[-1].value
    assert reply["code"] == "bad-council" and "live in this peer's gossip" in reply["reason"]
    assert p.m.refusals.counts() == {"bad-council": 3}
    out = p.offer(alloc(voters=grown.voters, council=grown.encode(), spares=(N[4],)), live=tuple(N[:5]))
    assert isinstance(out[-1], BuildStage) and p.election.council == grown  # the same change, with n4 live here
    assert root_council(sign_op(OPERATOR, "council", now_s=0.0, run_id=b"c" * 16,
                                args={"council": council_arg(four), "council_size": 5}), OPERATORS).same_root(own)
