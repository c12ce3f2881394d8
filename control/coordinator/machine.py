"""The coordinator side of the control plane as a sans-IO machine (see docs/control.md, "The
coordinator machine").

`Coordinator` owns what the coordinator decides while the election makes this peer one: the
hand-out of an allocation (ALLOCATION, then START), the step log of the epoch it handed out,
and reconfiguration: triggers, the phases STOPPING -> PLANNING -> OFFERING -> HANDING_OUT ->
TRAINING (or PAUSED, STOPPED), the retry count, the pause and its retry time, the drift timer,
the next configuration of voters, the common stop boundary and the offers' majority digest, the
failed-step reports waiting for a check of the run states (failures.py) and the STEP input it
refused (`refusals`).
It asks peers (`Ask`) and runs the scheduler (`Compute`) through the shell, which feeds the
answers back; it reads the election, this peer's epoch machine and the gossiped swarm, and
changes none of them.

Operator operations (`StartRun`, `Reschedule`, `ResumeRun`, `StopRun`) carry the operator's signed
operation (control/operator.py). Each is refused at once, before any costly work (the scheduler's
`Compute`, an `Ask`), unless it is signed by an operator of the swarm, for the run it acts on,
within the clock-skew window, not taken before, and no other operation of its kind is waiting; a
stop, resume or reschedule also only when signed after the run's last resume or reschedule, which
every later allocation of the run carries (`last_op_ms`), so a new coordinator knows it.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dtfm.gossip import NetworkView
from dtfm.net import ProtocolError, short_id
from dtfm.train import CompressionConfig, GPTSpec, LinkCodecs, TrainConfig, get_preset

from ..actions import Answers, Ask, Compute, Computed, CoordinatorAction, Emit, LogLine, Reply, ResetLog
from ..allocation import Allocation, Holding, SignedAllocation
from ..election import quorum
from ..epoch.machine import AbortRunner, ElectionView, EpochMachine
from ..epoch.report import StepReport
from .counters import RunCounters, RunCounts
from ..epoch.runstate import PeerRunState, ResumeError, ResumePoint, describe, resume_point
from ..events import EventKind, LeftOutPeer, PlaneEvent, Reconfiguration
from ..messages import ControlMsg
from .deadline import DeadlineRules, StepWatch, judge, laggards, missed_deadline, probe_targets
from .links import CutLinks, ReachAnswer, ReachRequest, used_cut_links
from ..operator import OperatorError, OperatorOp, SignedOp, check_op, check_time
from .request import TrainRequest
from ..refusals import Refusals, Refused
from .failures import FailedSteps
from .joins import JoinWave
from .leftout import LeftOut
from .reshape import ReshapePlan
from .schedule import Placement
from .steplog import StepLog

__all__ = [
    "MAX_OFFER_HOLDERS", "Coordinator", "CoordinatorStatus", "CoordinatorTimings", "Elected", "PeerLeaving", "Phase",
    "Planner", "Reschedule", "ResumeRun", "StartRun", "StepFailed", "StepReported", "SteppedDownEvent", "StopRun", "Swarm", "Tick", "Trigger",
    "Wake", "resume_refusal",
]

logger = logging.getLogger(__name__)

MAX_OFFER_HOLDERS = 64  # holders of one stage asked to offer it (each then keeps its own copy)
MAX_ABSENT = 4096
MAX_STARTS_KEPT = 64  # run ids of signed starts taken, kept while they could be replayed
MAX_LEAVING = 64  # peers that announced a planned leave, remembered (each for leaving_kept_s)
STALL_STEPS = 3  # steps' time without a completed step after which a failed report stands
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_REFUSAL_CODE = re.compile(r"[a-z][a-z-]{0,31}")
# Refusals of peers whose gossip does not agree with the coordinator's yet (a peer that just
# returned, one just declared dead): gossip converges, so they are retried without counting.
MEMBERSHIP_REFUSALS = frozenset({"not-covered", "dead-peer", "unknown-peer"})


class Phase(enum.Enum):
    IDLE = "idle"  # no run handed out by this peer
    HANDING_OUT = "handing out"
    TRAINING = "training"
    STOPPING = "stopping"  # a reconfiguration stops the epoch at a common step boundary
    PLANNING = "planning"  # resume point and the new layout
    OFFERING = "offering"  # holders offer the stages at the resume step
    PAUSED = "paused"  # some stage has no reachable holder: waits for one
    REFUSED = "refused"  # a peer refused the hand-out
    STOPPED = "stopped"  # the run cannot go on
    FINISHED = "finished"


class Swarm(Protocol):
    """What the coordinator reads of the gossiped swarm."""

    def live_peers(self) -> Iterable[bytes]: ...
    def known_peers(self) -> Iterable[bytes]: ...
    def regions(self) -> dict[bytes, str]: ...
    def view(self) -> NetworkView: ...
    def measured_view(self, candidates: Iterable[bytes]) -> tuple[NetworkView, list[bytes]]: ...
    def incarnations(self) -> Mapping[bytes, int]: ...


class Planner(Protocol):
    """The scheduler, as the coordinator calls it (off the event loop: see `Compute`)."""

    def reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                regions: dict[bytes, str], seed: int, force: bool,
                cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan: ...

    def first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                        regions: dict[bytes, str]) -> Placement: ...


@dataclass(frozen=True)
class CoordinatorTimings:
    accept_timeout_s: float
    request_timeout_s: float
    stop_timeout_s: float
    check_interval_s: float
    drift_check_s: float
    report_gather_s: float
    probe_timeout_s: float
    paused_retry_s: float
    stop_poll_s: float
    max_reconfig_attempts: int
    deadline: DeadlineRules | None = None  # the step deadline (None: steps are not watched)
    deadline_probe_timeout_s: float = 4.0  # a laggard answers a deadline probe within this
    link_retest_s: float = 2.0  # a cut link is pinged again this often
    # An operator's signed operation is taken this long before or after its time (clock skew;
    # a start also for its --min-peers wait after it): an older one is not taken again.
    operator_skew_s: float = 300.0
    # A peer that announced a planned leave is kept out of allocations this long (it leaves
    # gossip at once once handed off; a peer that comes back later is placed again).
    leaving_kept_s: float = 120.0
    # The council the coordinator aims for (3, 5 or 7 voters; control/election/council.py): more
    # voters survive more crashes (5: one, 7: two) at the cost of more votes per election.
    council_size: int = 5
    # A peer that refuses an allocation the others accept (or does not answer it) is left out of
    # the next attempts this long, doubled with each refusal in a row up to the max (see
    # leftout.py): shorter places an honest peer whose trouble passed sooner, at a failed
    # hand-out and a reconfiguration per refusal of a peer that keeps refusing.
    refused_backoff_s: float = 30.0
    refused_backoff_max_s: float = 600.0
    # Joined peers are taken in as a wave (joins.py): once no other peer joined for
    # join_settle_s, or the first of the wave waited join_wait_max_s. Shorter places a lone
    # joiner sooner, at a reconfiguration (a stop of the run) per join of a growing swarm.
    join_settle_s: float = 10.0
    join_wait_max_s: float = 60.0


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Wake:
    """A member joined or came back: look at once instead of at the next check."""


@dataclass(frozen=True)
class Trigger:
    """Something calls for a reconfiguration: a peer of the allocation lost, a step failed."""

    reason: str


@dataclass(frozen=True)
class StepReported:
    peer: bytes
    run_id: object
    report: StepReport


@dataclass(frozen=True)
class StepFailed:
    peer: bytes
    run_id: object
    epoch: object
    reason: str


@dataclass(frozen=True)
class Elected:
    term: int


@dataclass(frozen=True)
class SteppedDownEvent:
    term: int
    reason: str


@dataclass(frozen=True)
class StartRun:
    """`train start` on the coordinator: the operator's signed start, and this peer's own data
    set (the run trains on it, so it must be the one the start names); answered by
    `Reply(key, allocation)`."""

    key: tuple
    op: SignedOp | None
    data_hash: str
    data_name: str
    # The run's model when it is no built-in preset: the shape of the Hugging Face folder the
    # start names by digest (`init_from`), which this peer holds; None: the start's preset.
    model: GPTSpec | None = None


@dataclass(frozen=True)
class Reschedule:
    """An operator's signed reschedule: a new allocation now; answered by `Reply(key, record)`."""

    key: tuple
    op: SignedOp | None = None


@dataclass(frozen=True)
class ResumeRun:
    """An operator's signed resume of a stopped run: a new epoch of the same run from its newest
    step every stage is held at (in memory or a checkpoint), with the run's own parameters;
    answered by `Reply(key, record)` (the reconfiguration's) or an error."""

    key: tuple
    op: SignedOp | None = None


@dataclass(frozen=True)
class StopRun:
    """An operator's signed stop: every peer of the run ends before the same step and the run
    is over; answered by `Reply(key, {"at_step", "told"})`."""

    key: tuple
    op: SignedOp | None = None


@dataclass(frozen=True)
class PeerLeaving:
    """A peer announces a planned leave (`dtfm-peer leave`; the shell took the peer from the
    authenticated connection it came over: only a peer itself says that it leaves). The next
    allocation leaves it out, its stages offered from its memory; answered by
    `Reply(key, {"handed_off": bool})` once no running epoch gives it a stage, or an error."""

    key: tuple
    peer: bytes


@dataclass(frozen=True)
class _Start:
    """A start that passed the cheap checks, waiting for the procedure in progress."""

    key: tuple
    signed: SignedOp
    op: OperatorOp
    req: TrainRequest
    data_name: str
    model: GPTSpec


CoordinatorEvent = (Tick | Wake | Trigger | StepReported | StepFailed | Elected | SteppedDownEvent | StartRun
                    | Reschedule | ResumeRun | StopRun | PeerLeaving | Answers | Computed)


# ---- procedures ------------------------------------------------------------------------------


class _Failed(Exception):
    """A procedure cannot go on, with the reason (kept inside this module)."""

    def __init__(self, reason: str, *, counts: bool = True):
        super().__init__(reason)
        self.counts = counts  # toward max_reconfig_attempts


