"""A deterministic simulated network of `ElectionState` nodes, with virtual time.

Messages cross a link after its delay (a matrix, e.g. a scenario's one-way delays) times a
random jitter; a fraction is dropped, duplicated, or delayed further (which reorders them).
Partitions cut every message between groups at delivery; crashed nodes lose their state and
what is sent to them, and restart from their store (term and vote) and their disk (applied
(term, epoch) and voters). Each node has its own clock offset, so clocks can jump.

Actions run in order, as a driver must run them, and the simulation checks as they happen:

- one vote per (node, term), across restarts;
- a granted vote is sent only once the store holds it;
- at most one coordinator per term, and each elected by votes of a majority of its voters;
- a node that stood after the current partition formed wins only on a side with a majority;
- a node applies only allocations of the coordinator elected in that term, and its applied
  (term, epoch) only grows.

Allocations and training (a model of control/epoch.py and control/coordinate.py, no tensors).
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

Violations are collected in `violations` (the tests assert it stays empty). Same seed, same
run: all randomness comes from one `random.Random`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtfm.net import pack, short_id, unpack_untrusted
from dtfm.scenarios import load_scenario

from .election import (
    BecameCoordinator,
    CoordinatorKnown,
    ElectionConfig,
    ElectionRole,
    ElectionSend,
    ElectionState,
    Persist,
    SteppedDown,
)
from .election_messages import Vote, decode_election
from .election_store import MemoryElectionStore
from .runstate import MAX_REPORTS, PeerRunState, ResumeError, resume_point

__all__ = ["ElectionSim", "NetConditions", "SimAllocation", "returning_peer", "scenario_delays_s",
           "takeover_times"]

MAX_BODY_BYTES = 1 << 20
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
class _Stage:
    """A node's stage of the run (the daemon's `_run` and its `StageRunner`), in memory."""

    alloc: SimAllocation
    at: int  # the next step (steps 0 .. at-1 applied)
    prev: int | None = None  # the step of the one-step-back snapshot
    running: bool = True


@dataclass
class _Issued:
    """The issuer's record of the epoch it handed out (control/steplog.py `_Issued`)."""

    alloc: SimAllocation
    completed: int
    reports: dict[int, set[int]] = field(default_factory=dict)  # step -> nodes that reported it


def scenario_delays_s(name: str, n: int, rng: random.Random) -> list[list[float]]:
    """(n, n) one-way delays in seconds of n peers spread over a scenario's regions, shuffled."""
    matrix = load_scenario(name).scaled(n).delay_ms()
    order = list(range(n))
    rng.shuffle(order)
    return [[float(matrix[order[i], order[j]]) / 1000 for j in range(n)] for i in range(n)]


@dataclass
class NetConditions:
    jitter: float = 0.3  # each delay is multiplied by uniform(1, 1 + jitter)
    drop_fraction: float = 0.0
    duplicate_fraction: float = 0.0
    reorder_s: float = 0.0  # extra delay, uniform in [0, reorder_s]: later messages overtake
    delay_scale: float = 1.0


