"""The peer side of the control plane as a sans-IO machine: this peer's part in each epoch
(see docs/control.md, "The epoch machine").

`EpochMachine` owns what the peer decided and knows about the run: the (term, epoch) it applied
per run, its current and previous epoch (the allocation and what its stage is at), the step
reports it keeps, how its last epoch ended, whether the run is over without finishing (an
operator's stop, or its coordinator's `RunClosed`: this machine alone keeps that fact), the last
allocations it applied and the RUN_STATE requests it refused. It decides whether to accept an
allocation (an operator of the swarm must have started its run), where the stage comes from,
who may start and stop it (a run's final stop only from the recognised coordinator, carrying the
operator's signed stop of that run), what it answers to RUN_STATE and to whom
(control/epoch/access.py), and when to stop training because its coordinator is gone. The stage
itself (tensors, comm, runner thread) belongs to the shell, which reports what happens to it
(`StageBuilt`, `StepDone`, `RunnerEnded`, `EpochDone`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from dtfm.net import short_id

from ..actions import AbortRunner, Reply, Send
from ..allocation import AcceptContext, Allocation, Refusal, check_allocation
from ..answers import AllocationAnswer, StartAnswer, StopAnswer
from ..election import Certificate, Council, CouncilLink
from ..messages import ControlMsg
from ..operator import OperatorError, OperatorOp, SignedOp, check_council, check_op, check_operator_start
from ..refusals import Refusals, Refused
from .access import offer_refusal, run_state_refusal
from .report import RunEnd, StepReport
from .runstate import MAX_REPORTS, PeerRunState
from .taken import TakenOps

__all__ = [
    "MAX_KNOWN_EPOCHS", "RESTORED_ASK_S", "AbortRunner", "AllocationOffered", "ApplyToElection", "BuildFailed",
    "BuildStage", "ElectionView", "EndEpoch", "EpochAction", "EpochEvent", "changes_refusal",
    "EpochDone", "EpochMachine", "EpochPhase", "EpochRecord", "EpochStatus", "FailNeighbour", "MemberGone",
    "PersistApplied", "RunnerEnded", "StageBuilt", "StartAsked", "StartRunner", "StepDone", "StopAsked",
    "EpochTick", "KeepStage", "OperationTaken", "RunClosed", "RunReopened", "StopRunnerAt", "WaitForCoordinator",
]


class ElectionView(Protocol):
    """What the epoch machine and the coordinator read of the election (never change)."""

    @property
    def term(self) -> int: ...
    @property
    def coordinator(self) -> bytes | None: ...
    @property
    def voters(self) -> tuple[bytes, ...]: ...
    @property
    def last_applied(self) -> tuple[int, int]: ...
    @property
    def is_coordinator(self) -> bool: ...
    @property
    def is_follower(self) -> bool: ...
    @property
    def certificate(self) -> Certificate | None: ...
    @property
    def council(self) -> Council | None: ...

    def may_apply(self, issuer: bytes, term: int, epoch: int, certificate: Certificate | None = None,
                  council: Council | None = None) -> Refusal | None: ...

    def council_for(self, voters: Iterable[bytes], epoch: int) -> Council | None: ...


MAX_KNOWN_EPOCHS = 8  # allocations this peer applied that it remembers (to check kept step reports)
# A restarted peer asks its coordinator how the run it restored stands at most this often (a
# run that finished or was stopped without it shows so in its status within about this long).
RESTORED_ASK_S = 10.0


def changes_refusal(council: Council, changes: Iterable[CouncilLink], term: int, epoch: int,
                    live: AbstractSet[bytes]) -> Refusal | None:
    """None if the change of `council` that the allocation of (`term`, `epoch`) makes agrees
    with this peer's gossip: an added voter is a live member, a removed one is not (unless the
    council was above its size); else why not (control/election/council.py). Changes of earlier
    allocations were checked by the peers that saw them made (a peer back from a crash cannot
    tell who was live then)."""
    for link in changes:
        if (link.term, link.epoch) != (term, epoch):
            continue
        for v in sorted(set(link.after) - set(link.before)):
            if v not in live:
                return Refusal("bad-council", f"the council's new voter {short_id(v)} is not a live member of "
                                              "this peer's gossip")
        for v in sorted(set(link.before) - set(link.after)):
            if v in live and len(link.before) <= council.size:
                return Refusal("bad-council", f"the council drops voter {short_id(v)}, which is live in this "
                                              "peer's gossip")
    return None


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocationOffered:
    """A signed allocation arrived (signature checked) or this peer's coordinator hands one to
    itself; `ctx` is what the peer knows (its `applied` is filled in here). Answered by a
    `Reply(key, answer)` once the stage is built, or at once when refused."""

    key: tuple
    alloc: Allocation
    ctx: AcceptContext
    waited_until: float | None = None  # set when re-offered after a WaitForCoordinator
    certificate: Certificate | None = None  # of the issuer's election: carried beside the allocation


@dataclass(frozen=True)
class StageBuilt:
    key: tuple
    epoch: int
    at: int  # the stage's next step
    fetched_bytes: int = 0
    fetch_s: float = 0.0


@dataclass(frozen=True)
class BuildFailed:
    key: tuple
    epoch: int
    code: str  # build-failed | connect-failed
    reason: str


@dataclass(frozen=True)
class StartAsked:
    key: tuple
    sender: bytes
    run_id: object
    epoch: object


@dataclass(frozen=True)
class StopAsked:
    key: tuple
    sender: bytes
    run_id: object
    at_step: int
    final: bool = False  # an operator's stop: the run is over, nobody reconfigures it
    abort: bool = False  # a reconfiguration after a loss: end the step now
    op: SignedOp | None = None  # with `final`: the operator's signed stop of the run
    epoch: int | None = None  # the epoch the sender stops (None: the current one, an operator's stop)


@dataclass(frozen=True)
class StepDone:
    report: StepReport


@dataclass(frozen=True)
class RunnerEnded:
    epoch: int
    end: RunEnd
    wall_time: float


@dataclass(frozen=True)
class EpochDone:
    """The epoch's tasks and worker are over (after RunnerEnded, or cancelled before it ran)."""

    epoch: int


