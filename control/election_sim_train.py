"""The training model of the election simulation (control/election/sim.py): allocations,
steps, reports and reconfiguration, as control/peer_role.py and control/coordinate.py run them,
without tensors.

A coordinator hands out a `SimAllocation` (issuer, term, epoch = its last applied epoch + 1,
start step, peers, layer ranges) over the same network; a node applies it only when
`may_apply` says yes, retrying for `2 * heartbeat + 1 s` while the refusal is
`not-coordinator` of a term not older than its own (`_election_refusal`), then `applied` and
`set_voters(peers)`. `train` runs steps on every epoch whose peers all hold it, run and are
connected; a peer of an epoch that is gone or cut off makes the step fail on the others, and
`train(split=...)` lets some peers complete a step the others fail (one step apart). Each
completed step goes as a STEP report over the network to the issuer, which appends the step to
the shared `train_log` once every peer of its epoch reported it. `reconfigure` is the
coordinator's `_reconfigure`: run states of the nodes it reaches (its side of the partition;
instantaneous), stop, a majority of the voters or nothing, the real `resume_point`, back-fill
of the steps below it from the peers' last `MAX_REPORTS` reports, and the next epoch from
the resume step with the reached nodes as peers. In memory, lost in a crash: the stage
(layers, `at`, `prev`), the run, the reports, the issued epoch and the steps logged; on disk:
the term and vote, the applied (term, epoch), the voters and the train log. Two knobs depart
from the daemon where it is wrong: `one_voter_change` (a new epoch adds or removes one voter at
most, keeping the others as spares) and `lose_reports=False` (random loss spares STEP reports).

`SimTraining` is mixed into `ElectionSim`; it uses the simulation's nodes, network and checks
through `self`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtfm.net import short_id

from .coordinator.runstate import PeerRunState, ResumeError, resume_point
from .election import ElectionRole, ElectionState

__all__ = ["LAYOUTS", "RUN_ID", "SimAllocation", "SimIssued", "SimStage", "SimTraining"]

RUN_ID = b"r" * 16
LAYOUTS = {1: ((0, 4),), 2: ((0, 2), (2, 4))}  # stages -> layer ranges of a 4-layer model


@dataclass(frozen=True)
class SimAllocation:
    issuer: int
    term: int
    epoch: int
    start_step: int
    peers: tuple[int, ...]  # node indices, sorted
    layer_ranges: tuple[tuple[int, int], ...] = LAYOUTS[1]
    spares: tuple[int, ...] = ()  # voters without a stage

    @property
    def voters(self) -> tuple[int, ...]:
        return tuple(sorted(self.peers + self.spares))

    @property
    def key(self) -> tuple[int, int]:
        return (self.term, self.epoch)

    def layers_of(self, k: int) -> tuple[int, int]:
        return self.layer_ranges[self.peers.index(k) % len(self.layer_ranges)]


@dataclass
class SimStage:
    """A node's stage of the run (the daemon's `_run` and its `StageRunner`), in memory."""

    alloc: SimAllocation
    at: int  # the next step (steps 0 .. at-1 applied)
    prev: int | None = None  # the step of the one-step-back snapshot
    running: bool = True


@dataclass
class SimIssued:
    """The issuer's record of the epoch it handed out (control/steplog.py `_Issued`)."""

    alloc: SimAllocation
    completed: int
    reports: dict[int, set[int]] = field(default_factory=dict)  # step -> nodes that reported it