@dataclass
class _Procedure:
    """The one hand-out or reconfiguration in progress."""

    id: int
    kind: str  # "start" | "reconfigure"
    trigger: str
    reply: tuple | None = None  # the operator request waiting on it
    force: bool = False
    cur: Allocation | None = None
    t0: float = 0.0
    marks: dict[str, float] = field(default_factory=dict)
    asked: frozenset[bytes] = frozenset()
    running: list[bytes] = field(default_factory=list)
    stop_deadline: float = 0.0
    poll_at: float | None = None
    states: dict[bytes, PeerRunState] = field(default_factory=dict)
    rp: ResumePoint | None = None
    plan: ReshapePlan | None = None
    offers: dict[tuple[int, int], Mapping[bytes, dict]] = field(default_factory=dict)
    alloc: Allocation | None = None
    answers: Mapping[bytes, dict] = field(default_factory=dict)
    refused: str = ""
    rolled_back: bool = False
    steps_lost: int = 0  # a rollback: completed (logged or reported) steps the swarm runs again
    transient: bool = False  # every refusal of the hand-out was a membership disagreement
    stuck: bool = False  # a step missed its deadline: abort it, do not wait for a boundary
    retry: list[str] = field(default_factory=list)  # triggers to keep if it fails
    start: _Start | None = None  # kind "start": the operator's start
    resume: bool = False  # an operator's resume: if it fails, the run stays stopped
    leave: bool = False  # a planned leave's hand-off: recorded as a leave, not a failure
    links_note: str = ""  # a per-link run: which links and groups compress and why (`choose_links`)
    left_out: frozenset[bytes] = frozenset()  # reachable peers not placed: they refused an allocation
    tries: int = 0  # kind "start": hand-outs placed again without peers that refused


@dataclass(frozen=True)
class CoordinatorStatus:
    """A typed snapshot for `status`: the epoch this peer handed out, and its last
    reconfiguration."""

    phase: Phase
    run_id: bytes | None
    epoch: int | None
    reason: str
    completed: int | None
    end_step: int | None
    recent: tuple[dict, ...]
    started_at: float | None
    last_reconfig: Reconfiguration | None
    stalled_since: float | None = None  # wall time of the last progress of a run that makes none
    stalled_reason: str = ""
    cut_links: str = ""  # links left out of allocations until measured healthy again
    left_out: tuple[LeftOutPeer, ...] = ()  # peers left out of allocations because they refused one
    counts: RunCounts | None = None  # what this coordinator counted of the run (control/coordinator/counters.py)


