"""Golden fixtures of the control plane's decisions, recorded before the control plane became
sans-IO machines (issue 17): the same seeded scenarios must give the same bytes and traces after.

Five fixtures under tests/data/control_golden/, each a readable text file that the test
recomputes and compares line by line:

- allocations.txt: the scheduler's shape for scenario views (`choose_shape` with a budget so
  small that the anytime search stops at its first time check, `random_shape`, and `reshape`'s
  first allocation with the repeatable `SEARCH_PROFILES["test"]`), the `Allocation` built from
  each with fixed run id, term, epoch, voters and holdings, and the sha256 of its canonical body
  and of the signed wire bytes (Ed25519 is deterministic: the key comes from a fixed seed).
- reshape.txt: `reshape` plans (a peer lost with and without spares, peers joined, drift, a
  forced reschedule, a restage) with the repeatable search profile: kind, moves, placement,
  predicted times to 1e-9, fetches, lost ranges and every candidate.
- election.txt: `ElectionState` nodes driven by this module's own small network (virtual time,
  seeded jitter, drop, duplicate, reorder, crash and restart from the store, partitions, clock
  jumps, allocations handed out and applied through `may_apply` / `applied` / `set_voters`),
  every message through the wire codec. It depends on the election alone and stays valid when
  the simulation and its training model are replaced.
- election_sim.txt: `ElectionSim` (control/testing/election_sim.py) with election moves only, valid as
  long as the simulation draws its randomness the same way. (The simulation with the plane's
  machines on top is tested by tests/control/plane/test_plane_sim.py.)

Re-record (after a change that is meant to change them, and say why in the commit):

    DTFM_RECORD_GOLDEN=1 python -m pytest -q -p no:cacheprovider tests/control/plane/test_control_golden.py
    python tests/control/plane/test_control_golden.py --record [allocations reshape election ...]

No result depends on the clock or on the order the tests run in: the scheduler runs with a
generation cap or stops at its first time check, and the simulations run on virtual time from
fixed seeds.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import heapq
import itertools
import math
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dtfm.control import (
    Allocation,
    BecameCoordinator,
    Certificate,
    CoordinatorKnown,
    ElectionConfig,
    ElectionRole,
    ElectionSend,
    ElectionState,
    Holding,
    MemoryElectionStore,
    Persist,
    SignedAllocation,
    SteppedDown,
    choose_shape,
    decode_election,
    council_arg,
    random_shape,
    reshape,
    root_council,
    sign_op,
)
from dtfm.gossip import NetworkView
from dtfm.control.election import Council
from dtfm.control.election.state import trusted_root
from dtfm.net import Identity, OperatorKey, pack, unpack_untrusted
from dtfm.scenarios import load_scenario
from dtfm.sched import SEARCH_PROFILES
from dtfm.train import PRESETS, GPTSpec, Plan, TrainConfig
from paths import DATA


def _internal():
    """The names this test needs that no dtfm package exports at its top level; when modules
    move, fix the paths here (and only here)."""
    from dtfm.control.testing.election_sim import ElectionSim, NetConditions
    return ElectionSim, NetConditions


GOLDEN_DIR = DATA / "control_golden"
RECORD = os.environ.get("DTFM_RECORD_GOLDEN") == "1"

IDENTITIES = [Identity(bytes([i + 1]) * 32) for i in range(16)]
IDS = [i.peer_id for i in IDENTITIES]
SIGNERS = {i.peer_id: i for i in IDENTITIES}
NAMES = {p: f"p{k:02d}" for k, p in enumerate(IDS)}
RUN_ID = bytes(range(16))
DATA_HASH = hashlib.sha256(b"dtfm golden corpus").hexdigest()
SEARCH = SEARCH_PROFILES["test"]  # capped generations, ample time: repeatable
# choose_shape has only a time budget. One this small puts every deadline of the anytime
# search in the past, so it stops at its first time check whatever the machine's speed: the
# constructions, each polished by one realize, the best of them.
FIRST_CHECK_S = 1e-9
# The election profiles, spelled out, so that a change of the profiles is not a change of this fixture.
TEST_ELECTION = ElectionConfig(election_timeout_min_s=0.3, election_timeout_max_s=0.36, stagger_s=0.06,
                               heartbeat_interval_s=0.03, lease_s=0.24, pre_vote=True, check_quorum=True)
WAN_ELECTION = ElectionConfig(election_timeout_min_s=2.0, election_timeout_max_s=2.3, stagger_s=1.2,
                              heartbeat_interval_s=0.2, lease_s=1.6, pre_vote=True, check_quorum=True)
PLAIN_ELECTION = TEST_ELECTION.with_(pre_vote=False, check_quorum=False)


def f9(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.9f}"


def name(p: bytes | None) -> str:
    return "-" if p is None else NAMES.get(p, p[:4].hex())


def names(ps) -> str:
    return "[" + " ".join(name(p) for p in ps) + "]"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------- views


def scenario_view(scenario: str, n: int, seed: int, *, slow: tuple[int, ...] = (), factor: float = 1.0
                  ) -> tuple[NetworkView, dict[bytes, str]]:
    """A scenario scaled to n peers (IDS[:n]) as a measured view: every link +-20 % (symmetric,
    seeded, like bench/sched.py's), links among the peers of `slow` `factor` x slower."""
    sc = load_scenario(scenario).scaled(n)
    rng = np.random.default_rng(seed)
    j1, j2 = rng.uniform(0.8, 1.2, (2, n, n))
    delay = sc.delay_ms() * (j1 + j1.T) / 2
    bw = sc.bandwidth_gbps() * (j2 + j2.T) / 2
    for a in slow:
        for b in slow:
            if a != b:
                delay[a, b] *= factor
                bw[a, b] /= factor
    ids = tuple(IDS[:n])
    view = NetworkView(ids, delay, bw, np.full(n, np.nan), True)
    return view, dict(zip(ids, sc.peer_regions()))


def shape_lines(shape) -> list[str]:
    return [f"  pipelines {' | '.join(names(p) for p in shape.pipelines)}",
            f"  layer_ranges {[list(r) for r in shape.layer_ranges]}",
            f"  spares {names(shape.spares)}",
            f"  predicted_iteration_s {shape.predicted_iteration_s!r}",
            f"  objective_s {shape.objective_s!r}"]


# ---------------------------------------------------------------------- allocations


def make_allocation(shape, *, preset: str, train: TrainConfig, issuer: Identity, term: int, epoch: int,
                    start_step: int = 0, end_step: int = 1000, checkpoint_every: int = 0,
                    holdings=(), absent=(), reason: str = "train start", voters=()) -> Allocation:
    """The allocation a coordinator builds from a shape (control/coordinate.py's `train start`,
    control/reconfigure.py's next epoch). One place to adapt if the constructor changes; the
    bytes must not."""
    return Allocation(epoch=epoch, term=term, issuer=issuer.peer_id, run_id=RUN_ID, pipelines=shape.pipelines,
                        layer_ranges=shape.layer_ranges, preset=preset, model=PRESETS[preset], train=train,
                        data_hash=DATA_HASH, data_name="golden.txt", start_step=start_step, end_step=end_step,
                        checkpoint_every=checkpoint_every, predicted_iteration_s=shape.predicted_iteration_s,
                        spares=shape.spares, holdings=tuple(holdings), absent=tuple(absent), reason=reason,
                        voters=tuple(voters), council=golden_root(tuple(voters)).encode())


GOLDEN_OPERATOR = OperatorKey(b"\x07" * 32)


def golden_root(voters: tuple[bytes, ...]) -> Council:
    """The council of `voters` as the golden operator roots it, at a fixed time (the same bytes each run)."""
    signed = sign_op(GOLDEN_OPERATOR, "council", now_s=1.7e9, run_id=b"c" * 16,
                     args={"council": council_arg(voters), "council_size": 5 if len(voters) <= 5 else 7})
    return root_council(signed, {GOLDEN_OPERATOR.public_key})


def _digest(i: int) -> str:
    return sha(b"stage manifest %d" % i)


@dataclasses.dataclass(frozen=True)
class AllocCase:
    title: str
    scenario: str
    n: int
    preset: str
    placement: str  # choose_shape (FIRST_CHECK_S), random_shape, or reshape (first allocation, SEARCH)
    stages: int | None
    dp: int | None
    seed: int
    train: TrainConfig
    term: int = 1
    epoch: int = 1
    extra: dict = dataclasses.field(default_factory=dict)  # more Allocation fields
    full_hex: bool = False


WIDE = TrainConfig(global_batch_seqs=64, micro_batches=4)

ALLOC_CASES = [
    AllocCase("datacenter 2x3, tiny", "datacenter", 6, "tiny", "choose_shape", 2, 3, 0,
              TrainConfig(global_batch_seqs=12, micro_batches=2), full_hex=True),
    AllocCase("worldwide 4x2, tiny", "worldwide", 8, "tiny", "choose_shape", 4, 2, 1,
              TrainConfig(global_batch_seqs=16, micro_batches=4, wire_dtype="bfloat16"), term=3, epoch=7),
    AllocCase("regional auto, small", "regional", 12, "small", "choose_shape", None, None, 2, WIDE, term=2, epoch=2),
    AllocCase("spot 3x3 with a spare, small", "spot", 10, "small", "choose_shape", 3, 3, 3, WIDE, term=5, epoch=9,
              extra={"checkpoint_every": 10, "start_step": 40, "end_step": 500, "reason": "peer 0a1b2c3d is dead",
                     "absent": (IDS[12],), "holdings": "three"}),
    AllocCase("universities 2x4 random placement, tiny", "universities", 8, "tiny", "random_shape", 2, 4, 4, WIDE),
    AllocCase("worldwide 4x3, small, reshape's first allocation", "worldwide", 12, "small", "reshape", 4, 3, 5, WIDE,
              term=4, epoch=1),
]


def _alloc_shape(c: AllocCase):
    view, regions = scenario_view(c.scenario, c.n, c.seed)
    spec = PRESETS[c.preset]
    if c.placement == "choose_shape":
        return choose_shape(view, spec, c.train, stages=c.stages, dp=c.dp, regions=regions,
                            time_budget_s=FIRST_CHECK_S, seed=c.seed)
    if c.placement == "random_shape":
        return random_shape(view, spec, c.train, stages=c.stages, dp=c.dp, seed=c.seed)
    return reshape(view, spec, c.train, current=None, live=frozenset(view.peers), remaining_steps=1000,
                   regions=regions, seed=c.seed, stages=c.stages, dp=c.dp, config=SEARCH).placement


def golden_allocations() -> str:
    out = ["# The scheduler's shape for seeded scenario views and the signed allocation built from it.",
           f"# choose_shape: time_budget_s={FIRST_CHECK_S:g} (the search stops at its first time check);",
           "# random_shape: seeded; reshape: current=None with SEARCH_PROFILES['test'].",
           "# Peers: p00.. = Identity(bytes([k + 1]) * 32); the issuer is p00; voters are every placed peer.",
           "# body = Allocation.encode(); wire = pack(SignedAllocation.sign(alloc, p00).to_wire()).",
           ""]
    for c in ALLOC_CASES:
        shape = _alloc_shape(c)
        extra = dict(c.extra)
        if extra.get("holdings") == "three":
            n_layer = PRESETS[c.preset].n_layer
            cuts = [0, n_layer // 3, 2 * n_layer // 3, n_layer]
            extra["holdings"] = tuple(Holding((a, b), _digest(k), tuple(IDS[k:k + 2]))
                                      for k, (a, b) in enumerate(itertools.pairwise(cuts)))
        placed = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
        alloc = make_allocation(shape, preset=c.preset, train=c.train, issuer=IDENTITIES[0], term=c.term,
                                epoch=c.epoch, voters=sorted(sorted(placed - {IDS[0]})[:4] + [IDS[0]]), **extra)
        signed = SignedAllocation.sign(alloc, IDENTITIES[0])
        assert signed.open() == alloc and Allocation.decode(alloc.encode()) == alloc
        wire = pack(signed.to_wire())
        out += [f"== {c.title}: {c.scenario} x {c.n} peers, {c.placement}, stages={c.stages} dp={c.dp} "
                f"seed={c.seed}", *shape_lines(shape),
                f"  term {alloc.term} epoch {alloc.epoch} steps {alloc.start_step}..{alloc.end_step} "
                f"holdings {len(alloc.holdings)} absent {names(alloc.absent)}",
                f"  body {len(signed.body)} bytes sha256 {sha(signed.body)}",
                f"  signature {signed.signature.hex()}",
                f"  wire {len(wire)} bytes sha256 {sha(wire)}"]
        if c.full_hex:
            hx = signed.body.hex()
            out += ["  body hex:", *(f"    {hx[i:i + 96]}" for i in range(0, len(hx), 96))]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------- reshape


def plan_lines(title: str, p) -> list[str]:
    out = [f"== {title}", f"  kind {p.kind} moves {p.moves} bytes_moved {p.bytes_moved} move_s {f9(p.move_s)} "
                          f"gain_s {f9(p.gain_s)}",
           f"  pipelines {' | '.join(names(q) for q in p.placement.pipelines)}",
           f"  layer_ranges {[list(r) for r in p.placement.layer_ranges]}",
           f"  spares {names(p.placement.spares)}",
           f"  predicted_iteration_s {f9(p.placement.predicted_iteration_s)} objective_s {f9(p.placement.objective_s)}",
           f"  lost_ranges {[list(r) for r in p.lost_ranges]}"]
    out += [f"  fetch {name(m)} {list(r)} from {name(src)}" for m, r, src in p.fetches]
    for c in p.candidates:
        out.append(f"  candidate {'*' if c['chosen'] else ' '} {c['kind']:<10} {c['shape']:<5} "
                   f"predicted {f9(c['predicted_s'])} moves {c['moves']} bytes {c['bytes']} "
                   f"move_s {f9(c['move_s'])} score {f9(c['score'])}")
    return out + [""]


def golden_reshape() -> str:
    spec, cfg = PRESETS["small"], TrainConfig(global_batch_seqs=64, micro_batches=4)

    def plan(view, regions, cur, live=None, **kw):
        live = frozenset(view.peers if live is None else live)
        kw.setdefault("remaining_steps", 1000)
        return reshape(view, spec, cfg, current=cur, live=live, regions=regions, config=SEARCH, **kw)

    def current(p) -> Plan:
        return Plan(p.placement.pipelines, p.placement.layer_ranges)

    out = ["# reshape() on seeded worldwide views, model 'small', TrainConfig(global_batch_seqs=64,",
           "# micro_batches=4), SEARCH_PROFILES['test'], remaining_steps 1000 unless said; floats to 1e-9.", ""]
    w10, r10 = scenario_view("worldwide", 10, 7)
    first = plan(w10, r10, None, stages=4, dp=2, seed=1)
    out += plan_lines("first allocation: 10 peers, 4x2 (2 spares), seed 1", first)
    lost = first.placement.pipelines[1][2]
    out += plan_lines(f"peer lost with spares: {name(lost)} (stage 2 of pipeline 1), seed 2",
                      plan(w10, r10, current(first), live=set(w10.peers) - {lost}, seed=2))
    w8, r8 = scenario_view("worldwide", 8, 8)
    first8 = plan(w8, r8, None, stages=4, dp=2, seed=3)
    out += plan_lines("first allocation: 8 peers, 4x2 (no spare), seed 3", first8)
    lost8 = first8.placement.pipelines[0][1]
    out += plan_lines(f"peer lost without spares: {name(lost8)}, seed 4",
                      plan(w8, r8, current(first8), live=set(w8.peers) - {lost8}, seed=4))
    w12, r12 = scenario_view("worldwide", 12, 8)
    out += plan_lines("peers joined: the 8-peer allocation on a 12-peer view, seed 5",
                      plan(w12, r12, current(first8), seed=5))
    slow = tuple(IDS.index(p) for p in first.placement.pipelines[0])
    wd, rd = scenario_view("worldwide", 10, 7, slow=slow, factor=4.0)
    out += plan_lines(f"drift: links among pipeline 0 ({names(first.placement.pipelines[0])}) 4x slower, seed 6",
                      plan(wd, rd, current(first), seed=6))
    out += plan_lines("small drift: links among pipeline 0 1.05x slower, seed 6",
                      plan(*scenario_view("worldwide", 10, 7, slow=slow, factor=1.05), current(first), seed=6))
    out += plan_lines("forced reschedule, nothing changed, seed 7", plan(w10, r10, current(first), seed=7, force=True))
    survivors = {first.placement.pipelines[0][0], first.placement.pipelines[1][3], first.placement.spares[0]}
    out += plan_lines(f"restage: only {names(sorted(survivors, key=IDS.index))} live, seed 8",
                      plan(w10, r10, current(first), live=survivors, seed=8, remaining_steps=200))
    # A model whose activations outweigh its gradients (tests/test_control_reshape.py's): more
    # pipelines pay off, so spares are used.
    spec = GPTSpec("act-heavy", n_layer=4, n_embd=256, n_head=4, seq_len=1024)
    out += ["# The model GPTSpec('act-heavy', n_layer=4, n_embd=256, n_head=4, seq_len=1024) from here on.", ""]
    s10, rs = scenario_view("spot", 10, 9)
    first = plan(s10, rs, None, stages=4, dp=2, seed=1)
    out += plan_lines("first allocation: spot, 10 peers, 4x2, seed 1", first)
    lost = first.placement.pipelines[1][1]
    out += plan_lines(f"peer lost with spares: {name(lost)} (stage 1 of pipeline 1), seed 2",
                      plan(s10, rs, current(first), live=set(s10.peers) - {lost}, seed=2))
    d10, rd = scenario_view("datacenter", 10, 9)
    first = plan(d10, rd, None, stages=4, dp=2, seed=1)
    one = Plan(first.placement.pipelines[:1], first.placement.layer_ranges)
    out += plan_lines(f"peers joined: datacenter, 10 peers, the allocation {names(one.pipelines[0])} alone, seed 3",
                      plan(d10, rd, one, seed=3))
    return "\n".join(out)


# ---------------------------------------------------------------------- election, on this module's network


class ElectionNet:
    """n `ElectionState` nodes (IDS[:n], voters sorted) on a simulated network with virtual time.

    Each message crosses its link after delay x uniform(1, 1 + jitter) (+ uniform(0, reorder_s)),
    may be dropped or duplicated; partitions cut messages at delivery; every message goes
    through `pack` / `decode_election`. A crash loses the node's state and its messages in
    flight to it; a restart reads term and vote from its store and the applied (term, epoch)
    and voters from its "disk". Each node has a clock offset (clock jumps). All randomness
    comes from one `random.Random(seed)`; each node's election rng from (seed, node, boot)."""

    def __init__(self, n: int, config: ElectionConfig, *, seed: int, delays_s, jitter: float = 0.3) -> None:
        self.config, self.seed, self.jitter = config, seed, jitter
        self.rng = random.Random(seed)
        self.ids = IDS[:n]
        self.voters = tuple(sorted(self.ids))
        self.delays_s = delays_s
        self.drop = self.dup = self.reorder_s = 0.0
        self.now = 0.0
        self.offsets = [0.0] * n
        self.groups = [0] * n
        self.stores = [MemoryElectionStore() for _ in range(n)]
        self.disk_applied = [(0, 0)] * n
        self.disk_council = [trusted_root(self.voters)] * n
        self.boots = [0] * n
        self.nodes: list[ElectionState | None] = [None] * n
        self.tick_at = [math.nan] * n
        self.heap: list = []
        self.count = itertools.count()
        self.lines: list[str] = []
        self.wire = hashlib.sha256()  # every message sent: time, ends, bytes
        self.sent: dict[str, int] = {}
        self.dropped = 0
        for k in range(n):
            self._boot(k)

    @property
    def n(self) -> int:
        return len(self.ids)

    def say(self, k: int | None, text: str) -> None:
        self.lines.append(f"{self.now:10.6f} {'' if k is None else name(self.ids[k]) + ' '}{text}")

    def local(self, k: int) -> float:
        return self.now + self.offsets[k]

    # -- moves -------------------------------------------------------------------------------
    def crash(self, k: int) -> None:
        self.say(k, "** crash")
        self.nodes[k] = None

    def restart(self, k: int) -> None:
        self.say(k, f"** restart from store {self.stores[k].load()[0]}/{name(self.stores[k].load()[1])} "
                    f"applied {self.disk_applied[k]}")
        self._boot(k)

    def partition(self, groups) -> None:
        self.say(None, f"** partition {groups}")
        self.groups = list(groups)

    def heal(self) -> None:
        self.say(None, "** heal")
        self.groups = [0] * self.n

    def network(self, drop: float = 0.0, dup: float = 0.0, reorder_s: float = 0.0) -> None:
        self.say(None, f"** network drop {drop} duplicate {dup} reorder {reorder_s}")
        self.drop, self.dup, self.reorder_s = drop, dup, reorder_s

    def jump(self, k: int, delta_s: float) -> None:
        self.say(k, f"** clock jumps {delta_s:+g} s")
        self.offsets[k] += delta_s
        if self.nodes[k] is not None:
            self._run(k, self.nodes[k].tick(self.local(k)))

    def campaign(self, k: int) -> None:
        self.say(k, "** campaign")
        if self.nodes[k] is not None:
            self._run(k, self.nodes[k].campaign(self.local(k)))

    def hand_out(self, k: int, voters=None) -> None:
        """Node k, if coordinator, hands out its next epoch (its last applied + 1) to the voters
        (by default its own), applying it itself first."""
        node = self.nodes[k]
        if node is None or node.role is not ElectionRole.COORDINATOR:
            self.say(k, "** hand-out: not coordinator")
            return
        voters = tuple(sorted(voters if voters is not None else node.voters))
        term, epoch, cert = node.term, node.last_applied[1] + 1, node.certificate
        council = node.council_for(voters, epoch)
        if council is None:
            self.say(k, f"** hand-out: cannot change the council to {names(voters)} now")
            return
        self.say(k, f"** hand-out term {term} epoch {epoch} voters {names(voters)}")
        self._offer(k, k, term, epoch, council, cert)
        for v in voters:
            if v != self.ids[k]:
                self._send(k, self.ids.index(v), "alloc", pack([term, epoch, council.encode(), cert.to_wire()]))

    def run_until(self, t_end: float) -> None:
        while self.heap and self.heap[0][0] <= t_end:
            t, _, kind, k, item = heapq.heappop(self.heap)
            self.now = t
            node = self.nodes[k]
            if node is None:
                continue
            if kind == "tick":
                if t == self.tick_at[k]:
                    self.tick_at[k] = math.nan
                    self._run(k, node.tick(self.local(k)))
                continue
            src, what, payload = item
            if self.groups[src] != self.groups[k]:
                continue
            if what == "alloc":
                term, epoch, council, cert = unpack_untrusted(payload, max_len=1 << 20)
                self._offer(k, src, term, epoch, Council.decode(council), Certificate.from_wire(cert))
            else:
                self._run(k, node.handle(self.ids[src], decode_election(unpack_untrusted(payload, max_len=1 << 20)),
                                         self.local(k)))
        self.now = max(self.now, t_end)

    def summary(self) -> list[str]:
        out = []
        for k in range(self.n):
            node = self.nodes[k]
            if node is None:
                out.append(f"  {name(self.ids[k])} down")
                continue
            out.append(f"  {name(self.ids[k])} {node.role.value} term {node.term} voted {name(node.voted_for)} "
                       f"coordinator {name(node.coordinator)} applied {node.last_applied} voters {names(node.voters)}")
        out.append(f"  sent {dict(sorted(self.sent.items()))} dropped {self.dropped}")
        out.append(f"  wire sha256 {self.wire.hexdigest()}")
        return out

    # -- internals ---------------------------------------------------------------------------
    def _boot(self, k: int) -> None:
        term, voted_for = self.stores[k].load()
        rng = random.Random(self.seed * 1000 + k * 10 + self.boots[k])
        self.boots[k] += 1
        self.nodes[k] = ElectionState(self.ids[k], self.config, rng, self.local(k), signer=SIGNERS[self.ids[k]],
                                      term=term, voted_for=voted_for, council=self.disk_council[k],
                                      applied=self.disk_applied[k])
        self._schedule(k)

    def _schedule(self, k: int) -> None:
        node = self.nodes[k]
        if node is None:
            return
        deadline = node.next_deadline()
        t = max(self.now, deadline - self.offsets[k])
        while t + self.offsets[k] < deadline:  # rounding: the node must see its deadline reached
            t = math.nextafter(t, math.inf)
        if t != self.tick_at[k] and t != math.inf:
            self.tick_at[k] = t
            heapq.heappush(self.heap, (t, next(self.count), "tick", k, None))

    def _send(self, src: int, dst: int, what: str, payload: bytes) -> None:
        self.sent[what] = self.sent.get(what, 0) + 1
        self.wire.update(f"{self.now!r} {src} {dst} {what} ".encode() + payload)
        if self.drop and self.rng.random() < self.drop:
            self.dropped += 1
            return
        copies = 2 if self.dup and self.rng.random() < self.dup else 1
        for _ in range(copies):
            d = self.delays_s[src][dst] * self.rng.uniform(1.0, 1.0 + self.jitter)
            if self.reorder_s:
                d += self.rng.uniform(0.0, self.reorder_s)
            heapq.heappush(self.heap, (self.now + d, next(self.count), "msg", dst, (src, what, payload)))

    def _offer(self, k: int, src: int, term: int, epoch: int, council: Council, cert) -> None:
        node = self.nodes[k]
        refusal = node.may_apply(self.ids[src], term, epoch, cert, council)
        if refusal is not None:
            self.say(k, f"refuses term {term} epoch {epoch} of {name(self.ids[src])}: {refusal.code}")
            return
        self.disk_applied[k], self.disk_council[k] = (term, epoch), council
        self.say(k, f"applies term {term} epoch {epoch} of {name(self.ids[src])}")
        self._run(k, node.apply_allocation(term, epoch, council, cert, self.local(k)))

    def _run(self, k: int, actions: list) -> None:
        for a in actions:
            if isinstance(a, Persist):
                self.stores[k].persist(a.term, a.voted_for)
                self.say(k, f"persist term {a.term} vote {name(a.voted_for)}")
            elif isinstance(a, ElectionSend):
                kind = type(a.msg).__name__
                if kind not in ("Heartbeat", "HeartbeatAck"):
                    fields = ", ".join(f"{f.name}={_show(getattr(a.msg, f.name))}" for f in dataclasses.fields(a.msg))
                    self.say(k, f"-> {name(a.to)} {kind}({fields})")
                self._send(k, self.ids.index(a.to), kind, pack(a.msg.to_wire()))
            elif isinstance(a, BecameCoordinator):
                self.say(k, f"BECOMES COORDINATOR of term {a.term}")
            elif isinstance(a, CoordinatorKnown):
                self.say(k, f"knows coordinator {name(a.coordinator)} of term {a.term}")
            elif isinstance(a, SteppedDown):
                self.say(k, f"steps down in term {a.term}{' and stands again' if a.standing_again else ''}")
            else:
                raise AssertionError(f"unknown election action {a!r}")
        self._schedule(k)


def _show(v) -> str:
    if isinstance(v, bytes):
        return name(v)
    if isinstance(v, tuple):
        return names(v)
    return repr(v)


def _ms(n: int, scenario: str | None, seed: int):
    """One-way delays in seconds: 10 ms everywhere, or a scenario's regions, peers shuffled by seed."""
    if scenario is None:
        return [[0.01] * n for _ in range(n)]
    m = load_scenario(scenario).scaled(n).delay_ms()
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [[float(m[order[i], order[j]]) / 1000 for j in range(n)] for i in range(n)]


def _coordinator(net: ElectionNet) -> int | None:
    coords = [k for k, x in enumerate(net.nodes) if x is not None and x.role is ElectionRole.COORDINATOR]
    return max(coords, key=lambda k: net.nodes[k].term) if coords else None


# Each script: title, n, config, seed, scenario (None: 10 ms), and moves (time, what, *args);
# "coord" as a node stands for the coordinator with the highest term at that moment.
ELECTION_SCRIPTS = [
    ("first election, clean 10 ms network", 5, TEST_ELECTION, 1, None,
     [(1.5, "hand_out", "coord")]),
    ("coordinator crashes and restarts from its store (worldwide delays, wan timings)", 5, WAN_ELECTION, 2,
     "worldwide", [(8.0, "crash", "coord"), (16.0, "restart", "crashed"), (24.0, "hand_out", "coord")]),
    ("3 | 2 partition with the coordinator in the minority, then heal", 5, TEST_ELECTION, 3, None,
     [(1.0, "hand_out", "coord"), (1.2, "partition_minority"), (3.0, "hand_out", "coord"), (3.5, "heal"),
      (5.0, "hand_out", "coord")]),
    ("lossy network: 20 % drop, 10 % duplicates, 50 ms reorder; 7 nodes", 7, TEST_ELECTION, 4, "regional",
     [(0.0, "network", 0.2, 0.1, 0.05), (2.0, "hand_out", "coord"), (2.5, "crash", "coord"),
      (4.0, "restart", "crashed"), (5.0, "network", 0.0, 0.0, 0.0)]),
    ("clock jumps: +1 s on a follower, -0.2 s on the coordinator, +30 s on another", 4, TEST_ELECTION, 5, None,
     [(1.0, "jump", 1, 1.0), (1.5, "jump", "coord", -0.2), (2.0, "jump", 3, 30.0), (2.6, "campaign", 0),
      (3.5, "hand_out", "coord")]),
    ("voters change: a crashed voter left out, it returns and campaigns", 5, TEST_ELECTION, 6, None,
     [(1.0, "hand_out", "coord"), (1.2, "crash", 4), (1.6, "hand_out_without", 4), (2.4, "restart", 4),
      (3.0, "campaign", 4), (4.0, "crash", "coord"), (5.5, "hand_out", "coord")]),
    ("plain Raft (no pre-vote, no check-quorum): 2 | 3 partition, a crash, heal", 5, PLAIN_ELECTION, 7, None,
     [(1.0, "hand_out", "coord"), (1.2, "partition_minority"), (2.5, "hand_out", "coord"), (3.0, "heal"),
      (4.0, "crash", "coord"), (5.0, "restart", "crashed"), (6.0, "hand_out", "coord")]),
]


def election_trace(title, n, config, seed, scenario, moves, end_s: float = 0.0) -> list[str]:
    net = ElectionNet(n, config, seed=seed, delays_s=_ms(n, scenario, seed))
    crashed = None
    for t, what, *args in moves:
        net.run_until(t)
        args = [_coordinator(net) if a == "coord" else crashed if a == "crashed" else a for a in args]
        if None in args or (what in ("partition_minority", "hand_out_without") and _coordinator(net) is None):
            net.say(None, f"** {what}: no coordinator")
        elif what == "crash":
            crashed = args[0]
            net.crash(crashed)
        elif what == "restart":
            net.restart(args[0])
        elif what == "partition_minority":
            c = _coordinator(net)
            minority = {c, (c + 1) % n}
            net.partition([1 if k in minority else 0 for k in range(n)])
        elif what == "heal":
            net.heal()
        elif what == "network":
            net.network(*args)
        elif what == "jump":
            net.jump(*args)
        elif what == "campaign":
            net.campaign(*args)
        elif what == "hand_out":
            net.hand_out(args[0])
        elif what == "hand_out_without":
            c = _coordinator(net)
            net.hand_out(c, [v for v in net.nodes[c].voters if v != net.ids[args[0]]])
        else:
            raise AssertionError(what)
    net.run_until(max(t for t, *_ in moves) + (end_s or 20 * config.election_timeout_max_s))
    head = [f"== {title}: {n} nodes, seed {seed}, {scenario or '10 ms'}, config {_config(config)}"]
    return head + net.lines + ["-- at the end:", *net.summary(), ""]


def _config(c: ElectionConfig) -> str:
    return " ".join(f"{f.name}={getattr(c, f.name)}" for f in dataclasses.fields(c))


def golden_election() -> str:
    out = ["# ElectionState nodes on this test's own network (ElectionNet): every action but heartbeats",
           "# and their acks, with the virtual time of the node that took it. 'wire sha256' covers every",
           "# message (heartbeats too): time, ends and its bytes. Voters are listed as on the wire,",
           "# sorted by peer id.", ""]
    for script in ELECTION_SCRIPTS:
        out += election_trace(*script)
    return "\n".join(out)


# ---------------------------------------------------------------------- election, in ElectionSim


def _sim_state(sim) -> str:
    parts = []
    for k in range(sim.n):
        node = sim.nodes[k]
        if node is None:
            parts.append(f"n{k} down")
        else:
            coord = sim.index.get(node.coordinator)
            parts.append(f"n{k} {node.role.value[:5]} t{node.term} c{'-' if coord is None else coord}")
    return ", ".join(parts)


def _sim_lines(sim) -> list[str]:
    out = [f"  wins (time, node, term): {[(f'{t:.6f}', k, term) for t, k, term in sim.wins]}",
           f"  step downs (time, node, term, standing again): "
           f"{[(f'{t:.6f}', k, term, d.standing_again) for t, k, term, d in sim.step_downs]}",
           f"  votes (node, term) -> node: "
           f"{sorted((k, term, sim.index[v]) for (k, term), v in sim.votes.items())}",
           f"  sent {sim.sent} violations {sim.violations}"]
    return out


def _sim_run(title: str, sim, moves) -> list[str]:
    out = [f"== {title}"]
    for what, *args in moves:
        coords = sim.coordinators()
        c = max(coords, key=lambda k: sim.nodes[k].term) if coords else None
        args = [c if a == "coord" else a for a in args]
        got = ""
        if what == "run":
            sim.run_for(args[0])
        elif what == "network":
            sim.net = _internal()[1](**args[0])
        else:
            getattr(sim, what)(*args)
        out.append(f"  {sim.now:10.6f} {what} {args}{' -> ' + str(got) if got != '' else ''}: {_sim_state(sim)}")
    return out + ["-- at the end:", *_sim_lines(sim), ""]


SIM_ELECTION = [
    ("5 nodes, 10 ms, codec, seed 11: crash the coordinator, restart, partition, heal, jump, campaign",
     dict(n=5, config=TEST_ELECTION, seed=11, codec=True),
     [("run", 2.0), ("crash", "coord"), ("run", 1.5), ("restart", 0), ("restart", 1), ("restart", 2),
      ("restart", 3), ("restart", 4), ("run", 1.0), ("partition", [0, 0, 1, 1, 1]), ("run", 2.0), ("heal",),
      ("run", 1.0), ("jump_clock", 2, 30.0), ("run", 1.0), ("campaign", 4), ("run", 2.0)]),
    ("7 nodes, worldwide delays, wan timings, lossy, seed 12: two coordinator crashes",
     dict(n=7, config=WAN_ELECTION, seed=12, codec=True, delays_s=_ms(7, "worldwide", 12)),
     [("network", dict(jitter=0.5, drop_fraction=0.1, duplicate_fraction=0.1, reorder_s=0.05)), ("run", 15.0),
      ("crash", "coord"), ("run", 15.0), ("crash", "coord"), ("run", 20.0), ("restart", 0), ("restart", 1),
      ("restart", 2), ("restart", 3), ("restart", 4), ("restart", 5), ("restart", 6), ("run", 20.0)]),
    ("4 nodes, 10 ms, plain Raft, objects not bytes, seed 13: 2 | 2 partition, heal",
     dict(n=4, config=PLAIN_ELECTION, seed=13, codec=False),
     [("run", 2.0), ("partition", [0, 0, 1, 1]), ("run", 3.0), ("heal",), ("run", 3.0)]),
]

def _sim(kw: dict):
    ElectionSim, NetConditions = _internal()
    kw = dict(kw)
    n, config = kw.pop("n"), kw.pop("config")
    if "conditions" in kw:
        kw["conditions"] = NetConditions(**kw["conditions"])
    return ElectionSim(n, config, **kw)


def golden_election_sim() -> str:
    out = ["# ElectionSim (control/election/sim.py), election moves only: the state after each move",
           "# (nK role term cCoordinator), then the wins, step-downs and votes.",
           "# Valid as long as the simulation draws its randomness as it does today.", ""]
    for title, kw, moves in SIM_ELECTION:
        out += _sim_run(title, _sim(kw), moves)
    return "\n".join(out)


# ---------------------------------------------------------------------- the test


GOLDEN: dict[str, Callable[[], str]] = {
    "allocations": golden_allocations,
    "reshape": golden_reshape,
    "election": golden_election,
    "election_sim": golden_election_sim,
}


def record(which=None) -> list[Path]:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in which or GOLDEN:
        path = GOLDEN_DIR / f"{key}.txt"
        path.write_text(GOLDEN[key]() + "\n")
        paths.append(path)
    return paths


@pytest.mark.parametrize("key", list(GOLDEN))
def test_golden(key):
    path = GOLDEN_DIR / f"{key}.txt"
    got = GOLDEN[key]() + "\n"
    if RECORD:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        return
    want = path.read_text()
    if got != want:
        diff = list(difflib.unified_diff(want.splitlines(), got.splitlines(), f"recorded {path.name}", "now",
                                         lineterm="", n=2))
        more = f"\n... {len(diff) - 120} more diff lines" if len(diff) > 120 else ""
        pytest.fail(f"{path} differs from what the code gives now (re-record only for an intended change: "
                    f"DTFM_RECORD_GOLDEN=1):\n" + "\n".join(diff[:120]) + more, pytrace=False)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit("usage: python tests/control/plane/test_control_golden.py --record [" + " ".join(GOLDEN) + "]")
    for p in record(sys.argv[2:]):
        print(f"wrote {p}")
