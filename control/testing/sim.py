"""The whole control plane in a deterministic simulation: every node runs the daemon's own
machines (`ElectionState`, `EpochMachine`, `Coordinator`) over the election's simulated network
(control/testing/election_sim.py), with virtual time (see docs/control.md, "Simulation").

The simulation plays the shell: it delivers every message the machines send (ALLOCATION, START,
STOP, STEP, RUN_STATE as plain wire maps, dropped, duplicated, reordered, delayed and cut like
the election's), answers a request when every peer answered or its timeout passed, runs the
scheduler stand-in at once, fires the machines' timers, and plays each node's stage. Stages are
a cheap deterministic stand-in for the tiny model: a stage's weights at step s are a hash chain
`w(s) = H(w(s-1), s)` from the run's seed, so the loss a step logs (a number drawn from its
weights) is the reference's only if the stage was resumed from the right weights; fetching a
stage is looking its digest up in a content store (hash-verified, as the daemon's fetch), a
checkpoint is a (layers, step) -> weights entry on the node's disk, kept across a crash, and
every node of the run rebuilds step 0 from the seed, as a daemon rebuilds the initial weights.

Checked as it runs (in `violations`), besides the election's own checks: a node applies an
allocation only from the coordinator it recognises for that term (the one elected in it), its
applied (term, epoch) only grows, and every line any node logs has the reference loss of its
step. `merged_log` and `check_log` give the log invariants.

A Byzantine node (`byzantine`): a real key whose owner sends anything, well-formed or not, in
its own name (`byzantine_ask`, `byzantine_send`, and the election's `inject`); what is
delivered to it is kept in the election's `inbox` (for replays). "insider": one of the n nodes,
a voter and a peer of the run, whose daemon (its machines) works honestly besides; "outsider":
an (n + 1)-th key that is no voter, runs no machine and is never named. The shell's part here
checks untrusted bodies as the daemon's handlers do (control/plane.py): a malformed request or
one-way message is refused (`refused`, no answer: the daemon's transport drops it) before any
machine sees it; whatever gets past that goes to the machines, and an exception in a machine
ends the run (the test fails). An allocation of the Byzantine node counts as its elected
coordinator's when its certificate is true (honest votes it was given, and its own).
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import assert_never

from dtfm.net import Identity, OperatorKey, ProtocolError, short_id
from dtfm.sched import layer_ranges
from dtfm.train import PRESETS, TrainConfig, get_preset

from .. import inputs
from ..actions import Answers, Ask, Compute, Computed, CoordinatorAction, Emit, LogLine, Reply, ResetLog, Send
from ..config import PlaneConfig
from ..allocation import AcceptContext, Allocation, Refusal, SignedAllocation
from ..answers import AllocationAnswer, NoAnswer, OfferAnswer, read_answers
from ..coordinator.machine import (
    Coordinator,
    CoordinatorTimings,
    Elected,
    PeerLeaving,
    StartRun,
    SteppedDownEvent,
    CoordinatorTick,
    next_council,
)
from ..coordinator.reshape import ReshapePlan
from ..coordinator.schedule import Placement
from ..election import (
    COUNCIL_SIZES,
    BecameCoordinator,
    Certificate,
    Council,
    ElectionConfig,
    ElectionRole,
    ElectionState,
    SteppedDown,
)
from .election_sim import ElectionSim, NetConditions
from ..epoch.machine import (
    AbortRunner,
    AllocationOffered,
    ApplyToElection,
    BuildFailed,
    BuildStage,
    EndEpoch,
    EpochAction,
    EpochDone,
    EpochMachine,
    EpochTick,
    FailNeighbour,
    KeepStage,
    PersistApplied,
    RunnerEnded,
    StageBuilt,
    StartRunner,
    StepDone,
    StopRunnerAt,
    WaitForCoordinator,
)
from ..epoch.report import RunEnd, StepReport
from ..epoch.runstate import MAX_CHECKPOINTS
from ..messages import ControlMsg
from ..operator import SignedOp, council_arg, root_council, sign_op
from ..reach import ReachAnswer, ReachRequest

__all__ = ["PlaneSim", "SIM_CONFIG", "SIM_TIMINGS", "reference_loss", "reference_weights"]

PRESET = "tiny"
DATA_HASH = "0" * 64
RETRY_S = 0.1  # an allocation waiting for its coordinator is offered again this often
REFUSING = AllocationAnswer.refused("busy", "a refusing node refuses every allocation").to_wire()


def reference_weights(seed: int, step: int) -> bytes:
    """The stand-in model's weights before step `step` (a hash chain from the run's seed)."""
    w = hashlib.sha256(struct.pack(">q", seed)).digest()
    for s in range(step):
        w = hashlib.sha256(w + struct.pack(">q", s)).digest()
    return w


def _next_weights(w: bytes, step: int) -> bytes:
    return hashlib.sha256(w + struct.pack(">q", step)).digest()


def reference_loss(weights_after: bytes) -> float:
    """The loss a step reports: drawn from the weights it produced."""
    return 1.0 + int.from_bytes(weights_after[:4], "big") / 2**32


@dataclass
class SimStage:
    """A node's stage objects (the shell's `_Stage`): weights before step `at`, and before the
    last completed step (the runner's snapshot)."""

    alloc: Allocation
    weights: bytes
    at: int
    snapshot: tuple[int, bytes] | None = None
    started: bool = False
    stop_at: int | None = None
    ended: bool = False


@dataclass
class _Outstanding:
    """A request a node's coordinator made: answers so far."""

    ask: Ask
    answers: dict[bytes, object] = field(default_factory=dict)  # each peer's reply as it came


class SimSwarm:
    """Node k's gossip, as the coordinator reads it: the live nodes on its side, all measured."""

    def __init__(self, sim: PlaneSim, k: int):
        self.sim, self.k = sim, k

    def live_peers(self) -> list[bytes]:
        return [self.sim.ids[j] for j in self.sim.reachable(self.k) if j != self.k]

    def known_peers(self) -> list[bytes]:
        return list(self.sim.ids)

    def regions(self) -> dict[bytes, str]:
        return {p: "sim" for p in self.sim.ids}

    def view(self):
        return _View(tuple(sorted(self.live_peers() + [self.sim.ids[self.k]])))

    def measured_view(self, candidates):
        return _View(tuple(sorted(set(candidates)))), []

    def incarnations(self) -> dict[bytes, int]:
        return {p: self.sim.lives[j] for j, p in enumerate(self.sim.ids)}  # (one up per restart)


@dataclass(frozen=True)
class _View:
    peers: tuple[bytes, ...]
    complete: bool = True


class SimPlanner:
    """The scheduler's stand-in: every live peer in `stages`-stage pipelines (the rest spares).
    Cheap and deterministic; the scheduler's own choices are tested in tests/control/coordinator/test_reshape.py."""

    def __init__(self, sim: PlaneSim):
        self.sim = sim

    def placement(self, live: Sequence[bytes]) -> Placement:
        peers = sorted(live)
        stages = max(1, min(self.sim.stages, len(peers), PRESETS[PRESET].n_layer))
        cfg = TrainConfig(seed=self.sim.run_seed)
        dp = max(1, min(len(peers) // stages, cfg.global_batch_seqs // cfg.micro_batches))
        pipelines = tuple(tuple(peers[d * stages + s] for s in range(stages)) for d in range(dp))
        spares = tuple(peers[dp * stages:])
        ranges = tuple(layer_ranges(PRESETS[PRESET].n_layer, stages))
        return Placement(pipelines, ranges, spares, 1.0, 1.0)

    def first_placement(self, view, req, model, train, regions) -> Placement:
        return self.placement(view.peers)

    def reshape(self, view, cur: Allocation, *, live, remaining_steps, regions, seed, force,
                cut=frozenset()) -> ReshapePlan:
        if not live:
            raise ValueError("no live peer")
        return ReshapePlan(self.placement(sorted(live)), "reschedule", 0, 0, 0.0, 0.0, ())


# The coordinators' timings in a simulation: brisk, for a network of ~10 ms links.
# The plane's settings in the simulation: quick timeouts and checks on the virtual clock. The
# coordinator's timings are mapped from them as the daemon maps its own
# (`PlaneConfig.coordinator_timings`), but with no drift check (the simulated links never
# drift; 1e9 s is past what a daemon's settings allow) and no step deadline (step times are
# the stand-in's, not a model's).
SIM_CONFIG = PlaneConfig.test().with_(
    connect_timeout_s=1.0, accept_timeout_s=2.0, request_timeout_s=0.5, stop_timeout_s=2.0, check_interval_s=0.5,
    report_gather_s=0.05, probe_timeout_s=0.5, paused_retry_s=2.0, stop_poll_s=0.05,
    max_reconfig_attempts=5, refused_backoff_s=2.0, refused_backoff_max_s=16.0,
    join_settle_s=1.0, join_wait_max_s=4.0)
SIM_TIMINGS = replace(SIM_CONFIG.coordinator_timings(), drift_check_s=1e9, deadline=None)


class PlaneSim(ElectionSim):
    """`ElectionSim` whose nodes also run the plane's machines (see the module docstring)."""

    def __init__(self, n: int, config: ElectionConfig, *, seed: int = 0, stages: int = 2,
                 checkpoint_every: int = 0, conditions: NetConditions | None = None, lose_reports: bool = True,
                 delays_s=None, timings: CoordinatorTimings | None = None, byzantine: str | None = None):
        if byzantine not in (None, "insider", "outsider"):
            raise ValueError(f"byzantine is None, 'insider' or 'outsider', not {byzantine!r}")
        rng = random.Random(seed)
        n += byzantine == "outsider"
        keys = [Identity(rng.randbytes(32)) for _ in range(n)]
        by_id = {k.peer_id: k for k in keys}
        # the Byzantine node: the last key drawn (its index among the sorted ids)
        self.byzantine = sorted(by_id).index(keys[-1].peer_id) if byzantine else None
        self.refused: list[tuple[int, int, str]] = []  # (node, sender, why): untrusted input the shell refused
        # nodes that answer every other node's ALLOCATION with a refusal, applying nothing (a
        # daemon whose `ControlPlane.accept` is wrapped to refuse: the review's N2 insider)
        self.refusing: set[int] = set()
        # (term, epoch) -> the allocation some node applied; lines whose loss the Byzantine
        # insider could set (a last stage of their epoch: out of scope, like gradient poisoning)
        self.allocations: dict[tuple[int, int], Allocation] = {}
        self.liar_losses: list[dict] = []
        self.stages = stages
        self.checkpoint_every = checkpoint_every
        self.timings = timings or SIM_TIMINGS
        self.run_seed = seed
        # The swarm's operator: its key is not drawn from `rng`, so the fault schedule is the same.
        self.operator = OperatorKey(hashlib.sha256(b"sim operator" + struct.pack(">q", seed)).digest())
        self.content: dict[str, bytes] = {}  # digest -> weights (what a fetch verifies against)
        self.disk_alloc: list[Allocation | None] = [None] * n
        self.checkpoints: list[dict[tuple[bytes, tuple[int, int], int], bytes]] = [{} for _ in range(n)]
        # the step reports saved with each checkpoint (those of the steps its weights hold)
        self.checkpoint_reports: list[dict[tuple[bytes, tuple[int, int], int], tuple[StepReport, ...]]] = [
            {} for _ in range(n)]
        self.epochs: list[EpochMachine | None] = [None] * n
        self.coords: list[Coordinator | None] = [None] * n
        self.sim_stages: list[dict[int, SimStage]] = [{} for _ in range(n)]  # node -> epoch -> stage
        self.outstanding: list[dict[Hashable, _Outstanding]] = [{} for _ in range(n)]
        self.replies: list[dict[tuple, Reply]] = [{} for _ in range(n)]
        self.train_log: list[dict] = []  # every line any node logged, with `holder`
        self.events: list[tuple[float, int, str, dict]] = []
        self.applications: list[tuple[int, tuple[int, int], bytes | None, int]] = []
        self.applied: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.lives = [0] * n  # crashes of each node: what it logged in memory is lost with each
        self._signers = by_id
        self._ctick_at = [float("nan")] * n
        # (node, its key of an ALLOCATION it was asked) -> (asker, the asker's key): answered once built
        self._pending_allocs: dict[tuple[int, tuple], tuple[int, tuple]] = {}
        # (coordinator, its key of a LEAVE it was asked) -> (the leaving node, its key): answered once handed off
        self._pending_leaves: dict[tuple[int, tuple], tuple[int, tuple]] = {}
        self._leaving: dict[int, tuple] = {}  # node -> the key of its LEAVE, while it waits for the answer
        self.leave_timeout_s = 10.0  # a leaving node goes anyway after this (control/config.py leave_hand_off_s)
        self.left: list[tuple[float, int, str]] = []  # (time, node, how it went: handed off, or why not)
        self._seq = 0
        liars = () if self.byzantine is None else (self.byzantine,)
        super().__init__(n, config, seed=rng.getrandbits(64), codec=False, conditions=conditions,
                         lose_reports=lose_reports, delays_s=delays_s, keys=keys, liars=liars,
                         liars_vote=byzantine != "outsider", liars_run=byzantine == "insider")

    # ------------------------------------------------------------------ queries

    def reachable(self, k: int) -> list[int]:
        return [j for j in self.live() if self.groups[j] == self.groups[k]]

    def epoch(self, k: int) -> EpochMachine:
        e = self.epochs[k]
        assert e is not None
        return e

    def elected(self, term: int) -> set[int]:
        """The nodes elected in `term`: by their own machine, or (the Byzantine node) on a true
        certificate that a node recognised."""
        out = {self.winners[term]} if term in self.winners else set()
        return out | {self.index[c] for t, c in self.certificates if t == term}

    def merged_log(self) -> dict[int, dict]:
        """step -> the line of the highest (term, epoch) (what `dtfm-swarm` merges)."""
        best: dict[int, dict] = {}
        for line in self.train_log:
            key = (line["term"], line["epoch"])
            if line["step"] not in best or key > (best[line["step"]]["term"], best[line["step"]]["epoch"]):
                best[line["step"]] = line
        return best

    # ------------------------------------------------------------------ moves

    def start_training(self, k: int, *, steps: int = 10**6) -> bool:
        """`train start` on node k (its coordinator): the first epoch over the nodes it reaches."""
        coord = self.coords[k]
        if coord is None or not self._reader(k).is_coordinator:
            return False
        self._seq += 1
        ev = StartRun(("start", self._seq), self.signed_start(k, steps, self.checkpoint_every), DATA_HASH, "sim")
        self._coordinator(k, ev)
        return True

    def signed_start(self, k: int, steps: int, checkpoint_every: int) -> SignedOp:
        """The operator's start of the simulation's run, signed at node k's time."""
        args = {"preset": PRESET, "steps": steps, "seed": self.run_seed, "checkpoint_every": checkpoint_every,
                "placement": "scheduler", "data_hash": DATA_HASH, "data_name": "sim"}
        return sign_op(self.operator, "start", now_s=max(0.0, self.local_now(k)), run_id=self._run_id(), args=args)

    def _first_council(self, voters: tuple[bytes, ...]) -> Council:
        """The first council, rooted in the simulation's operator (a council operation)."""
        size = next(n for n in COUNCIL_SIZES if n >= len(voters))
        signed = sign_op(self.operator, "council", now_s=0.0,
                         args={"council": council_arg(voters), "council_size": size})
        return root_council(signed, {self.operator.public_key})

    def _council(self, k: int, voters: tuple[bytes, ...]) -> dict:
        """An allocation's voters and council as node k hands them out (`council_of`)."""
        council = self.council_of(k, voters)
        return {"voters": council.voters, "council": council.encode()}

    def issue(self, k: int, *, rogue: bool = False) -> Allocation | None:
        """Node k hands the next allocation of its term (epoch: its last applied + 1) to the
        nodes it reaches, without starting it (rogue: even when it is not coordinator, as a
        faulty peer would); the peers' acceptance decides. None if it issued nothing."""
        node = self.nodes[k]
        if node is None or not (rogue or node.role is ElectionRole.COORDINATOR):
            return None
        me = self.ids[k]
        placement = SimPlanner(self).placement([self.ids[j] for j in self.reachable(k)])
        named = {p for pipe in placement.pipelines for p in pipe} | set(placement.spares)
        live = {self.ids[j] for j in self.reachable(k)} | {me}
        alloc = Allocation(epoch=node.last_applied[1] + 1, term=node.term, issuer=me, pipelines=placement.pipelines,
                           layer_ranges=placement.layer_ranges, preset=PRESET, model=get_preset(PRESET),
                           train=TrainConfig(seed=self.run_seed), data_hash=DATA_HASH, data_name="sim", start_step=0,
                           end_step=10**6, checkpoint_every=0, predicted_iteration_s=1.0, spares=placement.spares,
                           run_id=self._run_id(), reason="issued",
                           **self._council(k, next_council(node.voters, named, live, {}, 5, me)),
                           operator_start=self.signed_start(k, 10**6, 0).encode())
        body = SignedAllocation.sign(alloc, self._signers[me]).to_wire()
        if node.certificate is not None:
            body["cert"] = node.certificate.to_wire()
        self._seq += 1
        for p in sorted(named):
            if p == me:
                self._local_answer(k, ControlMsg.ALLOCATION, body)
            else:
                self._transmit(k, self.index[p], ("ask", ("issued", self._seq), ControlMsg.ALLOCATION, body))
        return alloc

    def train(self, steps: int = 1, *, split: Sequence[int] = ()) -> int:
        """Every epoch whose peers all train it, on one side, runs `steps` steps; the peers of an
        epoch that cannot step fail the step. With `split`, the last of these steps is completed
        only by the peers in `split`, which then fail the next one, and failed by the others.
        Returns the steps completed, summed over the epochs."""
        done = 0
        allocs = {}
        for k in self.live():
            for st in self.sim_stages[k].values():
                if st.started and not st.ended:
                    allocs[(st.alloc.term, st.alloc.epoch)] = st.alloc
        for key in sorted(allocs):
            alloc = allocs[key]
            ks = [self.index[p] for p in alloc.peers]
            mine = [j for j in ks if self.nodes[j] is not None and alloc.epoch in self.sim_stages[j]
                    and self.sim_stages[j][alloc.epoch].started and not self.sim_stages[j][alloc.epoch].ended]
            ok = len(mine) == len(ks) and len({self.groups[j] for j in mine}) == 1
            for s in range(steps if ok else 0):
                last = s == steps - 1 and bool(split)
                stepping = [j for j in mine if not last or j in split]
                if any(self.sim_stages[j][alloc.epoch].at >= self._end_of(j, alloc) for j in stepping):
                    break
                for j in stepping:
                    self._complete(j, alloc.epoch)
                done += 1
            if ok and not split:
                continue
            for j in mine:
                st = self.sim_stages[j][alloc.epoch]
                self._end_runner(j, st, RunEnd(st.at - 1, "a neighbour's step failed", True))
        return done

    def _run_to_stops(self, alloc: Allocation) -> None:
        """A runner told to stop before a step trains on to it (steps otherwise run only in
        `train`): once every peer of the epoch has its stop, they step together to the first
        boundary, or fail the next step when a peer of the epoch is gone."""
        ks = [self.index[p] for p in alloc.peers]
        stages = [self.sim_stages[j].get(alloc.epoch) if self.nodes[j] is not None else None for j in ks]
        live = [st for st in stages if st is not None and st.started and not st.ended]
        if any(st.stop_at is None for st in live):
            return
        if len(live) < len(ks) or len({self.groups[j] for j in ks if self.nodes[j] is not None}) > 1:
            for j, st in zip(ks, stages):
                if st is not None and st.started and not st.ended:
                    self._end_runner(j, st, RunEnd(st.at - 1, "a neighbour's step failed", True))
            return
        stop = min(st.stop_at for st in live if st.stop_at is not None)
        while all(st.at < stop for st in live):
            for j in ks:
                self._complete(j, alloc.epoch)
        for j, st in zip(ks, stages):
            if st is not None and not st.ended:
                self._end_runner(j, st, RunEnd(st.at - 1, "stopped", False))

    def byzantine_ask(self, dst: int, msg: int, body: object) -> None:
        """The Byzantine node sends request `msg` with `body` to node dst (an answer lands in its inbox)."""
        assert self.byzantine is not None
        self._seq += 1
        self._transmit(self.byzantine, dst, ("ask", ("byzantine", self._seq), msg, body))

    def byzantine_send(self, dst: int, msg: int, body: object) -> None:
        """The Byzantine node sends one-way message `msg` with `body` to node dst."""
        assert self.byzantine is not None
        self._transmit(self.byzantine, dst, ("send", msg, body))

    def leave(self, k: int) -> None:
        """`dtfm-peer leave` on node k, as the daemon does it (control/plane.py `hand_off`): it
        tells the coordinator its epoch machine names, which hands its part off, and goes once
        answered, after leave_timeout_s, or at once when there is nothing to hand off."""
        target, why = self.epoch(k).hand_off_to()
        if target is None:
            self._went(k, why or "nothing to hand off")
            return
        self._seq += 1
        key = self._leaving[k] = ("leave", self._seq)
        self._push(self.now + self.leave_timeout_s, ("leave-timeout", k, key))
        if target == self.ids[k]:
            self._coordinator(k, PeerLeaving(key, self.ids[k]))
        else:
            self._transmit(k, self.index[target], ("ask", key, ControlMsg.LEAVE, {}))

    def _went(self, k: int, how: str) -> None:
        self._leaving.pop(k, None)
        self.left.append((self.now, k, how))
        self.crash(k)

    def _leave_answered(self, k: int, answer: dict) -> None:
        ok = answer.get("ok")
        self._went(k, "handed off" if isinstance(ok, dict) and ok.get("handed_off") else
                   "nothing to hand off" if isinstance(ok, dict) else f"not handed off: {answer.get('error')}")

    def crash(self, k: int) -> None:
        if self.nodes[k] is not None:
            self.lives[k] += 1
        super().crash(k)
        self.epochs[k] = self.coords[k] = None
        self.sim_stages[k] = {}
        self.outstanding[k] = {}
        self.replies[k] = {}
        self._pending_leaves = {x: v for x, v in self._pending_leaves.items() if x[0] != k}
        self._leaving.pop(k, None)
        self._ctick_at[k] = float("nan")

    # ------------------------------------------------------------------ the election sim's hooks

    def _booted(self, k: int) -> None:
        reader = self._reader(k)
        waits = SIM_CONFIG.with_election(self.config)  # (the epoch machine's waits, derived as the daemon's)
        epoch = EpochMachine(self.ids[k], reader, heartbeat_wait_s=waits.heartbeat_wait_s,
                             coordinator_lost_after_s=waits.coordinator_lost_after_s,
                             operators={self.operator.public_key})
        alloc = self.disk_alloc[k]
        if alloc is not None:
            newest: dict[tuple[int, int], int] = {}
            for (r, layers, step) in self.checkpoints[k]:
                if r == alloc.run_id:
                    newest[layers] = max(step, newest.get(layers, step))
            kept = {(rep.epoch, rep.step): rep for layers, step in newest.items()
                    for rep in self.checkpoint_reports[k][(alloc.run_id, layers, step)]}
            epoch.restore(alloc.run_id, alloc.term, alloc.epoch, alloc, kept.values())
        self.epochs[k] = epoch
        signer = self._signers[self.ids[k]]
        self.coords[k] = Coordinator(self.ids[k], lambda a: SignedAllocation.sign(a, signer), reader, epoch,
                                     SimSwarm(self, k), SimPlanner(self), self.timings,
                                     operators=frozenset({self.operator.public_key}))
        self._schedule_coordinator(k)
        self._push(self.now + 3 * self.config.heartbeat_interval_s, ("etick", k))

    def _election_event(self, k: int, a) -> None:
        if isinstance(a, BecameCoordinator):
            self._coordinator(k, Elected(a.term))
        elif isinstance(a, SteppedDown):
            self._coordinator(k, SteppedDownEvent(a.term, a.reason))

    def _dispatch(self, item) -> None:
        kind, k = item[0], item[1]
        if self.nodes[k] is None:
            return
        if kind == "ctick":
            if item[2] == self._ctick_at[k]:
                self._ctick_at[k] = float("nan")
                self._coordinator(k, CoordinatorTick())
        elif kind == "etick":
            self._epoch(k, EpochTick())
            self._push(self.now + 3 * self.config.heartbeat_interval_s, ("etick", k))
        elif kind == "timeout":
            out = self.outstanding[k].pop(item[2], None)
            if out is not None:
                self._answered(k, out, complete=True)
        elif kind == "reoffer":
            self._epoch(k, item[2])
        elif kind == "leave-timeout":
            if self._leaving.get(k) == item[2]:
                self._went(k, f"no answer within {self.leave_timeout_s:g} s")
        else:
            raise AssertionError(f"unknown item {item!r}")

    def _on_message(self, k: int, src: int, payload: tuple) -> None:
        kind = payload[0]
        if kind == "ask":
            _, key, msg, body = payload
            self._answer(k, src, key, msg, body)
        elif kind == "answer":
            _, key, answer = payload
            if self._leaving.get(k) == key:
                self._leave_answered(k, answer)
                return
            out = self.outstanding[k].get(key)
            if out is not None and self.ids[src] in out.ask.peers and self.ids[src] not in out.answers:
                out.answers[self.ids[src]] = answer
                self._answered(k, out)
        elif kind == "send":
            _, msg, body = payload
            self._one_way(k, src, msg, body)
        else:
            raise AssertionError(f"unknown message {payload!r}")

    # ------------------------------------------------------------------ the shell's part

    def _reader(self, k: int) -> _Reader:
        return _Reader(self, k)

    def _run_id(self) -> bytes:
        return hashlib.sha256(b"run" + struct.pack(">q", self.run_seed)).digest()[:16]

    def _end_of(self, k: int, alloc: Allocation) -> int:
        st = self.sim_stages[k][alloc.epoch]
        return min(alloc.end_step, st.stop_at) if st.stop_at is not None else alloc.end_step

    def _schedule_coordinator(self, k: int) -> None:
        coord = self.coords[k]
        if coord is None:
            return
        deadline = coord.next_deadline()
        if deadline == math.inf:
            return
        t = max(self.now, deadline - self.offsets[k])
        while t + self.offsets[k] < deadline:  # rounding: the machine must see its deadline reached
            t = math.nextafter(t, math.inf)
        if t != self._ctick_at[k]:
            self._ctick_at[k] = t
            self._push(t, ("ctick", k, t))

    def _coordinator(self, k: int, event) -> None:
        coord = self.coords[k]
        if coord is None:
            return
        for a in coord.handle(event, self.local_now(k)):
            self._execute(k, a)
        self._schedule_coordinator(k)

    def _epoch(self, k: int, event) -> None:
        epoch = self.epochs[k]
        if epoch is None:
            return
        for a in epoch.handle(event, self.local_now(k)):
            self._execute(k, a)

    def _execute(self, k: int, a: EpochAction | CoordinatorAction) -> None:
        me = self.ids[k]
        if isinstance(a, Ask):
            out = _Outstanding(a)
            self.outstanding[k][a.key] = out
            self._push(self.now + a.timeout_s, ("timeout", k, a.key))
            for p in a.peers:
                if p == me:
                    out.answers[me] = self._local_answer(k, a.msg, a.body)
                else:
                    self._transmit(k, self.index[p], ("ask", a.key, a.msg, a.body))
            self._answered(k, out)
        elif isinstance(a, Send):
            if a.peer == me:
                self._one_way(k, k, a.msg, a.body)
            else:
                self._transmit(k, self.index[a.peer], ("send", a.msg, a.body))
        elif isinstance(a, Compute):
            try:
                value, error = a.fn(), None
            except ValueError as e:
                value, error = None, str(e)
            self._coordinator(k, Computed(a.key, value, error))
        elif isinstance(a, LogLine):
            line = dict(a.line, holder=k, life=self.lives[k])
            self.train_log.append(line)
            self._check_line(line)
        elif isinstance(a, (ResetLog, Emit)):
            if isinstance(a, Emit):
                self.events.append((self.now, k, a.event, dict(a.fields)))
        elif isinstance(a, Reply):
            if self._leaving.get(k) == a.key:  # its own coordinator handed its part off
                self._leave_answered(k, {"ok": a.value} if a.error is None else {"error": a.error})
                return
            asker = self._pending_leaves.pop((k, a.key), None)
            if asker is not None:  # as control/plane.py's _on_leave answers
                self._transmit(k, asker[0], ("answer", asker[1], {"ok": a.value} if a.error is None
                                             else {"error": a.error}))
                return
            self.replies[k][a.key] = a
        elif isinstance(a, WaitForCoordinator):
            self._push(min(self.now + RETRY_S, a.until - self.offsets[k]), ("reoffer", k, a.offer))
        elif isinstance(a, EndEpoch):
            st = self.sim_stages[k].get(a.epoch)
            if st is not None and not st.ended:
                st.ended = True
                self._epoch(k, EpochDone(a.epoch))
        elif isinstance(a, ApplyToElection):
            self._apply(k, a)
        elif isinstance(a, PersistApplied):
            self.disk_alloc[k] = a.alloc
        elif isinstance(a, BuildStage):
            self._build(k, a)
        elif isinstance(a, StartRunner):
            st = self.sim_stages[k].get(a.epoch)
            if st is not None:
                st.started = True
        elif isinstance(a, StopRunnerAt):
            st = self.sim_stages[k].get(a.epoch)
            if st is not None and not st.ended:
                st.stop_at = max(a.step, st.at)
                self._run_to_stops(st.alloc)
        elif isinstance(a, AbortRunner):
            cur = self.epoch(k).current
            st = self.sim_stages[k].get(cur.epoch) if cur is not None else None
            if st is not None and not st.ended:
                if st.started:
                    self._end_runner(k, st, RunEnd(st.at - 1, a.reason, True))
                else:
                    st.ended = True
                    self._epoch(k, EpochDone(st.alloc.epoch))
        elif isinstance(a, FailNeighbour):
            pass  # its next step fails in `train`
        elif isinstance(a, KeepStage):
            self._keep(k, a.run_id)
        else:
            assert_never(a)

    def _answered(self, k: int, out: _Outstanding, complete: bool = False) -> None:
        if not complete and len(out.answers) < len(out.ask.peers):
            return
        self.outstanding[k].pop(out.ask.key, None)
        replies = {p: out.answers[p] if p in out.answers else NoAnswer(f"no answer within {out.ask.timeout_s:g} s")
                   for p in out.ask.peers}
        self._coordinator(k, Answers(out.ask.key, read_answers(out.ask.msg, out.ask.body, replies)))

    def _answer(self, k: int, src: int, key: tuple, msg: int, body: dict) -> None:
        """Node k answers node src's request (once its reply is known: an allocation waits for
        its coordinator and its stage)."""
        self._seq += 1
        if msg == ControlMsg.ALLOCATION and k in self.refusing:
            self._transmit(k, src, ("answer", key, dict(REFUSING)))
            return
        if msg == ControlMsg.ALLOCATION:
            local = ("alloc", self._seq)
            self._offer_signed(k, local, body, reply_to=(src, key))
            return
        if msg == ControlMsg.LEAVE:  # the sender's own leave (the transport authenticated it)
            try:
                inputs.leave_request(body)
            except ProtocolError as e:
                self._refuse(k, src, f"request {msg}: {e}")
                return
            local = ("leave", self._seq)
            self._pending_leaves[(k, local)] = (src, key)
            self._coordinator(k, PeerLeaving(local, self.ids[src]))
            return
        try:
            answer = self._handle_request(k, self.ids[src], msg, body)
        except ProtocolError as e:
            self._refuse(k, src, f"request {msg}: {e}")
            return
        self._transmit(k, src, ("answer", key, answer))

    def _refuse(self, k: int, src: int, why: str) -> None:
        self.refused.append((k, src, why))
        del self.refused[:-64]

    def _local_answer(self, k: int, msg: int, body: dict) -> dict:
        if msg == ControlMsg.ALLOCATION:
            self._seq += 1
            local = ("alloc", self._seq)
            self._offer_signed(k, local, body, reply_to=None)
            reply = self.replies[k].pop(local, None)
            if reply is None:  # waits for a coordinator it does not know: it is its own, so it does not
                return AllocationAnswer.refused("not-coordinator", "not recognised").to_wire()
            return reply.value.to_wire()
        return self._handle_request(k, self.ids[k], msg, body)

    def _handle_request(self, k: int, sender: bytes, msg: int, body: object) -> dict:
        """Node k's answer to `sender`'s request: the body checked by the plane's input layer
        (control/inputs.py, ProtocolError), as the daemon's handlers check it, then the machines."""
        epoch = self.epoch(k)
        self._seq += 1
        key = ("req", self._seq)
        if msg == ControlMsg.START:
            self._epoch(k, inputs.start_asked(key, sender, body))
        elif msg == ControlMsg.STOP:
            cur = epoch.current
            ev, learn = inputs.stop_asked(key, sender, body, current_run=cur.run_id if cur is not None else None,
                                          coordinator=self.node(k).coordinator)
            if learn is not None:
                self._run(k, self.node(k).learn(learn, self.local_now(k)))
            self._epoch(k, ev)
        elif msg == ControlMsg.RUN_STATE:
            return self._run_state_asked(k, sender, body)
        else:
            raise ProtocolError(f"no handler for message {msg}")
        reply = self.replies[k].pop(key)
        return reply.value.to_wire()

    def _run_state_asked(self, k: int, sender: bytes, body: object) -> dict:
        epoch = self.epoch(k)
        me = self.ids[k]
        coordinator = self.node(k).coordinator
        req = inputs.run_state_request(sender, body, coordinator=coordinator)
        if isinstance(req, inputs.Query):
            refused = epoch.check_run_state_reader(sender)
            if refused is not None:
                return {"error": refused.text}
            cur = epoch.current
            return epoch.run_state(self._checkpoints_of(k, cur.run_id if cur is not None else None)).to_wire()
        if isinstance(req, ReachRequest):
            if sender not in (coordinator, me):
                return {"error": "only the coordinator asks a peer to reach others"}
            live = {self.ids[j] for j in self.reachable(k)}
            peers = sorted(set(req.peers) - {me})
            return ReachAnswer(tuple(p for p in peers if p in live), tuple(p for p in peers if p not in live)).to_wire()
        if isinstance(req, inputs.Keep):
            refused = epoch.check_offer_asker(sender)
            if refused is not None:
                return {"error": refused.text}
            return {"kept": self._keep(k, req.run_id)}
        if not isinstance(req, inputs.Offer):  # (a coordinator's progress and an operator's export)
            raise ProtocolError(f"RUN_STATE: {type(req).__name__.lower()} is not simulated")
        # (req.fetchers: no fetch in the simulation, the content store stands for it)
        if req.learn is not None:
            self._run(k, self.node(k).learn(req.learn, self.local_now(k)))
        refused = epoch.check_offer_asker(sender)
        if refused is not None:
            return {"error": refused.text}
        layers, step = req.layers, req.step
        weights = self._held(k, req.run_id, layers, step)
        if weights is None:
            return OfferAnswer(None, reason="not held here").to_wire()
        digest = hashlib.sha256(repr((tuple(layers), step)).encode() + weights).hexdigest()
        self.content[digest] = weights
        return OfferAnswer(digest, 1).to_wire()

    def _offer_signed(self, k: int, key: tuple, body: object, reply_to: tuple[int, tuple] | None) -> None:
        if reply_to is not None:
            self._pending_allocs[(k, key)] = reply_to
        try:
            alloc, cert = inputs.signed_allocation(body)
        except ProtocolError as e:  # as the daemon's _accept_signed answers
            self.replies[k][key] = Reply(key, inputs.bad_allocation(e))
            self._flush_reply(k, key)
            return
        live = frozenset(self.ids[j] for j in self.reachable(k))
        ctx = AcceptContext(me=self.ids[k], live=live, known_presets=PRESETS, data_hash=DATA_HASH, data_name="sim",
                            known=frozenset(self.ids))
        self._epoch(k, AllocationOffered(key, alloc, ctx, certificate=cert))
        self._flush_reply(k, key)

    def _flush_reply(self, k: int, key: tuple) -> None:
        target = self._pending_allocs.get((k, key))
        reply = self.replies[k].get(key)
        if target is None or reply is None:
            return
        del self._pending_allocs[(k, key)]
        del self.replies[k][key]
        src, remote_key = target
        self._transmit(k, src, ("answer", remote_key, reply.value.to_wire()))

    def _one_way(self, k: int, src: int, msg: int, body: object) -> None:
        """A one-way message to node k, checked by the plane's input layer as the daemon's
        _on_step checks it."""
        if msg != ControlMsg.STEP:
            self._refuse(k, src, f"no one-way message {msg}")
            return
        try:
            event = inputs.step_message(self.ids[src], body)
        except ProtocolError as e:
            self._refuse(k, src, str(e))
            return
        self._coordinator(k, event)

    def _apply(self, k: int, a: ApplyToElection) -> None:
        node = self.nodes[k]
        assert node is not None
        cur = self.epoch(k).current
        assert cur is not None  # the machine applies the allocation before it says so
        issuer = self.index.get(cur.issuer)
        if issuer not in self.elected(a.term) and not (issuer in self.liars and self._certified(
                a.certificate, a.term, cur.issuer) is None):
            self._violation(f"node {k} applied term {a.term} of {short_id(cur.issuer)}, "
                            "not the coordinator elected in it")
        if (a.term, a.epoch) <= self.disk_applied[k]:
            self._violation(f"node {k} applied ({a.term}, {a.epoch}) after {self.disk_applied[k]}")
        self.allocations[(a.term, a.epoch)] = cur
        self.disk_applied[k] = (a.term, a.epoch)
        self.applied[k].append((a.term, a.epoch))
        self.disk_council[k] = a.council
        self._run(k, node.apply_allocation(a.term, a.epoch, a.council, a.certificate, self.local_now(k)))
        node = self.node(k)
        self.disk_previous[k] = node.previous
        self.applications.append((k, (a.term, a.epoch), node.coordinator if cur.issuer != self.ids[k] else self.ids[k],
                                  node.term))

    def _build(self, k: int, a: BuildStage) -> None:
        alloc = a.alloc
        me = self.ids[k]
        weights: bytes | None
        if not alloc.holdings:
            weights = reference_weights(self.run_seed, 0) if alloc.start_step == 0 else None
        else:
            s = alloc.position(me)[1]
            layers = alloc.layer_ranges[s]
            got = []
            for h in alloc.holdings:
                if not (h.layer_range[0] < layers[1] and layers[0] < h.layer_range[1]):
                    continue  # a stage this one needs nothing of
                sources = [self.index[p] for p in h.holders if self.nodes[self.index[p]] is not None
                           and self.groups[self.index[p]] == self.groups[k]]
                w = self.content.get(h.digest)
                got.append(w if sources or me in h.holders else None)
            weights = got[0] if got and all(w is not None and w == got[0] for w in got) else None
            if got and all(w is not None for w in got) and len(set(got)) > 1:
                self._violation(f"node {k}: the holdings of epoch {alloc.epoch} are of different weights")
        if weights is None:
            self._epoch(k, BuildFailed(a.key, alloc.epoch, "build-failed", f"{short_id(me)}: no holder reachable"))
        else:
            prev = self.epoch(k).prev
            self.sim_stages[k] = {e: st for e, st in self.sim_stages[k].items()
                                  if prev is not None and prev.alloc.epoch == e}
            self.sim_stages[k][alloc.epoch] = SimStage(alloc, weights, alloc.start_step)
            self._epoch(k, StageBuilt(a.key, alloc.epoch, alloc.start_step))
        self._flush_reply(k, a.key)

    def _held(self, k: int, run_id: bytes, layers: tuple[int, int], step: int) -> bytes | None:
        held = self.epoch(k).held_at(run_id, layers, step)
        if held is not None:
            where, epoch = held
            st = self.sim_stages[k].get(epoch)
            if st is not None:
                if where == "stage" and st.at == step:
                    return st.weights
                if where == "snapshot" and st.snapshot is not None and st.snapshot[0] == step:
                    return st.snapshot[1]
        saved = self.checkpoints[k].get((run_id, layers, step))
        cur = self.epoch(k).current
        if saved is None and step == 0 and cur is not None and cur.run_id == run_id:
            return reference_weights(self.run_seed, 0)  # the run's initial weights, rebuilt from its seed
        return saved

    def _keep(self, k: int, run_id: bytes) -> list[list[int]]:
        """What node k holds of run `run_id` in memory goes to its disk (the daemon's
        `StageHost.keep`): its stage and snapshot, once its worker stopped, step 0 aside."""
        epoch, kept = self.epoch(k), []
        for rec in (epoch.run, epoch.prev):
            if rec is None or not rec.built or rec.alloc.run_id != run_id or rec.active:
                continue
            layers = rec.alloc.layer_ranges[rec.alloc.position(self.ids[k])[1]]
            for step in sorted(x for x in (rec.at, rec.prev) if x):
                key = (run_id, layers, step)
                w = self._held(k, run_id, layers, step)
                if w is None or key in self.checkpoints[k]:
                    continue
                self.checkpoints[k][key] = w
                self.checkpoint_reports[k][key] = tuple(r for r in epoch.reports if r.step < step)
                kept.append([layers[0], layers[1], step])
        return kept

    def _checkpoints_of(self, k: int, run_id: bytes | None) -> tuple[tuple[int, int, int], ...]:
        if run_id is None:
            return ()
        out = sorted((a, b, step) for (r, (a, b), step) in self.checkpoints[k] if r == run_id)
        return tuple(out[-MAX_CHECKPOINTS:])

    def _complete(self, k: int, epoch: int) -> None:
        st = self.sim_stages[k][epoch]
        step = st.at
        st.snapshot = (step, st.weights)
        st.weights, st.at = _next_weights(st.weights, step), step + 1
        last = st.alloc.position(self.ids[k])[1] == st.alloc.stages - 1  # the loss: on last stages only
        rep = StepReport(epoch, step, reference_loss(st.weights) if last else None, 0.1, 0.05, 0.03, 0.02)
        if self.checkpoint_every and st.at % self.checkpoint_every == 0:
            s = st.alloc.position(self.ids[k])[1]
            key = (st.alloc.run_id, st.alloc.layer_ranges[s], st.at)
            self.checkpoints[k][key] = st.weights
            self.checkpoint_reports[k][key] = (*(r for r in self.epoch(k).reports if r.step < step), rep)
        self._epoch(k, StepDone(rep))
        if st.at >= self._end_of(k, st.alloc):
            reason = "finished" if st.at >= st.alloc.end_step else "stopped"
            self._end_runner(k, st, RunEnd(step, reason, False))

    def _end_runner(self, k: int, st: SimStage, end: RunEnd) -> None:
        if st.ended:
            return
        st.ended = True
        self._epoch(k, RunnerEnded(st.alloc.epoch, end, self.now))
        self._epoch(k, EpochDone(st.alloc.epoch))

    def _check_line(self, line: dict) -> None:
        want = reference_loss(reference_weights(self.run_seed, line["step"] + 1))
        if line["loss"] is None and line.get("backfilled"):
            return  # no last-stage peer that reported the step answered: the loss is taken from no other
        alloc = self.allocations.get((line["term"], line["epoch"]))
        liar = self.ids[self.byzantine] if self.byzantine is not None and self.liars_run else None
        if line["loss"] != want and alloc is not None and liar in {p[-1] for p in alloc.pipelines}:
            self.liar_losses.append(line)  # the insider computes this loss: it may lie about it
            del self.liar_losses[:-64]
        elif line["loss"] != want:
            self._violation(f"node {line['holder']} logged step {line['step']} with loss {line['loss']}, "
                            f"the reference gives {want}")


class _Reader:
    """Node k's ElectionState as the machines read it."""

    def __init__(self, sim: PlaneSim, k: int):
        self.sim, self.k = sim, k

    @property
    def _node(self) -> ElectionState:
        node = self.sim.nodes[self.k]
        assert node is not None
        return node

    @property
    def term(self) -> int:
        return self._node.term

    @property
    def coordinator(self) -> bytes | None:
        return self._node.coordinator

    @property
    def voters(self) -> tuple[bytes, ...]:
        return self._node.voters

    @property
    def last_applied(self) -> tuple[int, int]:
        return self._node.last_applied

    @property
    def is_coordinator(self) -> bool:
        return self._node.role is ElectionRole.COORDINATOR

    @property
    def is_follower(self) -> bool:
        return self._node.role is ElectionRole.FOLLOWER

    @property
    def certificate(self) -> Certificate | None:
        return self._node.certificate

    @property
    def council(self) -> Council | None:
        return self._node.council

    def may_apply(self, issuer: bytes, term: int, epoch: int, certificate: Certificate | None = None,
                  council: Council | None = None) -> Refusal | None:
        return self._node.may_apply(issuer, term, epoch, certificate, council)

    def council_for(self, voters: Iterable[bytes], epoch: int) -> Council | None:
        return self._node.council_for(tuple(sorted(voters)), epoch)