class Coordinator:
    """The coordinator's decisions (see the module docstring). `sign` signs an allocation with
    this peer's key; `wall_offset` turns the machine's `now` into wall-clock time for records and
    for the operators' signed times; `operators`: the swarm's operators' public keys."""

    def __init__(self, me: bytes, sign: Callable[[Allocation], SignedAllocation], election: ElectionView,
                 epoch: EpochMachine, swarm: Swarm, planner: Planner, timings: CoordinatorTimings, *,
                 wall_offset: float = 0.0, operators: frozenset[bytes] = frozenset()):
        self.me = me
        self.sign = sign
        self.election = election
        self.epoch = epoch
        self.swarm = swarm
        self.planner = planner
        self.t = timings
        self.wall_offset = wall_offset
        self.operators = frozenset(operators)
        self.phase = Phase.IDLE
        self.reason = ""
        self.steplog: StepLog | None = None  # the epoch this peer handed out last
        self.logged: dict[bytes, set[int]] = {}  # run id -> steps this peer logged
        self.last_reconfig: Reconfiguration | None = None
        self._triggers: list[str] = []
        self._gather_until: float | None = None  # triggers are collected until then
        self._attempts = 0
        self._paused_live: frozenset[bytes] | None = None  # reachable peers when the run paused
        self._paused_retry_at = 0.0
        self._next_check = 0.0
        self._next_drift_check = 0.0
        self._proc: _Procedure | None = None
        self._keeps = 0  # RUN_STATE keep requests made (their keys)
        self.counters = RunCounters()
        self._queue: list[_Start | Reschedule | ResumeRun | PeerLeaving] = []  # one of each kind (a leave per peer)
        self._leaving: dict[bytes, float] = {}  # peer that announced a planned leave -> kept out until
        self._starts_taken: dict[bytes, float] = {}  # run id of a signed start -> until when it could be replayed
        self._stops: dict[tuple, tuple[tuple, int]] = {}  # STOP request key -> (operator's key, boundary)
        self._operator_stop: tuple[bytes, int] | None = None  # (run, boundary) of the last operator's stop taken
        self._probe: str | None = None  # "joined" | "holders" | "epoch" | "drift" while one is out
        self._check_epoch: int | None = None  # re-elected in this term: is its epoch still running?
        self._keys = itertools.count()
        self._now = 0.0
        self.watch: StepWatch | None = None  # the step deadline of the epoch this peer started
        self.links = CutLinks()
        self._silent: frozenset[bytes] = frozenset()  # missed a deadline and a probe: not asked again
        self._stuck = False  # the next reconfiguration aborts a step that missed its deadline
        self._next_link_test = 0.0
        self._deadline_probe: tuple[int, int, tuple[bytes, ...]] | None = None  # (epoch, step, laggards)
        self.refusals = Refusals()  # STEP reports and failures refused
        self._failures = FailedSteps(self.refusals)  # failed-step reports of the current epoch
        # peers that refused an allocation: not placed until their back-off ends (leftout.py)
        self.left_out = LeftOut(timings.refused_backoff_s, timings.refused_backoff_max_s,
                                membership_codes=MEMBERSHIP_REFUSALS)
        self.joins = JoinWave(timings.join_settle_s, timings.join_wait_max_s)  # joined peers not yet taken in

    # ---- queries ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._proc is not None

    def next_deadline(self) -> float:
        """When the machine wants a Tick (it waits for answers meanwhile, not for time)."""
        if self._proc is not None:
            return self._proc.poll_at if self._proc.poll_at is not None else math.inf
        if self._probe is not None:
            return math.inf
        times = [self._next_check, self._watch_due()]
        if self._gather_until is not None:
            times.append(self._gather_until)
        if self.links:
            times.append(self._next_link_test)
        return min(times)

    def left_out_now(self, now: float) -> frozenset[bytes]:
        """The peers left out of allocations at `now` because they refused one (leftout.py)."""
        return self.left_out.out(now, self.swarm.incarnations())

    def logged_completed(self, run_id: bytes) -> int | None:
        log = self.steplog
        return log.completed if log is not None and log.alloc.run_id == run_id else None

    def status(self) -> CoordinatorStatus:
        log = self.steplog
        phase, reason, stall = self.phase, self.reason, self._stall()
        if (log is not None and phase not in (Phase.FINISHED, Phase.IDLE, Phase.STOPPED, Phase.REFUSED)
                and self.epoch.stopped_by_operator(log.alloc.run_id)):
            # A run that is over (an operator's train stop, a start that failed) is stopped
            # wherever its procedure was: not training, nor stalled while the peers run to the
            # stop's step.
            phase, stall = Phase.STOPPED, {}
            stop = self._operator_stop
            if stop is not None and stop[0] == log.alloc.run_id:
                reason = f"an operator stopped the run {stopped_after(stop[1])} (train stop)"
            else:
                reason = reason or "the run was stopped (an operator's train stop, or it could not go on)"
        return CoordinatorStatus(
            phase=phase, run_id=log.alloc.run_id if log else None, epoch=log.alloc.epoch if log else None,
            reason=reason, completed=log.completed if log else None, end_step=log.alloc.end_step if log else None,
            recent=tuple(log.recent[-8:]) if log else (), started_at=log.started_at if log else None,
            last_reconfig=self.last_reconfig, cut_links=self.links.describe(),
            left_out=self.left_out.snapshot(self._now, self.wall_offset),
            counts=self.counters.current if log is not None and self.counters.current is not None
            and self.counters.current.run_id == log.alloc.run_id else None, **stall)

    # ---- events -------------------------------------------------------------------------------

    def handle(self, event: CoordinatorEvent, now: float) -> list[CoordinatorAction]:
        self._now = now
        out: list = []
        if isinstance(event, Tick | Wake):
            if isinstance(event, Wake):
                self._next_check = now
            out += self._poll_stop(now)
        elif isinstance(event, Trigger):
            self._trigger(event.reason)
            self._next_check = now
        elif isinstance(event, StepReported):
            out += self._step(event)
        elif isinstance(event, StepFailed):
            self._step_failed(event, now)
        elif isinstance(event, Elected):
            out.append(Emit(PlaneEvent(EventKind.COORDINATOR, event.term, "elected")))
            cur = self.epoch.current
            if cur is not None and not self._over():
                if cur.issuer != self.me or self.steplog is None:
                    self._trigger(f"coordinator changed (term {event.term})")
                else:  # re-elected: its epoch may have broken while it was not the coordinator
                    self._check_epoch = event.term
                self._next_check = now
        elif isinstance(event, SteppedDownEvent):
            out.append(Emit(PlaneEvent(EventKind.STEPPED_DOWN, event.term, event.reason)))
        elif isinstance(event, StartRun):
            out += self._start_asked(event, now)
        elif isinstance(event, Reschedule):
            out += self._reschedule_asked(event, now)
        elif isinstance(event, StopRun):
            out += self._stop_asked(event, now)
        elif isinstance(event, ResumeRun):
            out += self._resume_asked(event, now)
        elif isinstance(event, PeerLeaving):
            out += self._leave_asked(event, now)
        elif isinstance(event, Answers):
            out += self._answers(event)
        elif isinstance(event, Computed):
            out += self._computed(event)
        else:
            raise TypeError(f"not a coordinator event: {event!r}")
        out += self._next(now)
        lines = [a.line for a in out if isinstance(a, LogLine)]
        if lines:
            fresh = any(not x.get("backfilled") for x in lines)
            self.counters.logged(bytes.fromhex(lines[0]["run"]), len(lines), self._wall(now) if fresh else None)
        return out

    # ---- the loop: what to do next ------------------------------------------------------------

    def _next(self, now: float) -> list:
        if self._proc is not None or self._probe is not None:
            return []
        if self._queue:
            op = self._queue.pop(0)
            if isinstance(op, _Start):
                return self._start_run(op, now)
            if isinstance(op, PeerLeaving):
                return self._hand_off(op, now)
            if not self.election.is_coordinator:
                return [Reply(op.key, error="this peer is no longer the coordinator")]
            if isinstance(op, ResumeRun):
                return self._resume(op, now)
            if self.epoch.current is None or self._over():
                return [Reply(op.key, error="no training run is in progress")]
            return self._reconfigure("operator asked", now, force=True, reply=op.key)
        if self.me in self.leaving(now):  # this peer handed its part off and goes: the run is its successor's
            self._triggers.clear()
            self._gather_until = None
            return []
        if not self._triggers:
            out = self._deadline_check(now) or self._link_retest(now)
            if out:
                return out
        if now < self._next_check and not (self._gather_until is not None and now >= self._gather_until):
            return []
        self._next_check = now + self.t.check_interval_s
        cur = self.epoch.current
        if not self.election.is_coordinator or cur is None or self._over():
            self._triggers.clear()
            self._gather_until = None
            self._stuck = False
            return []
        if self._check_epoch is not None and not self._triggers:
            self._probe = "epoch"
            return [self._ask(("probe", "epoch"), cur.peers, ControlMsg.RUN_STATE, {"op": "query"},
                              self.t.probe_timeout_s)]
        if self._triggers:
            if self._gather_until is None:  # the other peers' reports of the same event
                self._gather_until = now + self.t.report_gather_s
                return []
            if now < self._gather_until:
                return []
            reasons, self._triggers, self._gather_until = self._triggers, [], None
            return self._reconfigure("; ".join(reasons), now, retry=reasons)
        if self._failures.due(cur, self._completed_of(cur)):
            self._probe = "failed"  # a failed step triggers once the run states agree
            return [self._ask(("probe", "failed"), cur.peers, ControlMsg.RUN_STATE, {"op": "query"},
                              self.t.probe_timeout_s)]
        if self._paused_live is not None:
            missing = self._named(cur) | set(self.swarm.live_peers())
            missing -= set(self._paused_live) | {self.me}
            if missing:
                self._probe = "holders"
                return [self._ask(("probe", "holders"), missing, ControlMsg.RUN_STATE, {"op": "query"},
                                  self.t.probe_timeout_s)]
            if now >= self._paused_retry_at:
                return self._reconfigure("retrying the paused run", now, retry=["retrying the paused run"])
            return []
        # (a peer left out for refusing is not asked until its back-off ends: its joins and
        # returns start no reconfiguration meanwhile)
        leaving = self.leaving(now) | self.left_out_now(now)
        outside = [p for p in self.swarm.live_peers() if p not in self._named(cur) and p != self.me and p not in leaving]
        if outside:
            self._probe = "joined"
            return [self._ask(("probe", "joined"), outside, ControlMsg.RUN_STATE, {"op": "query"},
                              self.t.probe_timeout_s)]
        if (now >= self._next_drift_check and self.epoch.run is not None and self.epoch.run.active
                and now < self._watch_due()):  # an overdue step is the deadline's to explain
            self._next_drift_check = now + self.t.drift_check_s
            return self._drift_check(cur)
        return []

    def _probed(self, what: str, answers: Mapping[bytes, dict], now: float) -> list:
        self._probe = None
        if what == "deadline":
            return self._deadline_answers(answers, now)
        if what == "links":
            return self._links_answers(answers, now)
        states = _states(answers)
        if what == "holders":
            if states:
                reason = "peers that were out of reach answer again"
                return self._reconfigure(reason, now, retry=[reason])
            if now >= self._paused_retry_at:
                return self._reconfigure("retrying the paused run", now, retry=["retrying the paused run"])
            return []
        cur = self.epoch.current
        if cur is None or not self.election.is_coordinator:
            return []
        if what == "failed":
            for reason in self._failures.judge(cur, states, self._completed_of(cur), now, self._stall_s(cur)):
                self._trigger(reason)
                self._next_check = now
            return []
        if what == "epoch":
            term, self._check_epoch = self._check_epoch, None
            stalled = [p for p in cur.peers if p not in states or not states[p].running
                       or (states[p].run_id, states[p].epoch) != (cur.run_id, cur.epoch)]
            if not stalled:
                return []
            reason = f"coordinator changed (term {term}): its epoch no longer runs everywhere"
            return self._reconfigure(reason, now, retry=[reason])
        view, _ = self.swarm.measured_view(set(states) | set(self.swarm.live_peers()) | {self.me})
        out = self.left_out_now(now)
        ready = [p for p in states if p in view.peers and p not in out]
        if not self.joins.due(ready, now):
            if ready:
                logger.info("%d joined peers wait for the wave of joins to settle (%.1f s at most)",
                            len(self.joins), self.joins.wait_s(now))
            return []
        reasons = [f"peer {short_id(p)} joined" for p in sorted(ready)]
        trigger = "; ".join(reasons) if len(reasons) <= 4 else (
            f"{len(reasons)} peers joined ({', '.join(short_id(p) for p in sorted(ready)[:4])}, ...)")
        return self._reconfigure(trigger, now, retry=[trigger])

    def _drift_check(self, cur: Allocation) -> list:
        view = self.swarm.view()
        live = (frozenset(self.swarm.live_peers()) | {self.me}) - self.left_out_now(self._now)
        if not view.complete or not set(cur.peers) <= live:
            return []
        log = self.steplog
        done = log.completed + 1 if log is not None and log.alloc.run_id == cur.run_id else cur.start_step
        regions = self.swarm.regions()
        cut = self.links.pairs()
        self._probe = "drift"
        return [Compute(("drift",), lambda: self.planner.reshape(
            view, cur, live=live & frozenset(view.peers), remaining_steps=max(1, cur.end_step - done),
            regions=regions, seed=0, force=False, cut=cut))]

    def _trigger(self, reason: str) -> None:
        if reason not in self._triggers:
            self._triggers.append(reason)

    def _over(self) -> bool:
        """No run, or it finished or was stopped: nothing to reconfigure."""
        if self.epoch.run_over():
            return True
        cur, log = self.epoch.current, self.steplog
        return (cur is not None and log is not None and log.alloc.run_id == cur.run_id
                and self.phase is Phase.FINISHED)

    # ---- the step deadline and cut links (control/coordinator/deadline.py, links.py) ----------

    def _watch_due(self) -> float:
        """When the step of the epoch this peer started is overdue (inf: not watched now)."""
        w, log = self.watch, self.steplog
        if (w is None or log is None or log.alloc.epoch != w.epoch or self.phase is not Phase.TRAINING
                or self._proc is not None or self._triggers or self._stuck):
            return math.inf  # (with triggers pending, the reconfiguration is under way)
        return w.due_at()

    def _deadline_check(self, now: float) -> list:
        """An overdue step: ask its laggards to reach their neighbours."""
        log, cur = self.steplog, self.epoch.current
        if now < self._watch_due() or log is None or cur is None or not self.election.is_coordinator:
            return []
        if (cur.run_id, cur.epoch) != (log.alloc.run_id, log.alloc.epoch) or self._over():
            return []
        step = log.completed + 1
        lagging = laggards(log.alloc.peers, log.reports.get(step, {}))
        if not lagging:
            return []
        assert self.watch is not None
        # the laggards and their neighbours: a peer that froze right after its report holds
        # up the others, who wait for its acknowledgements
        asked = sorted(set(lagging) | set(probe_targets(lagging, {p: log.alloc.neighbours(p) for p in lagging})))
        logger.warning("step %d is overdue (%.1f s since the last, deadline %.1f s): %s have not reported it; "
                       "probing them and their neighbours", step, now - self.watch.last_at, self.watch.deadline_s(),
                       ", ".join(short_id(p) for p in lagging))
        self._deadline_probe = (log.alloc.epoch, step, tuple(asked))
        self._probe = "deadline"
        t = self.t.deadline_probe_timeout_s
        return [self._ask(("probe", "deadline"), asked, ControlMsg.RUN_STATE,
                          ReachRequest(tuple(asked), t / 2).to_wire(), t)]

    def _deadline_answers(self, answers: Mapping[bytes, dict], now: float) -> list:
        """A silent laggard is out, a link whose ends answer but not each other is cut: either
        reconfigures at once, aborting the stuck step; else the step is only slow."""
        probe, self._deadline_probe = self._deadline_probe, None
        log, w = self.steplog, self.watch
        if (probe is None or log is None or w is None or log.alloc.epoch != probe[0] or log.completed >= probe[1]
                or self.phase is not Phase.TRAINING or not self.election.is_coordinator):
            return []  # the step completed meanwhile, or the epoch changed
        epoch, step, asked = probe
        verdict = judge(asked, {p: log.alloc.neighbours(p) for p in asked}, answers)
        if not verdict.stuck:
            w.probe_answered(now)
            logger.info("step %d is slow, not stuck: every peer asked answered and reaches its neighbours; "
                        "next look at %.1f s", step, w.due_at() - now)
            return []
        for p in verdict.silent:
            self._trigger(missed_deadline(p, step, w.deadline_s(), self.t.deadline_probe_timeout_s))
        for a, b in verdict.cut:
            why = (f"link {short_id(a)}-{short_id(b)} failed step {step}: both ends answer a probe, "
                   "not each other's pings")
            self.links.add((a, b), why)
            self._trigger(why)
        self._silent, self._stuck, self._next_check = frozenset(verdict.silent), True, now
        self._next_link_test = now + self.t.link_retest_s
        if not verdict.silent:
            return []
        # A frozen peer reads this when it wakes: it aborts its step instead of sending on in
        # an epoch the others left (what it sends meanwhile is refused by epoch anyway).
        return [self._ask(("fence", epoch), verdict.silent, ControlMsg.STOP,
                          {"run": log.alloc.run_id, "at_step": step, "abort": True, "epoch": log.alloc.epoch}, self.t.request_timeout_s)]

    def _link_retest(self, now: float) -> list:
        """Ping each cut link from one end; a ping that comes back clears it."""
        if (not self.links or now < self._next_link_test or not self.election.is_coordinator
                or self.epoch.current is None or self._over()):
            return []
        self._next_link_test = now + self.t.link_retest_s
        self.links.forget_peers(set(self.swarm.live_peers()) | {self.me})
        if not self.links:
            return []
        pairs = self.links.pairs()
        self._probe = "links"
        t = self.t.deadline_probe_timeout_s
        return [self._ask(("probe", "links"), {a for a, _ in pairs}, ControlMsg.RUN_STATE,
                          ReachRequest(tuple(sorted({b for _, b in pairs})), t / 2).to_wire(), t)]

    def _links_answers(self, answers: Mapping[bytes, dict], now: float) -> list:
        healed = []
        for a, b in sorted(self.links.pairs()):
            try:
                if b in ReachAnswer.from_wire(answers.get(a)).reached:
                    healed.append((a, b))
            except ProtocolError:
                continue
        for link in healed:
            logger.info("link %s-%s answers again: allocations may use it", short_id(link[0]), short_id(link[1]))
            self.links.clear(link)
        if (healed and self.phase is Phase.PAUSED and self._paused_live is not None and self.election.is_coordinator
                and self.epoch.current is not None and not self._over()):
            reason = "; ".join(f"link {short_id(a)}-{short_id(b)} answers again" for a, b in healed)
            return self._reconfigure(reason, now, retry=[reason])
        return []

    def _stall(self) -> dict:
        """Since when (wall time) and why the run makes no progress, for `status`."""
        w, log = self.watch, self.steplog
        since = (w.last_at if w is not None else self._now) + self.wall_offset
        if self.phase is Phase.PAUSED:
            return {"stalled_since": since, "stalled_reason": self.reason}
        if w is None or log is None or self.phase is not Phase.TRAINING or self._now < w.last_at + w.deadline_s():
            return {}
        if self._probe == "deadline":
            why = "probing the peers that have not reported it"
        elif w.answered:
            why = "every peer that has not reported it answers and reaches its neighbours: a slow step"
        else:
            why = "the peers that have not reported it are probed next"
        return {"stalled_since": since,
                "stalled_reason": f"step {log.completed + 1} is overdue (deadline {w.deadline_s():.1f} s): {why}"}

    # ---- requests and their answers -----------------------------------------------------------

    def _ask(self, key: tuple, peers: Iterable[bytes], msg: int, body: dict, timeout_s: float) -> Ask:
        cert = self.election.certificate
        if cert is not None and (msg == ControlMsg.STOP or (msg == ControlMsg.RUN_STATE and body.get("op") == "offer")):
            # (what only the recognised coordinator may ask: a peer outside the council hears no
            # heartbeats and may not know this term's coordinator yet; it checks the certificate)
            body = {**body, "cert": cert.to_wire()}
        return Ask(key, tuple(sorted(set(peers))), msg, body, timeout_s)

    def _answers(self, ev: Answers) -> list:
        key = ev.key
        if key[0] == "probe":
            return self._probed(key[1], ev.answers, self._now)
        if key[0] == "gaps":
            return self._gaps_filled(key[1], ev.answers)
        if key[0] == "opstop":
            return self._stopped(key, ev.answers)
        if key[0] == "keep":
            for p, a in sorted(ev.answers.items()):
                if "kept" not in a:
                    logger.warning("%s did not keep its stage on disk: %s", short_id(p), a.get("error") or a.get("reason"))
            return []
        proc = self._proc
        if proc is None or key[0] != "proc" or key[1] != proc.id:
            return []  # a procedure that failed meanwhile
        try:
            return self._advance(proc, key[2], key[3], ev.answers, self._now)
        except _Failed as e:
            return self._failed(proc, e)

    def _computed(self, ev: Computed) -> list:
        if ev.key == ("drift",):
            self._probe = None
            plan = ev.value
            if ev.error is None and isinstance(plan, ReshapePlan) and plan.kind != "keep":
                reason = "a faster allocation is predicted on the measured network"
                return self._reconfigure(reason, self._now, retry=[reason])
            return []
        proc = self._proc
        if proc is None or ev.key[:2] != ("proc", proc.id):
            return []
        if proc.kind == "start":
            return self._first_placed(proc, ev, self._now)
        try:
            return self._planned(proc, ev, self._now)
        except _Failed as e:
            return self._failed(proc, e)

    # ---- train start --------------------------------------------------------------------------

    def _wall(self, now: float) -> float:
        return now + self.wall_offset

    def _start_asked(self, ev: StartRun, now: float) -> list:
        """The cheap refusals of an operator's start, at once: its signature, operator and time,
        a start taken before, no coordinator, a run in progress, another start waiting, data
        this peer does not hold. Then it waits for the procedure in progress, if any."""
        try:
            op = check_op(ev.op, "start", self.operators)
            req = op.request()
            check_time(op, self._wall(now), self.t.operator_skew_s, extra_s=req.wait_s)
            if op.run_id in self.epoch.applied or self._starts_taken.get(op.run_id, -math.inf) >= self._wall(now):
                raise OperatorError(f"run {op.run_id.hex()[:8]} was started already: sign a new start")
        except (OperatorError, ValueError) as e:
            logger.warning("refused a train start: %s", e)
            return [Reply(ev.key, error=str(e))]
        refusal = self.start_refusal()
        if refusal is None and (any(isinstance(q, _Start) for q in self._queue)
                                or (self._proc is not None and self._proc.kind == "start")):
            refusal = "another train start is in progress: try again once it is answered"
        if refusal is None and req.data_hash != ev.data_hash:
            refusal = (f"the start names data set {req.data_name[:100]!r} (sha256 {str(req.data_hash)[:12]}), the "
                       f"coordinator holds {ev.data_name[:100]!r} (sha256 {ev.data_hash[:12]}): every peer trains on "
                       "the data it was started with (`dtfm-peer join --data`); start them with the same content")
        model = ev.model
        if refusal is None and model is None and req.init_from is not None:
            refusal = (f"the start names model folder {req.init_name[:100]!r} (sha256 {req.init_from[:12]}), which "
                       "the coordinator does not hold: every peer needs a copy (`dtfm-peer join --model-dir DIR`)")
        if refusal is None and model is not None and model.name != req.preset:
            refusal = f"the coordinator's model {model.name!r} is not the start's {req.preset!r}"
        if refusal is not None:
            return [Reply(ev.key, error=refusal)]
        assert ev.op is not None
        self._queue.append(_Start(ev.key, ev.op, op, req, ev.data_name, model or get_preset(req.preset)))
        return []

    def start_refusal(self) -> str | None:
        """Why a start cannot be taken now (no coordinator, a run in progress), or None."""
        if not self.election.is_coordinator:
            return "this peer is no longer the coordinator"
        run = self.epoch.run
        if run is not None and run.active:
            if self.epoch.stopped_by_operator(run.alloc.run_id):
                return (f"run {run.alloc.run_id.hex()[:8]} is stopping at a step boundary: start again once it has "
                        "ended (`dtfm-peer train status`)")
            return "a run is in progress: `train stop` it first"
        return None

    def _take_start(self, op: OperatorOp, now: float, wait_s: float) -> None:
        """Remember a start's run id while its signature could be taken again."""
        wall = self._wall(now)
        self._starts_taken = {r: t for r, t in self._starts_taken.items() if t >= wall}
        while len(self._starts_taken) >= MAX_STARTS_KEPT:
            self._starts_taken.pop(min(self._starts_taken, key=self._starts_taken.__getitem__))
        self._starts_taken[op.run_id] = op.issued_at_s + self.t.operator_skew_s + wait_s

    def _start_run(self, start: _Start, now: float) -> list:
        """The first placement, off the loop (the scheduler, or a random one of the asked shape)."""
        refusal = self.start_refusal()
        if refusal is not None:
            return [Reply(start.key, error=refusal)]
        self._take_start(start.op, now, start.req.wait_s)
        self._paused_live, self._attempts = None, 0
        self.left_out.clear()  # (a new run: each peer is tried again; one that refuses it is left out again)
        proc = _Procedure(next(self._keys), "start", "train start", reply=start.key, t0=now)
        proc.start = start
        self._proc = proc
        return self._place_start(proc, start, now)

    def _place_start(self, proc: _Procedure, start: _Start, now: float) -> list:
        """The first placement over the measured view less the peers left out for refusing."""
        req = start.req
        spec, cfg = start.model, req.config
        view, regions = self.swarm.view(), self.swarm.regions()
        out = self.left_out_now(now)
        if out & set(view.peers):  # (a peer that refused an earlier hand-out is not placed until its back-off ends)
            view, _ = self.swarm.measured_view(set(view.peers) - out)
        return [Compute(("proc", proc.id, "first"), lambda: self.planner.first_placement(view, req, spec, cfg,
                                                                                        regions))]

    def _first_placed(self, proc: _Procedure, ev: Computed, now: float) -> list:
        start = proc.start
        assert start is not None
        if ev.error is not None or not isinstance(ev.value, Placement):
            return self._start_failed(proc, start, f"cannot schedule: {ev.error}")
        refusal = self.start_refusal()  # (things may have changed while the scheduler ran)
        run = self.epoch.run
        if refusal is not None and proc.tries and run is not None and run.alloc.run_id == start.op.run_id:
            refusal = None  # (its own refused attempt, stopped before it started: the next replaces it)
        if refusal is not None:
            return self._start_failed(proc, start, refusal)
        req, op, shape = start.req, start.op, ev.value
        proc.links_note = shape.links_note
        named = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
        try:
            alloc = Allocation(epoch=self.election.last_applied[1] + 1, term=self.election.term, issuer=self.me,
                               pipelines=shape.pipelines, layer_ranges=shape.layer_ranges, preset=req.preset,
                               model=start.model, train=req.config,
                               data_hash=str(req.data_hash), data_name=start.data_name, start_step=0,
                               end_step=req.steps, checkpoint_every=req.checkpoint_every,
                               predicted_iteration_s=shape.predicted_iteration_s, spares=shape.spares,
                               absent=self._absent(named), run_id=op.run_id, reason="train start",
                               **self._council(named, set(self.swarm.live_peers()) | {self.me}),
                               operator_start=start.signed.encode(), compression=req.compression,
                               compress_links=links_for(shape, req.compression))
        except ValueError as e:
            return self._start_failed(proc, start, f"cannot build the allocation: {e}")
        try:
            return self._hand_out(proc, alloc, (), now)
        except _Failed as e:
            return self._failed(proc, e)

    def _start_failed(self, proc: _Procedure, start: _Start, why: str) -> list:
        """The operator is told its start failed; once a hand-out of it went out (and was
        refused), the run is marked stopped: nobody reconfigures it."""
        self._proc = None
        if proc.alloc is not None or proc.tries:
            self.epoch.mark_stopped(start.op.run_id)
        return [Reply(start.key, error=why)]

    def _reschedule_asked(self, ev: Reschedule, now: float) -> list:
        """An operator's reschedule of the current run, within the skew window, signed after the
        run's last resume or reschedule and not taken before (this peer's record and the
        allocation's `last_op_ms`, so a new coordinator refuses a copy too); then it waits for
        the procedure in progress, if any."""
        cur = self.epoch.current
        try:
            if not self.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            if cur is None or self._over():
                raise OperatorError("no training run is in progress")
            op = check_op(ev.op, "reschedule", self.operators, run_id=cur.run_id)
            signed = self._fresh(ev.op, op, now)
            if any(isinstance(q, Reschedule) for q in self._queue):
                raise OperatorError("another reschedule is waiting: try again once it is answered")
        except OperatorError as e:
            logger.warning("refused a train reschedule: %s", e)
            return [Reply(ev.key, error=str(e))]
        self.epoch.take_op(op, signed, self._wall(now), self.t.operator_skew_s)
        self._queue.append(ev)
        return []

    def _fresh(self, signed: SignedOp | None, op: OperatorOp, now: float) -> SignedOp:
        """`signed` when its operation may be taken now (`EpochMachine.op_refusal`: the skew
        window, after the run's last resume or reschedule, not taken before); else OperatorError."""
        assert signed is not None  # (check_op opened it)
        why = self.epoch.op_refusal(op, signed, self._wall(now), self.t.operator_skew_s)
        if why is not None:
            raise OperatorError(why)
        return signed

    def _stop_asked(self, ev: StopRun, now: float) -> list:
        """An operator's stop of the current run, within the skew window, signed after the run's
        last resume or reschedule and not taken before (a copied stop cannot end a resumed run):
        STOP, with the operator's signed stop, to every peer of the run before the same step
        (each checks it by the same rules and keeps it, this peer's epoch machine too); nobody
        reconfigures the run after it."""
        cur = self.epoch.current
        try:
            if not self.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            if cur is None:
                raise OperatorError("no training run is in progress")
            op = check_op(ev.op, "stop", self.operators, run_id=cur.run_id)
            signed = self._fresh(ev.op, op, now)  # (a copy is refused as such, the run over or not)
            if self._over():
                raise OperatorError("no training run is in progress")
        except OperatorError as e:
            logger.warning("refused a train stop: %s", e)
            return [Reply(ev.key, error=str(e))]
        at = self.epoch.stop_boundary(self.logged_completed(cur.run_id))
        self.epoch.mark_stopped(cur.run_id)
        self._operator_stop = (cur.run_id, at)
        key = ("opstop", next(self._keys))
        self._stops[key] = (ev.key, at)
        logger.info("an operator stops run %s before step %d", cur.run_id.hex()[:8], at)
        emit = Emit(PlaneEvent(EventKind.OPERATOR_STOP, self.election.term, "train stop", epoch=cur.epoch,
                               reason=f"an operator stopped the run {stopped_after(at)}"))
        return [emit, self._ask(key, self._named(cur) | {cur.issuer, self.me}, ControlMsg.STOP,
                          {"run": cur.run_id, "at_step": at, "final": True, "op": signed.to_wire()},
                          self.t.request_timeout_s)]

    def _resume_asked(self, ev: ResumeRun, now: float) -> list:
        """An operator's resume of the run an operator stopped (the swarm's last run), within
        the skew window, signed after the run's last resume or reschedule and not taken before
        (kept, and carried by the resumed epoch's allocation); then it waits for the procedure
        in progress, if any."""
        cur = self.epoch.current
        try:
            if not self.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            op = check_op(ev.op, "resume", self.operators)
            signed = self._fresh(ev.op, op, now)
            refusal = resume_refusal(op.run_id, cur.run_id if cur is not None else None,
                                     stopped=cur is not None and self.epoch.stopped_by_operator(cur.run_id),
                                     over=self._over(), end_step=cur.end_step if cur is not None else 0)
            if refusal is not None:
                raise OperatorError(refusal)
            if any(isinstance(q, ResumeRun) for q in self._queue) or (self._proc is not None and self._proc.resume):
                raise OperatorError("another resume is in progress: try again once it is answered")
        except OperatorError as e:
            logger.warning("refused a train resume: %s", e)
            return [Reply(ev.key, error=str(e))]
        self.epoch.take_op(op, signed, self._wall(now), self.t.operator_skew_s)
        self._queue.append(ev)
        return []

    def _resume(self, ev: ResumeRun, now: float) -> list:
        """Take a queued resume: the run is no longer stopped, and a reconfiguration brings it
        back from the resume point (control/epoch/runstate.py); any failure leaves it stopped."""
        cur = self.epoch.current
        if cur is None or not self.epoch.stopped_by_operator(cur.run_id):
            return [Reply(ev.key, error="the run is no longer stopped: nothing to resume")]
        logger.info("an operator resumes run %s", cur.run_id.hex()[:8])
        self.epoch.resume(cur.run_id)
        self.phase, self.reason, self._attempts = Phase.IDLE, "", 0
        self.left_out.clear()  # (the operator may have fixed the peers that refused: each is tried again)
        self._paused_live = None
        return self._reconfigure("train resume", now, force=True, reply=ev.key, resume=True)

    def operator_stop_step(self, run_id: bytes) -> int | None:
        """The steps `run_id` has done when an operator's stop of it ends it (its peers run up
        to there after the stop was taken), or None when no operator stopped it."""
        stop = self._operator_stop
        return stop[1] if stop is not None and stop[0] == run_id else None

    def _stopped(self, key: tuple, answers: Mapping[bytes, dict]) -> list:
        reply_key, at = self._stops.pop(key, ((), 0))
        told = sum(1 for a in answers.values() if a.get("stopped"))
        return [Reply(reply_key, {"at_step": at, "told": told})]

    # ---- planned leave ------------------------------------------------------------------------

    def leaving(self, now: float) -> frozenset[bytes]:
        """The peers that announced a planned leave within `leaving_kept_s`: never placed."""
        self._leaving = {p: t for p, t in self._leaving.items() if t > now}
        return frozenset(self._leaving)

    def _leave_asked(self, ev: PeerLeaving, now: float) -> list:
        """A peer's planned leave: kept out of allocations from now on; when the current run
        names it, a reconfiguration without it at a step boundary (after the procedure in
        progress), else (a spare, a peer outside the run) answered at once."""
        if not self.election.is_coordinator:
            return [Reply(ev.key, error="this peer is no longer the coordinator")]
        if ev.peer not in self._leaving:
            while len(self._leaving) >= MAX_LEAVING:
                self._leaving.pop(min(self._leaving, key=self._leaving.__getitem__))
        self._leaving[ev.peer] = now + self.t.leaving_kept_s
        logger.info("peer %s leaves (planned)", short_id(ev.peer))
        if self._leave_done(ev):
            return [Reply(ev.key, {"handed_off": False})] + self._left_event(ev.peer)
        for q in [q for q in self._queue if isinstance(q, PeerLeaving) and q.peer == ev.peer]:
            self._queue.remove(q)  # asked again: the newer request is the one answered
        self._queue.append(ev)
        return []

    def _leave_done(self, ev: PeerLeaving) -> bool:
        """Whether the leaving peer has no stage in the run in progress (a spare goes without a
        reconfiguration: no step waits for it, and the next allocation leaves it out)."""
        cur = self.epoch.current
        return cur is None or self._over() or ev.peer not in cur.peers

    def _left_event(self, peer: bytes) -> list:
        cur = self.epoch.current
        return [Emit(PlaneEvent(EventKind.LEAVE, self.election.term, f"peer {short_id(peer)} left (planned)",
                                epoch=cur.epoch if cur is not None else None))]

    def _hand_off(self, ev: PeerLeaving, now: float) -> list:
        """The queued leave's turn: a reconfiguration without the leaving peer, unless an
        earlier one left it out already."""
        if self._leave_done(ev):
            return [Reply(ev.key, {"handed_off": False})] + self._left_event(ev.peer)
        self.leaving(now)
        self._leaving.setdefault(ev.peer, now + self.t.leaving_kept_s)  # (kept while its hand-off runs)
        return self._reconfigure(f"peer {short_id(ev.peer)} left (planned)", now, reply=ev.key, leave=True)

    # ---- reconfiguration ----------------------------------------------------------------------

    def _reconfigure(self, trigger: str, now: float, *, force: bool = False, reply: tuple | None = None,
                     retry: Sequence[str] = (), resume: bool = False, leave: bool = False) -> list:
        cur = self.epoch.current
        self.joins.clear()  # (every live peer is taken into account)
        proc = _Procedure(next(self._keys), "reconfigure", trigger, reply=reply, force=force, cur=cur, t0=now,
                          resume=resume, leave=leave)
        proc.retry = list(retry)
        self._proc = proc
        if cur is None or not self.election.is_coordinator:
            return self._failed(proc, _Failed("not the coordinator of a run"))
        self.phase = Phase.STOPPING
        proc.stuck, self._stuck = self._stuck, False
        proc.asked = frozenset(self._named(cur) | set(self.swarm.live_peers()) | {self.me}) - self._silent
        return [self._proc_ask(proc, "states", proc.asked, {"op": "query"}, self.t.request_timeout_s)]

    def _proc_ask(self, proc: _Procedure, step: str, peers: Iterable[bytes], body: dict, timeout_s: float,
                  msg: int = ControlMsg.RUN_STATE, sub: Any = None) -> Ask:
        return self._ask(("proc", proc.id, step, sub), peers, msg, body, timeout_s)

    def _advance(self, proc: _Procedure, step: str, sub: Any, answers: Mapping[bytes, dict], now: float) -> list:
        cur = proc.cur
        if step == "states":
            assert cur is not None
            proc.states = _states(answers)
            proc.running = [p for p, s in proc.states.items() if s.running and s.run_id == cur.run_id]
            if not proc.running:
                return self._plan(proc, now)
            ats = [s.at for s in proc.states.values() if s.run_id == cur.run_id and s.at is not None]
            at = max(ats) + 1 if ats else 0
            # With a peer of the epoch gone no step can complete: abort the current one at once
            # (it changes nothing) instead of waiting for every receive to time out. So too when
            # no peer says where it is: there is no boundary to stop at.
            lost = proc.stuck or not ats or not set(cur.peers) <= set(proc.states) or any(
                s.run_id == cur.run_id and not s.running and s.layers is not None for s in proc.states.values())
            logger.info("reconfiguring (%s): %s %d peers%s", proc.trigger,
                        "aborting the step of" if lost else "stopping", len(proc.running),
                        "" if lost else f" before step {at}")
            return [self._proc_ask(proc, "stop", proc.running, {"run": cur.run_id, "at_step": at, "abort": lost, "epoch": cur.epoch},
                                   self.t.request_timeout_s, msg=ControlMsg.STOP)]
        if step == "stop":
            proc.stop_deadline = now + self.t.stop_timeout_s
            proc.poll_at = now + self.t.stop_poll_s
            return []
        if step == "poll":
            assert cur is not None
            proc.states = _states(answers)
            proc.running = [p for p, s in proc.states.items() if s.running and s.run_id == cur.run_id]
            if not proc.running:
                return self._plan(proc, now)
            if now + self.t.stop_poll_s <= proc.stop_deadline:
                proc.poll_at = now + self.t.stop_poll_s
                return []
            logger.warning("peers %s did not stop in time for the reconfiguration%s",
                           ", ".join(short_id(p) for p in proc.running),
                           ": this peer aborts its own step" if self.me in proc.running else "")
            out: list = [AbortRunner("did not stop in time for a reconfiguration")] if self.me in proc.running else []
            return out + [self._proc_ask(proc, "final", proc.asked, {"op": "query"}, self.t.request_timeout_s)]
        if step == "final":
            proc.states = _states(answers)
            return self._plan(proc, now)
        if step == "offer":
            return self._offered(proc, sub, answers, now)
        if step == "alloc":
            return self._allocation_answers(proc, answers, now)
        if step == "unstop":
            raise _Failed(proc.refused, counts=not proc.transient)
        if step == "start":
            return self._started(proc, answers, now)
        raise AssertionError(f"unknown procedure step {step!r}")

    def _poll_stop(self, now: float) -> list:
        proc = self._proc
        if proc is None or proc.poll_at is None or now < proc.poll_at:
            return []
        proc.poll_at = None
        return [self._proc_ask(proc, "poll", proc.asked, {"op": "query"}, self.t.request_timeout_s)]

    def _plan(self, proc: _Procedure, now: float) -> list:
        """With a quorum of the voters reachable (as the election counts one): the resume point, then the new layout over
        the reachable, measured peers (the scheduler, off the loop)."""
        cur = proc.cur
        assert cur is not None
        proc.marks["stopped"] = now
        self.phase = Phase.PLANNING
        states = proc.states
        reachable = set(states)
        voters = set(self.election.voters)
        if voters and len(reachable & voters) < quorum(len(voters)):  # (a partition: waits for it to heal)
            return self._pause(proc, f"only {len(reachable & voters)} of {len(voters)} voters are reachable, "
                                     f"{quorum(len(voters))} needed: a side without a quorum does not reconfigure",
                               reachable, now)
        logger.info("run states: %s", describe(states))
        try:
            rp = resume_point(cur.run_id, cur.layer_ranges, states)
        except ResumeError as e:
            if proc.resume:
                raise _Failed(f"cannot resume run {cur.run_id.hex()[:8]}: {e}") from None
            # No peer of the run answered (every stage, even step 0, is restored by one): the run
            # waits and resumes when the reachable peers change.
            return self._pause(proc, f"{e}; waiting for a peer of the run to answer", reachable, now)
        if rp.step >= cur.end_step:
            raise _Failed("the run already reached its last step")
        proc.rp = rp
        # (a leaving peer answers and offers its stages, but is not placed)
        view, unmeasured = self.swarm.measured_view(reachable - self.leaving(now))
        if unmeasured:
            logger.info("left out until their links are measured: %s", ", ".join(short_id(p) for p in unmeasured))
        # (a peer that refused an allocation stays in the view, where it may hold a stage others
        # fetch, but is not placed until its back-off ends)
        proc.left_out = self.left_out_now(now) & frozenset(view.peers)
        if proc.left_out:
            logger.info("left out because they refused an allocation: %s", self.left_out.why(proc.left_out, now))
        live = frozenset(view.peers) - proc.left_out
        regions = self.swarm.regions()
        remaining = cur.end_step - rp.step
        cut = self.links.pairs()
        return [Compute(("proc", proc.id, "plan"), lambda: self.planner.reshape(
            view, cur, live=live, remaining_steps=remaining, regions=regions, seed=cur.epoch, force=proc.force,
            cut=cut))]

    def _planned(self, proc: _Procedure, ev: Computed, now: float) -> list:
        cur, rp = proc.cur, proc.rp
        assert cur is not None and rp is not None
        if ev.error is not None and proc.left_out:
            # Waiting would not help: the peers that accept have no layout, and obeying the ones
            # that refuse would hand the run to them. The operator resumes it once they are fixed.
            return self._stop_run(proc, f"no layout of the peers that accept the allocation exists ({ev.error}); "
                                        f"left out: {self.left_out.why(proc.left_out, now, timed=False)}",
                                  proc.trigger,
                                  left_out=proc.left_out)
        if ev.error is not None:
            return self._pause(proc, f"no allocation fits the reachable peers: {ev.error}", set(proc.states), now)
        proc.plan = ev.value
        through = used_cut_links(proc.plan.placement.pipelines, self.links.pairs())
        if through:
            return self._pause(proc, "stalled: every allocation of the reachable peers uses a cut link ("
                               + "; ".join(self.links.why(x) for x in through) + "); waiting for it to heal",
                               set(proc.states), now)
        proc.marks["planned"] = now
        self.phase = Phase.OFFERING
        out = []
        shape = proc.plan.placement  # its peers may fetch the offers (control/epoch/access.py)
        fetchers = sorted({p for pipe in shape.pipelines for p in pipe} | set(shape.spares))
        for r in cur.layer_ranges:
            holders = list(rp.holders(r))[:MAX_OFFER_HOLDERS]
            body = {"op": "offer", "run": cur.run_id, "step": rp.step, "layers": list(r), "for": fetchers}
            out.append(self._proc_ask(proc, "offer", holders, body, self.t.accept_timeout_s, sub=r))
        return out

    def _offered(self, proc: _Procedure, r: tuple[int, int], answers: Mapping[bytes, dict], now: float) -> list:
        """Once every stage's holders answered: the digest most of them give goes into the
        allocation, with the holders that gave it."""
        cur, rp, plan = proc.cur, proc.rp, proc.plan
        assert cur is not None and rp is not None and plan is not None
        proc.offers[r] = answers
        if len(proc.offers) < len(cur.layer_ranges):
            return []
        holdings = []
        for r in cur.layer_ranges:
            by_digest: dict[str, list[bytes]] = {}
            for p, a in proc.offers[r].items():
                digest = a.get("digest")
                if isinstance(digest, str) and _SHA256_HEX.fullmatch(digest):
                    by_digest.setdefault(digest, []).append(p)
                else:
                    logger.warning("%s offers no layers %s at step %d: %s", short_id(p), r, rp.step,
                                   a.get("error") or a.get("reason"))
            if not by_digest:  # (it held them a moment ago: retried, up to max_reconfig_attempts)
                raise _Failed(f"no holder of layers {r} could offer them at step {rp.step}")
            digest, peers = max(by_digest.items(), key=lambda kv: len(kv[1]))
            if len(by_digest) > 1:
                # with compressed DP the replicas of a stage differ (their error-feedback residuals,
                # DiLoCo's inner steps): each keeps its own, and the digest names one for fetchers
                logger.log(logging.INFO if cur.compression.dp_method != "exact" else logging.ERROR,
                           "holders of layers %s disagree at step %d: %s", r, rp.step,
                           {d[:12]: [short_id(p) for p in ps] for d, ps in by_digest.items()})
            holdings.append(Holding(r, digest, tuple(sorted(peers))))
        proc.marks["offered"] = now
        proc.links_note = plan.placement.links_note
        try:
            alloc = self._next_allocation(cur, plan.placement, rp, tuple(holdings), proc.trigger,
                                          set(proc.states) - self.leaving(now))
        except ValueError as e:
            raise _Failed(f"cannot build the next allocation: {e}") from None
        # Steps the current epoch completed that the swarm runs again: the holders of the newer
        # stages are gone (a checkpoint, the initial weights or older in-memory stages serve): a
        # rollback, said as such. Only the current epoch's steps count: those an earlier epoch
        # completed past its start were lost (and counted) by the rollback that started it.
        # (a peer that completed step j means every peer completed j - 1: the steps move together)
        mine = [r for st in proc.states.values() for r in st.reports if r.epoch == cur.epoch]
        logged = self._completed_of(cur)
        done = {r.step - 1 for r in mine} | {cur.start_step - 1} | ({logged} if logged is not None else set())
        # (a resume from the checkpoints of the stop boundary runs no logged step again: no rollback)
        proc.rolled_back = (rp.rollback and not proc.resume) or rp.step <= max(done)
        # (how many: from the newest step of the epoch any peer logged or reported completing)
        newest = max(done | {r.step for r in mine})
        # A step this peer logged in an earlier epoch is run again too when the rollback that
        # started the current epoch was never handed out (its hand-out failed): a rollback all the same.
        ran = max(self.logged.get(cur.run_id, ()), default=-1)
        if not proc.rolled_back and rp.step <= ran:
            proc.rolled_back, newest = True, ran
        proc.steps_lost = max(0, newest + 1 - rp.step) if proc.rolled_back else 0
        reports = [(p, r) for p, st in proc.states.items() for r in st.reports]
        return self._hand_out(proc, alloc, reports, now)

    def _next_allocation(self, cur: Allocation, shape: Placement, rp: ResumePoint, holdings: tuple[Holding, ...],
                         trigger: str, reachable: set[bytes]) -> Allocation:
        """The next epoch of the run: the new layout from the resume point, with the holdings."""
        named = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
        return Allocation(epoch=self.election.last_applied[1] + 1, term=self.election.term, issuer=self.me,
                          run_id=cur.run_id, pipelines=shape.pipelines, layer_ranges=shape.layer_ranges,
                          preset=cur.preset, model=cur.model, train=cur.train, data_hash=cur.data_hash,
                          data_name=cur.data_name, start_step=rp.step, end_step=cur.end_step,
                          checkpoint_every=cur.checkpoint_every, predicted_iteration_s=shape.predicted_iteration_s,
                          spares=shape.spares, holdings=holdings, absent=self._absent(named),
                          reason=trigger[:1024], **self._council(named, reachable),
                          operator_start=cur.operator_start, compression=cur.compression,
                          compress_links=links_for(shape, cur.compression),
                          last_op_ms=self.epoch.op_floor_ms(cur.run_id))

    def _council(self, named: set[bytes], reachable: set[bytes]) -> dict:
        """The allocation's `voters` and `council`: one step toward a council of its root's size
        of live voters spread over the regions (`next_council`), when the election can make it now
        (else the council as it is); ValueError when this peer has no council to hand out."""
        old = tuple(self.election.voters)
        live = set(self.swarm.live_peers()) | {self.me}  # (a removed voter must be gone to every peer's gossip)
        own = self.election.council
        size = own.size if own is not None else self.t.council_size  # (the operator's root names it)
        want = next_council(old, named & reachable & live, live, self.swarm.regions(), size, self.me)
        epoch = self.election.last_applied[1] + 1  # (the allocation's, as both callers build it)
        council = self.election.council_for(want, epoch) if want != old else None
        if council is None:
            council = self.election.council_for(old, epoch)
        if council is None:
            raise ValueError("this peer holds no council to hand out (it is not the certified coordinator)")
        return {"voters": council.voters, "council": council.encode()}

    def _absent(self, named: set[bytes]) -> tuple[bytes, ...]:
        """Every member this peer knows of that has no place: peers whose gossip still counts
        one of them alive must not refuse the allocation for leaving it out (this peer too
        when it leaves: it issues an allocation without itself)."""
        me = set() if self.me in self._leaving else {self.me}
        return tuple(sorted(set(self.swarm.known_peers()) - named - me)[:MAX_ABSENT])

    @staticmethod
    def _links_note(proc: _Procedure, alloc: Allocation) -> str:
        """A per-link run's choice in words: the scheduler's (with what each link saves), else the allocation's."""
        if alloc.compress_links is None:
            return ""
        return proc.links_note or alloc.compress_links.describe(alloc.compression)

    @staticmethod
    def _named(alloc: Allocation) -> set[bytes]:
        return set(alloc.peers) | set(alloc.spares)

    # ---- the hand-out -------------------------------------------------------------------------

    def _hand_out(self, proc: _Procedure, alloc: Allocation, backfill: Sequence[tuple[bytes, StepReport]],
                  now: float) -> list:
        """Log the steps before the resume point that `backfill` (the peers' reports) covers and
        this peer has not logged; ALLOCATION to every named peer, then START. Only while this
        peer is the coordinator of the allocation's term with its certificate: one that stepped
        down while the procedure ran (its scheduler or the offers were still out) hands nothing
        out, rather than an allocation without its proof or with its successor's."""
        cert = self.election.certificate
        mine = cert is None or (cert.candidate, cert.term) == (self.me, alloc.term)
        if not self.election.is_coordinator or not mine:
            raise _Failed(f"this peer is no longer the coordinator of term {alloc.term}")
        if proc.kind == "reconfigure" and not proc.resume and self.epoch.stopped_by_operator(alloc.run_id):
            # an operator's stop taken while the procedure ran: the run is over, nothing is handed out
            raise _Failed(f"an operator stopped run {alloc.run_id.hex()[:8]} while it was reconfigured", counts=False)
        proc.alloc = alloc
        self.phase = Phase.HANDING_OUT
        self.reason = ""
        signed = self.sign(alloc)
        logged = self.logged.setdefault(alloc.run_id, set())
        out: list = []
        if proc.kind == "start":
            logged.clear()
            out.append(ResetLog())
        known = self._known(proc.cur)
        self.steplog = log = StepLog(alloc, logged, started_at=now + self.wall_offset, refusals=self.refusals)
        out += [LogLine(line) for line in log.backfill(backfill, {r.step for _, r in backfill
                                                                       if r.step < alloc.start_step}, known)]
        logger.info("issuing term %d epoch %d (%s): %d stages x %d pipelines over %d peers from step %d, "
                    "predicted %.3f s per step", alloc.term, alloc.epoch, alloc.reason, alloc.stages, alloc.dp,
                    len(alloc.peers), alloc.start_step, alloc.predicted_iteration_s)
        if alloc.compress_links is not None:
            logger.info("term %d epoch %d compresses per link: %s", alloc.term, alloc.epoch, self._links_note(proc, alloc))
        targets = list(alloc.peers) + list(alloc.spares)
        body = signed.to_wire()
        if cert is not None:  # the proof of this peer's election in the allocation's term
            body["cert"] = cert.to_wire()
        out.append(self._proc_ask(proc, "alloc", targets, body, self.t.accept_timeout_s,
                                  msg=ControlMsg.ALLOCATION))
        return out

    def _allocation_answers(self, proc: _Procedure, answers: Mapping[bytes, dict], now: float) -> list:
        alloc = proc.alloc
        assert alloc is not None
        proc.answers = answers
        refused = {p: a for p, a in answers.items() if not a.get("accepted")}
        if refused:
            proc.refused = "the allocation was refused: " + "; ".join(
                f"{short_id(p)}: {str(a.get('reason', 'no answer'))[:200]}" for p, a in refused.items())
            left = self._leave_out(answers, refused, now)
            # A refusal that left its peer out counts toward no limit: the next attempt goes on
            # without it. So too a membership disagreement: gossip converges.
            proc.transient = all(p in left or _refusal_code(a) in MEMBERSHIP_REFUSALS for p, a in refused.items())
            self.phase, self.reason = Phase.REFUSED, proc.refused
            rest = [p for p in list(alloc.peers) + list(alloc.spares) if p not in refused]
            out: list = []
            if left:
                why = self.left_out.why(left, now)
                shown = tuple(x for x in self.left_out.snapshot(now, self.wall_offset) if x.peer in left)
                proc.refused += "; left out of the next attempts: " + ", ".join(
                    f"{short_id(x.peer)} for {x.until - x.since:.0f} s" for x in shown)
                self.reason = proc.refused
                logger.warning("the allocation of epoch %d was refused; left out of the next attempts: %s",
                               alloc.epoch, why)
                out.append(Emit(PlaneEvent(EventKind.LEFT_OUT, self.election.term, proc.trigger, epoch=alloc.epoch,
                                           reason=why, left_out=shown)))
            return out + [self._proc_ask(proc, "unstop", rest, {"run": alloc.run_id, "at_step": 0,
                                                                "epoch": alloc.epoch},
                                         self.t.request_timeout_s, msg=ControlMsg.STOP)]
        self.left_out.accepted(answers)
        return [self._proc_ask(proc, "start", alloc.peers, {"run": alloc.run_id, "epoch": alloc.epoch},
                               self.t.request_timeout_s, msg=ControlMsg.START)]

    def _leave_out(self, answers: Mapping[bytes, dict], refused: Mapping[bytes, dict], now: float) -> frozenset[bytes]:
        """Record each refusing peer (leftout.py); the peers left out now. While fewer peers
        refuse than accept (this peer counted), the allocation was fine and each refusing peer is
        unusable now, whatever its reason (its data, its stage build, another coordinator it
        follows, a lie, no answer). When as many refuse as accept, the allocation itself is
        refused (this peer may be behind the others' election, or cut off from them): nobody is
        singled out, and the failure counts as before. This peer never leaves itself out."""
        peers = sorted(p for p in refused if p != self.me)
        accepting = [p for p, a in answers.items() if a.get("accepted")]
        if not peers or len(peers) >= len(accepting):
            return frozenset()
        incarnations = self.swarm.incarnations()
        left = set()
        for p in peers:
            code, reason = _refusal_code(refused[p]), refused[p].get("reason")
            reason = reason[:200] if isinstance(reason, str) else "no reason given"
            if self.left_out.refused(p, code, reason, now, incarnations.get(p)):
                left.add(p)
        return frozenset(left)

    def _started(self, proc: _Procedure, answers: Mapping[bytes, dict], now: float) -> list:
        alloc, log = proc.alloc, self.steplog
        assert alloc is not None and log is not None
        late = [short_id(p) for p, a in answers.items() if not a.get("started")]
        if late:
            logger.warning("peers %s did not confirm the start", ", ".join(late))
        self.phase = Phase.TRAINING
        self._next_drift_check = now + self.t.drift_check_s
        log.fetched = int(sum(_num(a.get("fetched_bytes")) for a in proc.answers.values()))
        log.fetch_s = max([_num(a.get("fetch_s")) for a in proc.answers.values()] + [0.0])
        self._proc = None
        self._attempts = 0
        self._paused_live = None
        self._silent, self._stuck = frozenset(), False
        if self.t.deadline is not None:
            old, prior = self.watch, list[float]()
            if old is not None and proc.cur is not None and proc.cur.run_id == alloc.run_id:
                prior = old.prior_for(alloc.predicted_iteration_s / max(proc.cur.predicted_iteration_s, 1e-9))
            self.watch = StepWatch(self.t.deadline, alloc.epoch, now, prior)
        if proc.kind == "start":
            return [Emit(PlaneEvent(EventKind.START, alloc.term, "train start", epoch=alloc.epoch,
                                    start_shape=f"{alloc.stages}x{alloc.dp}",
                                    start_predicted_s=alloc.predicted_iteration_s,
                                    compress_links=self._links_note(proc, alloc) or None)),
                    Reply(proc.reply or (), alloc)]
        self._triggers.clear()  # what happened before the new epoch started is accounted for
        self._gather_until = None
        return self._reconfigured(proc, now)

    def _reconfigured(self, proc: _Procedure, now: float) -> list:
        """Record a reconfiguration (`last_reconfig` in status, an event, one INFO line)."""
        cur, alloc, plan, rp, log = proc.cur, proc.alloc, proc.plan, proc.rp, self.steplog
        assert cur is not None and alloc is not None and plan is not None and rp is not None and log is not None
        m = proc.marks
        info = Reconfiguration(
            at=now + self.wall_offset, reason=proc.trigger, epoch=alloc.epoch, term=alloc.term,
            old_shape=f"{cur.stages}x{cur.dp}", new_shape=f"{alloc.stages}x{alloc.dp}", kind=plan.kind,
            predicted_old_s=cur.predicted_iteration_s, predicted_new_s=alloc.predicted_iteration_s, moves=plan.moves,
            bytes_moved=log.fetched, resume_step=rp.step, rollback=proc.rolled_back,
            restored_from=rp.source.value, steps_lost=proc.steps_lost,
            started_at=proc.t0 + self.wall_offset, stop_s=m["stopped"] - proc.t0,
            schedule_s=m["planned"] - m["stopped"], offer_s=m["offered"] - m["planned"], transfer_s=log.fetch_s,
            handout_s=now - m["offered"], compress_links=self._links_note(proc, alloc))
        self.last_reconfig = info
        self.counters.reconfigured(alloc.run_id, rollback=proc.rolled_back, steps_lost=proc.steps_lost)
        logger.info("reconfigured (%s): %s -> %s (%s), predicted %.3f -> %.3f s per step, %d moves, %d bytes moved, "
                    "resuming at step %d%s", proc.trigger, info.old_shape, info.new_shape, plan.kind,
                    cur.predicted_iteration_s, alloc.predicted_iteration_s, plan.moves, log.fetched, rp.step,
                    f" (rolled back from {rp.source.value}: {proc.steps_lost} completed steps run again)"
                    if proc.rolled_back else "")
        kind = (EventKind.ROLLBACK if proc.rolled_back else EventKind.LEAVE if proc.leave
                else EventKind.RECONFIGURE)
        out: list = [Emit(PlaneEvent(kind, alloc.term, proc.trigger, epoch=alloc.epoch, reconfiguration=info))]
        if proc.reply is not None:
            out.append(Reply(proc.reply, {"handed_off": True, **info.to_wire()} if proc.leave else info.to_wire()))
        return out

    # ---- failure, pause, stop -----------------------------------------------------------------

    def _pause(self, proc: _Procedure, why: str, reachable: Iterable[bytes], now: float) -> list:
        """The run waits: retried when a peer out of reach answers, or after a while."""
        cur = proc.cur
        assert cur is not None
        self._paused_live = frozenset(reachable)
        self._paused_retry_at = now + self.t.paused_retry_s
        logger.error("training pauses: %s", why)
        self.phase, self.reason = Phase.PAUSED, why
        self._proc = None
        out: list = [Emit(PlaneEvent(EventKind.PAUSED, self.election.term, proc.trigger, epoch=cur.epoch, reason=why)),
                     self._keep(cur, reachable)]
        if proc.reply is not None:
            out.append(Reply(proc.reply, error=why))
        return out

    def _stop_run(self, proc: _Procedure, why: str, trigger: str, left_out: frozenset[bytes] = frozenset()) -> list:
        cur = proc.cur
        assert cur is not None
        logger.error("training stops: %s", why)
        self.phase, self.reason = Phase.STOPPED, why
        self.epoch.mark_stopped(cur.run_id)
        self._proc = None
        shown = tuple(x for x in self.left_out.snapshot(self._now, self.wall_offset) if x.peer in left_out)
        out: list = [Emit(PlaneEvent(EventKind.STOPPED, self.election.term, trigger, epoch=cur.epoch, reason=why,
                                     left_out=shown)),
                     self._keep(cur, set(proc.states) | self._named(cur))]
        if proc.reply is not None:
            out.append(Reply(proc.reply, error=why))
        return out

    def _keep(self, cur: Allocation, peers: Iterable[bytes]) -> Ask:
        """Ask the peers of run `cur` to write what they hold of it in memory to their data dirs
        (RUN_STATE `keep`): the run waits, and a crash meanwhile must lose nothing. The answers
        change nothing here."""
        self._keeps += 1
        return self._ask(("keep", self._keeps), set(peers) | {self.me}, ControlMsg.RUN_STATE,
                         {"op": "keep", "run": cur.run_id}, self.t.accept_timeout_s)

    def _failed(self, proc: _Procedure, e: _Failed) -> list:
        """A failed start answers its operator; a failed reconfiguration is retried on the next
        check, up to `max_reconfig_attempts` times, then the run stops."""
        self._proc = None
        why = str(e)
        start = proc.start
        if (proc.kind == "start" and start is not None and proc.alloc is not None and not e.counts
                and proc.tries + 1 < self.t.max_reconfig_attempts and self.election.is_coordinator):
            # Every peer that refused is left out (or its gossip disagreed): the run is placed
            # again without them, rather than failed for the operator by one member.
            logger.warning("the first hand-out of run %s failed (%s): placing it again", start.op.run_id.hex()[:8], why)
            proc.tries += 1
            proc.alloc, proc.answers, proc.refused, proc.transient = None, {}, "", False
            self._proc = proc
            return self._place_start(proc, start, self._now)
        if proc.kind == "start":
            if start is not None:  # the operator is told it failed: nobody reconfigures it
                return self._start_failed(proc, start, why)
            return [Reply(proc.reply or (), error=why)]
        out: list = [Reply(proc.reply, error=why)] if proc.reply is not None else []
        if proc.resume and proc.cur is not None:  # the operator is told; the run stays stopped
            logger.warning("the resume of run %s failed: %s", proc.cur.run_id.hex()[:8], why)
            self.epoch.mark_stopped(proc.cur.run_id)
            return out
        if e.counts:
            self._attempts += 1
            logger.warning("reconfiguration %d failed: %s", self._attempts, why)
        else:
            logger.warning("reconfiguration failed (retried; it counts toward no limit: the peers' membership views "
                           "differ, or the peers that refused are left out): %s", why)
        cur = self.epoch.current
        if cur is not None and not self._over() and self.election.is_coordinator:
            if self._attempts >= self.t.max_reconfig_attempts:
                proc.cur = cur
                return out + self._stop_run(
                    proc, f"{self.t.max_reconfig_attempts} reconfigurations failed, the last: {why}", proc.trigger)
            self._triggers.extend(r for r in proc.retry or [proc.trigger] if r not in self._triggers)
        return out

    # ---- step reports -------------------------------------------------------------------------

    def _completed_of(self, cur: Allocation) -> int | None:
        """The step log's last completed step of epoch `cur`, None when this peer does not log it."""
        log = self.steplog
        if log is None or (log.alloc.run_id, log.alloc.epoch) != (cur.run_id, cur.epoch):
            return None
        return log.completed

    def _stall_s(self, cur: Allocation) -> float:
        """How long an epoch may complete no step before a failed report stands: STALL_STEPS
        steps (the last logged step's time, else the predicted), at least one check interval."""
        log = self.steplog
        recent = log.recent[-1].get("iteration_s") if log is not None and log.recent else None
        step_s = recent if isinstance(recent, float) and recent > 0 else cur.predicted_iteration_s
        return max(self.t.check_interval_s, STALL_STEPS * step_s)

    def _known(self, cur: Allocation | None) -> Callable[[int], Allocation | None]:
        """epoch -> its allocation of the run of `cur`, if this peer knows it (to check the
        reports the peers keep)."""
        log = self.steplog
        mine = [a for a in (cur, log.alloc if log is not None else None)
                if a is not None and cur is not None and a.run_id == cur.run_id]

        def known(epoch: int) -> Allocation | None:
            for a in mine:
                if a.epoch == epoch:
                    return a
            return self.epoch.allocation_of(cur.run_id, epoch) if cur is not None else None
        return known

    def _step_failed(self, ev: StepFailed, now: float) -> None:
        """A peer says its step failed: checked (control/coordinator/failures.py), then the
        run states are asked at once."""
        cur = self.epoch.current
        if not self.election.is_coordinator or cur is None:
            self.refusals.refuse(Refused.FAILED_OTHER_RUN, ev.peer, "no run coordinated here")
            return
        if self._failures.add(ev.peer, cur, ev.run_id, ev.epoch, ev.reason, self._completed_of(cur), now) is None:
            logger.info("peer %s says a step of epoch %d failed: %s", short_id(ev.peer), cur.epoch, ev.reason[:200])
            self._next_check = now

    def _step(self, ev: StepReported) -> list:
        log = self.steplog
        if log is None or ev.run_id != log.alloc.run_id:
            self.refusals.refuse(Refused.STEP_OTHER_RUN, ev.peer, f"step {ev.report.step}")
            return []
        out: list = []
        for line in log.add(ev.peer, ev.report):
            if self.watch is not None and self.watch.epoch == log.alloc.epoch:
                self.watch.completed(self._now)
            if self.phase is Phase.HANDING_OUT:
                self.phase = Phase.TRAINING
            logger.info("step %d: loss %s, %.2f s, %.0f tokens/s%s", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}", line["iteration_s"] or 0,
                        line["tokens_per_s"] or 0, " (some reports lost)" if line.get("partial") else "")
            out.append(LogLine(line))
            if log.finished and self.phase is not Phase.FINISHED:
                self.phase = Phase.FINISHED
                out.append(Emit(PlaneEvent(EventKind.FINISHED, log.alloc.term, "last step", epoch=log.alloc.epoch,
                                           reason=f"all {log.alloc.end_step} steps completed")))
        if log.gaps and not log.filling:
            logger.warning("no report of steps %s arrived; asking the peers for theirs", sorted(log.gaps))
            log.filling = True
            out.append(self._ask(("gaps", log.alloc.epoch), log.alloc.peers, ControlMsg.RUN_STATE, {"op": "query"},
                                 self.t.request_timeout_s))
        return out

    def _gaps_filled(self, epoch: int, answers: Mapping[bytes, dict]) -> list:
        log = self.steplog
        if log is None or log.alloc.epoch != epoch:
            return []
        log.filling = False
        states = _states(answers)
        lines, left = log.fill([(p, r) for p, st in states.items() for r in st.reports],
                               everyone=True)
        for line in lines:
            logger.info("step %d: loss %s (back-filled from the peers' reports)", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}")
        for step in left:
            logger.warning("no peer kept a report of step %d; a later epoch may back-fill it", step)
        return [LogLine(line) for line in lines]



