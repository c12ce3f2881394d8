"""The election and the allocation acceptance together, with a model of training steps, under a
hypothesis rule-based state machine over the simulated network (control/election/sim.py).

Modelled: the real `ElectionState` on every node (votes, leases, check-quorum, terms persisted
in a store, the applied (term, epoch) and the voters on disk); allocations as small records
(issuer, term, epoch, start step, peers, a 1- or 2-stage layout) sent over the simulated
network, so they are dropped, duplicated, reordered, delayed and cut by partitions; their
acceptance exactly by the daemon's rule (`may_apply`, waiting like `_election_refusal` for a
coordinator not known yet, then `applied` and `set_voters`); steps run by the peers of an epoch
only while all of them hold it, run and are connected, a lost peer failing the step on the
others, and peers one step apart (some complete a step the others fail); STEP reports over the
network to the issuer, which logs a step once every peer reported it; the coordinator's
reconfiguration: run states of the nodes it reaches, a majority of the voters or nothing, the
real `resume_point`, back-fill of the steps below it, the next epoch from there; crashes that
lose everything in memory (stage, run, reports, what the issuer logged) but not the disk.

Not modelled: tensors, signatures, the other checks of `check_allocation`, gossip (reachable
means up and on the same side of the partition, and run states, STOP and START are
instantaneous), checkpoints, the scheduler (the peers of a new epoch are the nodes the
coordinator reaches), stage transfers, `train stop`, the retry limit of failed
reconfigurations, and the daemon's triggers (a rule says when the coordinator reconfigures).
A configuration changes by one voter at most per epoch (`one_voter_change`), as the daemon's
allocations carry it; STEP reports are lost like any message, and the issuer logs a step
whose report was lost once a later step has every report.

Invariants, after every rule: never two coordinators in one term; a node applies an allocation
only of its current term and from the coordinator it recognises for it, who is the one elected
in it; each node's applied (term, epoch) strictly increases; the merged train log (per step
the line of the highest (term, epoch), as `dtfm-swarm` merges it) has every step from 0; no
node logs a step as run in two epochs unless the swarm resumed below a logged step (a
rollback: to stale stages when the holders of newer ones crashed, which the daemon does not
flag). At the end, after a heal and a quiet period (and re-elections and reconfigurations, as
the daemon's triggers would make them): every live node applied the same newest
(term, epoch), and after two more steps the merged log holds every step the swarm completed;
unless the run cannot go on (every holder of a stage crashed, there are no checkpoints) or the
coordinator is a restarted node, which has no run and never reconfigures (as in the daemon).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from sim_faults import SimFaults

from dtfm.control.election import ElectionConfig
from dtfm.control.election.sim import ElectionSim, NetConditions

CFG = ElectionConfig.test()
CLEAN = NetConditions(jitter=1.0)


def check_log(sim: ElectionSim) -> list[int]:
    """The log invariants; returns the merged log's steps."""
    merged = sim.merged_log()
    steps = sorted(merged)
    assert steps == list(range(len(steps))), f"merged train log has holes: {steps}"
    trained: dict[tuple[int, int], set] = {}  # (holder, step) -> the (term, epoch) it ran in, per line
    for line in sim.train_log:
        trained.setdefault((line["holder"], line["step"]), set()).add(line["trained"])
    back = min((step for step, _, _ in sim.rollbacks), default=float("inf"))
    again = {k: t for k, t in trained.items() if len(t) > 1 and k[1] < back}
    assert not again, f"(node, step) logged as run in two epochs without a rollback: {again}"
    return steps


def check_applications(sim: ElectionSim) -> None:
    for k, (term, epoch), recognised, node_term in sim.applications:
        assert node_term == term, f"node {k} applied ({term}, {epoch}) in its term {node_term}"
        assert recognised == sim.ids[sim.winners[term]], f"node {k} applied ({term}, {epoch}) of a coordinator " \
                                                         "it did not recognise"
    for k, seq in enumerate(sim.applied):
        assert all(a < b for a, b in itertools.pairwise(seq)), f"node {k} applied {seq}"


