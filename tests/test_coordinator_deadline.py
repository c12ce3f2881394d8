"""Gray failures at the coordinator: the step deadline (control/coordinator/deadline.py) and cut
links (control/coordinator/links.py), pure and through the machine under virtual time.

The machine's tests play the shell around n0 as tests/test_coordinator_machine.py does
(tests/coordinator_fixtures.py's `Node`): a peer that stops answering but keeps its sockets open (frozen), a link cut between
two live pipeline neighbours, a healed link, and a loaded machine whose step times jitter.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from coordinator_fixtures import D01, D23, TIMINGS, Node, state
from machine_trace import RUN, N, alloc, named, report

from dtfm.control.coordinator.deadline import DeadlineRules, StepWatch, judge, laggards, probe_targets
from dtfm.control.coordinator.links import CutLinks, ReachAnswer, ReachRequest, exchanges, pair, used_cut_links
from dtfm.control.coordinator.machine import Phase, StepReported
from dtfm.net import ProtocolError

RULES = DeadlineRules(floor_s=3.0, mads=6.0, first_s=20.0)
WATCHED = dataclasses.replace(TIMINGS, deadline=RULES, deadline_probe_timeout_s=4.0, link_retest_s=2.0)


def reached(*ps, unreached=()) -> dict:
    return ReachAnswer(tuple(ps), tuple(unreached)).to_wire()


# ---- the deadline, pure -------------------------------------------------------------------------


@pytest.mark.parametrize("intervals, want", [
    ([], 20.0),  # the epoch's first steps: first_s
    ([1.0, 1.0], 20.0),  # fewer than min_samples intervals
    ([1.0, 1.1, 0.9, 1.0], 3.0),  # steady 1 s steps: the floor
    ([2.0, 2.1, 1.9, 2.0, 2.2], 2.6),  # median 2.0, MAD 0.1: 2.0 + 6 x 0.1
    ([2.0, 3.0, 2.5, 4.0, 2.2], 2.5 + 6 * 0.5),  # jitter widens it
])
def test_the_deadline_is_the_median_plus_k_mads_with_a_floor(intervals, want):
    assert RULES.deadline_s(intervals) == pytest.approx(max(want, 3.0 if len(intervals) >= 3 else want))


def test_an_answered_probe_backs_the_deadline_off_until_the_next_step():
    w = StepWatch(RULES, epoch=1, started=0.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        w.completed(t)
    assert w.intervals == pytest.approx([1.0] * 4) and w.due_at() == 8.0
    w.probe_answered(8.5)
    assert w.due_at() == 8.5 + 2 * 3.0
    w.probe_answered(14.5)
    assert w.due_at() == 14.5 + 4 * 3.0
    w.completed(16.0)  # the slow step completes: its interval counts, the back-off ends
    assert w.intervals[-1] == 11.0 and w.due_at() == 16.0 + w.deadline_s()


def test_laggards_and_whom_they_reach():
    a = alloc()  # [n0 n1 | n2 n3]
    assert laggards(a.peers, [N[0], N[2]]) == sorted([N[1], N[3]])
    assert probe_targets([N[1]], {N[1]: a.neighbours(N[1])}) == sorted([N[0], N[3]])


@pytest.mark.parametrize("answers, silent, cut", [
    # n3 froze: it does not answer, its neighbours cannot reach it
    ({0: reached(1, 2), 1: reached(0, 2, unreached=[3]), 2: reached(0, 1, unreached=[3])}, [3], []),
    # the n0-n1 link is cut: both answer, neither reaches the other
    ({0: reached(2, unreached=[1]), 1: reached(3, unreached=[0]), 2: reached(0, 3), 3: reached(1, 2)}, [], [(0, 1)]),
    # one direction is enough (a ping is a round trip)
    ({0: reached(1, 2), 1: reached(3, unreached=[0]), 2: reached(0, 3), 3: reached(1, 2)}, [], [(0, 1)]),
    # an unreached peer that is no neighbour names no link; a malformed answer is an answer
    ({0: reached(1, 2, unreached=[3]), 1: {"reached": "x"}, 2: reached(0, 3), 3: reached(1, 2)}, [], []),
    # every laggard answers and reaches its neighbours: a slow step
    ({0: reached(1, 2), 1: reached(0, 3), 2: reached(0, 3), 3: reached(1, 2)}, [], []),
])
def test_the_verdict_on_a_probe(answers, silent, cut):
    a = alloc()
    nb = {p: a.neighbours(p) for p in N[:4]}
    wire = {N[k]: {key: [N[i] if isinstance(i, int) else i for i in v] if isinstance(v, list) else v
                   for key, v in ans.items()} for k, ans in answers.items()}
    v = judge(N[:4], nb, wire)
    assert v.silent == tuple(N[k] for k in silent)
    assert v.cut == tuple(pair(N[x], N[y]) for x, y in cut)
    assert v.slow == (not silent and not cut)


def test_a_layouts_links_are_the_allocations_neighbours():
    a = alloc(pipelines=((N[0], N[1], N[2]), (N[3], N[4], N[5])), layer_ranges=((0, 1), (1, 3), (3, 4)))
    links = exchanges(a.pipelines)
    assert links == {pair(p, q) for p in a.peers for q in a.neighbours(p)}
    assert used_cut_links(a.pipelines, [(N[1], N[4]), (N[0], N[4])]) == [pair(N[1], N[4])]
    cut = CutLinks()
    cut.add((N[4], N[1]), "why")
    assert (N[1], N[4]) in cut and cut.why((N[1], N[4])) == "why"
    cut.forget_peers(N[:4])
    assert not cut


def test_reach_on_the_wire_checks_every_field():
    req = ReachRequest((N[1], N[2]), 2.0)
    assert ReachRequest.from_wire(req.to_wire()) == req
    for bad in ({"peers": [b"x"], "timeout_s": 1.0}, {"peers": N[1], "timeout_s": 1.0},
                {"peers": [], "timeout_s": 0.0}, {"peers": [], "timeout_s": "1"}, {"peers": [N[1]] * 5000}):
        with pytest.raises(ProtocolError):
            ReachRequest.from_wire(bad)
    with pytest.raises(ProtocolError):
        ReachAnswer.from_wire({"reached": [N[1]]})


# ---- through the machine ------------------------------------------------------------------------


def watched(n: Node, steps: int = 6) -> float:
    """Train start of 2 x 2 over n0..n3 (400 steps), every peer reports steps 0.. at 1 s
    intervals from t = 1; the time of the last report. The deadline is then the floor, 3 s."""
    return n.training(steps, run_steps=400)


def stuck_2x2(n: Node, answers: dict, at: float) -> None:
    """The deadline probe of step 6 answered; the reconfiguration it triggers stops the peers."""
    n.tick()
    n.answer("probe deadline", answers, at=at)
    n.tick()


WATCHED = dataclasses.replace(WATCHED, check_interval_s=1000.0)  # no looks for joined peers in between
CUT_01 = {N[0]: reached(N[2], unreached=[N[1]]), N[1]: reached(N[3], unreached=[N[0]]),
          N[2]: reached(N[0], N[3]), N[3]: reached(N[1], N[2])}
RUNNING_6 = {p: state((0, 2) if p in (N[0], N[2]) else (2, 4), 6, running=True) for p in N[:4]}


def test_a_frozen_peer_is_out_after_the_deadline_and_a_probe():
    # n3 freezes after step 5 (SIGSTOP: its sockets stay open, it answers nothing). Step 6 is
    # due 3 s after step 5 (the floor); the laggards, every peer, are asked to reach their
    # neighbours; n3 does not answer: it is out, the stuck step is aborted at once (no waiting
    # for a step boundary nobody reaches) and n3 is asked nothing more. It gets a STOP that it
    # reads when it wakes.
    n = Node(timings=WATCHED)
    last = watched(n)
    assert n.c.next_deadline() == last + 3.0
    stuck_2x2(n, {N[0]: reached(N[1], N[2]), N[1]: reached(N[0], N[2], unreached=[N[3]]),
                  N[2]: reached(N[0], N[1], unreached=[N[3]])}, last + 7.0)
    n.answer("states", {p: RUNNING_6[p] for p in N[:3]}, last + 7.6)
    n.answer("stop", everyone={"stopped": True}, at=last + 7.7)
    n.tick()
    n.answer("poll", {p: dict(RUNNING_6[p], running=False) for p in N[:3]}, last + 8.0)
    n.compute("plan", last + 8.1)
    n.answer("offer 0-2", everyone={"digest": D01}, at=last + 8.2)
    n.answer("offer 2-4", everyone={"digest": D23}, at=last + 8.2)
    n.answer("alloc", everyone={"accepted": True}, at=last + 8.5)
    n.answer("start", everyone={"started": True}, at=last + 8.6)
    n.transcript("""
        9 tick
          ask probe deadline: RUN_STATE reach n0 n1 n2 n3 within 2 s -> n0 n1 n2 n3
        13 answers probe deadline: n0 reached n1 n2, n1 reached n0 n2 not n3, n2 reached n0 n1 not n3, n3 -
          ask fence 1: STOP at_step=6 abort=True epoch=1 -> n3
        13.5 tick
          ask states: RUN_STATE query -> n0 n1 n2
          phase: stopping
        13.6 answers states: n0 0-2@6 running, n1 2-4@6 running, n2 0-2@6 running
          ask stop: STOP at_step=7 abort=True epoch=1 -> n0 n1 n2
        13.7 answers stop: n0 stopped, n1 stopped, n2 stopped
        13.95 tick
          ask poll: RUN_STATE query -> n0 n1 n2
        14 answers poll: n0 0-2@6, n1 2-4@6, n2 0-2@6
          compute plan
          phase: planning
        14.1 computed plan
          ask offer 0-2: RUN_STATE offer step=6 layers=0-2 -> n0 n2
          ask offer 2-4: RUN_STATE offer step=6 layers=2-4 -> n1
          phase: offering
        14.2 answers offer 0-2: n0 01010101, n2 01010101
        14.2 answers offer 2-4: n1 23232323
          ask alloc: ALLOCATION term 1 epoch 2 steps 6..400 [n0 n1] spares n2 holdings 0-2:01010101@n0 n2 2-4:23232323@n1 voters n0 n1 n2 n3 absent n3 n4 -> n0 n1 n2
          phase: handing out
        14.5 answers alloc: n0 accepted, n1 accepted, n2 accepted
          ask start: START epoch=2 -> n0 n1
        14.6 answers start: n0 started, n1 started
          emit reconfigure term=1 epoch=2 trigger=peer n3 missed the step deadline (step 6, 3.0 s) and did not answer a probe within 4 s old_shape=2x2 new_shape=2x1 kind=reschedule resume_step=6 rollback=False
          phase: training
    """)
    assert n.planner.calls[-1]["live"] == N[:3]
    assert n.c.next_deadline() == pytest.approx(14.6 + 20.0)  # the new epoch's first steps: first_s


def test_a_cut_link_between_live_neighbours_is_left_out_until_a_ping_comes_back():
    # n0 -> n1 (stages 0 and 1 of the first pipeline) is cut; n4 is a spare. Both ends answer the
    # probe, neither reaches the other: the link is cut, the planner gets it and places around
    # it. Then n0 is asked to ping n1 every 2 s: no answer, the link stays cut; then it heals
    # and the next ping clears it.
    n = Node(timings=WATCHED)
    last = watched(n)
    n.swarm.live.add(N[4])  # (joined after the start: the next look for joined peers is far off)
    stuck_2x2(n, CUT_01, last + 5.0)
    assert named(n.c.status().cut_links) == "n0-n1"
    n.answer("states", {**RUNNING_6, N[4]: state(None, None)}, last + 5.6)
    n.answer("stop", everyone={"stopped": True}, at=last + 5.7)
    n.tick()
    n.answer("poll", {**{p: dict(s, running=False) for p, s in RUNNING_6.items()}, N[4]: state(None, None)},
             last + 6.0)
    n.compute("plan", last + 6.1)
    assert n.planner.calls[-1]["cut"] == [pair(N[0], N[1])]
    n.answer("offer 0-2", everyone={"digest": D01}, at=last + 6.2)
    n.answer("offer 2-4", everyone={"digest": D23}, at=last + 6.2)
    n.answer("alloc", everyone={"accepted": True}, at=last + 6.5)
    n.answer("start", everyone={"started": True}, at=last + 6.6)
    n.tick()
    n.answer("probe links", at=n.now + 2.0)  # n0 does not reach n1 yet: asked again at once (2 s on)
    n.answer("probe links", {N[0]: reached(N[1])}, at=n.now + 0.1)
    n.transcript("""
        9 tick
          ask probe deadline: RUN_STATE reach n0 n1 n2 n3 within 2 s -> n0 n1 n2 n3
        11 answers probe deadline: n0 reached n2 not n1, n1 reached n3 not n0, n2 reached n0 n3, n3 reached n1 n2
        11.5 tick
          ask states: RUN_STATE query -> n0 n1 n2 n3 n4
          phase: stopping
        11.6 answers states: n0 0-2@6 running, n1 2-4@6 running, n2 0-2@6 running, n3 2-4@6 running, n4 -@None
          ask stop: STOP at_step=7 abort=True epoch=1 -> n0 n1 n2 n3
        11.7 answers stop: n0 stopped, n1 stopped, n2 stopped, n3 stopped
        11.95 tick
          ask poll: RUN_STATE query -> n0 n1 n2 n3 n4
        12 answers poll: n0 0-2@6, n1 2-4@6, n2 0-2@6, n3 2-4@6, n4 -@None
          compute plan
          phase: planning
        12.1 computed plan
          ask offer 0-2: RUN_STATE offer step=6 layers=0-2 -> n0 n2
          ask offer 2-4: RUN_STATE offer step=6 layers=2-4 -> n1 n3
          phase: offering
        12.2 answers offer 0-2: n0 01010101, n2 01010101
        12.2 answers offer 2-4: n1 23232323, n3 23232323
          ask alloc: ALLOCATION term 1 epoch 2 steps 6..400 [n0 n2 | n3 n1] spares n4 holdings 0-2:01010101@n0 n2 2-4:23232323@n1 n3 voters n0 n1 n2 n3 n4 -> n0 n1 n2 n3 n4
          phase: handing out
        12.5 answers alloc: n0 accepted, n1 accepted, n2 accepted, n3 accepted, n4 accepted
          ask start: START epoch=2 -> n0 n1 n2 n3
        12.6 answers start: n0 started, n1 started, n2 started, n3 started
          emit reconfigure term=1 epoch=2 trigger=link n0-n1 failed step 6: both ends answer a probe, not each other's pings old_shape=2x2 new_shape=2x2 kind=reschedule resume_step=6 rollback=False
          phase: training
        13 tick
          ask probe links: RUN_STATE reach n1 within 2 s -> n0
        15 answers probe links: n0 -
          ask probe links: RUN_STATE reach n1 within 2 s -> n0
        15.1 answers probe links: n0 reached n1
    """)
    assert not n.c.links and n.c.status().cut_links == "" and n.c.phase is Phase.TRAINING


def test_a_run_no_allocation_can_route_around_a_cut_link_pauses_as_stalled_until_it_heals():
    # 2 x 2 over n0..n3 and no spare, and the planner finds no layout without the cut link: the
    # run pauses with the reason (status: stalled, why). A ping that comes back reconfigures at
    # once.
    n = Node(timings=WATCHED)
    last = watched(n)
    plan = n.planner.reshape
    n.planner.reshape = lambda view, cur, **kw: plan(view, cur, **{**kw, "cut": frozenset()})  # type: ignore
    stuck_2x2(n, CUT_01, last + 5.0)
    n.answer("states", RUNNING_6, last + 5.6)
    n.answer("stop", everyone={"stopped": True}, at=last + 5.7)
    n.tick()
    n.answer("poll", {p: dict(s, running=False) for p, s in RUNNING_6.items()}, last + 6.0)
    n.lines.clear()
    n.compute("plan", last + 6.1)
    st = n.c.status()
    assert st.stalled_since == 6.0 and st.stalled_reason.startswith(
        "stalled: every allocation of the reachable peers uses a cut link (link ")
    n.tick()
    n.answer("probe links", {N[0]: reached(N[1])}, at=n.now + 0.2)
    n.transcript("""
        12.1 computed plan
          emit paused term=1 epoch=1 trigger=link n0-n1 failed step 6: both ends answer a probe, not each other's pings reason=stalled: every allocation of the reachable peers uses a cut link (link n0-n1 failed step 6: both ends answer a probe, not each other's pings); waiting for it to heal
          ask keep 1: RUN_STATE keep -> n0 n1 n2 n3
          phase: paused
        13 tick
          ask probe links: RUN_STATE reach n1 within 2 s -> n0
        13.2 answers probe links: n0 reached n1
          ask states: RUN_STATE query -> n0 n1 n2 n3
          phase: stopping
    """)


def test_a_loaded_machine_probes_slow_steps_and_excludes_nobody_over_200_steps():
    # Step times jitter (lognormal around 2 s) and one step in 20 stalls for 2-4x as long (a
    # loaded machine). Every probe is answered and every neighbour reached: no trigger, no
    # reconfiguration; the deadline follows the measured steps.
    rng = random.Random(7)
    n = Node(timings=WATCHED)
    t = watched(n, steps=0)
    probes = stalls = 0
    for s in range(200):
        stall = rng.random() < 0.05
        stalls += stall
        step_s = 2.0 * rng.lognormvariate(0, 0.15) * (rng.uniform(2, 4) if stall else 1.0)
        done_at = t + step_s
        while n.c.next_deadline() < done_at:
            n.tick()
            if "probe deadline" in n.asks:
                probes += 1
                ask = n.asks["probe deadline"]
                n.answer("probe deadline", {p: reached(*[q for q in ask.body["peers"] if q != p]) for p in ask.peers},
                         at=min(done_at, n.now + 0.3))
        t = done_at
        for p in N[:4]:
            n.feed(StepReported(p, RUN, report(1, s)), t)
    assert n.c.phase is Phase.TRAINING and n.c.status().completed == 199
    assert not any("trigger" in x or "phase: stopping" in x for x in n.lines)
    assert n.epoch.current is not None and n.epoch.current.epoch == 1 and not n.c.links
    assert stalls <= probes <= 2 * stalls, (stalls, probes)  # the stalls are probed, the jitter is not
    assert n.c.watch is not None and 2.5 <= n.c.watch.deadline_s() < 4.0


def test_a_step_that_completes_while_its_probe_is_out_clears_it():
    n = Node(timings=WATCHED)
    last = watched(n)
    n.tick()
    for p in N[:4]:
        n.feed(StepReported(p, RUN, report(1, 6)), last + 4.0)
    n.answer("probe deadline", at=last + 5.0)  # nobody answered, but the step completed meanwhile
    assert n.c.phase is Phase.TRAINING and n.c.status().stalled_since is None
    assert n.c.next_deadline() == last + 4.0 + 3.0


def test_a_slow_step_shows_as_stalled_until_it_completes():
    n = Node(timings=WATCHED)
    last = watched(n)
    n.tick()
    assert n.c.status().stalled_reason == ("step 6 is overdue (deadline 3.0 s): probing the peers that have not "
                                           "reported it")
    n.answer("probe deadline", everyone=reached(*N[:4]), at=last + 4.0)
    assert "a slow step" in n.c.status().stalled_reason
    assert n.c.next_deadline() == pytest.approx(last + 4.0 + 6.0)  # backed off: 2 x the deadline
    for p in N[:4]:
        n.feed(StepReported(p, RUN, report(1, 6)), last + 5.0)
    assert n.c.status().stalled_since is None and n.c.next_deadline() == last + 5.0 + 3.0


def test_a_new_epoch_starts_from_the_last_epochs_step_times_scaled_to_its_prediction():
    old = StepWatch(RULES, epoch=1, started=0.0)
    for t in (1.0, 3.0, 5.0, 7.0, 9.0):
        old.completed(t)
    new = StepWatch(RULES, epoch=2, started=20.0, prior=old.prior_for(0.5))  # predicted twice as fast
    assert new.due_at() == 20.0 + 20.0  # the first step warms up: first_s
    new.completed(30.0)
    assert list(new.intervals) == [1.0] * 4 and new.due_at() == 30.0 + 3.0  # the floor, at once
    assert old.prior_for(float("nan")) == []


def test_the_coordinators_status_says_stalled_with_the_reason_and_how_long():
    from pathlib import Path

    from dtfm.control.status import PlaneStatus

    n = Node(timings=WATCHED)
    last = watched(n)
    n.tick()
    st = PlaneStatus(N[0], {"role": "coordinator", "term": 1, "coordinator": N[0].hex()}, True, n.epoch.status(),
                     n.c.status(), Path("train.jsonl"), None, 1, now=last + 5.0).to_wire()
    assert st["state"] == "stalled" and st["issued"]["state"] == "stalled"
    assert st["issued"]["stalled_s"] == pytest.approx(5.0)
    assert st["issued"]["reason"].startswith("step 6 is overdue")
    n.answer("probe deadline", everyone=reached(*N[:4]), at=last + 4.0)
    for p in N[:4]:
        n.feed(StepReported(p, RUN, report(1, 6)), last + 5.0)
    st = PlaneStatus(N[0], {"role": "coordinator", "term": 1, "coordinator": N[0].hex()}, True, n.epoch.status(),
                     n.c.status(), Path("train.jsonl"), None, 1, now=last + 5.0).to_wire()
    assert st["state"] == "training" and st["issued"]["state"] == "training" and "stalled_s" not in st["issued"]


def test_a_peer_frozen_right_after_its_report_is_asked_too_and_is_out():
    # n3 reported step 6 and froze: the others wait for its acknowledgements. They are the
    # laggards; n3, their neighbour, is asked with them and does not answer.
    n = Node(timings=WATCHED)
    last = watched(n)
    n.feed(StepReported(N[3], RUN, report(1, 6)), last + 0.9)
    n.lines.clear()
    n.tick()
    n.answer("probe deadline", {N[0]: reached(N[1], N[2]), N[1]: reached(N[0], N[2], unreached=[N[3]]),
                                N[2]: reached(N[0], N[1], unreached=[N[3]])}, at=last + 7.0)
    n.transcript("""
        9 tick
          ask probe deadline: RUN_STATE reach n0 n1 n2 n3 within 2 s -> n0 n1 n2 n3
        13 answers probe deadline: n0 reached n1 n2, n1 reached n0 n2 not n3, n2 reached n0 n1 not n3, n3 -
          ask fence 1: STOP at_step=6 abort=True epoch=1 -> n3
    """)
    n.tick()
    assert n.lines[-2:] == ["  ask states: RUN_STATE query -> n0 n1 n2", "  phase: stopping"]