@dataclass(frozen=True)
class MemberGone:
    peer: bytes
    why: str


@dataclass(frozen=True)
class EpochTick:
    """Time passed: the machine looks at its timers (the coordinator's grace, keeping a stage)."""


@dataclass(frozen=True)
class RunClosed:
    """Run `run_id` is over without finishing: this peer's coordinator took an operator's stop of
    it, found it cannot go on, or failed it; or the shell found it so (a stop kept on disk before
    a restart, the coordinator failing). Nobody reconfigures it until an operator resumes it."""

    run_id: bytes
    why: str


@dataclass(frozen=True)
class RunReopened:
    """This peer's coordinator takes an operator's resume of run `run_id`: it is no longer over,
    and its next epoch is handed out."""

    run_id: bytes


@dataclass(frozen=True)
class OperationTaken:
    """This peer's coordinator took an operator's resume or reschedule (`op`, signed as `signed`)
    at wall time `now_s`, within `skew_s` of its signed time: a replay of it is refused from now
    on, a restart included."""

    op: OperatorOp
    signed: SignedOp
    now_s: float
    skew_s: float


EpochEvent = (AllocationOffered | StageBuilt | BuildFailed | StartAsked | StopAsked | StepDone | RunnerEnded
              | EpochDone | MemberGone | EpochTick | RunClosed | RunReopened | OperationTaken)


# ---- actions (besides the shared ones) --------------------------------------------------------


@dataclass(frozen=True)
class WaitForCoordinator:
    """Offer `alloc` again (with `waited_until=until`) at the next election change, or at `until`."""

    offer: AllocationOffered
    until: float


@dataclass(frozen=True)
class EndEpoch:
    """End this peer's epoch `epoch` and wait until its worker let go of the stage."""

    epoch: int
    reason: str


@dataclass(frozen=True)
class PersistApplied:
    """Write the applied allocation durably (DATA_DIR/applied.json) before anything follows."""

    alloc: Allocation


@dataclass(frozen=True)
class ApplyToElection:
    """Tell the election the applied (term, epoch), the council, and the certificate of the
    issuer's election."""

    term: int
    epoch: int
    council: Council
    certificate: Certificate | None = None


@dataclass(frozen=True)
class BuildStage:
    """Build this peer's stage of `alloc` from `prev` (the epoch before, whose stage may serve),
    connect its neighbours, make its runner; then feed StageBuilt or BuildFailed."""

    key: tuple
    alloc: Allocation
    prev: Allocation | None


@dataclass(frozen=True)
class StartRunner:
    epoch: int


@dataclass(frozen=True)
class StopRunnerAt:
    """End the epoch's runner before `step`; `final`: an operator's stop (the run is over, and
    its stage is checkpointed where it ends)."""

    epoch: int
    step: int
    final: bool = False