class AcceptanceMachine(SimFaults):
    def __init__(self):
        super().__init__()
        self.sim: ElectionSim | None = None

    @initialize(n=st.integers(3, 6), seed=st.integers(0, 2**32), stages=st.sampled_from([1, 2]))
    def start(self, n, seed, stages):
        self.sim = ElectionSim(n, CFG, seed=seed, codec=False, conditions=CLEAN, lose_reports=True,
                               one_voter_change=True)
        self.sim.run_for(2.0)
        for c in self.sim.coordinators():
            self.sim.start_training(c, stages=stages)
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

    @rule(stages=st.sampled_from([1, 2]))
    def reconfigure(self, stages):
        for c in self.sim.coordinators():
            self.sim.reconfigure(c, stages=stages)

    @invariant()
    def safe(self):
        if self.sim is None:
            return
        assert self.sim.violations == []
        terms = [self.sim.nodes[k].term for k in self.sim.coordinators()]
        assert len(terms) == len(set(terms)), "two coordinators in one term"
        check_applications(self.sim)
        check_log(self.sim)

    def teardown(self):
        sim = self.sim
        if sim is None:
            return
        sim.heal()
        sim.net = CLEAN
        for k in range(sim.n):
            sim.restart(k)
        outcome = ""
        for _ in range(4):  # the daemon's triggers: coordinator changed, peers joined, hand-out failed
            sim.run_for(3.0)
            [c] = sim.coordinators()
            if len({sim.disk_applied[k] for k in sim.live()}) == 1 and sim.stages[c] is not None \
                    and sim.stages[c].alloc.key == sim.disk_applied[c] and outcome == "issued":
                break
            outcome = sim.reconfigure(c)
            if outcome == "no run" or "no reachable peer holds" in outcome:
                return  # a restarted coordinator (see the report) or every holder of a stage lost
        newest = {sim.disk_applied[k] for k in sim.live()}
        assert len(newest) == 1, f"{outcome}: live nodes applied {sorted(newest)}"
        if sim.train(2):
            sim.run_for(1.0)
            steps = check_log(sim)
            assert steps[-1] == max(s.at for s in sim.stages if s is not None) - 1
        assert sim.violations == []


TestAcceptance = AcceptanceMachine.TestCase
TestAcceptance.settings = settings(max_examples=500, stateful_step_count=40, deadline=None, derandomize=True,
                                   suppress_health_check=[HealthCheck.too_slow])


def _training(n: int, stages: int, **kw) -> tuple[ElectionSim, int]:
    sim = ElectionSim(n, CFG, seed=3, codec=False, conditions=CLEAN, **kw)
    sim.run_for(2.0)
    [c] = sim.coordinators()
    sim.start_training(c, stages=stages)
    sim.run_for(0.5)
    return sim, c


def test_a_swarm_trains_logs_and_resumes_one_step_apart():
    sim, c = _training(4, 2)
    assert sim.train(3) == 3
    sim.run_for(0.5)
    assert sorted(sim.merged_log()) == [0, 1, 2]
    sim.train(1, split=[c])  # c completes step 3, the others fail it: c goes back with its snapshot
    assert sim.reconfigure(c) == "issued"
    sim.run_for(0.5)
    assert {s.alloc.start_step for s in sim.stages} == {3} and sim.rollbacks == []
    sim.train(2)
    sim.run_for(0.5)
    assert check_log(sim) == [0, 1, 2, 3, 4] and sim.violations == []


def test_a_peer_ahead_that_starts_the_next_step_can_still_go_back():
    sim, c = _training(2, 2)  # one pipeline of two stages
    sim.train(2)
    sim.train(1, split=[c], ahead_tries_next=True)
    assert sim.reconfigure(c) == "issued"


def test_a_lost_step_report_leaves_no_hole_in_the_log():
    sim, c = _training(3, 1, lose_reports=True)
    sim.train(1)
    sim.net = NetConditions(jitter=1.0, drop_fraction=1.0)
    sim.train(1)  # the other peers' reports of step 1 are lost
    sim.net = CLEAN
    sim.train(40)
    sim.run_for(0.5)
    assert sim.reconfigure(c) == "issued"
    check_log(sim)
