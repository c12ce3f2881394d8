"""Gray failures at the coordinator: the step deadline (control/coordinator/deadline.py) and cut
links (control/coordinator/links.py), pure and through the machine under virtual time.

The machine's tests play the shell around n0 as tests/control/coordinator/test_coordinator_machine.py does
(tests/coordinator_fixtures.py's `Node`): a loaded machine whose step times jitter, a slow step,
a step that completes while its probe is out. A peer that stops answering but keeps its sockets
open (frozen), a link cut between two live pipeline neighbours and a healed link are told as
transcripts, tests/data/deadline/*.txt, played by tests/transcripts.py (its `WATCHED` timings).
"""

from __future__ import annotations

import random

import pytest
import transcripts
from coordinator_fixtures import Node
from machine_trace import RUN, N, alloc, report
from transcripts import RULES, WATCHED

from dtfm.control import ControlMsg
from dtfm.control.answers import NoAnswer, read_answers
from dtfm.control.coordinator.deadline import StepWatch, judge, laggards, probe_targets
from dtfm.control.coordinator.links import CutLinks, exchanges, pair, used_cut_links
from dtfm.control.coordinator.machine import Phase, StepReported
from dtfm.control.reach import ReachAnswer, ReachRequest
from dtfm.net import ProtocolError



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
    asked = {p: wire[p] if p in wire else NoAnswer("no answer within 4 s") for p in N[:4]}
    v = judge(N[:4], nb, read_answers(ControlMsg.RUN_STATE, ReachRequest(tuple(N[:4]), 2.0).to_wire(), asked))
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


# ---- the transcripts (tests/data/deadline/*.txt, played by tests/transcripts.py) -----------------


@pytest.mark.parametrize("path", transcripts.files("deadline"), ids=lambda p: p.stem)
def test_transcript(path):
    transcripts.check(path)
