"""The control plane at swarm sizes well past the council: 64 nodes (and the election and
hand-out at 1,000) in `PlaneSim`, under a virtual clock. The council stays at most
MAX_COUNCIL voters, so what elections and hand-outs cost grows with the council, not the swarm;
a growing swarm is taken in by waves of joins, and churn at 64 peers loses no step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_plane_byzantine import ByzantinePlane
from test_plane_sim import CFG, CLEAN, PlaneMachine, check_applications, check_log

from dtfm.control.coordinator.machine import Phase
from dtfm.control.election.council import MAX_COUNCIL
from dtfm.control.testing.sim import SIM_TIMINGS, PlaneSim
from examples import examples


def _started(sim: PlaneSim, settle_s: float = 3.0) -> int:
    sim.run_for(settle_s)
    [c] = sim.coordinators()
    assert sim.start_training(c)
    sim.run_for(1.0)
    return c


def _joined_reconfigurations(sim: PlaneSim) -> list[dict]:
    return [e[3] for e in sim.events if e[2] == "reconfigure" and "joined" in e[3]["trigger"]]


@pytest.mark.parametrize("n", [64, 256])
def test_election_and_hand_out_cost_grows_with_the_council_not_the_swarm(n):
    """Elected within a second of virtual time, the first allocation applied by every node
    within another; the election messages of the first term are those of a council of at most
    MAX_COUNCIL (the same count as a swarm of 8)."""
    small = PlaneSim(8, CFG, seed=5)
    small.run_for(3.0)
    sim = PlaneSim(n, CFG, seed=5)
    sim.run_for(3.0)
    assert len(sim.voters) <= MAX_COUNCIL and sim.violations == []
    assert [t for _, _, t in sim.wins] == [1] and sim.wins[0][0] < 1.0
    assert sim.sent <= 1.2 * small.sent, (sim.sent, small.sent)
    [c] = sim.coordinators()
    t0 = sim.now
    assert sim.start_training(c, steps=20)
    while any(a == (0, 0) for a in sim.disk_applied) and sim.now < t0 + 5.0:
        sim.run_for(0.05)
    assert len(set(sim.disk_applied)) == 1 and sim.disk_applied[0] != (0, 0)
    assert sim.now - t0 < 1.0


def test_a_swarm_growing_from_8_to_64_takes_the_newcomers_in_within_3_reconfigurations():
    """56 peers join one a second while 8 train: the coordinator takes them in by waves (the
    daemon's default settle and wait), not one reconfiguration per joiner; every node ends in
    the run and no step is lost."""
    timings = dataclasses.replace(SIM_TIMINGS, join_settle_s=10.0, join_wait_max_s=60.0)
    sim = PlaneSim(64, CFG, seed=3, timings=timings, conditions=CLEAN)
    for k in range(8, 64):
        sim.crash(k)
    c = _started(sim)
    for _ in range(4):
        sim.run_for(0.5)
        sim.train(1)
    for k in range(8, 64):
        sim.restart(k)
        sim.run_for(0.5)
        sim.train(1)
        sim.run_for(0.5)
        sim.train(1)
    for _ in range(80):
        sim.run_for(0.5)
        sim.train(1)
    waves = _joined_reconfigurations(sim)
    assert 1 <= len(waves) <= 3, [w["trigger"] for w in waves]
    assert sim.violations == [] and sim.coordinators() == [c]
    cur = sim.epoch(c).current
    assert set(cur.peers) | set(cur.spares) == set(sim.ids)
    assert len({sim.disk_applied[k] for k in range(64)}) == 1
    check_applications(sim)
    steps = check_log(sim, pending=False)
    assert len(steps) > 60 and not [e for e in sim.events if e[2] == "rollback"]


def test_churn_at_64_peers_loses_no_step():
    """64 peers training; every 10 s of virtual time for 5 minutes one peer crashes or a
    crashed one comes back (any peer, the coordinator too). The run keeps training: every step
    in the merged log once, no rollback, one coordinator per term."""
    sim = PlaneSim(64, CFG, seed=11, conditions=CLEAN)
    _started(sim)
    rng = random.Random(11)
    down: list[int] = []
    done_before = len(check_log(sim))
    for tick in range(30):
        if down and (tick % 2 or len(down) > 4):
            sim.restart(down.pop(rng.randrange(len(down))))
        else:
            k = rng.choice(sim.live())
            sim.crash(k)
            down.append(k)
        for _ in range(20):
            sim.run_for(0.5)
            sim.train(1)
        assert sim.violations == []
    for k in down:
        sim.restart(k)
    for _ in range(40):
        sim.run_for(0.5)
        sim.train(1)
    assert sim.violations == []
    check_applications(sim)
    steps = check_log(sim, pending=False)
    assert len(steps) - done_before > 100
    kinds = [e[2] for e in sim.events]
    assert "rollback" not in kinds and "stopped" not in kinds, kinds
    [c] = sim.coordinators()
    assert sim.coords[c].phase is Phase.TRAINING
    assert len(sim.wins) > 1  # (a coordinator was among the crashed: the next one took the run on)


# ---------------------------------------------------------------------- the machines under faults, 64 nodes


class PlaneMachine64(PlaneMachine):
    """test_plane_sim's PlaneMachine (crash, restart, partition, heal, drop, duplicate, reorder,
    delay, clock jumps, split steps) on 64 nodes and a council of at most 7: the same checks."""

    def _k(self, i):
        return (i * 7) % self.sim.n  # (the 9 moves' nodes spread over the swarm)

    @initialize(seed=st.integers(0, 2**32), checkpoint_every=st.sampled_from([0, 2]))
    def start(self, seed, checkpoint_every):
        self.sim = PlaneSim(64, CFG, seed=seed, stages=2, checkpoint_every=checkpoint_every, conditions=CLEAN)
        self.sim.run_for(2.0)
        for c in self.sim.coordinators():
            self.sim.start_training(c)
        self.sim.run_for(0.5)

    @rule(ahead=st.lists(st.booleans(), min_size=9, max_size=9))
    def split_step(self, ahead):
        self.sim.train(1, split=[k for k in range(self.sim.n) if ahead[k % 9]])


TestPlane64 = PlaneMachine64.TestCase
TestPlane64.settings = settings(max_examples=examples(12), stateful_step_count=25, deadline=None, derandomize=True,
                                suppress_health_check=[HealthCheck.too_slow])


class ByzantinePlane64(ByzantinePlane):
    """test_plane_byzantine's ByzantinePlane (an insider or outsider with a real key sending
    well-formed control messages with arbitrary fields) among 64 nodes: the same checks."""

    def _k(self, i):
        return (i * 7) % self.sim.n

    @initialize(seed=st.integers(0, 2**32), checkpoint_every=st.sampled_from([0, 2]))
    def start(self, seed, checkpoint_every):
        super().start(63, seed, 2, checkpoint_every)  # (an outsider makes 64)

    @rule(ahead=st.lists(st.booleans(), min_size=9, max_size=9))
    def split_step(self, ahead):
        self.sim.train(1, split=[k for k in range(self.sim.n) if ahead[k % 9]])


TestByzantinePlane64 = ByzantinePlane64.TestCase
TestByzantinePlane64.settings = settings(max_examples=examples(10), stateful_step_count=25, deadline=None, derandomize=True,
                                         suppress_health_check=[HealthCheck.too_slow])