def first_council(me: bytes, live: set[bytes], regions: Mapping[bytes, str], size: int) -> tuple[bytes, ...]:
    """A first council for an operator's start: this peer, then live peers added as
    `next_council` would add them, up to `size`."""
    voters: tuple[bytes, ...] = (me,)
    while len(voters) < size:
        grown = next_council(voters, live, live | {me}, regions, size, me)
        if grown == voters:
            break
        voters = grown
    return voters


def next_council(old_voters: tuple[bytes, ...], candidates: set[bytes], reachable: set[bytes],
                 regions: Mapping[bytes, str], size: int, me: bytes) -> tuple[bytes, ...]:
    """The next council: one voter from the current one toward `size` live voters spread over
    the regions. An unreachable voter goes out first; else, below `size`, the candidate (a
    reachable peer of the allocation) of the region the council has fewest voters of comes in;
    else, above `size`, a voter of the region it has most of goes out. Never this peer (the
    issuer, elected by the council). One voter a step, so every quorum of the old council meets
    every quorum of the new (election/certificate.py); the rest goes at the next epochs."""
    old = set(old_voters)
    new = set(old)

    def region(p: bytes) -> str:
        return regions.get(p, "")

    def held(r: str, among: set[bytes]) -> int:
        return sum(1 for v in among if region(v) == r)

    def order(p: bytes) -> bytes:  # a stable tie-break every peer computes alike
        return hashlib.blake2b(p, digest_size=8).digest()

    gone = sorted(old - reachable - {me})
    joining = candidates - old - {me}
    if gone:
        new.discard(gone[0])
    elif len(old) < size and joining:
        new.add(min(joining, key=lambda p: (held(region(p), old), order(p))))
    elif len(old) > size:
        leaving = old - {me}
        if leaving:
            new.discard(max(leaving, key=lambda p: (held(region(p), old), order(p))))
    return tuple(sorted(new))