class ElectionSim:
    def __init__(self, n: int, config: ElectionConfig, *, delays_s: Sequence[Sequence[float]] | None = None,
                 seed: int = 0, codec: bool = True, conditions: NetConditions | None = None,
                 lose_reports: bool = True, one_voter_change: bool = False) -> None:
        self.config = config
        self.one_voter_change = one_voter_change  # True: reconfigure adds or removes one voter at most
        self.lose_reports = lose_reports  # False: drop_fraction spares STEP reports (a connection that stays up)
        self.rng = random.Random(seed)
        self.codec = codec  # False: hand message objects over (faster); True: through the wire codec
        self.net = conditions or NetConditions()
        self.delays_s = [list(row) for row in delays_s] if delays_s is not None else [[0.01] * n for _ in range(n)]
        self.ids = sorted(self.rng.randbytes(32) for _ in range(n))
        self.index = {p: k for k, p in enumerate(self.ids)}
        self.voters = tuple(self.ids)
        self.now = 0.0
        self.stores = [MemoryElectionStore() for _ in range(n)]
        self.disk_applied: list[tuple[int, int]] = [(0, 0)] * n
        self.disk_voters: list[tuple[bytes, ...]] = [self.voters] * n
        self.offsets = [0.0] * n
        self.groups = [0] * n
        self.partition_since: float | None = None
        self.nodes: list[ElectionState | None] = [None] * n
        self.winners: dict[int, int] = {}  # term -> node elected
        self.wins: list[tuple[float, int, int]] = []  # (time, node, term)
        self.step_downs: list[tuple[float, int, int, SteppedDown]] = []
        self.votes: dict[tuple[int, int], bytes] = {}  # (node, term) -> voted for
        self.stood_at: dict[tuple[int, int], float] = {}  # (node, term) -> when it stood
        self.applied: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        # (node, (term, epoch), the coordinator it recognised then, its term then), per application
        self.applications: list[tuple[int, tuple[int, int], bytes | None, int]] = []
        self.stages: list[_Stage | None] = [None] * n
        self.step_reports: list[collections.deque] = [collections.deque(maxlen=MAX_REPORTS) for _ in range(n)]
        self.issued: list[_Issued | None] = [None] * n
        self.logged: list[set[int]] = [set() for _ in range(n)]  # steps each node wrote (in memory)
        # every line of every node's train.jsonl: step, term, epoch (as the daemon writes them),
        # holder (whose file), backfilled, and `trained`: the (term, epoch) the step ran in
        self.train_log: list[dict] = []
        self.stopped: list[str] = []  # reasons the run stopped (ResumeError)
        self.rollbacks: list[tuple[int, int, bool]] = []  # (resume step, last logged step, flagged by resume_point)
        self.refused = 0
        self.sent = 0
        self.violations: list[str] = []
        self._heap: list = []
        self._count = itertools.count()
        self._tick_at = [float("nan")] * n
        for k in range(n):
            self._boot(k)

    # ------------------------------------------------------------------ queries

    @property
    def n(self) -> int:
        return len(self.ids)

    def local_now(self, k: int) -> float:
        return self.now + self.offsets[k]

    def coordinators(self) -> list[int]:
        return [k for k, node in enumerate(self.nodes) if node is not None and node.role is ElectionRole.COORDINATOR]

    def live(self) -> list[int]:
        return [k for k, node in enumerate(self.nodes) if node is not None]

    # ------------------------------------------------------------------ moves

    def crash(self, k: int) -> None:
        self.nodes[k] = None
        self.stages[k] = self.issued[k] = None
        self.step_reports[k].clear()
        self.logged[k] = set()

    def restart(self, k: int) -> None:
        if self.nodes[k] is None:
            self._boot(k)

    def partition(self, groups: Sequence[int]) -> None:
        """groups[k]: the side of node k; messages between sides are lost."""
        self.groups = list(groups)
        self.partition_since = self.now

    def heal(self) -> None:
        self.groups = [0] * self.n
        self.partition_since = None

    def jump_clock(self, k: int, delta_s: float) -> None:
        self.offsets[k] += delta_s
        if self.nodes[k] is not None:
            self._run(k, self.nodes[k].tick(self.local_now(k)))

    def campaign(self, k: int) -> None:
        if self.nodes[k] is not None:
            self._run(k, self.nodes[k].campaign(self.local_now(k)))

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
        self.issued[k] = _Issued(alloc, start_step - 1)
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

    # ------------------------------------------------------------------ running

    def run_until(self, t_end: float) -> None:
        while self._heap and self._heap[0][0] <= t_end:
            t, _, item = heapq.heappop(self._heap)
            self.now = t
            kind, k = item[0], item[1]
            node = self.nodes[k]
            if node is None:
                continue
            if kind == "tick":
                if t == self._tick_at[k]:
                    self._tick_at[k] = float("nan")
                    self._run(k, node.tick(self.local_now(k)))
            elif kind == "retry":
                self._offer(k, item[2], item[3])
            else:
                _, _, src, payload = item
                if self.groups[src] != self.groups[k]:
                    continue
                if type(payload) is tuple and payload[0] == "alloc":
                    self._offer(k, payload[1], self.now + 2 * self.config.heartbeat_interval_s + 1.0)
                    continue
                if type(payload) is tuple:
                    self._on_report(k, src, *payload[1:])
                    continue
                msg = decode_election(unpack_untrusted(payload, max_len=MAX_BODY_BYTES)) if self.codec else payload
                self._run(k, node.handle(self.ids[src], msg, self.local_now(k)))
        self.now = max(self.now, t_end)

    def run_for(self, dt_s: float) -> None:
        self.run_until(self.now + dt_s)

    # ------------------------------------------------------------------ internals

    def _boot(self, k: int) -> None:
        term, voted_for = self.stores[k].load()
        self.nodes[k] = ElectionState(self.ids[k], self.config, random.Random(self.rng.random()), self.local_now(k),
                                      term=term, voted_for=voted_for, voters=self.disk_voters[k],
                                      applied=self.disk_applied[k])
        self._schedule(k)

    def _push(self, t: float, item) -> None:
        heapq.heappush(self._heap, (t, next(self._count), item))

    def _schedule(self, k: int) -> None:
        node = self.nodes[k]
        if node is None:
            return
        deadline = node.next_deadline()
        t = max(self.now, deadline - self.offsets[k])
        while t + self.offsets[k] < deadline:  # rounding: the node must see its deadline reached
            t = math.nextafter(t, math.inf)
        if t != self._tick_at[k] and t != math.inf:
            self._tick_at[k] = t
            self._push(t, ("tick", k))

    def _transmit(self, src: int, dst: int, msg) -> None:
        self.sent += 1
        net = self.net
        lossy = net.drop_fraction and (self.lose_reports or not (type(msg) is tuple and msg[0] == "step"))
        if lossy and self.rng.random() < net.drop_fraction:
            return
        copies = 2 if net.duplicate_fraction and self.rng.random() < net.duplicate_fraction else 1
        payload = pack(msg.to_wire()) if self.codec and not isinstance(msg, tuple) else msg
        for _ in range(copies):
            d = self.delays_s[src][dst] * net.delay_scale * self.rng.uniform(1.0, 1.0 + net.jitter)
            if net.reorder_s:
                d += self.rng.uniform(0.0, net.reorder_s)
            self._push(self.now + d, ("msg", dst, src, payload))

    def _violation(self, what: str) -> None:
        self.violations.append(f"t={self.now:.3f}: {what}")

    def _run(self, k: int, actions: list) -> None:
        """Execute node k's actions in order, checking the invariants as they happen."""
        store = self.stores[k]
        for a in actions:
            if isinstance(a, Persist):
                if a.voted_for is not None:
                    prev = self.votes.setdefault((k, a.term), a.voted_for)
                    if prev != a.voted_for:
                        self._violation(f"node {k} voted twice in term {a.term}")
                    if a.voted_for == self.ids[k]:
                        self.stood_at[(k, a.term)] = self.now
                store.persist(a.term, a.voted_for)
            elif isinstance(a, ElectionSend):
                if isinstance(a.msg, Vote) and a.msg.granted and store.load() != (a.msg.term, a.to):
                    self._violation(f"node {k} sent a vote in term {a.msg.term} before persisting it")
                self._transmit(k, self.index[a.to], a.msg)
            elif isinstance(a, BecameCoordinator):
                self._check_win(k, a.term)
            elif isinstance(a, SteppedDown):
                self.step_downs.append((self.now, k, a.term, a))
            elif not isinstance(a, CoordinatorKnown):
                self._violation(f"unknown action {a!r}")
        self._schedule(k)

    def _check_win(self, k: int, term: int) -> None:
        node = self.nodes[k]
        if self.winners.setdefault(term, k) != k:
            self._violation(f"two coordinators in term {term}: nodes {self.winners[term]} and {k}")
        votes = [v for v in node.voters if self.votes.get((self.index[v], term)) == self.ids[k]]
        if len(votes) < node.majority:
            self._violation(f"node {k} coordinator of term {term} with {len(votes)} of {len(node.voters)} votes")
        stood = self.stood_at.get((k, term), -1.0)
        if self.partition_since is not None and stood >= self.partition_since:
            side = [v for v in node.voters if self.groups[self.index[v]] == self.groups[k]]
            if len(side) < node.majority:
                self._violation(f"node {k} elected in term {term} on a minority side of {len(side)}")
        self.wins.append((self.now, k, term))

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
        self.stages[k] = _Stage(alloc, alloc.start_step)

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


