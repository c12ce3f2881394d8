"""The run this peer handed out, and the hand-out itself (see docs/control.md, "The coordinator
machine").

`HandOut` owns the run's phase and why (`Phase`: the procedure moves it with `to`, the hand-out
and the step log with their own answers), the step log of the epoch it handed out last, the
steps it logged per run, and the last reconfiguration. It hands an allocation out (ALLOCATION to
every named peer, then START, or STOP to those that accepted a refused one), records the peers
that refused it (leftout.py) and, once the epoch started, the reconfiguration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from dtfm.net import short_id

from ..actions import Ask, Emit, LogLine, Reply, ResetLog
from ..allocation import Allocation, SignedAllocation
from ..answers import AllocationAnswer, PeerAnswer
from ..epoch.report import StepReport
from ..epoch.runstate import Source
from ..events import EventKind, PlaneEvent, Reconfiguration
from ..messages import ControlMsg
from ..refusals import Refusals
from .answers import allocation_answer, started
from .context import Reads
from .counters import RunCounters
from .keys import ProcStep, Step
from .leftout import LeftOut
from .phase import Phase
from .record import Kind, Procedure, ProcedureFailed
from .steplog import StepLog
from .watch import RunWatch

__all__ = ["MEMBERSHIP_REFUSALS", "HandOut"]

logger = logging.getLogger(__name__)

# Refusals of peers whose gossip does not agree with the coordinator's yet (a peer that just
# returned, one just declared dead): gossip converges, so they are retried without counting.
MEMBERSHIP_REFUSALS = frozenset({"not-covered", "dead-peer", "unknown-peer"})


class HandOut:
    """The run this peer handed out (see the module docstring)."""

    def __init__(self, reads: Reads, sign: Callable[[Allocation], SignedAllocation], watch: RunWatch,
                 left_out: LeftOut, counters: RunCounters, refusals: Refusals) -> None:
        self.r = reads
        self.sign = sign
        self.watch = watch
        self.left_out = left_out
        self.counters = counters
        self.refusals = refusals
        self.phase = Phase.IDLE
        self.reason = ""
        self.shape_note = ""  # why the last run started here has its shape (`choose_shape`)
        self.steplog: StepLog | None = None  # the epoch this peer handed out last
        self.logged: dict[bytes, set[int]] = {}  # run id -> steps this peer logged
        # run id -> logged steps a rollback handed out (its epoch started) undid, and counted as lost
        self.undone: dict[bytes, set[int]] = {}
        self.last_reconfig: Reconfiguration | None = None

    def to(self, phase: Phase, reason: str | None = None) -> None:
        """The procedure moved the run to `phase` (with why, when given)."""
        self.phase = phase
        if reason is not None:
            self.reason = reason

    def _ask(self, proc: Procedure, step: Step, peers: Iterable[bytes], body: dict, timeout_s: float,
             msg: int) -> Ask:
        return self.r.ask(ProcStep(proc.id, step), peers, msg, body, timeout_s)

    def hand_out(self, proc: Procedure, alloc: Allocation, backfill: Sequence[tuple[bytes, StepReport]],
                  now: float) -> list:
        """Log the steps before the resume point that `backfill` (the peers' reports) covers and
        this peer has not logged; ALLOCATION to every named peer, then START. Only while this
        peer is the coordinator of the allocation's term with its certificate: one that stepped
        down while the procedure ran (its scheduler or the offers were still out) hands nothing
        out, rather than an allocation without its proof or with its successor's."""
        election, epoch = self.r.election, self.r.epoch
        cert = election.certificate
        mine = cert is None or (cert.candidate, cert.term) == (self.r.me, alloc.term)
        if not election.is_coordinator or not mine:
            raise ProcedureFailed(f"this peer is no longer the coordinator of term {alloc.term}")
        if (proc.kind is Kind.RECONFIGURE and not proc.order.resume
                and epoch.over_without_finishing(alloc.run_id)):
            # an operator's stop taken while the procedure ran: the run is over, nothing is handed out
            raise ProcedureFailed(f"an operator stopped run {alloc.run_id.hex()[:8]} while it was reconfigured",
                                  counts=False)
        proc.hand.alloc = alloc
        self.phase = Phase.HANDING_OUT
        self.reason = ""
        signed = self.sign(alloc)
        logged = self.logged.setdefault(alloc.run_id, set())
        out: list = []
        if proc.kind is Kind.START:
            logged.clear()
            self.undone.pop(alloc.run_id, None)
            out.append(ResetLog())
        known = self._known(proc.cur)
        before = self._unlogged_before(proc.cur, alloc)
        prev = self.steplog
        asking = prev is not None and prev.filling and prev.alloc.epoch == alloc.epoch  # (its answers come to this log)
        self.steplog = log = StepLog(alloc, logged, started_at=self.r.clock.wall(now), refusals=self.refusals,
                                     known=known)
        out += [LogLine(line) for line in log.backfill(backfill, {x.step for _, x in backfill
                                                                       if x.step < alloc.start_step}, known)]
        # what neither this back-fill nor the epoch before logged is asked for again by the new log
        log.carry(before, asking=asking)
        logger.info("issuing term %d epoch %d (%s): %d stages x %d pipelines over %d peers from step %d, "
                    "predicted %.3f s per step", alloc.term, alloc.epoch, alloc.reason, alloc.stages, alloc.dp,
                    len(alloc.peers), alloc.start_step, alloc.predicted_iteration_s)
        if proc.planning.shape_note:
            self.shape_note = proc.planning.shape_note
            logger.info("term %d epoch %d shape: %s", alloc.term, alloc.epoch, proc.planning.shape_note)
        if alloc.compress_links is not None:
            logger.info("term %d epoch %d compresses per link: %s", alloc.term, alloc.epoch, _links_note(proc, alloc))
        body = signed.to_wire()
        if cert is not None:  # the proof of this peer's election in the allocation's term
            body["cert"] = cert.to_wire()
        out.append(self._ask(proc, Step.ALLOC, list(alloc.peers) + list(alloc.spares), body,
                             self.r.timings.accept_timeout_s, msg=ControlMsg.ALLOCATION))
        return out

    def allocation_answers(self, proc: Procedure, answered: Mapping[bytes, PeerAnswer], now: float) -> list:
        alloc, hand, t = proc.hand.alloc, proc.hand, self.r.timings
        assert alloc is not None
        hand.answers = answers = {p: allocation_answer(a) for p, a in answered.items()}
        refused = {p: a for p, a in answers.items() if not a.accepted}
        if not refused:
            self.left_out.accepted(answers)
            return [self._ask(proc, Step.START, alloc.peers, {"run": alloc.run_id, "epoch": alloc.epoch},
                              t.request_timeout_s, msg=ControlMsg.START)]
        hand.refused = "the allocation was refused: " + "; ".join(
            f"{short_id(p)}: {'no answer' if a.reason is None else a.reason[:200]}" for p, a in refused.items())
        left = self._leave_out(answers, refused, now)
        # A refusal that left its peer out counts toward no limit: the next attempt goes on
        # without it. So too a membership disagreement: gossip converges.
        hand.transient = all(p in left or a.code in MEMBERSHIP_REFUSALS for p, a in refused.items())
        self.phase, self.reason = Phase.REFUSED, hand.refused
        rest = [p for p in list(alloc.peers) + list(alloc.spares) if p not in refused]
        out: list = []
        if left:
            why = self.left_out.why(left, now)
            shown = tuple(x for x in self.left_out.snapshot(now, self.r.clock.offset) if x.peer in left)
            hand.refused += "; left out of the next attempts: " + ", ".join(
                f"{short_id(x.peer)} for {x.until - x.since:.0f} s" for x in shown)
            self.reason = hand.refused
            logger.warning("the allocation of epoch %d was refused; left out of the next attempts: %s",
                           alloc.epoch, why)
            out.append(Emit(PlaneEvent(EventKind.LEFT_OUT, self.r.election.term, proc.trigger, epoch=alloc.epoch,
                                       reason=why, left_out=shown)))
        return out + [self._ask(proc, Step.UNSTOP, rest, {"run": alloc.run_id, "at_step": 0, "epoch": alloc.epoch},
                                t.request_timeout_s, msg=ControlMsg.STOP)]

    def _leave_out(self, answers: Mapping[bytes, AllocationAnswer], refused: Mapping[bytes, AllocationAnswer],
                   now: float) -> frozenset[bytes]:
        """Record each refusing peer (leftout.py); the peers left out now. While fewer peers
        refuse than accept (this peer counted), the allocation was fine and each refusing peer is
        unusable now, whatever its reason (its data, its stage build, another coordinator it
        follows, a lie, no answer). When as many refuse as accept, the allocation itself is
        refused (this peer may be behind the others' election, or cut off from them): nobody is
        singled out, and the failure counts as before. This peer never leaves itself out."""
        peers = sorted(p for p in refused if p != self.r.me)
        accepting = [p for p, a in answers.items() if a.accepted]
        if not peers or len(peers) >= len(accepting):
            return frozenset()
        incarnations = self.r.swarm.incarnations()
        left = set()
        for p in peers:
            a = refused[p]
            reason = a.reason[:200] if a.reason is not None else "no reason given"
            if self.left_out.refused(p, a.code, reason, now, incarnations.get(p)):
                left.add(p)
        return frozenset(left)

    def started(self, proc: Procedure, answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        """The peers answered START: the epoch trains, watched from now; the operator's start
        is answered, or the reconfiguration recorded."""
        alloc, log = proc.hand.alloc, self.steplog
        assert alloc is not None and log is not None
        late = [short_id(p) for p, a in answers.items() if not started(a)]
        if late:
            logger.warning("peers %s did not confirm the start", ", ".join(late))
        self.phase = Phase.TRAINING
        log.fetched = sum(a.fetched_bytes for a in proc.hand.answers.values())
        log.fetch_s = max([a.fetch_s for a in proc.hand.answers.values()] + [0.0])
        self.watch.epoch_started(alloc, proc.cur, now, reconfigured=proc.kind is Kind.RECONFIGURE)
        if proc.kind is Kind.START:
            return [Emit(PlaneEvent(EventKind.START, alloc.term, "train start", epoch=alloc.epoch,
                                    start_shape=f"{alloc.stages}x{alloc.dp}",
                                    start_predicted_s=alloc.predicted_iteration_s,
                                    compress_links=_links_note(proc, alloc) or None,
                                    shape_note=proc.planning.shape_note or None)),
                    Reply(proc.order.reply or (), alloc)]
        return self._reconfigured(proc, now)

    def still_logged(self, cur: Allocation, *, logs_cur: bool) -> set[int]:
        """The steps of `cur`'s run this peer logged that no rollback it handed out undid. Where
        its step log is not of epoch `cur` (`logs_cur` false), only those before `cur` started:
        `cur` is another coordinator's epoch, and what this peer logged from its start on, that
        start undid and counted; unless the log is of a newer epoch of the run that this peer
        handed out and that never started (refused), after which its steps are still its own."""
        left = self.logged.get(cur.run_id, set()) - self.undone.get(cur.run_id, set())
        log = self.steplog
        refused = log is not None and log.alloc.run_id == cur.run_id and log.alloc.epoch > cur.epoch
        return left if logs_cur or refused else {s for s in left if s < cur.start_step}

    def _reconfigured(self, proc: Procedure, now: float) -> list:
        """Record a reconfiguration (`last_reconfig` in status, an event, one INFO line)."""
        cur, alloc, plan, rp, log = proc.cur, proc.hand.alloc, proc.planning.plan, proc.planning.rp, self.steplog
        assert cur is not None and alloc is not None and plan is not None and rp is not None and log is not None
        m, pl, wall = proc.marks, proc.planning, self.r.clock.wall
        # (a rollback to step 0 goes back to the run's initial weights, whoever holds them: the
        # peers of a rollback whose hand-out failed built them, and hold them in memory since)
        restored = Source.INITIAL.value if pl.rolled_back and rp.step == 0 else rp.source.value
        info = Reconfiguration(
            at=wall(now), reason=proc.trigger, epoch=alloc.epoch, term=alloc.term,
            old_shape=f"{cur.stages}x{cur.dp}", new_shape=f"{alloc.stages}x{alloc.dp}", kind=plan.kind,
            predicted_old_s=cur.predicted_iteration_s, predicted_new_s=alloc.predicted_iteration_s, moves=plan.moves,
            bytes_moved=log.fetched, resume_step=rp.step, rollback=pl.rolled_back,
            restored_from=restored, steps_lost=pl.steps_lost,
            started_at=wall(proc.t0), stop_s=m["stopped"] - proc.t0,
            schedule_s=m["planned"] - m["stopped"], offer_s=m["offered"] - m["planned"], transfer_s=log.fetch_s,
            handout_s=now - m["offered"], compress_links=_links_note(proc, alloc))
        self.last_reconfig = info
        self.counters.reconfigured(alloc.run_id, rollback=pl.rolled_back, steps_lost=pl.steps_lost)
        if pl.rolled_back:  # (counted lost here: a later reconfiguration counts only what runs from now)
            self.undone.setdefault(alloc.run_id, set()).update(
                s for s in self.logged.get(alloc.run_id, ()) if s >= rp.step)
        logger.info("reconfigured (%s): %s -> %s (%s), predicted %.3f -> %.3f s per step, %d moves, %d bytes moved, "
                    "resuming at step %d%s", proc.trigger, info.old_shape, info.new_shape, plan.kind,
                    cur.predicted_iteration_s, alloc.predicted_iteration_s, plan.moves, log.fetched, rp.step,
                    f" (rolled back from {restored}: {pl.steps_lost} completed steps run again)"
                    if pl.rolled_back else "")
        kind = (EventKind.ROLLBACK if pl.rolled_back else EventKind.LEAVE if proc.order.leave
                else EventKind.RECONFIGURE)
        out: list = [Emit(PlaneEvent(kind, alloc.term, proc.trigger, epoch=alloc.epoch, reconfiguration=info))]
        reply = proc.order.reply
        if reply is not None:
            out.append(Reply(reply, {"handed_off": True, **info.to_wire()} if proc.order.leave else info.to_wire()))
        return out

    def _unlogged_before(self, cur: Allocation | None, alloc: Allocation) -> set[int]:
        """The steps before `alloc`'s start that the step log of the epoch it follows (`cur`, or
        a hand-out of `alloc`'s epoch that failed after it) left unlogged: its gaps and the
        steps after its last completed one. Empty when this peer did not log that epoch (a run it
        takes over: its hand-out's back-fill is all it knows of the steps before)."""
        log = self.steplog
        if log is None or cur is None or log.alloc.run_id != alloc.run_id or log.alloc.epoch not in (
                cur.epoch, alloc.epoch):
            return set()
        return log.unlogged_before(alloc.start_step)

    def _known(self, cur: Allocation | None) -> Callable[[int], Allocation | None]:
        """epoch -> its allocation of the run of `cur`, if this peer knows it (to check the
        reports the peers keep)."""
        log, epoch = self.steplog, self.r.epoch
        mine = [a for a in (cur, log.alloc if log is not None else None)
                if a is not None and cur is not None and a.run_id == cur.run_id]

        def known(n: int) -> Allocation | None:
            for a in mine:
                if a.epoch == n:
                    return a
            return epoch.allocation_of(cur.run_id, n) if cur is not None else None
        return known

    # ---- step reports -------------------------------------------------------------------------

    def logged_step(self, finished: bool) -> bool:
        """A step line was logged (`finished`: the run's last): the run trains, or it finished.
        Whether it finished with this line."""
        if self.phase is Phase.HANDING_OUT:
            self.phase = Phase.TRAINING
        if finished and self.phase is not Phase.FINISHED:
            self.phase = Phase.FINISHED
            return True
        return False



def _links_note(proc: Procedure, alloc: Allocation) -> str:
    """A per-link run's choice in words: the scheduler's (with what each link saves), else the allocation's."""
    if alloc.compress_links is None:
        return ""
    return proc.planning.links_note or alloc.compress_links.describe(alloc.compression)
