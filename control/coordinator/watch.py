"""Watching the run the coordinator handed out, while no procedure runs (see docs/control.md,
"The coordinator machine" and "Gray failures").

`RunWatch` owns the triggers and their gathering, the check and drift timers, the probe out
(`Probe`: one at a time), the re-election check, the step deadline of the epoch (`StepWatch`,
deadline.py) with its probe and the peers it found silent, the cut links (links.py) and their
retest, the failed-step reports (failures.py), the wave of joins (joins.py) and the council's
voters gone from gossip (`VOTER_GONE_SETTLE_S`). It decides what
to look at next; when the run needs a new allocation it answers `Reconfigure`, which the
coordinator hands to its procedure.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from dtfm.gossip import NetworkView
from dtfm.net import short_id

from ..actions import Ask, Compute
from ..allocation import Allocation
from ..answers import NoAnswer, PeerAnswer
from ..messages import ControlMsg
from ..reach import ReachRequest
from ..refusals import Refusals
from .allocate import gone_voters
from .answers import reached, run_states
from .context import Reads, named
from .deadline import StepWatch, judge, laggards, missed_deadline, probe_targets
from .failures import FailedSteps
from .joins import JoinWave
from .keys import Drift, Fence, JoinPlan, Probe, ProbeKey
from .links import CutLinks
from .phase import Phase
from .reshape import ReshapePlan
from .steplog import StepLog

__all__ = ["Reconfigure", "RunWatch", "Watched"]

logger = logging.getLogger(__name__)

# An epoch's first drift check comes once its peers can have reported what their own steps
# measure (`ComputeGauge`: its first steps, then a gossip round or two), where that is sooner
# than `drift_check_s`: the prediction `train start` printed, costed at the figures the peers
# probed at their start, is re-estimated on their steps within the run's first steps (the step
# log's `predicted_iteration_s`). It waits `first_drift_steps` predicted steps (`[plane]`
# setting: twice the gauge's by default, as a loaded machine's steps run slower than
# predicted), and REPORT_SPREAD_S more.
REPORT_SPREAD_S = 5.0

# A council voter that has left the swarm (gone from this peer's gossip) and holds no stage
# would stay a voter until the next reconfiguration: the reconfiguration after its death, if
# any, came before gossip declared it dead, and the council drops only voters gone from every
# peer's gossip (peers refuse a change that drops a voter they count live). A council of five
# needs four votes, so a second voter lost (the coordinator, say) would leave the swarm with no
# election until one came back. Once a voter has been gone this long (gossip's word of a death
# reaching the other peers), a reconfiguration takes it out.
VOTER_GONE_SETTLE_S = 10.0


def first_drift_check_s(predicted_s: float, drift_check_s: float, steps: int) -> float:
    """Seconds from an epoch's start to its first drift check: `steps` predicted steps and
    REPORT_SPREAD_S, or `drift_check_s` where that is sooner, `steps` is 0 or nothing is predicted."""
    if steps <= 0 or not (math.isfinite(predicted_s) and predicted_s > 0):
        return drift_check_s
    return min(drift_check_s, steps * predicted_s + REPORT_SPREAD_S)


STALL_STEPS = 3  # steps' time without a completed step after which a failed report stands


@dataclass(frozen=True)
class Reconfigure:
    """The watch's verdict: the run needs a new allocation, for `trigger`; `retry`: the
    triggers kept if the reconfiguration fails."""

    trigger: str
    retry: tuple[str, ...]

    @classmethod
    def of(cls, reason: str) -> Reconfigure:
        return cls(reason, (reason,))


class Watched(Protocol):
    """What the watch reads of the rest of the coordinator."""

    @property
    def phase(self) -> Phase: ...
    @property
    def steplog(self) -> StepLog | None: ...
    @property
    def busy(self) -> bool: ...
    @property
    def paused_live(self) -> frozenset[bytes] | None: ...
    @property
    def paused_retry_at(self) -> float: ...

    def over(self) -> bool: ...
    def left_out_now(self, now: float) -> frozenset[bytes]: ...
    def leaving(self, now: float) -> frozenset[bytes]: ...


class RunWatch:
    """The run watch (see the module docstring)."""

    def __init__(self, reads: Reads, rest: Watched, refusals: Refusals) -> None:
        self.r = reads
        self.rest = rest
        self._probe: Probe | None = None  # the probe out, if any
        self._check_epoch: int | None = None  # re-elected in this term: is its epoch still running?
        self._triggers: list[str] = []
        self._gather_until: float | None = None  # triggers are collected until then
        self._next_check = 0.0
        self._next_drift_check = 0.0
        self.step_watch: StepWatch | None = None  # the step deadline of the epoch this peer started
        self._deadline_probe: tuple[int, int, tuple[bytes, ...]] | None = None  # (epoch, step, laggards)
        self._silent: frozenset[bytes] = frozenset()  # missed a deadline and a probe: not asked again
        self._stuck = False  # the next reconfiguration aborts a step that missed its deadline
        self.links = CutLinks()
        self._next_link_test = 0.0
        self.failures = FailedSteps(refusals)  # failed-step reports of the current epoch
        # joined peers not yet taken in
        self.joins = JoinWave(reads.timings.join_settle_s, reads.timings.join_wait_max_s)
        self._voters_gone: dict[bytes, float] = {}  # voter gone from gossip, holding no stage -> since
        # (voters, gone voters) a reconfiguration was asked for: not asked again for the same
        self._council_asked: tuple[tuple[bytes, ...], frozenset[bytes]] | None = None

    # ---- what happened ------------------------------------------------------------------------

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def wake(self, now: float) -> None:
        """Look at once instead of at the next check."""
        self._next_check = now

    def trigger(self, reason: str, now: float) -> None:
        self._add_trigger(reason)
        self._next_check = now

    def _add_trigger(self, reason: str) -> None:
        if reason not in self._triggers:
            self._triggers.append(reason)

    def elected(self, term: int, now: float, *, own_epoch: bool) -> None:
        """Elected in `term` with a run in progress: its own epoch (`own_epoch`, its step log
        kept) may have broken while it was not the coordinator; another's is reconfigured."""
        if own_epoch:
            self._check_epoch = term
        else:
            self._add_trigger(f"coordinator changed (term {term})")
        self._next_check = now

    def step_failed(self, peer: bytes, cur: Allocation, run_id: object, epoch: object, reason: str,
                    completed: int | None, now: float) -> None:
        """A peer says its step failed: checked (failures.py), then the run states are asked at once."""
        if self.failures.add(peer, cur, run_id, epoch, reason, completed, now) is None:
            logger.info("peer %s says a step of epoch %d failed: %s", short_id(peer), cur.epoch, reason[:200])
            self._next_check = now

    def step_completed(self, epoch: int, now: float) -> None:
        if self.step_watch is not None and self.step_watch.epoch == epoch:
            self.step_watch.completed(now)

    def reconfiguring(self) -> None:
        """A reconfiguration starts: it takes every live peer (the wave of joins is over)."""
        self.joins.clear()

    def take_stuck(self) -> bool:
        """Whether the reconfiguration that starts aborts a step that missed its deadline."""
        stuck, self._stuck = self._stuck, False
        return stuck

    @property
    def silent(self) -> frozenset[bytes]:
        """The peers that missed a deadline and its probe: not asked again."""
        return self._silent

    def retry(self, reasons: list[str]) -> None:
        """A reconfiguration failed: its triggers are kept for the next check."""
        self._triggers.extend(r for r in reasons if r not in self._triggers)

    def epoch_started(self, alloc: Allocation, cur: Allocation | None, now: float, *, reconfigured: bool) -> None:
        """Epoch `alloc` (after `cur`) started: its steps are watched from now."""
        self._next_drift_check = now + first_drift_check_s(alloc.predicted_iteration_s, self.r.timings.drift_check_s,
                                                           self.r.timings.first_drift_steps)
        self._silent, self._stuck = frozenset(), False
        rules = self.r.timings.deadline
        if rules is not None:
            old, prior = self.step_watch, list[float]()
            if old is not None and cur is not None and cur.run_id == alloc.run_id:
                prior = old.prior_for(alloc.predicted_iteration_s / max(cur.predicted_iteration_s, 1e-9))
            self.step_watch = StepWatch(rules, alloc.epoch, now, prior)
        if reconfigured:
            self._triggers.clear()  # what happened before the new epoch started is accounted for
            self._gather_until = None

    # ---- what to look at next -----------------------------------------------------------------

    def deadline(self) -> float:
        """When the watch wants a Tick (inf while a probe is out: it waits for the answers)."""
        if self._probe is not None:
            return math.inf
        times = [self._next_check, self._due()]
        if self._gather_until is not None:
            times.append(self._gather_until)
        if self.links:
            times.append(self._next_link_test)
        return min(times)

    def next(self, now: float) -> list | Reconfigure:
        """What to do now that neither a procedure nor a probe runs and no operator waits."""
        if self.r.me in self.rest.leaving(now):  # this peer handed its part off and goes: the run is its successor's
            self._triggers.clear()
            self._gather_until = None
            return []
        if not self._triggers:
            out = self._deadline_check(now) or self._link_retest(now)
            if out:
                return out
        if now < self._next_check and not (self._gather_until is not None and now >= self._gather_until):
            return []
        t = self.r.timings
        self._next_check = now + t.check_interval_s
        cur = self.r.epoch.current
        if not self.r.election.is_coordinator or cur is None or self.rest.over():
            self._triggers.clear()
            self._gather_until = None
            self._stuck = False
            return []
        if self._check_epoch is not None and not self._triggers:
            return [self._ask(Probe.EPOCH, cur.peers)]
        if self._triggers:
            if self._gather_until is None:  # the other peers' reports of the same event
                self._gather_until = now + t.report_gather_s
                return []
            if now < self._gather_until:
                return []
            reasons, self._triggers, self._gather_until = self._triggers, [], None
            return Reconfigure("; ".join(reasons), tuple(reasons))
        if self.failures.due(cur, self._completed_of(cur)):  # a failed step triggers once the run states agree
            return [self._ask(Probe.FAILED, cur.peers)]
        paused = self.rest.paused_live
        if paused is not None:
            missing = named(cur) | set(self.r.swarm.live_peers())
            missing -= set(paused) | {self.r.me}
            if missing:
                return [self._ask(Probe.HOLDERS, missing)]
            if now >= self.rest.paused_retry_at:
                return Reconfigure.of("retrying the paused run")
            return []
        # (a peer left out for refusing is not asked until its back-off ends: its joins and
        # returns start no reconfiguration meanwhile)
        # (nor is a joiner the scheduler kept out, while it stays live: `JoinWave.decline`)
        leaving = self.rest.leaving(now) | self.rest.left_out_now(now)
        self.joins.prune(self.r.swarm.live_peers())
        outside = [p for p in self.r.swarm.live_peers() if p not in named(cur) and p != self.r.me and p not in leaving
                   and p not in self.joins.declined]
        if outside:
            return [self._ask(Probe.JOINED, outside)]
        gone = self._voters_to_drop(cur, now)
        if gone:
            return Reconfigure.of(", ".join(f"voter {short_id(p)}" for p in sorted(gone)) + " left the swarm: the "
                                  + ("council takes it out" if len(gone) == 1 else "council takes them out, one an epoch"))
        # (whether or not this peer holds a stage of it: a coordinator left out as a spare checks too)
        if (now >= self._next_drift_check and self.rest.phase is Phase.TRAINING
                and now < self._due()):  # an overdue step is the deadline's to explain
            self._next_drift_check = now + t.drift_check_s
            return self._drift_check(cur, now)
        return []

    def _voters_to_drop(self, cur: Allocation, now: float) -> frozenset[bytes]:
        """The council's voters gone from this peer's gossip for `VOTER_GONE_SETTLE_S`, holding
        no stage of the epoch (a stage holder's loss reconfigures by itself), while the run
        trains: a reconfiguration is due to take them out (one a reconfiguration, as the council
        changes), unless one was asked for these voters and this council already (the
        election could not make the change: nothing to gain from asking again)."""
        voters = tuple(self.r.election.voters)
        gone = set(gone_voters(voters, set(self.r.swarm.live_peers()), self.r.me)) - set(cur.peers)
        self._voters_gone = {v: self._voters_gone.get(v, now) for v in gone}
        settled = frozenset(v for v, t in self._voters_gone.items() if now - t >= VOTER_GONE_SETTLE_S)
        if not settled or self.rest.phase is not Phase.TRAINING or self._council_asked == (voters, settled):
            return frozenset()
        self._council_asked = (voters, settled)
        return settled

    def _ask(self, probe: Probe, peers) -> Ask:
        """A run-state query of `peers`, as probe `probe`."""
        self._probe = probe
        return self.r.ask(ProbeKey(probe), peers, ControlMsg.RUN_STATE, {"op": "query"}, self.r.timings.probe_timeout_s)

    def probed(self, probe: Probe, answers: Mapping[bytes, PeerAnswer], now: float) -> list | Reconfigure:
        """The answers to probe `probe`."""
        self._probe = None
        # A silent peer that answers is silent no more (a frozen peer woke): the reconfiguration
        # its answer may start asks it again, or its stage would never be taken back.
        self._silent -= {p for p, a in answers.items() if not isinstance(a, NoAnswer)}
        if probe is Probe.DEADLINE:
            return self._deadline_answers(answers, now)
        if probe is Probe.LINKS:
            return self._links_answers(answers, now)
        states = run_states(answers)
        if probe is Probe.HOLDERS:
            if states:
                return Reconfigure.of("peers that were out of reach answer again")
            if now >= self.rest.paused_retry_at:
                return Reconfigure.of("retrying the paused run")
            return []
        cur = self.r.epoch.current
        if cur is None or not self.r.election.is_coordinator:
            return []
        if probe is Probe.FAILED:
            for reason in self.failures.judge(cur, states, self._completed_of(cur), now, self._stall_s(cur)):
                self.trigger(reason, now)
            return []
        if probe is Probe.EPOCH:
            term, self._check_epoch = self._check_epoch, None
            stalled = [p for p in cur.peers if p not in states or not states[p].running
                       or (states[p].run_id, states[p].epoch) != (cur.run_id, cur.epoch)]
            if not stalled:
                return []
            return Reconfigure.of(f"coordinator changed (term {term}): its epoch no longer runs everywhere")
        view, _ = self.r.swarm.measured_view(set(states) | set(self.r.swarm.live_peers()) | {self.r.me})
        out = self.rest.left_out_now(now)
        ready = [p for p in states if p in view.peers and p not in out]
        if not self.joins.due(ready, now):
            if ready:
                logger.info("%d joined peers wait for the wave of joins to settle (%.1f s at most)",
                            len(self.joins), self.joins.wait_s(now))
            return []
        reasons = [f"peer {short_id(p)} joined" for p in sorted(ready)]
        trigger = "; ".join(reasons) if len(reasons) <= 4 else (
            f"{len(reasons)} peers joined ({', '.join(short_id(p) for p in sorted(ready)[:4])}, ...)")
        return self._plan_joins(cur, tuple(sorted(ready)), trigger, now)

    # ---- a wave of joins, planned before anything stops ---------------------------------------

    def _plan_joins(self, cur: Allocation, joiners: tuple[bytes, ...], trigger: str, now: float) -> list | Reconfigure:
        """The scheduler with the wave's joiners live, while the run trains on (`reshape` without
        force, as the drift check runs it): a reconfiguration only when it finds the run faster
        with them (`join_planned`). Without a complete view or with a peer of the run not live,
        the reconfiguration at once (it plans after the stop)."""
        view = self.r.swarm.view()
        if not set(joiners) <= set(view.peers):
            return Reconfigure.of(trigger)
        search = self._reshape_as_it_runs(cur, view, now)
        if search is None:
            return Reconfigure.of(trigger)
        self._probe = Probe.JOINS
        return [Compute(JoinPlan(joiners, trigger), search)]

    def _reshape_as_it_runs(self, cur: Allocation, view: NetworkView, now: float) -> Callable[[], ReshapePlan] | None:
        """The scheduler's `reshape` of the running epoch on `view`, without force (keep wins
        unless another allocation gains enough), over the live peers, for a worker thread; None
        without a complete view or with a peer of the epoch not live."""
        live = (frozenset(self.r.swarm.live_peers()) | {self.r.me}) - self.rest.left_out_now(now)
        if not view.complete or not set(cur.peers) <= live:
            return None
        log = self.rest.steplog
        done = log.completed + 1 if log is not None and log.alloc.run_id == cur.run_id else cur.start_step
        regions = self.r.swarm.regions()
        cut = self.links.pairs()
        planner = self.r.planner
        return lambda: planner.reshape(view, cur, live=live & frozenset(view.peers),
                                       remaining_steps=max(1, cur.end_step - done), regions=regions, seed=0,
                                       force=False, cut=cut)

    def join_planned(self, key: JoinPlan, value: object, error: str | None) -> list | Reconfigure:
        """The scheduler's answer for a wave of joins: keep (the run is not faster with them)
        declines the joiners, nothing stops; any other plan, or a failed search, reconfigures."""
        self._probe = None
        cur = self.r.epoch.current
        if cur is None or not self.r.election.is_coordinator or self.rest.over():
            return []
        if error is None and isinstance(value, ReshapePlan) and value.kind == "keep":
            self.joins.decline(key.peers)
            logger.info("%s: the run is not faster with %s (predicted %.3f s per step as it runs): %s outside "
                        "the run, nothing stops", key.trigger, "it" if len(key.peers) == 1 else "them",
                        value.placement.predicted_iteration_s, "it waits" if len(key.peers) == 1 else "they wait")
            return []
        return Reconfigure.of(key.trigger)

    # ---- drift --------------------------------------------------------------------------------

    def _drift_check(self, cur: Allocation, now: float) -> list:
        search = self._reshape_as_it_runs(cur, self.r.swarm.view(), now)
        if search is None:
            return []
        self._probe = Probe.DRIFT
        return [Compute(Drift(), search)]

    def drift_computed(self, value: object, error: str | None) -> list | Reconfigure:
        self._probe = None
        if error is None and isinstance(value, ReshapePlan) and value.kind != "keep":
            return Reconfigure.of("a faster allocation is predicted on the measured network")
        log, cur = self.rest.steplog, self.r.epoch.current
        if (error is None and isinstance(value, ReshapePlan) and log is not None and cur is not None
                and (log.alloc.run_id, log.alloc.epoch) == (cur.run_id, cur.epoch)
                and math.isfinite(value.placement.predicted_iteration_s)):
            new = value.placement.predicted_iteration_s
            if abs(new - log.predicted_s) > 0.05 * log.predicted_s:
                logger.info("term %d epoch %d: predicted step re-estimated on the measured view: %.3f s -> %.3f s",
                            cur.term, cur.epoch, log.predicted_s, new)
            log.predicted_s = new
        return []

    # ---- the step deadline and cut links (deadline.py, links.py) ------------------------------

    def _due(self) -> float:
        """When the step of the epoch this peer started is overdue (inf: not watched now)."""
        w, log = self.step_watch, self.rest.steplog
        if (w is None or log is None or log.alloc.epoch != w.epoch or self.rest.phase is not Phase.TRAINING
                or self.rest.busy or self._triggers or self._stuck):
            return math.inf  # (with triggers pending, the reconfiguration is under way)
        # (nor once the run is over, or by a peer that is no coordinator: its deadline check does
        # nothing then, and a due time in the past would tick the machine without a pause)
        if self.rest.over() or not self.r.election.is_coordinator:
            return math.inf
        return w.due_at()

    def _deadline_check(self, now: float) -> list:
        """An overdue step: ask its laggards to reach their neighbours."""
        log, cur = self.rest.steplog, self.r.epoch.current
        if now < self._due() or log is None or cur is None or not self.r.election.is_coordinator:
            return []
        if (cur.run_id, cur.epoch) != (log.alloc.run_id, log.alloc.epoch) or self.rest.over():
            return []
        step = log.completed + 1
        lagging = laggards(log.alloc.peers, log.reports.get(step, {}))
        if not lagging:
            return []
        assert self.step_watch is not None
        # the laggards and their neighbours: a peer that froze right after its report holds
        # up the others, who wait for its acknowledgements
        asked = sorted(set(lagging) | set(probe_targets(lagging, {p: log.alloc.neighbours(p) for p in lagging})))
        logger.warning("step %d is overdue (%.1f s since the last, deadline %.1f s): %s have not reported it; "
                       "probing them and their neighbours", step, now - self.step_watch.last_at,
                       self.step_watch.deadline_s(), ", ".join(short_id(p) for p in lagging))
        self._deadline_probe = (log.alloc.epoch, step, tuple(asked))
        self._probe = Probe.DEADLINE
        t = self.r.timings.deadline_probe_timeout_s
        return [self.r.ask(ProbeKey(Probe.DEADLINE), asked, ControlMsg.RUN_STATE,
                           ReachRequest(tuple(asked), t / 2).to_wire(), t)]

    def _deadline_answers(self, answers: Mapping[bytes, PeerAnswer], now: float) -> list:
        """A silent laggard is out, a link whose ends answer but not each other is cut: either
        reconfigures at once, aborting the stuck step; else the step is only slow."""
        probe, self._deadline_probe = self._deadline_probe, None
        log, w = self.rest.steplog, self.step_watch
        if (probe is None or log is None or w is None or log.alloc.epoch != probe[0] or log.completed >= probe[1]
                or self.rest.phase is not Phase.TRAINING or not self.r.election.is_coordinator):
            return []  # the step completed meanwhile, or the epoch changed
        epoch, step, asked = probe
        t = self.r.timings
        verdict = judge(asked, {p: log.alloc.neighbours(p) for p in asked}, answers)
        if not verdict.stuck:
            w.probe_answered(now)
            logger.info("step %d is slow, not stuck: every peer asked answered and reaches its neighbours; "
                        "next look at %.1f s", step, w.due_at() - now)
            return []
        for p in verdict.silent:
            self._add_trigger(missed_deadline(p, step, w.deadline_s(), t.deadline_probe_timeout_s))
        for a, b in verdict.cut:
            why = (f"link {short_id(a)}-{short_id(b)} failed step {step}: both ends answer a probe, "
                   "not each other's pings")
            self.links.add((a, b), why)
            self._add_trigger(why)
        self._silent, self._stuck, self._next_check = frozenset(verdict.silent), True, now
        self._next_link_test = now + t.link_retest_s
        if not verdict.silent:
            return []
        # A frozen peer reads this when it wakes: it aborts its step instead of sending on in
        # an epoch the others left (what it sends meanwhile is refused by epoch anyway).
        return [self.r.ask(Fence(epoch), verdict.silent, ControlMsg.STOP,
                           {"run": log.alloc.run_id, "at_step": step, "abort": True, "epoch": log.alloc.epoch},
                           t.request_timeout_s)]

    def _link_retest(self, now: float) -> list:
        """Ping each cut link from one end; a ping that comes back clears it."""
        if (not self.links or now < self._next_link_test or not self.r.election.is_coordinator
                or self.r.epoch.current is None or self.rest.over()):
            return []
        t = self.r.timings
        self._next_link_test = now + t.link_retest_s
        self.links.forget_peers(set(self.r.swarm.live_peers()) | {self.r.me})
        if not self.links:
            return []
        pairs = self.links.pairs()
        self._probe = Probe.LINKS
        return [self.r.ask(ProbeKey(Probe.LINKS), {a for a, _ in pairs}, ControlMsg.RUN_STATE,
                           ReachRequest(tuple(sorted({b for _, b in pairs})), t.deadline_probe_timeout_s / 2).to_wire(),
                           t.deadline_probe_timeout_s)]

    def _links_answers(self, answers: Mapping[bytes, PeerAnswer], now: float) -> list | Reconfigure:
        healed = []
        for a, b in sorted(self.links.pairs()):
            if a in answers and b in reached(answers[a]):
                healed.append((a, b))
        for link in healed:
            logger.info("link %s-%s answers again: allocations may use it", short_id(link[0]), short_id(link[1]))
            self.links.clear(link)
        if (healed and self.rest.phase is Phase.PAUSED and self.rest.paused_live is not None
                and self.r.election.is_coordinator and self.r.epoch.current is not None and not self.rest.over()):
            return Reconfigure.of("; ".join(f"link {short_id(a)}-{short_id(b)} answers again" for a, b in healed))
        return []

    # ---- for status and the failed-step check -------------------------------------------------

    def stall(self, reason: str, now: float) -> dict:
        """Since when (wall time) and why the run makes no progress, for `status`."""
        w, log, phase = self.step_watch, self.rest.steplog, self.rest.phase
        since = self.r.clock.wall(w.last_at if w is not None else now)
        if phase is Phase.PAUSED:
            return {"stalled_since": since, "stalled_reason": reason}
        if w is None or log is None or phase is not Phase.TRAINING or now < w.last_at + w.deadline_s():
            return {}
        if self._probe is Probe.DEADLINE:
            why = "probing the peers that have not reported it"
        elif w.answered:
            why = "every peer that has not reported it answers and reaches its neighbours: a slow step"
        else:
            why = "the peers that have not reported it are probed next"
        return {"stalled_since": since,
                "stalled_reason": f"step {log.completed + 1} is overdue (deadline {w.deadline_s():.1f} s): {why}"}

    def _completed_of(self, cur: Allocation) -> int | None:
        """The step log's last completed step of epoch `cur`, None when this peer does not log it."""
        return completed_of(self.rest.steplog, cur)

    def _stall_s(self, cur: Allocation) -> float:
        """How long an epoch may complete no step before a failed report stands: STALL_STEPS
        steps (the last logged step's time, else the predicted), at least one check interval."""
        log = self.rest.steplog
        recent = log.recent[-1].get("iteration_s") if log is not None and log.recent else None
        step_s = recent if isinstance(recent, float) and recent > 0 else cur.predicted_iteration_s
        return max(self.r.timings.check_interval_s, STALL_STEPS * step_s)


def completed_of(log: StepLog | None, cur: Allocation) -> int | None:
    """`log`'s last completed step of epoch `cur`, None when it does not log that epoch."""
    if log is None or (log.alloc.run_id, log.alloc.epoch) != (cur.run_id, cur.epoch):
        return None
    return log.completed
