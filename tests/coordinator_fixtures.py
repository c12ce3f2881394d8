"""The shell around one coordinator, n0, that the coordinator's tests play
(tests/control/coordinator/test_coordinator_machine.py, tests/control/coordinator/test_coordinator_deadline.py): `Node` drives n0's
coordinator and epoch machine with a hand-set election, a fake swarm and a fake planner, and
keeps the requests out and the transcript (tests/machine_trace.py writes its lines); with the
placements, digests, operator ops and RUN_STATE answers those tests feed it.
"""

from __future__ import annotations

import dataclasses
import itertools

from machine_trace import (
    DATA_HASH,
    DATA_NAME,
    KEYS,
    OPERATOR,
    OPERATORS,
    RUN,
    FakeElection,
    N,
    context,
    describe,
    label,
    report,
    same_transcript,
    show,
    start_op,
)

from dtfm.control import ControlMsg, Placement, ReshapePlan, SignedAllocation, SignedOp, inputs, sign_op
from dtfm.control.actions import Answers, Ask, Compute, Computed, Reply
from dtfm.control.answers import NoAnswer, read_answers
from dtfm.control.coordinator.links import used_cut_links
from dtfm.control.coordinator.machine import Coordinator, CoordinatorTick, CoordinatorTimings, StartRun, StepReported
from dtfm.control.epoch.machine import (
    AbortRunner,
    AllocationOffered,
    ApplyToElection,
    BuildStage,
    EndEpoch,
    EpochDone,
    EpochEvent,
    EpochMachine,
    EpochPhase,
    StageBuilt,
    StartAsked,
)

ME = N[0]
WALL = 1.7e9  # a wall clock for the operators' times: the machine's `now` 0 is this time (Node(wall=WALL))
TIMINGS = CoordinatorTimings(accept_timeout_s=5.0, request_timeout_s=1.0, stop_timeout_s=3.0, check_interval_s=2.0,
                             drift_check_s=1000.0, report_gather_s=0.5, probe_timeout_s=1.0, paused_retry_s=20.0,
                             stop_poll_s=0.25, max_reconfig_attempts=3,
                             join_settle_s=0.0, join_wait_max_s=0.0,  # (a joiner is taken at once; see joins.py)
                             first_drift_steps=0)  # (every drift check at drift_check_s)


class View:
    """The gossiped view as the fake planner needs it: its peers."""

    def __init__(self, peers):
        self.peers = tuple(sorted(peers))
        self.complete = True


class FakeSwarm:
    """Gossip as the coordinator reads it: `live` (without n0) and `known`, every link measured
    but those of `unmeasured`."""

    def __init__(self, live, known=N[:5]):
        self.live, self.known, self.unmeasured = set(live), set(known), set()
        self.incarnation: dict[bytes, int] = {}  # a peer's gossiped incarnation (0 when not set)

    def live_peers(self):
        return sorted(self.live)

    def known_peers(self):
        return sorted(self.known)

    def regions(self):
        return {p: "r" for p in self.known}

    def view(self):
        return View(self.live | {ME})

    def measured_view(self, candidates):
        c = set(candidates)
        return View(c - self.unmeasured), sorted(c & self.unmeasured)

    def incarnations(self):
        return {p: self.incarnation.get(p, 0) for p in self.known}