@dataclass(frozen=True)
class KeepStage:
    """Write what this peer holds of run `run_id` in memory (its stage, its one-step-back
    snapshot) to its data dir, each step not on disk yet: the run waits, and a crash meanwhile
    must not lose it. Its worker has stopped."""

    run_id: bytes


@dataclass(frozen=True)
class FailNeighbour:
    """A neighbour of the running epoch is gone: its receives fail now."""

    peer: bytes
    why: str


# Everything `EpochMachine.handle` returns: the shell executes each of these (and a type checker
# proves it does, control/plane.py's `_execute_now`).
EpochAction = (Reply | Send | WaitForCoordinator | EndEpoch | PersistApplied | ApplyToElection | BuildStage
               | StartRunner | StopRunnerAt | AbortRunner | KeepStage | FailNeighbour)


# ---- state -----------------------------------------------------------------------------------


class EpochPhase(enum.Enum):
    SPARE = "spare"  # placed in no pipeline
    WAITING = "waiting"  # a restarted peer: it knows the run it applied, it holds no stage
    BUILDING = "building"
    ACCEPTED = "accepted"  # built and connected, waiting for START
    TRAINING = "training"
    ENDED = "ended"  # the runner ended; `end` says how
    REFUSED = "refused"  # building or connecting failed


@dataclass
class EpochRecord:
    """This peer's part in one epoch, as the machine knows it."""

    alloc: Allocation
    phase: EpochPhase
    at: int | None = None  # the stage's next step; None: no stage built
    prev: int | None = None  # the step of the runner's one-step-back snapshot
    end: RunEnd | None = None
    done: bool = False  # its tasks and worker are over
    fetched_bytes: int = 0

    @property
    def built(self) -> bool:
        return self.at is not None

    @property
    def active(self) -> bool:
        """Its runner exists and has not ended."""
        return self.phase in (EpochPhase.ACCEPTED, EpochPhase.TRAINING) and not self.done


@dataclass(frozen=True)
class EpochStatus:
    """A typed snapshot for `status`."""

    phase: EpochPhase | None
    alloc: Allocation | None
    step: int | None  # the last step completed (at - 1)
    fetched_bytes: int
    last_report: StepReport | None
    last_end: dict | None
    end: RunEnd | None  # how the current epoch's runner ended
    run_stopped: bool = False  # the current run is over without finishing: an operator's train stop,
    # or the coordinator found it cannot go on (`RunClosed`)
    restored: bool = False  # the current epoch is the one applied before this daemon restarted
    heard: tuple[str, int] | None = None  # (state, steps done) of the restored run, as its coordinator told

    @property
    def run_over(self) -> bool:
        """No run, or it is over: stopped without finishing, or its last step ran here."""
        if self.alloc is None or self.run_stopped:
            return True
        return self.end is not None and self.end.reason == "finished"


