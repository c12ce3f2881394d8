"""The operators' requests to the coordinator: their cheap checks, taken at once, and the queue
of those that wait for the procedure in progress (see docs/control.md, "Operators").

`OperatorQueue` owns the waiting requests (one of each kind, a leave per peer), the run ids of
the signed starts it took (while their signature could be replayed), the operators' stops out
and the last one taken, and the peers that announced a planned leave. Each `*_asked` check
answers at once (`Reply`) or queues the request; the coordinator takes queued requests in turn
(`pop`) once no procedure runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dtfm.net import short_id
from dtfm.train import GPTSpec, get_preset

from ..actions import Emit, Reply
from ..answers import PeerAnswer
from ..epoch.machine import OperationTaken, RunClosed
from ..events import EventKind, PlaneEvent
from ..messages import ControlMsg
from ..operator import OperatorError, OperatorOp, SignedOp, check_op, check_time
from .answers import stopped
from .context import Reads, named
from .keys import OperatorStop
from .phase import IN_PROGRESS, Phase
from .request import TrainRequest

__all__ = ["MAX_LEAVING", "MAX_STARTS_KEPT", "OperatorQueue", "PeerLeaving", "QueuedStart", "Reschedule",
           "ResumeRun", "StartRun", "StopRun", "resume_refusal", "stopped_after"]

logger = logging.getLogger(__name__)

MAX_STARTS_KEPT = 64  # run ids of signed starts taken, kept while they could be replayed
MAX_LEAVING = 64  # peers that announced a planned leave, remembered (each for leaving_kept_s)


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
class QueuedStart:
    """A start that passed the cheap checks, waiting for the procedure in progress."""

    key: tuple
    signed: SignedOp
    op: OperatorOp
    req: TrainRequest
    data_name: str
    model: GPTSpec


Queued = QueuedStart | Reschedule | ResumeRun | PeerLeaving | StopRun


class OperatorQueue:
    """The operators' requests (see the module docstring). `over()` in the checks: whether the
    current run is over (the coordinator's `run_over`)."""

    def __init__(self, reads: Reads, phase: Callable[[], Phase] = lambda: Phase.IDLE,
                 over: Callable[[], bool] = lambda: True,
                 completed: Callable[[bytes], int | None] = lambda run_id: None) -> None:
        self.r = reads
        # the phase of the run this coordinator handed out, and whether it is over: whether or not
        # this peer holds a stage of it (the scheduler may leave it a spare)
        self._phase = phase
        self._over = over
        self._completed = completed  # a run's last step every stage completed, by the step log (or None)
        self._queue: list[Queued] = []  # one of each kind (a leave per peer)
        self._leaving: dict[bytes, float] = {}  # peer that announced a planned leave -> kept out until
        self._starts_taken: dict[bytes, float] = {}  # run id of a signed start -> until when it could be replayed
        self._stops: dict[OperatorStop, tuple[tuple, int]] = {}  # STOP request -> (operator's key, boundary)
        self._operator_stop: tuple[bytes, int] | None = None  # (run, boundary) of the last operator's stop taken
        # (run, boundary, until) of an operator's stop of a run whose peers were stepping: they run
        # up to the boundary, at most until `until` (`stop_timeout_s` after the stop)
        self._landing: tuple[bytes, int, float] | None = None

    def __bool__(self) -> bool:
        return bool(self._queue)

    def pop(self) -> Queued:
        """The request whose turn it is."""
        return self._queue.pop(0)

    def start_waiting(self) -> bool:
        return any(isinstance(q, QueuedStart) for q in self._queue)

    # ---- train start --------------------------------------------------------------------------

    def start_asked(self, ev: StartRun, now: float, *, starting: bool) -> list:
        """The cheap refusals of an operator's start, at once: its signature, operator and time,
        a start taken before, no coordinator, a run in progress, another start waiting
        (`starting`: one runs), data this peer does not hold. Then it waits for the procedure in
        progress, if any."""
        wall = self.r.clock.wall(now)
        try:
            op = check_op(ev.op, "start", self.r.operators)
            req = op.request()
            check_time(op, wall, self.r.timings.operator_skew_s, extra_s=req.wait_s)
            if op.run_id in self.r.epoch.applied or self._starts_taken.get(op.run_id, -math.inf) >= wall:
                raise OperatorError(f"run {op.run_id.hex()[:8]} was started already: sign a new start")
        except (OperatorError, ValueError) as e:
            logger.warning("refused a train start: %s", e)
            return [Reply(ev.key, error=str(e))]
        refusal = self.start_refusal(now)
        if refusal is None and (self.start_waiting() or starting):
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
        self._queue.append(QueuedStart(ev.key, ev.op, op, req, ev.data_name, model or get_preset(req.preset)))
        return []

    def start_refusal(self, now: float) -> str | None:
        """Why a start cannot be taken now (no coordinator, a run in progress, a run an operator
        stopped still running to its boundary), or None."""
        if not self.r.election.is_coordinator:
            return "this peer is no longer the coordinator"
        run = self.r.epoch.run
        if run is not None and run.active:
            if self.r.epoch.over_without_finishing(run.alloc.run_id):
                return _stopping(run.alloc.run_id)
            return "a run is in progress: `train stop` it first"
        if self._landing_stop(now):
            # (this peer holds no stage of the run, a spare: the run's peers are still stepping
            # to the stop's boundary, and a new allocation would end their epoch before it)
            assert self._landing is not None
            return _stopping(self._landing[0])
        if self._phase() in IN_PROGRESS and not self._over():
            return "a run is in progress: `train stop` it first"
        return None

    def _landing_stop(self, now: float) -> bool:
        """An operator's stop of the current run taken while its peers stepped, this peer none
        of them (a stage holder waits for its own runner to end), the step log not yet at the
        stop's boundary, and `stop_timeout_s` not passed since (a peer lost on the way never
        completes those steps; nobody reconfigures a stopped run)."""
        landing, cur = self._landing, self.r.epoch.current
        if (landing is None or cur is None or cur.run_id != landing[0] or self.r.me in cur.peers
                or now >= landing[2]):
            return False
        done = self._completed(landing[0])
        return done is None or done + 1 < landing[1]

    def take_start(self, op: OperatorOp, now: float, wait_s: float) -> None:
        """Remember a start's run id while its signature could be taken again."""
        wall = self.r.clock.wall(now)
        self._starts_taken = {r: t for r, t in self._starts_taken.items() if t >= wall}
        while len(self._starts_taken) >= MAX_STARTS_KEPT:
            self._starts_taken.pop(min(self._starts_taken, key=self._starts_taken.__getitem__))
        self._starts_taken[op.run_id] = op.issued_at_s + self.r.timings.operator_skew_s + wait_s

    # ---- reschedule, stop, resume -------------------------------------------------------------

    def reschedule_asked(self, ev: Reschedule, now: float, *, over: bool) -> list:
        """An operator's reschedule of the current run, within the skew window, signed after the
        run's last resume or reschedule and not taken before (this peer's record and the
        allocation's `last_op_ms`, so a new coordinator refuses a copy too); then it waits for
        the procedure in progress, if any."""
        cur = self.r.epoch.current
        try:
            if not self.r.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            if cur is None or over:
                raise OperatorError("no training run is in progress")
            op = check_op(ev.op, "reschedule", self.r.operators, run_id=cur.run_id)
            signed = self._fresh(ev.op, op, now)
            if any(isinstance(q, Reschedule) for q in self._queue):
                raise OperatorError("another reschedule is waiting: try again once it is answered")
        except OperatorError as e:
            logger.warning("refused a train reschedule: %s", e)
            return [Reply(ev.key, error=str(e))]
        self.r.epoch.handle(OperationTaken(op, signed, self.r.clock.wall(now), self.r.timings.operator_skew_s), now)
        self._queue.append(ev)
        return []

    def _fresh(self, signed: SignedOp | None, op: OperatorOp, now: float) -> SignedOp:
        """`signed` when its operation may be taken now (`EpochMachine.op_refusal`: the skew
        window, after the run's last resume or reschedule, not taken before); else OperatorError."""
        assert signed is not None  # (check_op opened it)
        why = self.r.epoch.op_refusal(op, signed, self.r.clock.wall(now), self.r.timings.operator_skew_s)
        if why is not None:
            raise OperatorError(why)
        return signed

    def stop_asked(self, ev: StopRun, now: float, *, over: bool, logged_completed: int | None,
                   reconfiguring: bool = False) -> list:
        """An operator's stop of the current run, within the skew window, signed after the run's
        last resume or reschedule and not taken before (a copied stop cannot end a resumed run):
        STOP, with the operator's signed stop, to every peer of the run before the same step
        (each checks it by the same rules and keeps it, this peer's epoch machine too, which is
        told the run is over at once); nobody reconfigures the run after it. While a
        reconfiguration hands its epoch out (`reconfiguring`) the stop waits for it, first in
        the queue: the new epoch's allocation, applied after the stop, would start the run again
        on the peers it reached (a new epoch of a stopped run resumes it), while the stop ended
        the old epoch on the others."""
        cur = self.r.epoch.current
        try:
            if not self.r.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            if cur is None:
                raise OperatorError("no training run is in progress")
            op = check_op(ev.op, "stop", self.r.operators, run_id=cur.run_id)
            signed = self._fresh(ev.op, op, now)  # (a copy is refused as such, the run over or not)
            if over:
                raise OperatorError("no training run is in progress")
            if reconfiguring and any(isinstance(q, StopRun) for q in self._queue):
                raise OperatorError("another stop is waiting for the reconfiguration in progress: try again once it "
                                    "is answered")
        except OperatorError as e:
            logger.warning("refused a train stop: %s", e)
            return [Reply(ev.key, error=str(e))]
        if reconfiguring:
            logger.info("an operator's stop of run %s waits for the reconfiguration in progress", cur.run_id.hex()[:8])
            self._queue.insert(0, ev)
            return []
        at = self.r.epoch.stop_boundary(logged_completed)
        self.r.epoch.handle(RunClosed(cur.run_id, f"an operator stopped the run {stopped_after(at)}"), now)
        self._operator_stop = (cur.run_id, at)
        self._landing = (cur.run_id, at, now + self.r.timings.stop_timeout_s) if self._phase() is Phase.TRAINING else None
        key = OperatorStop(self.r.next_id())
        self._stops[key] = (ev.key, at)
        logger.info("an operator stops run %s before step %d", cur.run_id.hex()[:8], at)
        emit = Emit(PlaneEvent(EventKind.OPERATOR_STOP, self.r.election.term, "train stop", epoch=cur.epoch,
                               reason=f"an operator stopped the run {stopped_after(at)}"))
        return [emit, self.r.ask(key, named(cur) | {cur.issuer, self.r.me}, ControlMsg.STOP,
                                 {"run": cur.run_id, "at_step": at, "final": True, "op": signed.to_wire()},
                                 self.r.timings.request_timeout_s)]

    def stopped(self, key: OperatorStop, answers: Mapping[bytes, PeerAnswer]) -> list:
        """The answers to an operator's stop: how many peers took it."""
        reply_key, at = self._stops.pop(key, ((), 0))
        told = sum(1 for a in answers.values() if stopped(a))
        return [Reply(reply_key, {"at_step": at, "told": told})]

    def operator_stop_step(self, run_id: bytes) -> int | None:
        """The steps `run_id` has done when an operator's stop of it ends it (its peers run up
        to there after the stop was taken), or None when no operator stopped it."""
        stop = self._operator_stop
        return stop[1] if stop is not None and stop[0] == run_id else None

    def resume_asked(self, ev: ResumeRun, now: float, *, over: bool, resuming: bool) -> list:
        """An operator's resume of the run an operator stopped (the swarm's last run), within
        the skew window, signed after the run's last resume or reschedule and not taken before
        (kept, and carried by the resumed epoch's allocation); then it waits for the procedure
        in progress (`resuming`: a resume runs), if any."""
        cur = self.r.epoch.current
        try:
            if not self.r.election.is_coordinator:
                raise OperatorError("this peer is no longer the coordinator")
            op = check_op(ev.op, "resume", self.r.operators)
            signed = self._fresh(ev.op, op, now)
            refusal = resume_refusal(op.run_id, cur.run_id if cur is not None else None,
                                     stopped=cur is not None and self.r.epoch.over_without_finishing(cur.run_id),
                                     over=over, end_step=cur.end_step if cur is not None else 0)
            if refusal is not None:
                raise OperatorError(refusal)
            if any(isinstance(q, ResumeRun) for q in self._queue) or resuming:
                raise OperatorError("another resume is in progress: try again once it is answered")
        except OperatorError as e:
            logger.warning("refused a train resume: %s", e)
            return [Reply(ev.key, error=str(e))]
        self.r.epoch.handle(OperationTaken(op, signed, self.r.clock.wall(now), self.r.timings.operator_skew_s), now)
        self._queue.append(ev)
        return []

    # ---- planned leave ------------------------------------------------------------------------

    def leaving(self, now: float) -> frozenset[bytes]:
        """The peers that announced a planned leave within `leaving_kept_s`: never placed."""
        return frozenset(p for p, t in self._leaving.items() if t > now)

    def _forget_left(self, now: float) -> None:
        self._leaving = {p: t for p, t in self._leaving.items() if t > now}

    def leave_asked(self, ev: PeerLeaving, now: float, *, done: bool) -> list:
        """A peer's planned leave: kept out of allocations from now on; when the current run
        names it (not `done`), a reconfiguration without it at a step boundary (after the
        procedure in progress), else (a spare, a peer outside the run) answered at once."""
        if not self.r.election.is_coordinator:
            return [Reply(ev.key, error="this peer is no longer the coordinator")]
        self._forget_left(now)
        if ev.peer not in self._leaving:
            while len(self._leaving) >= MAX_LEAVING:
                self._leaving.pop(min(self._leaving, key=self._leaving.__getitem__))
        self._leaving[ev.peer] = now + self.r.timings.leaving_kept_s
        logger.info("peer %s leaves (planned)", short_id(ev.peer))
        if done:
            return self.left(ev)
        for q in [q for q in self._queue if isinstance(q, PeerLeaving) and q.peer == ev.peer]:
            self._queue.remove(q)  # asked again: the newer request is the one answered
        self._queue.append(ev)
        return []

    def left(self, ev: PeerLeaving) -> list:
        """A leave that needs no reconfiguration (the run does not place the peer): answered."""
        cur = self.r.epoch.current
        return [Reply(ev.key, {"handed_off": False}),
                Emit(PlaneEvent(EventKind.LEAVE, self.r.election.term, f"peer {short_id(ev.peer)} left (planned)",
                                epoch=cur.epoch if cur is not None else None))]

    def hand_off(self, ev: PeerLeaving, now: float) -> None:
        """The queued leave's turn: its peer is kept out while its hand-off runs."""
        self._forget_left(now)
        self._leaving.setdefault(ev.peer, now + self.r.timings.leaving_kept_s)


def stopped_after(at_step: int) -> str:
    """Where an operator's stop ends a run, in a reason people read beside `train status`,
    which counts steps from 1: `at_step` (the first step not taken) is the number of steps done."""
    return f"after step {at_step}" if at_step > 0 else "before its first step"


def _stopping(run_id: bytes) -> str:
    return (f"run {run_id.hex()[:8]} is stopping at a step boundary: start again once it has ended "
            "(`dtfm-peer train status`)")


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