class FakePlanner:
    """The scheduler's stand-in: the live peers, sorted, in pipelines of the run's stages, the
    rest spares; each call is kept in `calls`. `error`: raise it as the scheduler's ValueError."""

    def __init__(self):
        self.calls: list[dict] = []
        self.kind = "reschedule"
        self.error: str | None = None
        self.first: Placement | None = None  # a new run's placement
        self.firsts: list[dict] = []  # the calls for it

    def first_placement(self, view, req, model, train, regions):
        self.firsts.append({"peers": sorted(view.peers), "stages": req.stages, "dp": req.dp})
        if self.error is not None:
            raise ValueError(self.error)
        assert self.first is not None
        first, peers = self.first, sorted(view.peers)
        if {p for pipe in first.pipelines for p in pipe} <= set(peers):
            return first
        stages = len(first.layer_ranges)  # (a peer of `first` is not in the view: the same shape over the others)
        dp = len(peers) // stages
        return Placement(tuple(tuple(peers[d * stages:(d + 1) * stages]) for d in range(dp)), first.layer_ranges,
                         tuple(peers[dp * stages:]), 1.0, 1.0)

    def reshape(self, view, cur, *, live, remaining_steps, regions, seed, force, cut=frozenset()):
        self.calls.append({"live": sorted(live), "remaining_steps": remaining_steps, "seed": seed, "force": force})
        if cut:
            self.calls[-1]["cut"] = sorted(cut)
        if self.error is not None:
            raise ValueError(self.error)
        stages = len(cur.layer_ranges)
        if len(live) < stages:  # (the scheduler would restage; this stand-in keeps S)
            raise ValueError(f"no allocation fits the {len(live)} live peers")
        dp = len(live) // stages
        # the first order of the live peers (sorted, then its permutations) whose pipelines use
        # no cut link, else sorted
        orders = itertools.permutations(sorted(live)) if cut else iter([tuple(sorted(live))])
        ps = next((o for o in orders if not used_cut_links(
            [o[d * stages:(d + 1) * stages] for d in range(dp)], cut)), tuple(sorted(live)))
        placement = Placement(tuple(tuple(ps[d * stages:(d + 1) * stages]) for d in range(dp)), cur.layer_ranges,
                              tuple(ps[dp * stages:]), 2.0, 2.0)
        return ReshapePlan(placement, self.kind, 0, 0, 0.0, 0.0, ())


