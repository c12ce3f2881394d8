"""The epoch machine (control/epoch/machine.py) through its public API: `handle(event, now)`
and its queries, driven by tests/epoch_fixtures.py's `Peer`. A peer's part in epochs told as a
transcript (one line per event, its actions indented under it; see tests/machine_trace.py) is a
data file, tests/data/epoch/*.txt, played by tests/transcripts.py; the refusals of an
allocation are a table. The protocol is in docs/control.md."""

from __future__ import annotations

import dataclasses

import pytest
import transcripts
from epoch_fixtures import STOP, Peer
from machine_trace import INTRUDER, OPERATOR, OPERATORS, RUN, TINY, N, alloc, named, report, start_op

from dtfm.control import RunEnd, sign_op
from dtfm.control.actions import Reply
from dtfm.control.answers import StopAnswer
from dtfm.control.epoch.access import fetch_refusal
from dtfm.control.epoch.machine import (
    BuildFailed,
    BuildStage,
    EpochDone,
    EpochPhase,
    RunnerEnded,
    StageBuilt,
    StartAsked,
    StepDone,
    StopAsked,
    StopRunnerAt,
    EpochTick as Tick,
    RunClosed,
)
from dtfm.control.epoch.taken import MAX_OPS_PER_RUN, MAX_RUNS, TakenOps, load_taken, save_taken
from dtfm.control.refusals import Refused
from dtfm.train import parse_compression

# ---- accepting an allocation ----------------------------------------------------------------------


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
    assert isinstance(reply, Reply) and reply.value.accepted is False and reply.value.code == code
    assert reply.error == reply.value.reason
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
     "dp_value_bits=2,outer_momentum=0.8,inner_steps=8,dp_ramp_syncs=8", False),
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
        assert reply.value.code == "no-operator" and "differs from the operator's start in compression" \
            in reply.value.reason, reply
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
    assert isinstance(reply, Reply) and reply.value.code == "no-operator", reply
    for w in words:
        assert w in reply.value.reason, (w, reply.value.reason)
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
    assert reply.value.stopped is stopped, reply
    for w in words:
        assert w in reply.value.reason, (w, reply.value.reason)
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
        assert reply.value.stopped is False and words in reply.value.reason, reply
        assert not p.m.run_over()
    [*_, reply] = p.feed(StopAsked(p.key("t"), N[0], RUN, 8, final=True, op=new), 7.0)
    assert reply.value.stopped is True and p.m.over_without_finishing(RUN)
    [reply] = p.feed(StopAsked(p.key("t"), N[0], RUN, 8, final=True, op=new), 7.5)
    assert reply.value == StopAnswer(False, "this stop was taken already: sign a new one")
    save_taken(tmp_path, p.m.taken.to_json())
    again = Peer(N[1])
    again.m.restore_taken(load_taken(tmp_path))
    again.accept(alloc(epoch=2, start_step=4, last_op_ms=5_000))
    [reply] = again.feed(StopAsked(again.key("t"), N[0], RUN, 8, final=True, op=new), 8.0)
    assert reply.value == StopAnswer(False, "this stop was taken already: sign a new one")
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


def test_start_of_an_epoch_that_cannot_run_is_not_confirmed():
    p = Peer(N[1])
    [*_, build] = p.offer(alloc(), 0.0)
    p.feed(BuildFailed(build.key, 1, "connect-failed", "n1: no route"), 0.1)
    [reply] = p.feed(StartAsked(p.key("s"), N[0], RUN, 1), 0.2)
    assert reply.value.started is False


# ---- a restarted peer ---------------------------------------------------------------------------


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
    assert reply.code == "bad-council" and "not an operator" in reply.reason
    assert p.m.refusals.counts() == {"bad-council": 1}

    def changed(after, epoch):
        after = tuple(sorted(after))
        payload = vote_payload(1, N[0], config_digest(own.voters))
        cert = Certificate.of(1, N[0], own.voters, {v: KEY_OF[v].sign(payload) for v in own.voters})
        return own.extended(CouncilLink(cert, after, KEY_OF[N[0]].sign(link_payload(1, epoch, own.voters, after)),
                                        epoch))

    grown = changed(four + (N[4],), 1)  # n4: not live in this peer's gossip (context: n0..n3)
    reply = p.offer(alloc(voters=grown.voters, council=grown.encode()))[-1].value
    assert reply.code == "bad-council" and "not a live member" in reply.reason
    dropped = changed(four[:3], 1)  # drops a voter this peer sees live
    reply = p.offer(alloc(voters=dropped.voters, council=dropped.encode()))[-1].value
    assert reply.code == "bad-council" and "live in this peer's gossip" in reply.reason
    assert p.m.refusals.counts() == {"bad-council": 3}
    out = p.offer(alloc(voters=grown.voters, council=grown.encode(), spares=(N[4],)), live=tuple(N[:5]))
    assert isinstance(out[-1], BuildStage) and p.election.council == grown  # the same change, with n4 live here
    assert root_council(sign_op(OPERATOR, "council", now_s=0.0, run_id=b"c" * 16,
                                args={"council": council_arg(four), "council_size": 5}), OPERATORS).same_root(own)


# ---- the transcripts (tests/data/epoch/*.txt, played by tests/transcripts.py) -----------------


@pytest.mark.parametrize("path", transcripts.files("epoch"), ids=lambda p: p.stem)
def test_transcript(path):
    transcripts.check(path)
