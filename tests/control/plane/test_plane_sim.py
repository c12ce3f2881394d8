"""The control plane's own machines (`ElectionState`, `EpochMachine`, `Coordinator`) on every
node of a simulated network (`PlaneSim`, control/testing/sim.py), under crash, restart, partition,
heal, drop, duplicate, reorder, delay and clock jumps.

The stand-in model's weights are a hash chain over the steps, so a logged loss is the
reference's only if its stage was resumed from the right weights (checked as the simulation
runs, in `violations`). After every rule: never two coordinators in one term; a node applies an
allocation only in its current term and from the coordinator it recognises, the one elected in
it; each node's applied (term, epoch) strictly increases; the merged train log (per step the
line of the highest (term, epoch), as `dtfm-swarm` merges it) has every step from 0 but those a
live coordinator is back-filling (their reports were lost and it is asking the peers) or a
crashed one was (its successor's hand-out back-fills them); a node
logs a step once in one life unless the swarm rolled back to it. At the end, after a heal, the
restart of every node and a quiet period in which the swarm trains: every live node applied the
same newest (term, epoch) and the merged log holds every step the swarm completed: a run that
lost every holder of a stage rolls back to a checkpoint, or to the initial weights, and goes on.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from sim_faults import SimFaults

# Hundreds of simulated examples: a minute alone, more beside the real swarms of the other worker
# (the suite's 120 s per test would cut one short and read as a flaky example).
pytestmark = pytest.mark.timeout(360)

from dtfm.control.coordinator.machine import Phase
from dtfm.control.coordinator.steplog import STEP_WINDOW
from dtfm.control.election import ElectionConfig
from dtfm.control.testing.election_sim import NetConditions
from dtfm.control.epoch.machine import EpochPhase
from dtfm.control.testing.sim import PlaneSim
from examples import examples

CFG = ElectionConfig.test()
CLEAN = NetConditions(jitter=1.0)


def backfilling(sim: PlaneSim, *, coordinators: bool = False) -> set[int]:
    """The steps a live node's step log passed over (their reports lost on the way) and asks
    the peers for (`coordinators`: only the logs of the nodes that are coordinators now): not in
    the log yet, and not lost."""
    out: set[int] = set()
    for k in sim.coordinators() if coordinators else sim.live():
        log = sim.coords[k].steplog if sim.coords[k] is not None else None
        if log is not None:
            out |= log.gaps
    return out


def check_log(sim: PlaneSim, *, pending: bool = True, orphaned: set[int] = frozenset()) -> list[int]:
    """The log invariants; returns the merged log's steps. `pending`: a hole may be a step a
    live coordinator is back-filling, or one of `orphaned`: the gaps a coordinator was
    back-filling when it crashed (its successor's hand-out back-fills them from the reports the
    peers keep, or, were those peers lost too, the swarm rolls back and runs them again)."""
    merged = sim.merged_log()
    steps = sorted(merged)
    allowed = backfilling(sim) | orphaned if pending else set()
    holes = set(range(steps[-1] + 1)) - set(steps) - allowed if steps else set()
    assert not holes, f"merged train log has holes: {steps} (being back-filled: {sorted(allowed)})"
    back = min((e[3]["resume_step"] for e in sim.events if e[2] == "rollback"), default=float("inf"))
    again = [k for k, n in Counter((x["holder"], x["life"], x["step"]) for x in sim.train_log
                                   if x["step"] < back).items() if n > 1]
    assert not again, f"(node, life, step) logged twice without a rollback: {again}"
    return steps


def check_applications(sim: PlaneSim) -> None:
    for k, (term, epoch), recognised, node_term in sim.applications:
        assert node_term == term, f"node {k} applied ({term}, {epoch}) in its term {node_term}"
        assert sim.index.get(recognised) in sim.elected(term), f"node {k} applied ({term}, {epoch}) of a " \
                                                               "coordinator it did not recognise"
    for k, seq in enumerate(sim.applied):
        assert all(a < b for a, b in itertools.pairwise(seq)), f"node {k} applied {seq}"


def settle(sim: PlaneSim, rounds: int = 12, *, catch_up: bool = False) -> str:
    """Heal, restart every node, a clean network: the swarm reconfigures itself and trains.
    What came of it: "training", or why the run cannot go on. `catch_up`: then train on until
    the log holds every step done and no coordinator is back-filling (at most a few windows)."""
    sim.heal()
    sim.net = CLEAN
    for k in range(sim.n):
        sim.restart(k)
    paused = ""
    for _ in range(rounds):
        sim.run_for(1.0)
        sim.train(1)
        coords = sim.coordinators()
        if len(coords) != 1:
            continue
        phase = sim.coords[coords[0]].phase
        if phase is Phase.STOPPED:
            return f"{phase.value}: {sim.coords[coords[0]].reason}"
        if phase is Phase.PAUSED:  # (it retries when the peers out of reach answer)
            paused = f"{phase.value}: {sim.coords[coords[0]].reason}"
            continue
        # (a node that refuses every allocation is left out: it takes no part)
        taking = [k for k in sim.live() if k not in sim.refusing]
        epochs = {sim.epoch(k).current.term_epoch if sim.epoch(k).current else None for k in taking}
        training = all(sim.epoch(k).run is not None and sim.epoch(k).run.phase in (
            EpochPhase.TRAINING, EpochPhase.SPARE) for k in taking)
        if len(epochs) == 1 and training and sim.train(2) == 2:
            # A step whose reports were lost (or came while the coordinator was down) is logged
            # once every peer reported the last step of its window, from the reports the peers
            # keep (steplog.py; asked again, spaced, while some peer did not answer): train on
            # until the log holds every step done and no gap waits.
            # (after a rollback, the steps run again fill the holes the lost steps left)
            for _ in range(3 * STEP_WINDOW if catch_up else 0):
                done = max(x.at for k in sim.live() for x in sim.sim_stages[k].values())
                logged = set(sim.merged_log())
                if (done - 1 in logged and logged >= set(range(max(logged) + 1))
                        and not backfilling(sim, coordinators=True)):
                    break
                sim.train(1)
                sim.run_for(0.5)
            return "training"
    return paused or "not settled"


class PlaneMachine(SimFaults):
    def __init__(self):
        super().__init__()
        self.sim: PlaneSim | None = None
        self.orphaned: set[int] = set()  # the gaps crashed coordinators were back-filling, until logged

    @rule(i=st.integers(0, 8))
    def crash(self, i):
        k = self._k(i)
        coord = self.sim.coords[k]
        if coord is not None and coord.steplog is not None:
            self.orphaned |= coord.steplog.gaps
        self.sim.crash(k)

    def _orphaned(self) -> set[int]:
        self.orphaned -= set(self.sim.merged_log())
        return self.orphaned

    @initialize(n=st.integers(3, 6), seed=st.integers(0, 2**32), stages=st.sampled_from([1, 2]),
                checkpoint_every=st.sampled_from([0, 2]))
    def start(self, n, seed, stages, checkpoint_every):
        self.sim = PlaneSim(n, CFG, seed=seed, stages=stages, checkpoint_every=checkpoint_every, conditions=CLEAN)
        self.sim.run_for(2.0)
        for c in self.sim.coordinators():
            self.sim.start_training(c)
        self.sim.run_for(0.5)

    @rule(i=st.integers(0, 8))
    def campaign(self, i):
        self.sim.campaign(self._k(i))

    @rule(steps=st.integers(1, 3))
    def train(self, steps):
        self.sim.train(steps)
        self.sim.run_for(0.1)

    @rule(ahead=st.lists(st.booleans(), min_size=9, max_size=9))
    def split_step(self, ahead):
        """Some peers complete a step the others fail (a peer lost half-way through it)."""
        self.sim.train(1, split=[k for k in range(self.sim.n) if ahead[k]])

    @invariant()
    def safe(self):
        if self.sim is None:
            return
        assert self.sim.violations == []
        terms = [self.sim.nodes[k].term for k in self.sim.coordinators()]
        assert len(terms) == len(set(terms)), "two coordinators in one term"
        check_applications(self.sim)
        check_log(self.sim, orphaned=self._orphaned())

    def teardown(self):
        sim = self.sim
        if sim is None:
            return
        outcome = settle(sim, catch_up=True)
        assert sim.violations == []
        # (every stage can be restored at step 0 at least, so the run always goes on)
        assert outcome == "training", outcome
        newest = {sim.disk_applied[k] for k in sim.live()}
        assert len(newest) == 1, f"live nodes applied {sorted(newest)}"
        steps = check_log(sim, pending=False)
        done = max(st.at for k in sim.live() for st in sim.sim_stages[k].values())
        # (after a rollback the log also holds the lines of the steps run before it)
        assert done - 1 in steps and (steps[-1] == done - 1 or any(e[2] == "rollback" for e in sim.events))


TestPlane = PlaneMachine.TestCase
TestPlane.settings = settings(max_examples=examples(300), stateful_step_count=40, deadline=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