def _states(answers: Mapping[bytes, dict]) -> dict[bytes, PeerRunState]:
    out = {}
    for p, a in answers.items():
        try:
            out[p] = PeerRunState.from_wire(a)
        except ProtocolError as e:
            logger.debug("run state of %s: %s", short_id(p), e)
    return out


def links_for(shape: Placement, compression: CompressionConfig) -> LinkCodecs | None:
    """The allocation's `compress_links`: a per-link run's choice from the planner, or (a planner
    that chose none) every link and group compressed; None for any other run."""
    if not compression.per_link:
        return None
    return shape.links or LinkCodecs.uniform(len(shape.layer_ranges), len(shape.pipelines))


def stopped_after(at_step: int) -> str:
    """Where an operator's stop ends a run, in a reason people read beside `train status`,
    which counts steps from 1: `at_step` (the first step not taken) is the number of steps done."""
    return f"after step {at_step}" if at_step > 0 else "before its first step"


def resume_refusal(asked: bytes, last: bytes | None, *, stopped: bool, over: bool, end_step: int) -> str | None:
    """Why run `asked` cannot be resumed, given the swarm's last run (`last`, as this peer
    applied it) and how it ended; None when it can (pure)."""
    if last is None:
        return f"unknown run {asked.hex()[:8]}: this swarm has run nothing yet"
    if asked != last:
        return (f"unknown run {asked.hex()[:8]}: only the swarm's last run ({last.hex()[:8]}) can be resumed "
                "(its peers hold its stages)")
    if stopped:
        return None
    if over:
        return f"run {asked.hex()[:8]} finished its {end_step} steps: start a new run to train more"
    return f"run {asked.hex()[:8]} is still running: `train stop` it first, or let it be"


def _refusal_code(answer: Mapping) -> str | None:
    """A refusing peer's code (untrusted: a short lower-case word), "malformed" for any other
    value, None when it gave none (it did not answer in time)."""
    code = answer.get("code")
    if code is None:
        return None
    if isinstance(code, str) and _REFUSAL_CODE.fullmatch(code):
        return code
    return "malformed"


def _num(v: object) -> float:
    """A count or a duration a peer reported, or 0 for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    return float(v) if 0 <= v < 1e18 else 0.0
