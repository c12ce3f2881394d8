"""A deterministic simulated network of `ElectionState` nodes, with virtual time.

Messages cross a link after its delay (a matrix, e.g. a scenario's one-way delays) times a
random jitter; a fraction is dropped, duplicated, or delayed further (which reorders them).
Partitions cut every message between groups at delivery; crashed nodes lose their state and
what is sent to them, and restart from their store (term and vote) and their disk (applied
(term, epoch) and voters). Each node has its own clock offset, so clocks can jump.

Actions run in order, as a driver must run them, and the simulation checks as they happen:

- one vote per (node, term), across restarts;
- a granted vote is sent only once the store holds it;
- at most one coordinator per term, and each elected by votes of a quorum of its voters
  (certificate.py's `quorum`): its certificate's signatures verify, and each vote in it of an
  honest node is that node's vote of the term;
- a node recognises a coordinator only with such a certificate (its `certificate`);
- a node that stood after the current partition formed wins only on a side with a quorum;
- a node applies only allocations of the coordinator elected in that term, and its applied
  (term, epoch) only grows.

Liars (`liars`, node indices): nodes that run no machine (`liars_run` False) or that run the
honest machines and besides send anything (`liars_run` True: a compromised peer whose daemon
still works). Their keys are real (`signers`), the messages delivered to them are kept in
`inbox` (the plane's too), and a test sends anything in their name with `inject`. A liar
that is a voter can sign two votes in one term; since two quorums of 4 or more voters share
two voters, one of them honest, that elects no second coordinator. Two coordinators of a term
are therefore always a violation, except beyond what a quorum can tolerate: every voter both
certificates hold is a liar, and either two or more liars are voters or a certificate is of at
most 3 voters (where the quorum is a plain majority and two quorums may share a single voter).

The control plane's machines run on top of it in `PlaneSim` (control/testing/sim.py), through the
hooks `_booted`, `_election_event`, `_on_message` and `_dispatch`. The figures of
bench/election.py (`takeover_times`, `returning_peer`) are at the end of this module.

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
from dataclasses import dataclass

from dtfm.net import Identity, pack, unpack_untrusted, verify_signature
from dtfm.scenarios import load_scenario

from ..election.certificate import Certificate, quorum, vote_payload
from ..election.config import ElectionConfig
from ..election.council import MAX_COUNCIL, Council
from ..election.messages import ElectionMessage, Vote, decode_election
from ..election.state import (
    trusted_root,
    BecameCoordinator,
    CoordinatorKnown,
    ElectionRole,
    ElectionSend,
    ElectionState,
    Persist,
    PreviousConfiguration,
    SteppedDown,
)
from ..election.store import MemoryElectionStore

__all__ = ["ElectionSim", "NetConditions", "returning_peer", "scenario_delays_s", "takeover_times"]

MAX_BODY_BYTES = 1 << 20
INBOX_MESSAGES = 256  # kept per liar


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
                 lose_reports: bool = True, keys: Sequence[Identity] | None = None, liars: Sequence[int] = (),
                 liars_vote: bool = True, liars_run: bool = False) -> None:
        self.config = config
        # False: drop_fraction spares the plane's messages (a connection that stays up)
        self.lose_reports = lose_reports
        self.rng = random.Random(seed)
        self.codec = codec  # False: hand message objects over (faster); True: through the wire codec
        self.net = conditions or NetConditions()
        self.delays_s = [list(row) for row in delays_s] if delays_s is not None else [[0.01] * n for _ in range(n)]
        # real Ed25519 keys from the seed (Ed25519 signs deterministically: same seed, same run)
        keys = list(keys) if keys is not None else [Identity(self.rng.randbytes(32)) for _ in range(n)]
        self.signers = {key.peer_id: key for key in keys}
        self.ids = sorted(self.signers)
        self.index = {p: k for k, p in enumerate(self.ids)}
        self.liars = frozenset(liars)
        self.liars_run = liars_run  # the liars also run the honest machines
        self.inbox: dict[int, collections.deque] = {k: collections.deque(maxlen=INBOX_MESSAGES) for k in self.liars}
        self.certificates: dict[tuple[int, bytes], Certificate] = {}  # (term, coordinator) -> its certificate
        self._genuine: set[bytes] = set()  # digests of certificates whose signatures all verify
        # the first council: every node (liars_vote False: every node but the liars), at most
        # MAX_COUNCIL of them
        self.voters = tuple(p for k, p in enumerate(self.ids) if liars_vote or k not in self.liars)[:MAX_COUNCIL]
        self.now = 0.0
        self.stores = [MemoryElectionStore() for _ in range(n)]
        self.disk_applied: list[tuple[int, int]] = [(0, 0)] * n
        self.disk_council: list[Council | None] = [self._first_council(self.voters)] * n
        self.disk_previous: list[PreviousConfiguration | None] = [None] * n
        self.offsets = [0.0] * n
        self.groups = [0] * n
        self.partition_since: float | None = None
        self.nodes: list[ElectionState | None] = [None] * n
        self.winners: dict[int, int] = {}  # term -> node elected
        self.wins: list[tuple[float, int, int]] = []  # (time, node, term)
        self.step_downs: list[tuple[float, int, int, SteppedDown]] = []
        self.votes: dict[tuple[int, int], bytes] = {}  # (node, term) -> voted for
        self.stood_at: dict[tuple[int, int], float] = {}  # (node, term) -> when it stood
        self.sent = 0
        self.violations: list[str] = []
        self._heap: list = []
        self._count = itertools.count()
        self._tick_at = [float("nan")] * n
        for k in range(n):
            self._boot(k)

    def _first_council(self, voters: tuple[bytes, ...]) -> Council:
        """The council every node starts with (a subclass roots it in an operator's operation)."""
        return trusted_root(voters)

    # ------------------------------------------------------------------ queries

    @property
    def n(self) -> int:
        return len(self.ids)

    def node(self, k: int) -> ElectionState:
        """The state of node k, which must be up."""
        node = self.nodes[k]
        if node is None:
            raise RuntimeError(f"node {k} is down")
        return node

    def local_now(self, k: int) -> float:
        return self.now + self.offsets[k]

    def coordinators(self) -> list[int]:
        return [k for k, node in enumerate(self.nodes) if node is not None and node.role is ElectionRole.COORDINATOR]

    def live(self) -> list[int]:
        return [k for k, node in enumerate(self.nodes) if node is not None]

    # ------------------------------------------------------------------ moves

    def crash(self, k: int) -> None:
        self.nodes[k] = None

    def restart(self, k: int) -> None:
        if self.nodes[k] is None and (k not in self.liars or self.liars_run):
            self._boot(k)

    def inject(self, k: int, dst: int, msg: ElectionMessage) -> None:
        """Liar k sends `msg` to node dst, through the network like any message."""
        if k not in self.liars:
            raise ValueError(f"node {k} is not a liar")
        self._transmit(k, dst, msg)

    def partition(self, groups: Sequence[int]) -> None:
        """groups[k]: the side of node k; messages between sides are lost."""
        self.groups = list(groups)
        self.partition_since = self.now

    def heal(self) -> None:
        self.groups = [0] * self.n
        self.partition_since = None

    def jump_clock(self, k: int, delta_s: float) -> None:
        self.offsets[k] += delta_s
        node = self.nodes[k]
        if node is not None:
            self._run(k, node.tick(self.local_now(k)))

    def council_of(self, src: int, voters: tuple[bytes, ...]) -> Council:
        """The council node src's allocation configuring `voters` carries: its own council with
        the change it signs (`council_for`) where it can make it; else (a liar, a node that is not
        the certified coordinator, or more than one change) `voters` as a root of its own making,
        which no configured peer takes."""
        node = self.nodes[src]
        council = node.council_for(tuple(sorted(voters)), node.last_applied[1] + 1) if node is not None else None
        return council if council is not None else Council(b"forged", tuple(sorted(voters)), 0)

    def offer(self, src: int, term: int, epoch: int, voters: tuple[bytes, ...] | Council,
              cert: Certificate | None) -> int:
        """Node (or liar) src's allocation of (term, epoch) configuring `voters` (a council, or
        the voters `council_of` makes one of), with `cert`, offered to every live node at once
        (no network; PlaneSim runs the real hand-out): each applies it if its `may_apply` says
        yes. Checked: an allocation is applied only from the coordinator a true certificate
        elects in its term, and applied (term, epoch) only grows. Returns how many applied it."""
        applied = 0
        issuer = self.ids[src]
        council = voters if isinstance(voters, Council) else self.council_of(src, voters)
        for k in self.live():
            node = self.node(k)
            if node.may_apply(issuer, term, epoch, cert, council) is not None:
                continue
            why = self._certified(cert, term, issuer)
            if why is not None:
                self._violation(f"node {k} applied term {term} epoch {epoch} of {src} on {why}")
            if (term, epoch) <= self.disk_applied[k]:
                self._violation(f"node {k} applied ({term}, {epoch}) after {self.disk_applied[k]}")
            self.disk_applied[k], self.disk_council[k] = (term, epoch), council
            self._run(k, node.apply_allocation(term, epoch, council, cert, self.local_now(k)))
            self.disk_previous[k] = node.previous
            applied += 1
        return applied

    def campaign(self, k: int) -> None:
        node = self.nodes[k]
        if node is not None:
            self._run(k, node.campaign(self.local_now(k)))

    # ------------------------------------------------------------------ running

    def run_until(self, t_end: float) -> None:
        while self._heap and self._heap[0][0] <= t_end:
            t, _, item = heapq.heappop(self._heap)
            self.now = t
            kind, k = item[0], item[1]
            node = self.nodes[k]
            if kind == "msg" and k in self.liars and self.groups[item[2]] == self.groups[k]:
                payload = item[3]
                if self.codec and type(payload) is not tuple:
                    payload = decode_election(unpack_untrusted(payload, max_len=MAX_BODY_BYTES))
                self.inbox[k].append((item[2], payload))
            if node is None:
                continue
            if kind == "tick":
                if t == self._tick_at[k]:
                    self._tick_at[k] = float("nan")
                    self._run(k, node.tick(self.local_now(k)))
            elif kind == "msg":
                _, _, src, payload = item
                if self.groups[src] != self.groups[k]:
                    continue
                if type(payload) is tuple:  # the plane's messages (PlaneSim)
                    self._on_message(k, src, payload)
                    continue
                msg = decode_election(unpack_untrusted(payload, max_len=MAX_BODY_BYTES)) if self.codec else payload
                self._run(k, node.handle(self.ids[src], msg, self.local_now(k)))
            else:
                self._dispatch(item)
        self.now = max(self.now, t_end)

    def run_for(self, dt_s: float) -> None:
        self.run_until(self.now + dt_s)

    # ------------------------------------------------------------------ internals

    def _boot(self, k: int) -> None:
        if k in self.liars and not self.liars_run:
            return
        term, voted_for = self.stores[k].load()
        self.nodes[k] = ElectionState(self.ids[k], self.config, random.Random(self.rng.random()), self.local_now(k),
                                      signer=self.signers[self.ids[k]], term=term, voted_for=voted_for,
                                      council=self.disk_council[k], applied=self.disk_applied[k],
                                      previous=self.disk_previous[k])
        self._schedule(k)
        self._booted(k)

    # ------------------------------------------------------------------ hooks (PlaneSim)

    def _booted(self, k: int) -> None:
        """Node k (re)started."""

    def _election_event(self, k: int, action: BecameCoordinator | SteppedDown) -> None:
        """Node k's election became coordinator or stepped down (after the checks)."""

    def _on_message(self, k: int, src: int, payload: tuple) -> None:
        raise AssertionError(f"no plane in this simulation: {payload[0]!r}")

    def _dispatch(self, item: tuple) -> None:
        raise AssertionError(f"unknown item {item[0]!r}")

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
        lossy = net.drop_fraction and (self.lose_reports or type(msg) is not tuple)
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
                self._election_event(k, a)
            elif isinstance(a, SteppedDown):
                self.step_downs.append((self.now, k, a.term, a))
                self._election_event(k, a)
            elif isinstance(a, CoordinatorKnown):
                self._check_recognised(k, a)
            else:
                self._violation(f"unknown action {a!r}")
        self._schedule(k)

    def _certified(self, cert: Certificate | None, term: int, coordinator: bytes) -> str | None:
        """None if `cert` is a true record of `coordinator`'s election in `term`, else why not:
        every signature verifies, and an honest node's vote in it is the vote it persisted."""
        if cert is None:
            return "no certificate"
        if cert.term != term or cert.candidate != coordinator:
            return f"a certificate of {self.index.get(cert.candidate)} in term {cert.term}"
        if cert.digest not in self._genuine:
            payload = vote_payload(term, coordinator, cert.config)
            for v, sig in cert.signed():
                if not verify_signature(v, payload, sig):
                    return f"a forged vote of {self.index.get(v)}"
            self._genuine.add(cert.digest)
        true = 0
        for v in cert.signers:
            j = self.index.get(v)
            if j is None or j in self.liars or self.votes.get((j, term)) == coordinator:
                true += 1
        if true < quorum(len(cert.voters)):
            return f"{true} true votes of {len(cert.voters)} voters"
        return None

    def _beyond_tolerance(self, a: Certificate | None, b: Certificate | None) -> bool:
        """Whether two certificates of one term for two coordinators are beyond what the quorum
        rules out (module docstring): every voter both hold is a liar, and two or more liars are
        voters of them or one is of at most 3 voters."""
        if a is None or b is None:
            return False
        liars = {self.ids[k] for k in self.liars}
        if not a.signers & b.signers <= liars:
            return False
        return len(liars & (set(a.voters) | set(b.voters))) >= 2 or min(len(a.voters), len(b.voters)) <= 3

    def _check_recognised(self, k: int, a: CoordinatorKnown) -> None:
        node = self.node(k)
        if a.coordinator is None or (node.term, node.coordinator) != (a.term, a.coordinator):
            return  # gone again within the same input
        why = self._certified(node.certificate, a.term, a.coordinator)
        if why is not None:
            self._violation(f"node {k} recognises {self.index.get(a.coordinator)} in term {a.term} on {why}")
            return
        assert node.certificate is not None
        self.certificates.setdefault((a.term, a.coordinator), node.certificate)
        rivals = [(c, cert) for (t, c), cert in self.certificates.items() if t == a.term and c != a.coordinator]
        for c, cert in rivals:
            if not self._beyond_tolerance(cert, node.certificate):
                self._violation(f"node {k} recognises {self.index.get(a.coordinator)} in term {a.term}, "
                                f"which {self.index.get(c)} was elected in")

    def _check_win(self, k: int, term: int) -> None:
        node = self.node(k)
        cert = node.certificate
        if cert is not None and cert.term == term:
            self.certificates.setdefault((term, self.ids[k]), cert)
        if self.winners.setdefault(term, k) != k:
            other = self.certificates.get((term, self.ids[self.winners[term]]))
            if not self._beyond_tolerance(cert, other):
                self._violation(f"two coordinators in term {term}: nodes {self.winners[term]} and {k}")
        why = self._certified(cert, term, self.ids[k])
        if why is not None:
            self._violation(f"node {k} coordinator of term {term} on {why}")
        stood = self.stood_at.get((k, term), -1.0)
        if self.partition_since is not None and stood >= self.partition_since:
            side = [v for v in node.voters if self.groups[self.index[v]] == self.groups[k]]
            if len(side) < node.quorum:
                self._violation(f"node {k} elected in term {term} on a minority side of {len(side)}")
        self.wins.append((self.now, k, term))

# ---------------------------------------------------------------------- figures


def _settled(sim: ElectionSim, limit_s: float) -> int:
    """Run until exactly one node is coordinator and every live voter follows it; that node
    (nodes outside the council hear no heartbeats: they learn the coordinator by asking)."""
    end = sim.now + limit_s
    while sim.now < end:
        sim.run_for(0.05)
        coords = sim.coordinators()
        voters = [k for k in sim.live() if sim.ids[k] in sim.node(k).voters]
        if len(coords) == 1 and all(sim.node(k).coordinator == sim.ids[coords[0]] for k in voters):
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
        term, crashed_at, seen = sim.node(k).term, sim.now, len(sim.wins)
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
    term, wins, downs = sim.node(c).term, len(sim.wins), len(sim.step_downs)
    if inflate_terms:
        sim.crash(f)
        sim.run_for(away_s)
        stored_term, _ = sim.stores[f].load()
        sim.stores[f].persist(stored_term + inflate_terms, None)
        sim.restart(f)
    else:
        sim.partition([1 if k == f else 0 for k in range(n)])
        sim.run_for(away_s)
        returned_term = sim.node(f).term
        sim.heal()
    returned_term = sim.node(f).term
    sim.run_for(after_s)
    mine = [d for _, k, _, d in sim.step_downs[downs:] if k == c]
    return {
        "deposed": any(not d.standing_again for d in mine),
        "changed": any(k != c for _, k, _ in sim.wins[wins:]),
        "stood_again": any(d.standing_again for d in mine),
        "returned_term_ahead": returned_term - term,
        "terms": max(sim.node(k).term for k in sim.live()) - term,
        "violations": list(sim.violations),
    }