class Node:
    """n0: its election (set by the test), its epoch machine and its coordinator, with the
    requests the coordinator has out (by label) and the transcript."""

    def __init__(self, *, live=N[1:4], voters=N[:4], timings: CoordinatorTimings = TIMINGS, wall: float = 0.0):
        self.election = FakeElection(ME, term=1, coordinator=ME, voters=tuple(voters))
        self.epoch = EpochMachine(ME, self.election, heartbeat_wait_s=1.0, coordinator_lost_after_s=10.0,
                                  operators=OPERATORS, wall_offset=wall)
        self.swarm = FakeSwarm(live)
        self.planner = FakePlanner()
        self.c = Coordinator(ME, lambda a: SignedAllocation.sign(a, KEYS[0]), self.election, self.epoch, self.swarm,
                             self.planner, timings, wall_offset=wall, operators=OPERATORS)
        self.wall = wall
        self.now = 0.0
        self.asks: dict[str, Ask] = {}
        self.computes: dict[str, Compute] = {}
        self.lines: list[str] = []
        self._phase = self.c.phase
        self._keys = 0

    # ---- inputs ---------------------------------------------------------------------------------

    def feed(self, event, at: float | None = None) -> list:
        if at is not None:
            assert at >= self.now
            self.now = at
        actions = self.c.handle(event, self.now)
        self.lines.append(f"{self.now:g} {describe(event)}")
        for a in actions:
            if isinstance(a, Ask):
                assert label(a.key) not in self.asks, f"two requests {label(a.key)} out"
                self.asks[label(a.key)] = a
            elif isinstance(a, Compute):
                self.computes[label(a.key)] = a
            self.lines.append("  " + show(a))
        if self.c.phase is not self._phase:
            self._phase = self.c.phase
            self.lines.append(f"  phase: {self._phase.value}")
        return actions

    def tick(self, at: float | None = None) -> list:
        """A Tick at `at`, by default at the machine's next deadline."""
        return self.feed(CoordinatorTick(), self.c.next_deadline() if at is None else at)

    def answer(self, what: str, given: dict[bytes, dict] | None = None, at: float | None = None, *,
               everyone: dict | None = None) -> list:
        """The answers to the request `what`: `given` per peer, or `everyone`'s; n0 answers
        ALLOCATION, START and STOP itself; any other peer not given did not answer in time."""
        ask = self.asks.pop(what)
        given = dict(given or {})
        out: dict[bytes, object] = {}
        for p in ask.peers:
            if p in given:
                out[p] = given[p]
            elif p == ME and ask.msg in (ControlMsg.ALLOCATION, ControlMsg.START, ControlMsg.STOP):
                out[p] = self.local(ask)
            elif everyone is not None:
                out[p] = everyone
            else:
                out[p] = NoAnswer(f"no answer within {ask.timeout_s:g} s")
        return self.feed(Answers(ask.key, read_answers(ask.msg, ask.body, out)), at)

    def compute(self, what: str = "plan", at: float | None = None) -> list:
        c = self.computes.pop(what)
        try:
            done = Computed(c.key, c.fn())
        except ValueError as e:
            done = Computed(c.key, error=str(e))
        return self.feed(done, at)

    def local(self, ask: Ask) -> dict:
        """n0's own answer, through the plane's input layer and its epoch machine (what the
        shell's local answer does; a runner told to abort before it started is cancelled at
        once)."""
        self._keys += 1
        key = ("local", self._keys)
        if ask.msg == ControlMsg.START:
            event: EpochEvent = inputs.start_asked(key, ME, ask.body)
        elif ask.msg == ControlMsg.STOP:
            cur = self.epoch.current
            event, learn = inputs.stop_asked(key, ME, ask.body, current_run=cur.run_id if cur is not None else None,
                                             coordinator=self.election.coordinator)
            assert learn is None  # (n0 is its own coordinator)
        else:
            a, cert = inputs.signed_allocation(ask.body)
            event = AllocationOffered(key, a, context(ME, live=self.swarm.live | {ME}), certificate=cert)
        pending, reply = [event], None
        while pending:
            for x in self.epoch.handle(pending.pop(0), self.now):
                if isinstance(x, ApplyToElection):
                    self.election.apply(x)
                elif isinstance(x, EndEpoch):
                    pending.append(EpochDone(x.epoch))
                elif isinstance(x, AbortRunner) and self.epoch.status().phase is EpochPhase.ACCEPTED:
                    pending.append(EpochDone(self.epoch.run.alloc.epoch))  # a runner not started is cancelled
                elif isinstance(x, BuildStage):
                    pending.append(StageBuilt(x.key, x.alloc.epoch, x.alloc.start_step))
                elif isinstance(x, Reply):
                    reply = x.value.to_wire()  # (the epoch machine's typed answer, as the shell sends it)
        assert isinstance(reply, dict)
        return reply

    def local_epoch(self, a) -> None:
        """n0's epoch machine applies, builds and starts `a` (handed out by another coordinator)."""
        reply = self.local(Ask(("setup",), (ME,), ControlMsg.ALLOCATION, SignedAllocation.sign(
            a, KEYS[N.index(a.issuer)]).to_wire(), 1.0))
        assert reply["accepted"], reply
        self.epoch.handle(StartAsked(("setup",), a.issuer, a.run_id, a.epoch), self.now)

    def autopilot(self, until: float, refusing: dict[bytes, dict] | None = None, *,
                  step: float = 0.01) -> list[tuple[float, Ask]]:
        """Every peer answers whatever the machine asks, at once (`step` later), until `until`:
        the peers of the current epoch hold its stages at step 2, every other peer holds
        nothing, every holder offers, every peer accepts an allocation but those of `refusing`,
        which answer it so. The allocations handed out, in order, with their times."""
        handed: list[tuple[float, Ask]] = []
        refusing = refusing or {}
        while self.now < until:
            if self.computes:
                self.compute(next(iter(self.computes)), self.now + step)
                continue
            if not self.asks:
                self.tick(min(self.c.next_deadline(), until))
                continue
            what = next(iter(self.asks))
            ask = self.asks[what]
            alive = [p for p in ask.peers if p in self.swarm.live or p == ME]  # (the others do not answer)
            if what == "alloc":
                handed.append((self.now, ask))
                given = {p: refusing.get(p, {"accepted": True, "role": "stage"}) for p in alive if p != ME}
            elif ask.msg == ControlMsg.RUN_STATE and ask.body.get("op") == "offer":
                digest = D01 if tuple(ask.body["layers"]) == (0, 2) else D23
                given = {p: {"digest": digest, "bytes": 1} for p in alive}
            elif ask.msg == ControlMsg.RUN_STATE:
                given = {p: self.held(p) for p in alive}
            elif ask.msg == ControlMsg.START:
                given = {p: {"started": True} for p in alive if p != ME}
            else:
                given = {p: {"stopped": True} for p in alive if p != ME}
            self.answer(what, given, self.now + step)
        return handed

    def held(self, p: bytes) -> dict:
        """`p`'s RUN_STATE answer in `autopilot`: its stage of n0's current epoch at step 2."""
        cur = self.epoch.current
        if cur is None or p not in cur.peers:
            return state(None, None, run=b"", epoch=0)
        d, s = cur.position(p)
        return state(cur.layer_ranges[s], 2, epoch=cur.epoch)

    def transcript(self, want: str) -> None:
        same_transcript(self.lines, want)
        self.lines.clear()

    # ---- set-ups --------------------------------------------------------------------------------

    def train_start(self, placement: Placement, at: float = 0.0, steps: int = 100) -> list:
        """The operator's start of RUN, signed at `at`; the first placement (`placement`) is
        computed at once."""
        self.planner.first = placement
        out = self.feed(StartRun(("op", "start"), start_op(steps=steps, at_s=self.wall + at), DATA_HASH, DATA_NAME), at)
        if "first" in self.computes:
            out += self.compute("first", at)
        return out

    def training(self, steps: int = 2, *, run_steps: int = 100) -> float:
        """Train start of 2 x 2 over n0..n3 (a run of `run_steps` steps), every peer accepts and
        starts; every peer reports steps 0..`steps`-1 at 1 s intervals from t = 1, each logged.
        The time of the last report (1 when there is none)."""
        self.train_start(PLACEMENT, steps=run_steps)
        self.answer("alloc", everyone={"accepted": True, "role": "stage"}, at=0.1)
        self.answer("start", everyone={"started": True}, at=0.2)
        t = 1.0
        for s in range(steps):
            t = 1.0 + s
            for p in N[:4]:
                self.feed(StepReported(p, RUN, stage_report(p, 1, s)), t)
        self.lines.clear()
        return t