# ---------------------------------------------------------------------- figures


def _settled(sim: ElectionSim, limit_s: float) -> int:
    """Run until exactly one node is coordinator and every live node follows it; that node."""
    end = sim.now + limit_s
    while sim.now < end:
        sim.run_for(0.05)
        coords = sim.coordinators()
        if len(coords) == 1 and all(sim.nodes[k].coordinator == sim.ids[coords[0]] for k in sim.live()):
            return coords[0]
    raise RuntimeError(f"no settled coordinator within {limit_s:g} s (seed of the run decides; see violations)")


def takeover_times(config: ElectionConfig, n: int, crashes: int, *, seed: int, scenario: str = "worldwide",
                   conditions: NetConditions | None = None) -> tuple[list[float], ElectionSim]:
    """Seconds from a coordinator's crash to the next coordinator's election, `crashes` times.

    n nodes on the scenario's one-way delays (times the jitter); each crash comes at a random
    phase of the heartbeat period; the crashed node restarts from its store once the next
    coordinator is elected, and the swarm settles before the next crash."""
    rng = random.Random(seed)
    sim = ElectionSim(n, config, delays_s=scenario_delays_s(scenario, n, rng), seed=rng.getrandbits(64),
                      codec=False, conditions=conditions)
    limit_s = 20 * config.election_timeout_max_s + n * config.stagger_s
    times = []
    for _ in range(crashes):
        k = _settled(sim, limit_s)
        sim.run_for(sim.rng.uniform(0, config.heartbeat_interval_s))
        term, crashed_at, seen = sim.nodes[k].term, sim.now, len(sim.wins)
        sim.crash(k)
        while not any(w[2] > term for w in sim.wins[seen:]):
            if sim.now - crashed_at > limit_s:
                raise RuntimeError(f"no coordinator within {limit_s:g} s of a crash")
            sim.run_for(0.01)
        times.append(next(w[0] for w in sim.wins[seen:] if w[2] > term) - crashed_at)
        sim.restart(k)
    return times, sim


