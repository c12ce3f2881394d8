"""The resume point of a reconfigured swarm, and the run state a peer reports."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtfm.control import PeerRunState, ResumeError, StepReport, resume_point
from dtfm.control.epoch.runstate import Source
from dtfm.net import ProtocolError, pack, unpack_untrusted

RUN, OTHER = b"r" * 16, b"o" * 16
RANGES = ((0, 2), (2, 4))
P = [bytes([i]) * 32 for i in range(1, 9)]


def st_(layers, at, prev=None, *, run=RUN, ckpts=(), running=False) -> PeerRunState:
    return PeerRunState(run, 1, 2, layers, at, prev, running, tuple(ckpts))


def test_every_peer_at_one_step_resumes_there_with_every_holder():
    states = {P[0]: st_((0, 2), 7, 6), P[1]: st_((2, 4), 7, 6), P[2]: st_((0, 2), 7, 6), P[3]: st_((2, 4), 7, 6)}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 7 and not rp.rollback
    assert rp.memory == {(0, 2): (P[0], P[2]), (2, 4): (P[1], P[3])}


def test_a_replica_one_step_ahead_goes_back_with_its_snapshot():
    # P[0] completed step 7 (its stage is at 8), the others did not: the swarm resumes at 7 and
    # P[0] holds stage (0, 2) at 7 through its snapshot.
    states = {P[0]: st_((0, 2), 8, 7), P[1]: st_((2, 4), 7, 6), P[2]: st_((0, 2), 7, 6)}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 7 and rp.memory[(0, 2)] == (P[0], P[2]) and rp.memory[(2, 4)] == (P[1],)


def test_the_newest_step_every_stage_holds_wins():
    states = {P[0]: st_((0, 2), 8, 7), P[1]: st_((2, 4), 8, 7)}
    assert resume_point(RUN, RANGES, states).step == 8


def test_a_lost_stage_rolls_the_swarm_back_to_the_newest_common_checkpoint():
    # Nobody holds (2, 4) in memory; checkpoints of it at 4 and 6, of (0, 2) at 6 (and memory at 9).
    states = {P[0]: st_((0, 2), 9, 8, ckpts=[(0, 2, 6)]), P[1]: st_(None, None, ckpts=[(2, 4, 4), (2, 4, 6)])}
    rp = resume_point(RUN, RANGES, states)
    assert rp.rollback and rp.step == 6
    assert rp.holders((2, 4)) == (P[1],) and rp.holders((0, 2)) == (P[0],)


def test_checkpoints_of_another_run_are_not_this_runs():
    # P[1]'s checkpoints of the same layers, at later steps, belong to the run it reports (an
    # earlier one): taking them would go on with another run's weights. Only P[0] is of this
    # run, so it rebuilds step 0 of both stages.
    states = {P[0]: st_((0, 2), 9, 8, ckpts=[(0, 2, 6)]),
              P[1]: st_(None, None, run=OTHER, ckpts=[(2, 4, 12), (2, 4, 16), (0, 2, 16)])}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 0 and rp.rollback and rp.source is Source.INITIAL
    assert rp.holders((2, 4)) == (P[0],) and rp.holders((0, 2)) == (P[0],)


def test_a_stage_lost_before_any_checkpoint_rolls_every_stage_back_to_the_initial_weights():
    # Both holders of (2, 4) died at step 7 before the first checkpoint; they came back holding
    # nothing (a restarted peer of the run reports its run, no stage). Step 0 is a checkpoint
    # every peer of the run rebuilds: the swarm resumes there, and each stage names all of them.
    states = {P[0]: st_((0, 2), 7, 6), P[1]: st_((0, 2), 7, 6), P[2]: st_(None, None), P[3]: st_(None, None),
              P[4]: st_(None, None, run=OTHER)}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 0 and rp.rollback and rp.source is Source.INITIAL
    assert rp.memory == {} and rp.checkpoint == {}
    assert rp.initial == {(0, 2): tuple(P[:4]), (2, 4): tuple(P[:4])}


def test_a_stage_held_in_memory_at_step_0_is_taken_from_memory_there():
    # The lost stage's holders died during step 0: the other stage's snapshot at 0 serves it
    # from memory, and only the lost one is rebuilt.
    states = {P[0]: st_((0, 2), 1, 0), P[1]: st_(None, None)}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 0 and rp.memory == {(0, 2): (P[0],)} and rp.initial == {(2, 4): (P[0], P[1])}
    assert rp.holders((0, 2)) == (P[0],) and rp.source is Source.INITIAL


def test_a_checkpoint_wins_over_the_initial_weights():
    states = {P[0]: st_((0, 2), 9, 8, ckpts=[(0, 2, 4)]), P[1]: st_(None, None, ckpts=[(2, 4, 4)])}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 4 and rp.source is Source.CHECKPOINT and rp.initial == {}


def test_stages_held_at_no_common_step_roll_back_to_step_0():
    # (without checkpoints, one stage's only holders may be a step ahead of another's)
    states = {P[0]: st_((0, 2), 9, 8), P[1]: st_((2, 4), 4, 3)}
    rp = resume_point(RUN, RANGES, states)
    assert rp.step == 0 and rp.initial == {(0, 2): (P[0], P[1]), (2, 4): (P[0], P[1])}


def test_no_peer_of_the_run_is_an_error():
    states = {P[0]: st_((0, 2), 7, run=OTHER), P[1]: st_(None, None, run=None)}
    with pytest.raises(ResumeError, match="no reachable peer has applied an allocation of run"):
        resume_point(RUN, RANGES, states)


def test_run_state_round_trips_through_the_wire():
    s = PeerRunState(RUN, 3, 5, (0, 2), 9, 8, True, ((0, 2, 6),),
                     (StepReport(5, 8, 4.5, 1.0, 0.5, 0.7, 0.2), StepReport(5, 7, None, 1.0, 0.5, 0.7, 0.2)))
    assert PeerRunState.from_wire(unpack_untrusted(pack(s.to_wire()), max_len=1 << 16)) == s
    idle = PeerRunState(None, 0, 0, None, None, None, False)
    assert PeerRunState.from_wire(unpack_untrusted(pack(idle.to_wire()), max_len=1 << 16)) == idle


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["run", "term", "epoch", "layers", "at", "prev", "running", "checkpoints",
                                        "reports", "x"]),
                       st.one_of(st.none(), st.integers(-5, 2**64), st.binary(max_size=20), st.text(max_size=5),
                                 st.booleans(), st.lists(st.integers(-1, 10), max_size=4),
                                 st.lists(st.lists(st.integers(-1, 10), max_size=4), max_size=3))))
def test_garbage_run_states_raise_only_protocol_error(d):
    try:
        PeerRunState.from_wire(d)
    except ProtocolError:
        pass


def test_step_reports_from_the_wire_are_checked_and_a_diverging_loss_travels():
    rep = StepReport(3, 9, float("inf"), 1.0, 0.5, 0.7, 0.2)
    assert StepReport.from_wire(rep.to_wire()) == rep
    for bad in ({**rep.to_wire(), "step": "9"}, {**rep.to_wire(), "loss": "low"}, {**rep.to_wire(), "sync_s": -1.0},
                {k: v for k, v in rep.to_wire().items() if k != "epoch"}, [1, 2]):
        with pytest.raises(ProtocolError):
            StepReport.from_wire(bad)