def stage_report(peer: bytes, epoch: int, step: int):
    """`peer`'s report in PLACEMENT: the loss on the last stages (n1, n3) only, as a runner's."""
    r = report(epoch, step)
    return r if peer in (N[1], N[3]) else dataclasses.replace(r, loss=None)


D01, D23 = "01" * 32, "23" * 32  # digests of offered stages


def reschedule_op(at: float, run: bytes = RUN, key=OPERATOR, wall: float = 0.0) -> SignedOp:
    """The operator's reschedule of `run`, signed at the machine's time `at` (of a Node(wall=wall))."""
    return sign_op(key, "reschedule", now_s=wall + at, run_id=run)


def resume_op(at: float, run: bytes = RUN, key=OPERATOR, wall: float = 0.0) -> SignedOp:
    return sign_op(key, "resume", now_s=wall + at, run_id=run)


def stop_op(at: float, run: bytes = RUN, key=OPERATOR, wall: float = 0.0) -> SignedOp:
    return sign_op(key, "stop", now_s=wall + at, run_id=run)
PLACEMENT = Placement(((N[0], N[1]), (N[2], N[3])), ((0, 2), (2, 4)), (), 1.0, 1.0)


def state(layers: tuple[int, int] | None, at: int | None, *, prev: int | None = None, running: bool = False,
          epoch: int = 1, run: bytes = RUN, reports=(), checkpoints=()) -> dict:
    """A peer's RUN_STATE answer."""
    return {"run": run, "term": 1, "epoch": epoch, "layers": list(layers) if layers else None, "at": at,
            "prev": prev if prev is not None else (at - 1 if at else None), "running": running,
            "checkpoints": [list(c) for c in checkpoints], "reports": [r.to_wire() for r in reports]}
