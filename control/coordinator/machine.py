"""The coordinator side of the control plane as a sans-IO machine (see docs/control.md, "The
coordinator machine").

`Coordinator` decides what the coordinator does while the election makes this peer one. It is a
small core that routes each event to the part that owns the state it concerns:

- `OperatorQueue` (operator_queue.py): the operators' requests, their cheap checks and the queue
  of those waiting for the procedure in progress, the starts taken, the operators' stops, the
  peers leaving;
- `Procedures` (procedure.py): the run's phase, the one hand-out or reconfiguration in progress
  (ALLOCATION, then START; STOPPING -> PLANNING -> OFFERING -> HANDING_OUT -> TRAINING, or PAUSED,
  STOPPED), the retry count, the pause, the step log of the epoch it handed out and the last
  reconfiguration;
- `RunWatch` (watch.py): triggers and their gathering, the probes (`Probe`), the check and drift
  timers, the step deadline, the cut links, the failed-step reports and the wave of joins.

It owns the run's counters (`counters`), the STEP input it refused (`refusals`) and the peers
left out for refusing an allocation (`left_out`, leftout.py). It asks peers (`Ask`) and runs the
scheduler (`Compute`) through the shell, which feeds the answers back under the request's key
(keys.py), routed by the key's type. It reads the election and the gossiped swarm and changes
neither; it reads this peer's epoch machine and changes it only by the events it feeds it: that
the run is over without finishing (`RunClosed`: an operator's stop, a run that cannot go on, a
failed start or resume) or is not any more (`RunReopened`: an operator's resume), and that it
took an operator's resume or reschedule (`OperationTaken`, so that a replay is refused). Whether
the run is over is decided in one place, `run_over` (phase.py).

Operator operations (`StartRun`, `Reschedule`, `ResumeRun`, `StopRun`) carry the operator's signed
operation (control/operator.py). Each is refused at once, before any costly work (the scheduler's
`Compute`, an `Ask`), unless it is signed by an operator of the swarm, for the run it acts on,
within the clock-skew window, not taken before, and no other operation of its kind is waiting; a
stop, resume or reschedule also only when signed after the run's last resume or reschedule, which
every later allocation of the run carries (`last_op_ms`), so a new coordinator knows it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from dtfm.net import short_id

from ..actions import Answers, Computed, CoordinatorAction, Emit, LogLine, Reply
from ..allocation import Allocation, SignedAllocation
from ..answers import PeerAnswer
from ..epoch.machine import ElectionView, EpochMachine
from ..epoch.report import StepReport
from ..events import EventKind, PlaneEvent
from ..messages import ControlMsg
from ..refusals import Refusals, Refused
from .allocate import MAX_ABSENT, MAX_OFFER_HOLDERS, first_council, links_for, next_council
from .answers import kept, run_states, why
from .context import CoordinatorTimings, Planner, Reads, Swarm, WallClock
from .counters import RunCounters
from .deadline import StepWatch
from .handout import MEMBERSHIP_REFUSALS, HandOut
from .joins import JoinWave
from .keys import Drift, Gaps, JoinPlan, Keep, OperatorStop, ProbeKey, ProcStep
from .leftout import LeftOut
from .links import CutLinks
from .operator_queue import (
    OperatorQueue, PeerLeaving, QueuedStart, Reschedule, ResumeRun, StartRun, StopRun, resume_refusal, stopped_after,
)
from .phase import CoordinatorStatus, Phase, run_over
from .procedure import Procedures
from .record import Kind, Order
from .steplog import GAP_ATTEMPTS, StepLog
from .watch import Reconfigure, RunWatch, completed_of

__all__ = [
    "MAX_ABSENT", "MAX_OFFER_HOLDERS", "Coordinator", "CoordinatorEvent", "CoordinatorStatus", "CoordinatorTick",
    "CoordinatorTimings", "Elected", "PeerLeaving", "Phase", "Planner", "Reschedule", "ResumeRun", "StartRun",
    "StepFailed", "StepReported", "SteppedDownEvent", "StopRun", "Swarm", "Trigger", "Wake", "first_council",
    "links_for", "next_council", "resume_refusal", "stopped_after",
]

logger = logging.getLogger(__name__)


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoordinatorTick:
    """Time passed: the machine looks at its timers (`next_deadline` says when it wants one)."""


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


CoordinatorEvent = (CoordinatorTick | Wake | Trigger | StepReported | StepFailed | Elected | SteppedDownEvent
                    | StartRun | Reschedule | ResumeRun | StopRun | PeerLeaving | Answers | Computed)


class Coordinator:
    """The coordinator's decisions: the core that owns the parts (see the module docstring).
    `sign` signs an allocation with this peer's key; `wall_offset` turns the machine's `now` into
    wall-clock time for records and for the operators' signed times (the shell sets it once it
    knows it); `operators`: the swarm's operators' public keys."""

    def __init__(self, me: bytes, sign: Callable[[Allocation], SignedAllocation], election: ElectionView,
                 epoch: EpochMachine, swarm: Swarm, planner: Planner, timings: CoordinatorTimings, *,
                 wall_offset: float = 0.0, operators: frozenset[bytes] = frozenset()):
        self.me = me
        self.election = election
        self.epoch = epoch
        self.swarm = swarm
        self.timings = timings
        self._clock = WallClock(wall_offset)
        ids = itertools.count()
        reads = Reads(me, election, epoch, swarm, planner, timings, frozenset(operators), self._clock,
                      lambda: next(ids))
        self._reads = reads
        self._now = 0.0
        self.counters = RunCounters()
        self.refusals = Refusals()  # STEP reports and failures refused
        # peers that refused an allocation: not placed until their back-off ends (leftout.py)
        self.left_out = LeftOut(timings.refused_backoff_s, timings.refused_backoff_max_s,
                                membership_codes=MEMBERSHIP_REFUSALS)
        self.queue = OperatorQueue(reads, lambda: self.phase, self.over, self.logged_completed)
        self.run_watch = RunWatch(reads, self, self.refusals)
        self.hand = HandOut(reads, sign, self.run_watch, self.left_out, self.counters, self.refusals)
        self.procedure = Procedures(reads, self.hand, self.run_watch, self.queue, self.left_out, self.over)

    @property
    def wall_offset(self) -> float:
        return self._clock.offset

    @wall_offset.setter
    def wall_offset(self, offset: float) -> None:
        self._clock.offset = offset

    # ---- queries ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self.procedure.proc is not None

    @property
    def phase(self) -> Phase:
        return self.hand.phase

    @property
    def reason(self) -> str:
        return self.hand.reason

    @property
    def steplog(self) -> StepLog | None:
        """The step log of the epoch this peer handed out last."""
        return self.hand.steplog

    @property
    def logged(self) -> Mapping[bytes, set[int]]:
        return self.hand.logged

    @property
    def paused_live(self) -> frozenset[bytes] | None:
        return self.procedure.paused_live

    @property
    def paused_retry_at(self) -> float:
        return self.procedure.paused_retry_at

    @property
    def watch(self) -> StepWatch | None:
        """The step deadline of the epoch this peer started."""
        return self.run_watch.step_watch

    @property
    def links(self) -> CutLinks:
        return self.run_watch.links

    @property
    def joins(self) -> JoinWave:
        return self.run_watch.joins

    def next_deadline(self) -> float:
        """When the machine wants a Tick (it waits for answers meanwhile, not for time)."""
        proc = self.procedure.proc
        log = self.steplog
        gaps = log.gap_retry_at() if log is not None and self.election.is_coordinator else math.inf
        if proc is not None:
            return min(t for t in (proc.place_at, proc.stop.poll_at, gaps) if t is not None)
        return min(self.run_watch.deadline(), gaps)

    def left_out_now(self, now: float) -> frozenset[bytes]:
        """The peers left out of allocations at `now` because they refused one (leftout.py)."""
        return self.left_out.out(now, self.swarm.incarnations())

    def leaving(self, now: float) -> frozenset[bytes]:
        """The peers that announced a planned leave within `leaving_kept_s`: never placed."""
        return self.queue.leaving(now)

    def start_refusal(self) -> str | None:
        """Why a start cannot be taken now (no coordinator, a run in progress), or None."""
        return self.queue.start_refusal(self._now)

    @property
    def shape_note(self) -> str:
        """Why the last run this coordinator started has its shape (empty when it chose none)."""
        return self.hand.shape_note

    def operator_stop_step(self, run_id: bytes) -> int | None:
        """The steps `run_id` has done when an operator's stop of it ends it, or None."""
        return self.queue.operator_stop_step(run_id)

    def logged_completed(self, run_id: bytes) -> int | None:
        log = self.steplog
        return log.completed if log is not None and log.alloc.run_id == run_id else None

    def over(self) -> bool:
        """No run, or it finished or is over without finishing: nothing to reconfigure (`run_over`)."""
        return run_over(self.epoch.status(), self.status())

    def status(self) -> CoordinatorStatus:
        log, now = self.steplog, self._now
        phase, reason = self.phase, self.reason
        stall = self.run_watch.stall(reason, now)
        if (log is not None and phase not in (Phase.FINISHED, Phase.IDLE, Phase.STOPPED, Phase.REFUSED)
                and self.epoch.over_without_finishing(log.alloc.run_id)):
            # A run that is over (an operator's train stop, a start that failed) is stopped
            # wherever its procedure was: not training, nor stalled while the peers run to the
            # stop's step.
            phase, stall = Phase.STOPPED, {}
            at = self.queue.operator_stop_step(log.alloc.run_id)
            if at is not None:
                reason = f"an operator stopped the run {stopped_after(at)} (train stop)"
            else:
                reason = reason or "the run was stopped (an operator's train stop, or it could not go on)"
        counts = self.counters.current
        return CoordinatorStatus(
            phase=phase, run_id=log.alloc.run_id if log else None, epoch=log.alloc.epoch if log else None,
            reason=reason, completed=log.completed if log else None, end_step=log.alloc.end_step if log else None,
            recent=tuple(log.recent[-8:]) if log else (), started_at=log.started_at if log else None,
            last_reconfig=self.hand.last_reconfig, cut_links=self.links.describe(),
            left_out=self.left_out.snapshot(now, self.wall_offset),
            counts=counts if log is not None and counts is not None and counts.run_id == log.alloc.run_id else None,
            kept_out=tuple(sorted(self.run_watch.joins.declined)), **stall)

    # ---- events -------------------------------------------------------------------------------

    def handle(self, event: CoordinatorEvent, now: float) -> list[CoordinatorAction]:
        self._now = now
        out: list = []
        if isinstance(event, CoordinatorTick | Wake):
            if isinstance(event, Wake):
                self.run_watch.wake(now)
            out += self.procedure.poll(now)
        elif isinstance(event, Trigger):
            self.run_watch.trigger(event.reason, now)
        elif isinstance(event, StepReported):
            out += self._step(event)
        elif isinstance(event, StepFailed):
            self._step_failed(event, now)
        elif isinstance(event, Elected):
            out.append(Emit(PlaneEvent(EventKind.COORDINATOR, event.term, "elected")))
            cur = self.epoch.current
            if cur is not None and not self.over():
                self.run_watch.elected(event.term, now, own_epoch=cur.issuer == self.me and self.steplog is not None)
        elif isinstance(event, SteppedDownEvent):
            out.append(Emit(PlaneEvent(EventKind.STEPPED_DOWN, event.term, event.reason)))
        elif isinstance(event, Answers):
            out += self._answers(event, now)
        elif isinstance(event, Computed):
            out += self._computed(event, now)
        else:
            out += self._operator(event, now)
        out += self._next(now)
        out += self._gap_query(now)
        lines = [a.line for a in out if isinstance(a, LogLine)]
        if lines:
            fresh = any(not x.get("backfilled") for x in lines)
            self.counters.logged(bytes.fromhex(lines[0]["run"]), len(lines), self._clock.wall(now) if fresh else None)
        return out

    def _operator(self, event: object, now: float) -> list:
        """An operator's request (or a peer's planned leave): to the queue's checks."""
        proc = self.procedure.proc
        if isinstance(event, StartRun):
            return self.queue.start_asked(event, now, starting=proc is not None and proc.order.start is not None)
        if isinstance(event, Reschedule):
            return self.queue.reschedule_asked(event, now, over=self.over())
        if isinstance(event, StopRun):
            # (a reconfiguration that has not handed its epoch out yet hands nothing out after the
            # stop; one that has waits: the stop ends the new epoch)
            return self._stop_asked(event, now, reconfiguring=proc is not None and proc.kind is Kind.RECONFIGURE
                                    and self.phase is Phase.HANDING_OUT)
        if isinstance(event, ResumeRun):
            return self.queue.resume_asked(event, now, over=self.over(),
                                           resuming=proc is not None and proc.order.resume)
        if isinstance(event, PeerLeaving):
            return self.queue.leave_asked(event, now, done=self._leave_done(event.peer))
        raise TypeError(f"not a coordinator event: {event!r}")

    def _answers(self, ev: Answers, now: float) -> list:
        key = ev.key
        if isinstance(key, ProcStep):
            return self.procedure.answered(key, ev.answers, now)
        if isinstance(key, ProbeKey):
            return self._go(self.run_watch.probed(key.kind, ev.answers, now), now)
        if isinstance(key, Gaps):
            return self._gaps_filled(key.epoch, ev.answers, now)
        if isinstance(key, OperatorStop):
            return self.queue.stopped(key, ev.answers)
        if isinstance(key, Keep):
            for p, a in sorted(ev.answers.items()):
                if not kept(a):
                    logger.warning("%s did not keep its stage on disk: %s", short_id(p), why(a))
        return []  # (a fence's answers change nothing)

    def _computed(self, ev: Computed, now: float) -> list:
        if isinstance(ev.key, Drift):
            return self._go(self.run_watch.drift_computed(ev.value, ev.error), now)
        if isinstance(ev.key, JoinPlan):
            return self._go(self.run_watch.join_planned(ev.key, ev.value, ev.error), now)
        if isinstance(ev.key, ProcStep):
            return self.procedure.computed(ev, ev.key, now)
        return []

    def _go(self, watched: list | Reconfigure, now: float) -> list:
        """What the watch asks, or the reconfiguration it calls for."""
        if isinstance(watched, Reconfigure):
            return self.procedure.reconfigure(watched.trigger, now, Order(retry=watched.retry))
        return watched

    # ---- the loop: what to do next ------------------------------------------------------------

    def _next(self, now: float) -> list:
        """Once no procedure runs and no probe is out: the operator's request whose turn it is,
        else what the watch sees."""
        if self.procedure.proc is not None or self.run_watch.probing:
            return []
        if not self.queue:
            return self._go(self.run_watch.next(now), now)
        op = self.queue.pop()
        if isinstance(op, StopRun):  # (it waited for a reconfiguration)
            return self._stop_asked(op, now, reconfiguring=False)
        if isinstance(op, QueuedStart):
            return self.procedure.start(op, now)
        if isinstance(op, PeerLeaving):
            return self._hand_off(op, now)
        if not self.election.is_coordinator:
            return [Reply(op.key, error="this peer is no longer the coordinator")]
        if isinstance(op, ResumeRun):
            return self.procedure.resume(op.key, now)
        if self.epoch.current is None or self.over():
            return [Reply(op.key, error="no training run is in progress")]
        return self.procedure.reconfigure("operator asked", now, Order(reply=op.key, force=True))

    def _stop_asked(self, ev: StopRun, now: float, *, reconfiguring: bool) -> list:
        cur = self.epoch.current
        return self.queue.stop_asked(ev, now, over=self.over(), reconfiguring=reconfiguring,
                                     logged_completed=self.logged_completed(cur.run_id) if cur else None)

    def _leave_done(self, peer: bytes) -> bool:
        """Whether the leaving peer has no stage in the run in progress (a spare goes without a
        reconfiguration: no step waits for it, and the next allocation leaves it out)."""
        cur = self.epoch.current
        return cur is None or self.over() or peer not in cur.peers

    def _hand_off(self, ev: PeerLeaving, now: float) -> list:
        """The queued leave's turn: a reconfiguration without the leaving peer, unless an
        earlier one left it out already."""
        if self._leave_done(ev.peer):
            return self.queue.left(ev)
        self.queue.hand_off(ev, now)
        return self.procedure.reconfigure(f"peer {short_id(ev.peer)} left (planned)", now,
                                          Order(reply=ev.key, leave=True))

    # ---- step reports -------------------------------------------------------------------------

    def _step_failed(self, ev: StepFailed, now: float) -> None:
        """A peer says its step failed: checked by the watch (failures.py), then the run states
        are asked at once."""
        cur = self.epoch.current
        if not self.election.is_coordinator or cur is None:
            self.refusals.refuse(Refused.FAILED_OTHER_RUN, ev.peer, "no run coordinated here")
            return
        self.run_watch.step_failed(ev.peer, cur, ev.run_id, ev.epoch, ev.reason, completed_of(self.steplog, cur), now)

    def _step(self, ev: StepReported) -> list:
        log = self.steplog
        if log is None or ev.run_id != log.alloc.run_id:
            self.refusals.refuse(Refused.STEP_OTHER_RUN, ev.peer, f"step {ev.report.step}")
            return []
        out: list = []
        for line in log.add(ev.peer, ev.report):
            self.run_watch.step_completed(log.alloc.epoch, self._now)
            finished = self.hand.logged_step(log.finished)
            logger.info("step %d: loss %s, %.2f s, %.0f tokens/s%s", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}", line["iteration_s"] or 0,
                        line["tokens_per_s"] or 0, " (some reports lost)" if line.get("partial") else "")
            out.append(LogLine(line))
            if finished:
                out.append(Emit(PlaneEvent(EventKind.FINISHED, log.alloc.term, "last step", epoch=log.alloc.epoch,
                                           reason=f"all {log.alloc.end_step} steps completed")))
        return out

    def _gap_query(self, now: float) -> list:
        """Ask the epoch's peers for the reports they keep when the step log's gaps are due
        (steplog.py: at once, again while some peer does not answer, spaced after a few tries),
        and record the gaps it gave up. A coordinator that stepped down asks while its epoch
        is still the one this peer runs (on its events only: its timer is the coordinator's);
        once a successor handed out another, that hand-out's back-fill is the successor's."""
        log = self.steplog
        if log is None:
            return []
        out = self._unlogged(log)
        cur = self.epoch.current
        ours = cur is not None and (cur.run_id, cur.epoch) == (log.alloc.run_id, log.alloc.epoch)
        if (self.election.is_coordinator or ours) and log.gap_query_due(now):
            logger.warning("no report of steps %s arrived; asking the peers for theirs%s", _steps(log.gaps),
                           f" (attempt {log.gap_attempts + 1})" if log.gap_attempts else "")
            log.asking()
            out.append(self._reads.ask(Gaps(log.alloc.epoch), log.alloc.peers, ControlMsg.RUN_STATE, {"op": "query"},
                                       self.timings.request_timeout_s))
        return out

    def _gaps_filled(self, epoch: int, answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        log = self.steplog
        if log is None or log.alloc.epoch != epoch:
            return []
        states = run_states(answers)
        lines = log.fill({p: st.reports for p, st in states.items()}, now, self.timings.check_interval_s)
        for line in lines:
            logger.info("step %d: loss %s (back-filled from the peers' reports)", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}")
        if log.gaps and log.gap_attempts >= GAP_ATTEMPTS:
            logger.warning("steps %s are not logged yet (%d of %d peers answered); asking again in %.1f s",
                           _steps(log.gaps), len(states), len(log.alloc.peers), log.gap_retry_at() - now)
        return [LogLine(line) for line in lines]

    def _unlogged(self, log: StepLog) -> list:
        """The gaps the step log gave up (no peer keeps a report of them): a WARNING, the run's
        count and an `unlogged` event, never a silent hole in the log."""
        lost = log.take_lost()
        if not lost:
            return []
        logger.warning("steps %s of run %s cannot be logged: no peer of epoch %d keeps a report of them",
                       _steps(lost), log.alloc.run_id.hex()[:8], log.alloc.epoch)
        self.counters.unlogged(log.alloc.run_id, len(lost))
        return [Emit(PlaneEvent(EventKind.UNLOGGED, log.alloc.term, "step reports lost", epoch=log.alloc.epoch,
                                reason=f"no peer keeps a report of steps {_steps(lost)}", steps=tuple(lost)))]


def _steps(steps: Iterable[int]) -> str:
    """Steps in a log line: the first few, and how many in all."""
    shown = sorted(steps)
    return ", ".join(map(str, shown[:8])) + (f" ... ({len(shown)} steps)" if len(shown) > 8 else "")