class EpochMachine:
    """This peer's part in every epoch (see the module docstring)."""

    def __init__(self, me: bytes, election: ElectionView, *, heartbeat_wait_s: float,
                 coordinator_lost_after_s: float, operators: AbstractSet[bytes] = frozenset(),
                 wall_offset: float = 0.0, operator_skew_s: float = 300.0):
        self.me = me
        self.election = election
        self.operators = frozenset(operators)  # the swarm's operators' public keys
        self.wall_offset = wall_offset  # the machine's `now` + this: wall-clock time, for the operators' times
        self.operator_skew_s = operator_skew_s  # an operator's signed stop is taken this long before or after its time
        self.heartbeat_wait_s = heartbeat_wait_s
        self.coordinator_lost_after_s = coordinator_lost_after_s
        self.applied: dict[bytes, tuple[int, int]] = {}  # run id -> (term, epoch) applied
        self.run: EpochRecord | None = None
        self.prev: EpochRecord | None = None  # the epoch before, whose stage may still serve
        self.reports: collections.deque[StepReport] = collections.deque(maxlen=MAX_REPORTS)
        self.last_end: dict | None = None
        # the run that is over without finishing: an operator stopped it, or it cannot go on
        self._over_without_finishing: bytes | None = None
        self._lost_since: float | None = None  # when this peer stopped recognising its epoch's coordinator
        self._ended_since: float | None = None  # when the current epoch's runner ended, until it is kept on disk
        self._kept_epoch: int | None = None  # the last epoch whose stage this peer kept on disk while it waited
        self._restarted = False  # restored a stage's place, not the stage: the coordinator is told once
        self._restored = False  # the current epoch is the one restored from applied.json (until the next applied)
        self._restored_asked_at: float | None = None  # when the coordinator was last asked about it
        self._heard: tuple[str, int] | None = None  # what the coordinator told about it: (state, steps done)
        self._known: collections.deque[Allocation] = collections.deque(maxlen=MAX_KNOWN_EPOCHS)  # applied, newest last
        self.refusals = Refusals()  # RUN_STATE and councils this peer refused
        self.taken = TakenOps()  # the operators' operations this peer took, per run (control/epoch/taken.py)

    # ---- restore ------------------------------------------------------------------------------

    def restore(self, run_id: bytes, term: int, epoch: int, alloc: Allocation | None,
                reports: Iterable[StepReport] = ()) -> None:
        """What DATA_DIR/applied.json held at start: the (term, epoch) applied and, when it is the
        same run, its allocation (a restarted peer holds no stage; as coordinator it takes the
        run over from the others' run states); `reports`: the step reports its checkpoints of
        that run kept, which it sends with its run state like the reports of this life."""
        self.applied[run_id] = (term, epoch)
        kept = sorted(reports, key=lambda r: (r.step, r.epoch))
        self.reports.extend(kept)
        if alloc is not None and alloc.run_id == run_id and alloc.term_epoch == (term, epoch):
            placed = self.me in alloc.peers
            self._known.append(alloc)
            self._restored = True
            last = max((r.step for r in kept), default=-1)
            if last >= alloc.end_step - 1:
                # Its stage completed the run's last step before the restart (the run's end is
                # checkpointed): the run finished; nothing is left to wait for or resume.
                end = RunEnd(last, "finished", False)
                self.run = EpochRecord(alloc, EpochPhase.ENDED, end=end, done=True)
                self.last_end = {"epoch": max(r.epoch for r in kept if r.step == last), "completed": last,
                                 "reason": "finished", "failed": False, "at": None, "params_sha256": ""}
                return
            self.run = EpochRecord(alloc, EpochPhase.WAITING if placed else EpochPhase.SPARE, done=True)
            self._restarted = placed

    def restore_taken(self, taken: TakenOps) -> None:
        """The operations this peer took before it restarted (DATA_DIR/operations.json)."""
        self.taken = taken

    # ---- operators' operations --------------------------------------------------------------------

    def op_refusal(self, op: OperatorOp, signed: SignedOp, now_s: float, skew_s: float) -> str | None:
        """Why this peer may not take `op` now (None: it may): outside the skew window of
        `now_s` (wall clock), signed at or before the run's last resume or reschedule (the
        current allocation's `last_op_ms`, or one this peer took since), or taken before."""
        try:
            self.taken.check(op, signed, now_s=now_s, skew_s=skew_s, after_ms=self.op_floor_ms(op.run_id))
        except OperatorError as e:
            return str(e)
        return None

    def op_floor_ms(self, run_id: bytes) -> int:
        """The signed time of the run's last resume or reschedule, as this peer knows it: its
        current allocation's `last_op_ms` or one it took since (0: none)."""
        cur = self.current
        carried = cur.last_op_ms if cur is not None and cur.run_id == run_id else 0
        return max(carried, self.taken.floor_ms(run_id))

    def _take_op(self, op: OperatorOp, signed: SignedOp, now_s: float, skew_s: float) -> None:
        """Record `op` as taken by this peer (the coordinator's resume or reschedule, told by
        `OperationTaken`, or a final STOP): a replay of it is refused from now on, a restart included."""
        self.taken.take(op, signed, now_s=now_s, skew_s=skew_s)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def current(self) -> Allocation | None:
        return self.run.alloc if self.run is not None else None

    def over_without_finishing(self, run_id: bytes) -> bool:
        """Run `run_id` is over without finishing (an operator's stop, or it cannot go on)."""
        return self._over_without_finishing == run_id

    def run_over(self) -> bool:
        """No run, or it finished or was stopped: nothing to reconfigure (`EpochStatus.run_over`)."""
        return self.status().run_over

    def hand_off_to(self) -> tuple[bytes | None, str]:
        """Before a planned leave: (the coordinator to tell, "") while a run is in progress (this
        peer itself when it is the coordinator; it hands this peer's part off when the run names
        it); (None, "") when there is no run to tell about; (None, why) when the run names this
        peer and no coordinator is known to take its part over."""
        cur = self.current
        if cur is None or self.run_over():
            return None, ""
        coordinator = self.election.coordinator
        if coordinator is None:
            named = self.me in cur.peers or self.me in cur.spares
            return None, "no coordinator is known to hand this peer's part off" if named else ""
        return coordinator, ""

    def restored_run_to_ask(self, now: float) -> bytes | None:
        """The run to ask the coordinator about now (its progress: `restored_run_heard`), or
        None: this peer restarted, its restored epoch waits (or is a spare's) and is not over, it
        is not the coordinator itself, and it did not ask within RESTORED_ASK_S. The run may have
        finished or been stopped while this peer was down; nothing else tells it. (A peer left
        out of the voters hears no heartbeat: the ask finds the coordinator first.)"""
        run = self.run
        if not self._restored or run is None or run.phase not in (EpochPhase.WAITING, EpochPhase.SPARE):
            return None
        coordinator = self.election.coordinator
        if self.run_over() or coordinator == self.me or self.election.is_coordinator:
            return None
        if self._restored_asked_at is not None and now - self._restored_asked_at < RESTORED_ASK_S:
            return None
        self._restored_asked_at = now
        return run.alloc.run_id

    def restored_run_heard(self, run_id: bytes, state: str, steps_done: int) -> None:
        """The coordinator's account of the run this peer restored (`state` as control/progress.py
        names it, `steps_done` of its steps): a run that finished, or stopped or was refused,
        is over here too; any other state changes nothing (its coordinator reconfigures it)."""
        run = self.run
        if not self._restored or run is None or run.alloc.run_id != run_id \
                or run.phase not in (EpochPhase.WAITING, EpochPhase.SPARE):
            return
        if state == "finished":
            self.run = EpochRecord(run.alloc, EpochPhase.ENDED, end=RunEnd(steps_done - 1, "finished", False),
                                   done=True)
        elif state in ("stopped", "refused"):
            self._over_without_finishing = run_id
        else:
            return
        self._restarted = False
        self._heard = (state, steps_done)

    def run_state(self, checkpoints: tuple[tuple[int, int, int], ...] = ()) -> PeerRunState:
        """This peer's answer to a RUN_STATE query; `checkpoints`: those of the current run."""
        run = self.run
        if run is None:
            return PeerRunState(None, *self.election.last_applied, None, None, None, False, (), tuple(self.reports))
        layers = at = prev = None
        if run.built:
            d, s = run.alloc.position(self.me)
            layers, at, prev = run.alloc.layer_ranges[s], run.at, run.prev
        return PeerRunState(run.alloc.run_id, run.alloc.term, run.alloc.epoch, layers, at, prev, run.active,
                            checkpoints, tuple(self.reports))

    def allocation_of(self, run_id: bytes, epoch: int) -> Allocation | None:
        """The allocation of `epoch` of `run_id`, if this peer applied it lately (the last
        MAX_KNOWN_EPOCHS)."""
        for a in reversed(self._known):
            if a.run_id == run_id and a.epoch == epoch:
                return a
        return None

    def check_run_state_reader(self, sender: bytes) -> Refused | None:
        """None when `sender` may read this peer's run state (control/epoch/access.py); a
        refusal is counted and logged."""
        run = self.run
        in_progress = run is not None and run.phase in (EpochPhase.BUILDING, EpochPhase.ACCEPTED,
                                                        EpochPhase.TRAINING, EpochPhase.SPARE)
        why = run_state_refusal(sender, me=self.me, coordinator=self.election.coordinator,
                                current=run.alloc if run is not None else None,
                                previous=self.prev.alloc if self.prev is not None else None, in_progress=in_progress,
                                over=self.run_over())
        return self.refusals.refuse(why, sender, "RUN_STATE query") if why is not None else None

    def check_offer_asker(self, sender: bytes) -> Refused | None:
        """None when `sender` may ask this peer for an offer; a refusal is counted and logged."""
        why = offer_refusal(sender, me=self.me, coordinator=self.election.coordinator)
        return self.refusals.refuse(why, sender, "RUN_STATE offer") if why is not None else None

    def held_at(self, run_id: bytes, layers: tuple[int, int], step: int) -> tuple[str, int] | None:
        """Where this peer holds `layers` of `run_id` at `step` in memory, once its worker
        stopped: ("stage", epoch) or ("snapshot", epoch); None: not in memory."""
        for rec in (self.run, self.prev):
            if rec is None or not rec.built or rec.alloc.run_id != run_id or rec.active:
                continue
            s = rec.alloc.position(self.me)[1]
            if tuple(rec.alloc.layer_ranges[s]) != tuple(layers):
                continue
            if rec.at == step:
                return ("stage", rec.alloc.epoch)
            if rec.prev == step:
                return ("snapshot", rec.alloc.epoch)
        return None

    def stop_boundary(self, logged_completed: int | None) -> int:
        """The step before which an operator's stop ends the run: two steps ahead of this peer
        (every peer is within one step of every other). `logged_completed`: the coordinator's
        last logged step, for a spare that holds no stage."""
        run = self.run
        assert run is not None
        if run.at is not None:
            now = run.at
        else:
            now = logged_completed + 1 if logged_completed is not None else run.alloc.start_step
        return now + 2

    def status(self) -> EpochStatus:
        run = self.run
        return EpochStatus(
            phase=run.phase if run is not None else None, alloc=run.alloc if run is not None else None,
            step=(run.at - 1) if run is not None and run.at is not None else None,
            fetched_bytes=run.fetched_bytes if run is not None else 0,
            last_report=self.reports[-1] if self.reports and run is not None
            and self.reports[-1].epoch == run.alloc.epoch else None,
            last_end=self.last_end, end=run.end if run is not None else None,
            run_stopped=run is not None and self._over_without_finishing == run.alloc.run_id,
            restored=run is not None and self._restored,
            heard=self._heard if run is not None and self._restored else None)

    # ---- events -------------------------------------------------------------------------------

    def handle(self, event: EpochEvent, now: float) -> list[EpochAction]:
        if isinstance(event, AllocationOffered):
            return self._offered(event, now)
        if isinstance(event, StageBuilt):
            return self._built(event)
        if isinstance(event, BuildFailed):
            return self._build_failed(event)
        if isinstance(event, StartAsked):
            return self._start(event)
        if isinstance(event, StopAsked):
            return self._stop(event, now)
        if isinstance(event, StepDone):
            return self._step_done(event.report)
        if isinstance(event, RunnerEnded):
            return self._runner_ended(event)
        if isinstance(event, EpochDone):
            return self._epoch_done(event.epoch)
        if isinstance(event, MemberGone):
            return self._member_gone(event)
        if isinstance(event, EpochTick):
            return self._tick(now)
        if isinstance(event, RunClosed):
            self._over_without_finishing = event.run_id
            return []
        if isinstance(event, RunReopened):
            if self._over_without_finishing == event.run_id:
                self._over_without_finishing = None
            return []
        if isinstance(event, OperationTaken):
            self._take_op(event.op, event.signed, event.now_s, event.skew_s)
            return []
        raise TypeError(f"not an epoch event: {event!r}")

    def _offered(self, ev: AllocationOffered, now: float) -> list:
        alloc = ev.alloc
        ctx = dataclasses.replace(ev.ctx, applied=self.applied.get(alloc.run_id), run_id=alloc.run_id)
        refusal = check_allocation(alloc, ctx) or check_operator_start(alloc, self.operators)
        council: Council | None = None
        if refusal is None:
            council, refusal = check_council(alloc, self.operators)
        if refusal is None and self.election.council is not None:
            assert council is not None
            refusal = changes_refusal(council, council.since(self.election.council), alloc.term, alloc.epoch,
                                      ctx.live)
        if refusal is None:
            refusal = self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch, ev.certificate, council)
            if (refusal is not None and alloc.issuer != self.me and refusal.code == "not-coordinator"
                    and alloc.term >= self.election.term):
                # The first heartbeat of a new coordinator may come after its allocation.
                until = ev.waited_until if ev.waited_until is not None else now + self.heartbeat_wait_s
                if now < until:
                    return [WaitForCoordinator(dataclasses.replace(ev, waited_until=until), until)]
        if refusal is not None:
            if refusal.code == "bad-council":  # (counted: a council not following from this one is an attack or a bug)
                self.refusals.refuse(Refused.BAD_COUNCIL, alloc.issuer, refusal.reason)
            return [Reply(ev.key, AllocationAnswer.refused(refusal.code, refusal.reason), error=refusal.reason)]
        out: list = []
        if self.run is not None and not self.run.done:
            out.append(EndEpoch(self.run.alloc.epoch, f"replaced by epoch {alloc.epoch}"))
        if self.run is None or self.run.alloc.run_id != alloc.run_id:
            self.reports.clear()  # the kept reports are the current run's
        if self._over_without_finishing == alloc.run_id:  # a new epoch of a stopped run: resumed
            self._over_without_finishing = None
        prev = self.run if self.run is not None and self.run.built else self.prev
        self.applied[alloc.run_id] = (alloc.term, alloc.epoch)
        self._known.append(alloc)
        self.taken.raise_floor(alloc.run_id, alloc.last_op_ms)
        assert council is not None
        out += [ApplyToElection(alloc.term, alloc.epoch, council, ev.certificate), PersistApplied(alloc)]
        self.prev = prev
        self._lost_since = None
        self._restored = False
        if self.me not in alloc.peers:
            self.run = EpochRecord(alloc, EpochPhase.SPARE, done=True)
            return out + [Reply(ev.key, AllocationAnswer(True, role="spare"))]
        self.run = EpochRecord(alloc, EpochPhase.BUILDING)
        return out + [BuildStage(ev.key, alloc, prev.alloc if prev is not None else None)]

    def _current(self, epoch: int) -> EpochRecord | None:
        run = self.run
        return run if run is not None and run.alloc.epoch == epoch else None

    def _built(self, ev: StageBuilt) -> list:
        run = self._current(ev.epoch)
        if run is None or run.phase is not EpochPhase.BUILDING:
            return [Reply(ev.key, AllocationAnswer.refused("build-failed", "replaced while building"))]
        run.phase, run.at, run.fetched_bytes = EpochPhase.ACCEPTED, ev.at, ev.fetched_bytes
        d, s = run.alloc.position(self.me)
        return [Reply(ev.key, AllocationAnswer(True, role="stage", stage=s, pipeline=d, fetched_bytes=ev.fetched_bytes,
                                               fetch_s=ev.fetch_s if ev.fetched_bytes else 0.0))]

    def _build_failed(self, ev: BuildFailed) -> list:
        run = self._current(ev.epoch)
        if run is not None and run.phase is EpochPhase.BUILDING:
            run.phase = EpochPhase.REFUSED
        return [Reply(ev.key, AllocationAnswer.refused(ev.code, ev.reason), error=ev.reason)]

    def _start(self, ev: StartAsked) -> list:
        run = self.run
        if run is None or ev.run_id != run.alloc.run_id or ev.epoch != run.alloc.epoch:
            return [Reply(ev.key, StartAnswer(False, "no such epoch accepted here"))]
        if ev.sender != run.alloc.issuer:
            return [Reply(ev.key, StartAnswer(False, "only the issuer starts an epoch"))]
        if run.phase is EpochPhase.ACCEPTED and not run.done:
            run.phase = EpochPhase.TRAINING
            return [StartRunner(run.alloc.epoch), Reply(ev.key, StartAnswer(True))]
        if run.phase is EpochPhase.TRAINING and not run.done:
            return [Reply(ev.key, StartAnswer(True))]  # a START sent twice
        return [Reply(ev.key, StartAnswer(False, f"the epoch is {run.phase.value} here"))]

    def _stop(self, ev: StopAsked, now: float) -> list:
        """An operator's stop (`final`: the run is over) only from the coordinator this peer
        recognises, with the operator's signed stop of this run, signed within the skew window,
        after the run's last resume or reschedule, and not taken before (a copied stop cannot end
        a resumed run); an epoch's stop (a reconfiguration's) from that coordinator or the epoch's
        issuer."""
        run = self.run
        if run is None or ev.run_id != run.alloc.run_id:
            return [Reply(ev.key, StopAnswer(False, "not in that run"))]
        if ev.epoch is not None and ev.epoch != run.alloc.epoch:  # (a procedure that outlived its epoch)
            return [Reply(ev.key, StopAnswer(False, f"a stop of epoch {ev.epoch}, this peer is in epoch "
                                                    f"{run.alloc.epoch}"))]
        coordinator = self.election.coordinator
        recognised = ev.sender == coordinator and (ev.sender != self.me or self.election.is_coordinator)
        if ev.final:
            if not recognised:
                return [Reply(ev.key, StopAnswer(False, "only the coordinator this peer recognises "
                                                        "carries an operator's stop"))]
            try:
                op = check_op(ev.op, "stop", self.operators, run_id=run.alloc.run_id)
            except OperatorError as e:
                return [Reply(ev.key, StopAnswer(False, str(e)))]
            assert ev.op is not None
            wall = now + self.wall_offset
            why = self.op_refusal(op, ev.op, wall, self.operator_skew_s)
            if why is not None:
                return [Reply(ev.key, StopAnswer(False, why))]
            self._take_op(op, ev.op, wall, self.operator_skew_s)
            self._over_without_finishing = run.alloc.run_id
        elif not recognised and ev.sender not in (run.alloc.issuer, self.me):
            return [Reply(ev.key, StopAnswer(False, "only the coordinator stops an epoch"))]
        if ev.abort:
            out: list = [AbortRunner("aborted for a reconfiguration")]
        elif run.phase is EpochPhase.TRAINING and not run.done:
            out = [StopRunnerAt(run.alloc.epoch, ev.at_step, final=ev.final)]
        else:
            out = [AbortRunner("stopped before it started")]
        return out + [Reply(ev.key, StopAnswer(True))]

    def _step_done(self, rep: StepReport) -> list:
        self.reports.append(rep)
        run = self._current(rep.epoch)
        if run is None:
            return []
        run.prev, run.at = rep.step, rep.step + 1
        return [Send(run.alloc.issuer, ControlMsg.STEP, {"run": run.alloc.run_id, **rep.to_wire()})]

    def _runner_ended(self, ev: RunnerEnded) -> list:
        run = self._current(ev.epoch)
        if run is None:
            return []
        end = ev.end
        run.end, run.phase = end, EpochPhase.ENDED
        if end.completed >= 0 and (run.at is None or run.at < end.completed + 1):
            run.at = end.completed + 1
        self.last_end = {"epoch": run.alloc.epoch, "completed": end.completed, "reason": end.reason,
                         "failed": end.failed, "at": ev.wall_time, "params_sha256": end.params_sha256}
        if not end.failed:
            return []
        coordinator = self.election.coordinator or run.alloc.issuer
        return [Send(coordinator, ControlMsg.STEP, {"run": run.alloc.run_id, "epoch": run.alloc.epoch,
                                                    "failed": end.reason[:512], "step": max(end.completed, 0)})]

    def _epoch_done(self, epoch: int) -> list:
        for rec in (self.run, self.prev):
            if rec is not None and rec.alloc.epoch == epoch:
                rec.done = True
                if rec.phase in (EpochPhase.BUILDING, EpochPhase.ACCEPTED, EpochPhase.TRAINING):
                    rec.phase = EpochPhase.ENDED
        return []

    def _member_gone(self, ev: MemberGone) -> list:
        run = self.run
        if run is None or ev.peer not in run.alloc.peers or run.done:
            return []
        out: list = [FailNeighbour(ev.peer, ev.why)]
        if run.phase is EpochPhase.ACCEPTED:
            out.append(AbortRunner(ev.why))
        return out

    def _keep_waiting(self, now: float) -> list:
        """A stage whose runner ended without the run being over, and no next epoch for
        `coordinator_lost_after_s` (a partition, a lost coordinator, a pause whose request to
        keep never came): written to disk once, so a crash while it waits loses nothing."""
        run = self.run
        waiting = (run is not None and run.phase is EpochPhase.ENDED and run.built and run.end is not None
                   and run.end.reason != "finished" and self._kept_epoch != run.alloc.epoch
                   and not self.over_without_finishing(run.alloc.run_id))
        if not waiting:
            self._ended_since = None
            return []
        assert run is not None
        self._ended_since = now if self._ended_since is None else self._ended_since
        if now - self._ended_since < self.coordinator_lost_after_s:
            return []
        self._ended_since, self._kept_epoch = None, run.alloc.epoch
        return [KeepStage(run.alloc.run_id)]

    def _tick(self, now: float) -> list:
        """A peer whose epoch's coordinator is gone (stepped down, cut off, replaced) stops
        training, discarding the step in progress: a minority side does not train on without a
        coordinator. The grace keeps a slow heartbeat from stopping a healthy run."""
        run = self.run
        keep = self._keep_waiting(now)
        if keep:
            return keep
        if self._restarted and run is not None and run.phase is EpochPhase.WAITING:
            # This peer restarted and lost its stage: the epoch it was placed in cannot step
            # any more. Its coordinator may not notice (a restart quicker than gossip's failure
            # detection, every stage holder restarted): say so as a failed step.
            coordinator = self.election.coordinator
            if coordinator is None:
                return []
            self._restarted = False
            return [Send(coordinator, ControlMsg.STEP, {"run": run.alloc.run_id, "epoch": run.alloc.epoch,
                                                        "failed": "restarted: holds no stage", "step": 0})]
        if run is None or run.phase is not EpochPhase.TRAINING or run.done or run.end is not None:
            self._lost_since = None
            return []
        issuer, el = run.alloc.issuer, self.election
        if (el.is_coordinator and issuer == self.me) or (el.is_follower and el.coordinator == issuer):
            self._lost_since = None
            return []
        self._lost_since = now if self._lost_since is None else self._lost_since
        if now - self._lost_since < self.coordinator_lost_after_s:
            return []
        self._lost_since = None
        return [AbortRunner(f"the coordinator of epoch {run.alloc.epoch} ({short_id(issuer)}) is gone")]

