"""The one hand-out or reconfiguration in progress (see docs/control.md, "The coordinator machine").

`Procedures` owns the procedure in progress (`Procedure`, record.py: an operator's start, its
first placement then the hand-out; or a reconfiguration, STOPPING -> PLANNING -> OFFERING, then
the hand-out; each may end PAUSED or STOPPED), the count of failed reconfigurations in a row, the
pause and its retry time, and the RUN_STATE `keep` requests. Each step asks peers or the
scheduler under a `ProcStep` key and goes on when the answers come back (`answered`,
`computed`); the hand-out itself, the run's phase and its step log are `HandOut`'s (handout.py),
which it moves through the phases with `HandOut.to`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from dtfm.net import short_id

from ..actions import Ask, Compute, Computed, Emit, Reply
from ..allocation import Allocation
from ..answers import PeerAnswer
from ..election import quorum
from ..epoch.machine import AbortRunner, RunClosed, RunReopened
from ..epoch.runstate import ResumeError, ResumePoint, describe, resume_point
from ..events import EventKind, PlaneEvent
from ..messages import ControlMsg
from .allocate import NoHolder, first_allocation, majority_holdings, next_allocation, offer_holders
from .answers import offer_answer, run_states
from .context import Reads, named
from .handout import HandOut
from .keys import Keep, ProcStep, Step
from .leftout import LeftOut
from .links import used_cut_links
from .operator_queue import OperatorQueue, QueuedStart
from .phase import Phase
from .record import HandingOut, Kind, Order, Procedure, ProcedureFailed
from .reshape import ReshapePlan
from .schedule import Placement
from .watch import RunWatch, completed_of

__all__ = ["Procedures"]

logger = logging.getLogger(__name__)

# A rollback that runs at most this many completed steps again (or a checkpoint interval, when
# longer) goes on at once: what a lost stage normally costs, not worth a wait.
ROLLBACK_WAIT_MIN_STEPS = 20

# A start whose live peers are not all measured yet (a report not yet relayed to this peer, a
# link its measurer dropped): the first placement waits this long for gossip, polling every
# START_MEASURE_POLL_S, then goes on with the measured peers (the others join later).
START_MEASURE_WAIT_S = 15.0
START_MEASURE_POLL_S = 1.0


class Procedures:
    """The procedure in progress (see the module docstring)."""

    def __init__(self, reads: Reads, hand: HandOut, watch: RunWatch, queue: OperatorQueue, left_out: LeftOut,
                 over: Callable[[], bool]) -> None:
        self.r = reads
        self.over = over  # whether the run of this peer's epoch is over (the coordinator's `run_over`)
        self.hand = hand
        self.watch = watch
        self.queue = queue
        self.left_out = left_out
        self.proc: Procedure | None = None
        self._attempts = 0  # reconfigurations that failed in a row
        self.paused_live: frozenset[bytes] | None = None  # reachable peers when the run paused
        self.paused_retry_at = 0.0
        self._keeps = 0  # RUN_STATE keep requests made (their keys)
        # (run, epoch) whose costly rollback has waited for a holder to come back since when
        self._rollback_wait: tuple[bytes, int, float] | None = None

    def _ask(self, proc: Procedure, step: Step, peers: Iterable[bytes], body: dict, timeout_s: float,
             msg: int = ControlMsg.RUN_STATE, layers: tuple[int, int] | None = None) -> Ask:
        return self.r.ask(ProcStep(proc.id, step, layers), peers, msg, body, timeout_s)

    # ---- answers ------------------------------------------------------------------------------

    def answered(self, key: ProcStep, answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        """The peers' answers to a request of procedure `key.proc` at its step `key.step`."""
        proc = self.proc
        if proc is None or key.proc != proc.id:
            return []  # a procedure that failed meanwhile
        try:
            return self._advance(proc, key, answers, now)
        except ProcedureFailed as e:
            return self._failed(proc, e, now)

    def computed(self, ev: Computed, key: ProcStep, now: float) -> list:
        """The scheduler's answer: a start's first placement, or a reconfiguration's new layout."""
        proc = self.proc
        if proc is None or key.proc != proc.id:
            return []
        if proc.kind is Kind.START:
            return self._first_placed(proc, ev, now)
        try:
            return self._planned(proc, ev, now)
        except ProcedureFailed as e:
            return self._failed(proc, e, now)

    def poll(self, now: float) -> list:
        """Time passed: place a waiting start again, or ask the stopping peers again, once due."""
        proc = self.proc
        if proc is not None and proc.place_at is not None and now >= proc.place_at:
            proc.place_at = None
            assert proc.order.start is not None
            return self._place_start(proc, proc.order.start, now)
        if proc is None or proc.stop.poll_at is None or now < proc.stop.poll_at:
            return []
        proc.stop.poll_at = None
        return [self._ask(proc, Step.POLL, proc.stop.asked, {"op": "query"}, self.r.timings.request_timeout_s)]

    # ---- train start --------------------------------------------------------------------------

    def start(self, start: QueuedStart, now: float) -> list:
        """The first placement, off the loop (the scheduler, or a random one of the asked shape)."""
        refusal = self.queue.start_refusal(now)
        if refusal is not None:
            return [Reply(start.key, error=refusal)]
        self.queue.take_start(start.op, now, start.req.wait_s)
        self.paused_live, self._attempts = None, 0
        self.left_out.clear()  # (a new run: each peer is tried again; one that refuses it is left out again)
        proc = Procedure(self.r.next_id(), Kind.START, "train start", Order(reply=start.key, start=start), t0=now)
        self.proc = proc
        return self._place_start(proc, start, now)

    def _place_start(self, proc: Procedure, start: QueuedStart, now: float) -> list:
        """The first placement over the measured view less the peers left out for refusing."""
        req = start.req
        spec, cfg = start.model, req.config
        swarm, planner = self.r.swarm, self.r.planner
        live, regions = swarm.view().peers, swarm.regions()
        out = self.left_out.out(now, swarm.incarnations())  # (refused an earlier hand-out: out until its back-off ends)
        view, unmeasured = swarm.measured_view(set(live) - out)
        if unmeasured:
            if now < proc.t0 + START_MEASURE_WAIT_S:
                if now == proc.t0:
                    logger.info("train start waits up to %g s for the links of %d live peers to be measured",
                                START_MEASURE_WAIT_S, len(unmeasured))
                proc.place_at = now + START_MEASURE_POLL_S
                return []
            logger.warning("train start places the %d measured peers: %s not measured after %g s",
                           len(view.peers), ", ".join(short_id(p) for p in unmeasured), START_MEASURE_WAIT_S)
        return [Compute(ProcStep(proc.id, Step.FIRST), lambda: planner.first_placement(view, req, spec, cfg, regions))]

    def _first_placed(self, proc: Procedure, ev: Computed, now: float) -> list:
        start = proc.order.start
        assert start is not None
        if ev.error is not None or not isinstance(ev.value, Placement):
            return self._start_failed(proc, start, f"cannot schedule: {ev.error}", now)
        refusal = self.queue.start_refusal(now)  # (things may have changed while the scheduler ran)
        run = self.r.epoch.run
        if refusal is not None and proc.tries and run is not None and run.alloc.run_id == start.op.run_id:
            refusal = None  # (its own refused attempt, stopped before it started: the next replaces it)
        if refusal is not None:
            return self._start_failed(proc, start, refusal, now)
        shape = ev.value
        proc.planning.links_note = shape.links_note
        proc.planning.shape_note = shape.shape_note
        try:
            alloc = first_allocation(self.r, start, shape, self.r.me in self.queue.leaving(now))
        except ValueError as e:
            return self._start_failed(proc, start, f"cannot build the allocation: {e}", now)
        try:
            return self.hand.hand_out(proc, alloc, (), now)
        except ProcedureFailed as e:
            return self._failed(proc, e, now)

    def _start_failed(self, proc: Procedure, start: QueuedStart, why: str, now: float) -> list:
        """The operator is told its start failed; once a hand-out of it went out (and was
        refused), the run is over: nobody reconfigures it."""
        self.proc = None
        if proc.hand.alloc is not None or proc.tries:
            self.r.epoch.handle(RunClosed(start.op.run_id, f"its start failed: {why}"), now)
        return [Reply(start.key, error=why)]

    # ---- resume -------------------------------------------------------------------------------

    def resume(self, key: tuple, now: float) -> list:
        """Take a queued resume: the run is no longer over, and a reconfiguration brings it
        back from the resume point (control/epoch/runstate.py); any failure leaves it over."""
        cur = self.r.epoch.current
        if cur is None or not self.r.epoch.over_without_finishing(cur.run_id):
            return [Reply(key, error="the run is no longer stopped: nothing to resume")]
        logger.info("an operator resumes run %s", cur.run_id.hex()[:8])
        self.r.epoch.handle(RunReopened(cur.run_id), now)
        self.hand.to(Phase.IDLE, "")
        self._attempts = 0
        self.left_out.clear()  # (the operator may have fixed the peers that refused: each is tried again)
        self.paused_live = None
        return self.reconfigure("train resume", now, Order(reply=key, force=True, resume=True))

    # ---- reconfiguration ----------------------------------------------------------------------

    def reconfigure(self, trigger: str, now: float, order: Order = Order()) -> list:
        """A new epoch of the run, for `trigger`: first the run states of the named and live peers."""
        cur = self.r.epoch.current
        self.watch.reconfiguring()
        proc = Procedure(self.r.next_id(), Kind.RECONFIGURE, trigger, order, t0=now, cur=cur)
        self.proc = proc
        if cur is None or not self.r.election.is_coordinator:
            return self._failed(proc, ProcedureFailed("not the coordinator of a run"), now)
        self.hand.to(Phase.STOPPING)
        proc.stop.stuck = self.watch.take_stuck()
        proc.stop.asked = frozenset(named(cur) | set(self.r.swarm.live_peers()) | {self.r.me}) - self.watch.silent
        return [self._ask(proc, Step.STATES, proc.stop.asked, {"op": "query"}, self.r.timings.request_timeout_s)]

    def _advance(self, proc: Procedure, key: ProcStep, answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        cur, stop, t = proc.cur, proc.stop, self.r.timings
        step = key.step
        if step is Step.STATES or step is Step.POLL:
            assert cur is not None
            stop.states = run_states(answers)
            stop.running = [p for p, s in stop.states.items() if s.running and s.run_id == cur.run_id]
            if not stop.running:
                return self._plan(proc, now)
        if step is Step.STATES:
            assert cur is not None
            ats = [s.at for s in stop.states.values() if s.run_id == cur.run_id and s.at is not None]
            at = max(ats) + 1 if ats else 0
            # With a peer of the epoch gone no step can complete: abort the current one at once
            # (it changes nothing) instead of waiting for every receive to time out. So too when
            # no peer says where it is: there is no boundary to stop at.
            lost = stop.stuck or not ats or not set(cur.peers) <= set(stop.states) or any(
                s.run_id == cur.run_id and not s.running and s.layers is not None for s in stop.states.values())
            logger.info("reconfiguring (%s): %s %d peers%s", proc.trigger,
                        "aborting the step of" if lost else "stopping", len(stop.running),
                        "" if lost else f" before step {at}")
            return [self._ask(proc, Step.STOP, stop.running,
                              {"run": cur.run_id, "at_step": at, "abort": lost, "epoch": cur.epoch},
                              t.request_timeout_s, msg=ControlMsg.STOP)]
        if step is Step.STOP:
            stop.deadline = now + t.stop_timeout_s
            stop.poll_at = now + t.stop_poll_s
            return []
        if step is Step.POLL:
            if now + t.stop_poll_s <= stop.deadline:
                stop.poll_at = now + t.stop_poll_s
                return []
            me = self.r.me
            logger.warning("peers %s did not stop in time for the reconfiguration%s",
                           ", ".join(short_id(p) for p in stop.running),
                           ": this peer aborts its own step" if me in stop.running else "")
            out: list = [AbortRunner("did not stop in time for a reconfiguration")] if me in stop.running else []
            return out + [self._ask(proc, Step.FINAL, stop.asked, {"op": "query"}, t.request_timeout_s)]
        if step is Step.FINAL:
            stop.states = run_states(answers)
            return self._plan(proc, now)
        if step is Step.OFFER:
            assert key.layers is not None
            return self._offered(proc, key.layers, answers, now)
        if step is Step.ALLOC:
            return self.hand.allocation_answers(proc, answers, now)
        if step is Step.UNSTOP:
            raise ProcedureFailed(proc.hand.refused, counts=not proc.hand.transient)
        if step is Step.START:
            self.proc, self._attempts, self.paused_live = None, 0, None
            return self.hand.started(proc, answers, now)
        raise AssertionError(f"no answers expected for procedure step {step!r}")

    def _plan(self, proc: Procedure, now: float) -> list:
        """With a quorum of the voters reachable (as the election counts one): the resume point,
        then the new layout over the reachable, measured peers (the scheduler, off the loop)."""
        cur = proc.cur
        assert cur is not None
        proc.marks["stopped"] = now
        self.hand.to(Phase.PLANNING)
        states = proc.stop.states
        reachable = set(states)
        voters = set(self.r.election.voters)
        if voters and len(reachable & voters) < quorum(len(voters)):  # (a partition: waits for it to heal)
            return self._pause(proc, f"only {len(reachable & voters)} of {len(voters)} voters are reachable, "
                                     f"{quorum(len(voters))} needed: a side without a quorum does not reconfigure",
                               reachable, now)
        logger.info("run states: %s", describe(states))
        try:
            rp = resume_point(cur.run_id, cur.layer_ranges, states)
        except ResumeError as e:
            if proc.order.resume:
                raise ProcedureFailed(f"cannot resume run {cur.run_id.hex()[:8]}: {e}") from None
            # No peer of the run answered (every stage, even step 0, is restored by one): the run
            # waits and resumes when the reachable peers change.
            return self._pause(proc, f"{e}; waiting for a peer of the run to answer", reachable, now)
        if rp.step >= cur.end_step:
            raise ProcedureFailed("the run already reached its last step")
        began = self._rollback_wait
        wait = self._rollback_wait_until(proc, rp, now)
        if wait is not None:
            lost, until = wait
            return self._pause(proc, f"waiting up to {until - now:.0f} s more for a holder of a newer state to come back: "
                                     f"the newest step every stage can be restored at now is {rp.step}, "
                                     f"{lost} completed steps would run again", reachable, now,
                               retry_at=min(now + self.r.timings.paused_retry_s, until), again=began == self._rollback_wait)
        proc.planning.rp = rp
        swarm = self.r.swarm
        # (a leaving peer answers and offers its stages, but is not placed)
        view, unmeasured = swarm.measured_view(reachable - self.queue.leaving(now))
        if unmeasured:
            logger.info("left out until their links are measured: %s", ", ".join(short_id(p) for p in unmeasured))
        # (a peer that refused an allocation stays in the view, where it may hold a stage others
        # fetch, but is not placed until its back-off ends)
        left_out = proc.planning.left_out = self.left_out.out(now, swarm.incarnations()) & frozenset(view.peers)
        if left_out:
            logger.info("left out because they refused an allocation: %s", self.left_out.why(left_out, now))
        live = frozenset(view.peers) - left_out
        regions, cut, planner = swarm.regions(), self.watch.links.pairs(), self.r.planner
        remaining, force = cur.end_step - rp.step, proc.order.force
        return [Compute(ProcStep(proc.id, Step.PLAN), lambda: planner.reshape(
            view, cur, live=live, remaining_steps=remaining, regions=regions, seed=cur.epoch, force=force,
            cut=cut))]

    def _planned(self, proc: Procedure, ev: Computed, now: float) -> list:
        cur, pl = proc.cur, proc.planning
        assert cur is not None and pl.rp is not None
        if ev.error is not None and pl.left_out:
            # Waiting would not help: the peers that accept have no layout, and obeying the ones
            # that refuse would hand the run to them. The operator resumes it once they are fixed.
            return self._stop_run(proc, f"no layout of the peers that accept the allocation exists ({ev.error}); "
                                        f"left out: {self.left_out.why(pl.left_out, now, timed=False)}",
                                  now, left_out=pl.left_out)
        if ev.error is not None:
            return self._pause(proc, f"no allocation fits the reachable peers: {ev.error}", set(proc.stop.states), now)
        assert isinstance(ev.value, ReshapePlan)
        pl.plan = plan = ev.value
        links = self.watch.links
        through = used_cut_links(plan.placement.pipelines, links.pairs())
        if through:
            return self._pause(proc, "stalled: every allocation of the reachable peers uses a cut link ("
                               + "; ".join(links.why(x) for x in through) + "); waiting for it to heal",
                               set(proc.stop.states), now)
        proc.marks["planned"] = now
        self.hand.to(Phase.OFFERING)
        out = []
        shape = plan.placement  # its peers may fetch the offers (control/epoch/access.py)
        fetchers = sorted({p for pipe in shape.pipelines for p in pipe} | set(shape.spares))
        for r in cur.layer_ranges:
            holders = list(offer_holders(pl.rp, r, cur.layer_ranges, shape))
            body = {"op": "offer", "run": cur.run_id, "step": pl.rp.step, "layers": list(r), "for": fetchers}
            out.append(self._ask(proc, Step.OFFER, holders, body, self.r.timings.accept_timeout_s, layers=r))
        return out

    def _offered(self, proc: Procedure, r: tuple[int, int], answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        """Once every stage's holders answered: the digest most of them give goes into the
        allocation, with the holders that gave it."""
        cur, pl, states = proc.cur, proc.planning, proc.stop.states
        assert cur is not None and pl.rp is not None and pl.plan is not None
        rp = pl.rp
        pl.offers[r] = {p: offer_answer(a) for p, a in answers.items()}
        if len(pl.offers) < len(cur.layer_ranges):
            return []
        try:
            holdings = majority_holdings(cur, pl.offers, rp.step)
        except NoHolder as e:
            raise ProcedureFailed(str(e)) from None
        proc.marks["offered"] = now
        pl.links_note = pl.plan.placement.links_note
        leaving = self.queue.leaving(now)
        try:
            alloc = next_allocation(self.r, cur, pl.plan.placement, rp, holdings, proc.trigger,
                                    set(states) - leaving, self.r.me in leaving)
        except ValueError as e:
            raise ProcedureFailed(f"cannot build the next allocation: {e}") from None
        pl.rolled_back, pl.steps_lost = self._rollback_loss(proc, rp)
        reports = [(p, x) for p, st in states.items() for x in st.reports]
        return self.hand.hand_out(proc, alloc, reports, now)

    def _rollback_loss(self, proc: Procedure, rp: ResumePoint) -> tuple[bool, int]:
        """Whether resuming at `rp` rolls the run back, and how many completed steps it runs again."""
        cur, states = proc.cur, proc.stop.states
        assert cur is not None
        # Steps the current epoch completed that the swarm runs again: the holders of the newer
        # stages are gone (a checkpoint, the initial weights or older in-memory stages serve): a
        # rollback, said as such. Only the current epoch's steps count: those an earlier epoch
        # completed past its start were lost (and counted) by the rollback that started it.
        # (a peer that completed step j means every peer completed j - 1: the steps move together)
        mine = [x for st in states.values() for x in st.reports if x.epoch == cur.epoch]
        logged = completed_of(self.hand.steplog, cur)
        done = {x.step - 1 for x in mine} | {cur.start_step - 1} | ({logged} if logged is not None else set())
        # (a resume from the checkpoints of the stop boundary runs no logged step again: no rollback)
        rolled_back = (rp.rollback and not proc.order.resume) or rp.step <= max(done)
        # (how many: from the newest step of the epoch any peer logged or reported completing)
        newest = max(done | {x.step for x in mine})
        # A step this peer logged in an earlier epoch is run again too when the rollback that
        # started the current epoch was never handed out (its hand-out failed): a rollback all the same.
        # Not the steps a rollback that was handed out undid: that one counted them (the current
        # epoch's own completed steps are in `done`).
        ran = max(self.hand.still_logged(cur, logs_cur=logged is not None), default=-1)
        if not rolled_back and rp.step <= ran:
            rolled_back, newest = True, ran
        return rolled_back, max(0, newest + 1 - rp.step) if rolled_back else 0

    def _rollback_wait_until(self, proc: Procedure, rp: ResumePoint, now: float) -> tuple[int, float] | None:
        """(steps lost, until when to wait) when resuming at `rp` would run more completed steps
        again than a checkpoint interval (and than ROLLBACK_WAIT_MIN_STEPS): the peers that held the newer state may come back (a
        restarted peer brings the checkpoints of its data dir), and waiting for them as long as
        running those steps again is predicted to take (capped by `rollback_wait_max_s`) costs
        at worst as much as the loss, where rolling back at once costs all of it when they would
        have come back. None: resume at `rp` now (no rollback, a small one, an operator's resume,
        or the wait is over)."""
        cur = proc.cur
        assert cur is not None
        cap = self.r.timings.rollback_wait_max_s
        rolled_back, lost = self._rollback_loss(proc, rp)
        if not rolled_back or proc.order.resume or cap <= 0 or lost <= max(ROLLBACK_WAIT_MIN_STEPS, cur.checkpoint_every):
            return None
        key = (cur.run_id, cur.epoch)
        if self._rollback_wait is None or self._rollback_wait[:2] != key:
            self._rollback_wait = (*key, now)
        until = self._rollback_wait[2] + min(cap, lost * cur.predicted_iteration_s)
        return (lost, until) if now < until else None

    # ---- failure, pause, stop -----------------------------------------------------------------

    def _pause(self, proc: Procedure, why: str, reachable: Iterable[bytes], now: float,
               retry_at: float | None = None, again: bool = False) -> list:
        """The run waits: retried when a peer out of reach answers, or after a while (at
        `retry_at`, by default `paused_retry_s` from now). `again`: the same wait as the last
        pause's, retried: said in the log only (its event was emitted and the peers kept their
        stages on disk when it began)."""
        cur = proc.cur
        assert cur is not None
        self.paused_live = frozenset(reachable)
        self.paused_retry_at = now + self.r.timings.paused_retry_s if retry_at is None else retry_at
        self.hand.to(Phase.PAUSED, why)
        self.proc = None
        if again:
            logger.info("training still pauses: %s", why)
            return [] if proc.order.reply is None else [Reply(proc.order.reply, error=why)]
        logger.error("training pauses: %s", why)
        out: list = [Emit(PlaneEvent(EventKind.PAUSED, self.r.election.term, proc.trigger, epoch=cur.epoch,
                                     reason=why)),
                     self._keep(cur, reachable)]
        if proc.order.reply is not None:
            out.append(Reply(proc.order.reply, error=why))
        return out

    def _stop_run(self, proc: Procedure, why: str, now: float, left_out: frozenset[bytes] = frozenset()) -> list:
        """The run cannot go on: it is over (the epoch machine is told), and waits for an
        operator's resume."""
        cur = proc.cur
        assert cur is not None
        logger.error("training stops: %s", why)
        self.hand.to(Phase.STOPPED, why)
        self.r.epoch.handle(RunClosed(cur.run_id, why), now)
        self.proc = None
        shown = tuple(x for x in self.left_out.snapshot(now, self.r.clock.offset) if x.peer in left_out)
        out: list = [Emit(PlaneEvent(EventKind.STOPPED, self.r.election.term, proc.trigger, epoch=cur.epoch,
                                     reason=why, left_out=shown)),
                     self._keep(cur, set(proc.stop.states) | named(cur))]
        if proc.order.reply is not None:
            out.append(Reply(proc.order.reply, error=why))
        return out

    def _keep(self, cur: Allocation, peers: Iterable[bytes]) -> Ask:
        """Ask the peers of run `cur` to write what they hold of it in memory to their data dirs
        (RUN_STATE `keep`): the run waits, and a crash meanwhile must lose nothing. The answers
        change nothing here."""
        self._keeps += 1
        return self.r.ask(Keep(self._keeps), set(peers) | {self.r.me}, ControlMsg.RUN_STATE,
                          {"op": "keep", "run": cur.run_id}, self.r.timings.accept_timeout_s)

    def _failed(self, proc: Procedure, e: ProcedureFailed, now: float) -> list:
        """A failed start answers its operator; a failed reconfiguration is retried on the next
        check, up to `max_reconfig_attempts` times, then the run stops."""
        self.proc = None
        why, t, order = str(e), self.r.timings, proc.order
        start = order.start
        if (proc.kind is Kind.START and start is not None and proc.hand.alloc is not None and not e.counts
                and proc.tries + 1 < t.max_reconfig_attempts and self.r.election.is_coordinator):
            # Every peer that refused is left out (or its gossip disagreed): the run is placed
            # again without them, rather than failed for the operator by one member.
            logger.warning("the first hand-out of run %s failed (%s): placing it again", start.op.run_id.hex()[:8], why)
            proc.tries += 1
            proc.hand = HandingOut()
            self.proc = proc
            return self._place_start(proc, start, now)
        if proc.kind is Kind.START:
            if start is not None:  # the operator is told it failed: nobody reconfigures it
                return self._start_failed(proc, start, why, now)
            return [Reply(order.reply or (), error=why)]
        out: list = [Reply(order.reply, error=why)] if order.reply is not None else []
        if order.resume and proc.cur is not None:  # the operator is told; the run stays over
            logger.warning("the resume of run %s failed: %s", proc.cur.run_id.hex()[:8], why)
            self.r.epoch.handle(RunClosed(proc.cur.run_id, f"its resume failed: {why}"), now)
            return out
        if e.counts:
            self._attempts += 1
            logger.warning("reconfiguration %d failed: %s", self._attempts, why)
        else:
            logger.warning("reconfiguration failed (retried; it counts toward no limit: the peers' membership views "
                           "differ, or the peers that refused are left out): %s", why)
        cur = self.r.epoch.current
        if cur is not None and not self.over() and self.r.election.is_coordinator:
            if self._attempts >= t.max_reconfig_attempts:
                proc.cur = cur
                return out + self._stop_run(
                    proc, f"{t.max_reconfig_attempts} reconfigurations failed, the last: {why}", now)
            self.watch.retry(list(order.retry) or [proc.trigger])
        return out