class SimTraining:
    """`ElectionSim`'s allocations and training (a mixin: see the module docstring)."""

    def issue(self, k: int, *, rogue: bool = False, start_step: int = 0, peers: Sequence[int] | None = None,
              stages: int = 1, spares: Sequence[int] = ()) -> SimAllocation | None:
        """Node k hands out the next allocation of its term (epoch: its last applied + 1, as the
        daemon numbers them) to its peers, all nodes by default (rogue: even when it is not
        coordinator, as a faulty peer would). None if it issued nothing."""
        node = self.nodes[k]
        if node is None or not (rogue or node.role is ElectionRole.COORDINATOR):
            return None
        peers = tuple(sorted(set(range(self.n) if peers is None else peers) | {k}))
        alloc = SimAllocation(k, node.term, node.last_applied[1] + 1, start_step, peers,
                              LAYOUTS[min(stages, len(peers), 2)], tuple(sorted(set(spares) - set(peers))))
        self.issued[k] = SimIssued(alloc, start_step - 1)
        self._offer(k, alloc)
        for j in alloc.voters:
            if j != k:
                self._transmit(k, j, ("alloc", alloc))
        return alloc

    def start_training(self, k: int, *, stages: int = 2) -> SimAllocation | None:
        """`train start` on coordinator k: the first epoch, from step 0, over the nodes it reaches."""
        return self.issue(k, peers=[j for j in self.live() if self.groups[j] == self.groups[k]], stages=stages)

    def reconfigure(self, k: int, *, stages: int = 2) -> str:
        """Coordinator k's reconfiguration (`_reconfigure`); what came of it, in words."""
        node = self.nodes[k]
        if node is None or node.role is not ElectionRole.COORDINATOR:
            return "not coordinator"
        reached = [j for j in self.live() if self.groups[j] == self.groups[k]]
        if len(set(reached) & {self.index[v] for v in node.voters}) < node.majority:
            return "minority"
        if self.stages[k] is None:
            return "no run"  # like the daemon's, a coordinator without `_run` (restarted) does nothing
        cur = self.stages[k].alloc
        for j in reached:  # STOP at a common boundary: steps only run in `train`, so at once
            if self.stages[j] is not None:
                self.stages[j].running = False
        states = {self.ids[j]: self.run_state(j) for j in reached}
        try:
            rp = resume_point(RUN_ID, cur.layer_ranges, states)
        except ResumeError as e:
            self.stopped.append(str(e))
            return f"stopped: {e}"
        start = rp.step
        logged = max((line["step"] for line in self.train_log), default=-1)
        if rp.rollback or start <= logged:  # steps already logged run again (the daemon flags only the former)
            self.rollbacks.append((start, logged, rp.rollback))
        backfill: dict[int, list[tuple[int, int]]] = {}
        for j in reached:
            for term, epoch, step in self.step_reports[j]:
                if step < start:
                    backfill.setdefault(step, []).append((term, epoch))
        peers, spares = self._next_voters(node, reached)
        alloc = self.issue(k, start_step=start, peers=peers, stages=stages, spares=spares)
        for step, trained in sorted(backfill.items()):
            if step not in self.logged[k]:
                self._log(k, step, alloc.term, trained[0], backfilled=True)
        return "issued"

    def _next_voters(self, node: ElectionState, reached: list[int]) -> tuple[list[int], list[int]]:
        """Peers and spares of the next epoch: every node reached (the daemon), or with
        `one_voter_change` one voter added or removed at most, the others kept as spares or left out."""
        old = {self.index[v] for v in node.voters}
        if not self.one_voter_change:
            return reached, []
        removed, added = sorted(old - set(reached)), sorted(set(reached) - old)
        if removed:
            return sorted(old & set(reached)), removed[1:]
        return sorted(old | set(added[:1])), []

    def run_state(self, k: int) -> PeerRunState:
        """What node k answers to RUN_STATE (control/holdings.py `run_state`)."""
        st = self.stages[k]
        if st is None:
            return PeerRunState(None, *self.disk_applied[k], None, None, None, False)
        if k not in st.alloc.peers:  # a spare: the run, no stage
            return PeerRunState(RUN_ID, *st.alloc.key, None, None, None, False)
        return PeerRunState(RUN_ID, *st.alloc.key, st.alloc.layers_of(k), st.at, st.prev, st.running)

    def train(self, steps: int = 1, *, split: Sequence[int] = (), ahead_tries_next: bool = False) -> int:
        """Every epoch whose peers all hold it, run, are up and connected runs `steps` steps;
        the peers of an epoch that cannot step fail the step (they stay where they are). With
        `split`, the last of these steps is completed only by the peers in `split` and failed by
        the others; those ahead stop before the next step, or (`ahead_tries_next`, what
        `StageRunner` does when no STOP came first) start it and fail it too.
        Returns the steps completed, summed over the epochs."""
        done = 0
        for alloc in sorted({st.alloc for st in self.stages if st is not None and st.running}, key=lambda a: a.key):
            mine = [j for j in alloc.peers if self.stages[j] is not None and self.stages[j].alloc == alloc]
            ok = len(mine) == len(alloc.peers) and all(
                self.stages[j].running and self.groups[j] == self.groups[alloc.issuer] for j in mine)
            for s in range(steps if ok else 0):
                last = s == steps - 1 and split
                for j in mine:
                    if not last or j in split:
                        self._complete(j)
                done += 1
            if ok and not split:
                continue
            for j in mine:  # the step that fails changes nothing: StageRunner keeps the snapshot
                self.stages[j].running = False  # of the last completed step
        return done

    def merged_log(self) -> dict[int, dict]:
        """step -> the line of the highest (term, epoch) (what `dtfm-swarm` merges)."""
        best: dict[int, dict] = {}
        for line in self.train_log:
            if line["step"] not in best or (line["term"], line["epoch"]) > (best[line["step"]]["term"],
                                                                           best[line["step"]]["epoch"]):
                best[line["step"]] = line
        return best

    # ------------------------------------------------------------------ internals

    def _offer(self, k: int, alloc: SimAllocation, wait_until: float = -math.inf) -> None:
        """Node k receives an allocation: applies it if its election state allows (`accept`);
        until `wait_until` it waits for a coordinator it does not know yet (`_election_refusal`)."""
        node = self.nodes[k]
        issuer, term, epoch = alloc.issuer, alloc.term, alloc.epoch
        refusal = node.may_apply(self.ids[issuer], term, epoch)
        if refusal is not None:
            if refusal.code == "not-coordinator" and term >= node.term and self.now + 0.1 <= wait_until:
                self._push(self.now + 0.1, ("retry", k, alloc, wait_until))
            else:
                self.refused += 1
            return
        if self.winners.get(term) != issuer:
            self._violation(f"node {k} applied term {term} of {short_id(self.ids[issuer])}, "
                            f"not the coordinator elected in it")
        if (term, epoch) <= self.disk_applied[k]:
            self._violation(f"node {k} applied ({term}, {epoch}) after {self.disk_applied[k]}")
        self.applications.append((k, (term, epoch), node.coordinator, node.term))
        node.applied(term, epoch)
        self.disk_applied[k] = (term, epoch)
        self.applied[k].append((term, epoch))
        self.disk_voters[k] = tuple(self.ids[j] for j in alloc.voters)
        self._run(k, node.set_voters(self.disk_voters[k], self.local_now(k)))
        self.stages[k] = SimStage(alloc, alloc.start_step)

    def _complete(self, k: int) -> None:
        """Node k completes the step its stage is at and reports it to the issuer."""
        st = self.stages[k]
        step, alloc = st.at, st.alloc
        st.prev, st.at = step, step + 1
        self.step_reports[k].append((alloc.term, alloc.epoch, step))
        if alloc.issuer == k:
            self._on_report(k, k, alloc.term, alloc.epoch, step)
        else:
            self._transmit(k, alloc.issuer, ("step", alloc.term, alloc.epoch, step))

    def _on_report(self, k: int, src: int, term: int, epoch: int, step: int) -> None:
        """The issuer k gets a STEP report (`_Issued.add`: matched on the epoch, as the daemon does)."""
        issued = self.issued[k]
        if issued is None or epoch != issued.alloc.epoch or step <= issued.completed or src not in issued.alloc.peers:
            return
        issued.reports.setdefault(step, set()).add(src)
        n = len(issued.alloc.peers)
        while len(issued.reports.get(issued.completed + 1, ())) == n or any(
                len(r) == n for s, r in issued.reports.items() if s > issued.completed + 1):
            got = issued.reports.pop(issued.completed + 1, None)  # a step with a lost report: logged all the same
            issued.completed += 1
            if got:  # with no report at all: passed over, for a later back-fill
                self._log(k, issued.completed, issued.alloc.term, issued.alloc.key)

    def _log(self, k: int, step: int, term: int, trained: tuple[int, int], backfilled: bool = False) -> None:
        self.logged[k].add(step)
        self.train_log.append({"step": step, "term": term, "epoch": trained[1], "holder": k,
                               "backfilled": backfilled, "trained": trained})