def returning_peer(config: ElectionConfig, n: int, *, seed: int, away_s: float, inflate_terms: int = 0,
                   after_s: float = 20.0, scenario: str = "worldwide") -> dict:
    """A follower is cut off for away_s and returns (inflate_terms > 0: it is down as long and
    restarts with its stored term raised by that much). What happens to the coordinator then:
    `deposed` (it stepped down and waited for an election), `changed` (another node won a
    term), `stood_again` (it stood in a higher term at once), and the terms that passed."""
    rng = random.Random(seed)
    sim = ElectionSim(n, config, delays_s=scenario_delays_s(scenario, n, rng), seed=rng.getrandbits(64), codec=False)
    c = _settled(sim, 20 * config.election_timeout_max_s + n * config.stagger_s)
    f = sim.rng.choice([k for k in range(n) if k != c])
    term, wins, downs = sim.nodes[c].term, len(sim.wins), len(sim.step_downs)
    if inflate_terms:
        sim.crash(f)
        sim.run_for(away_s)
        stored_term, _ = sim.stores[f].load()
        sim.stores[f].persist(stored_term + inflate_terms, None)
        sim.restart(f)
    else:
        sim.partition([1 if k == f else 0 for k in range(n)])
        sim.run_for(away_s)
        returned_term = sim.nodes[f].term
        sim.heal()
    returned_term = sim.nodes[f].term
    sim.run_for(after_s)
    mine = [d for _, k, _, d in sim.step_downs[downs:] if k == c]
    return {
        "deposed": any(not d.standing_again for d in mine),
        "changed": any(k != c for _, k, _ in sim.wins[wins:]),
        "stood_again": any(d.standing_again for d in mine),
        "returned_term_ahead": returned_term - term,
        "terms": max(sim.nodes[k].term for k in sim.live()) - term,
        "violations": list(sim.violations),
    }
