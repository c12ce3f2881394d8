"""Reconfiguring a running swarm, on the coordinator (see control/plane.py for the protocol).

The coordinator's loop (`_coordinate`) wakes on triggers (a peer of the allocation lost, a
failed step, the coordinator changing, an operator's `train reschedule`) and looks for joined
peers and a drifting network. A reconfiguration stops the epoch at a common step boundary,
checks that it reaches a majority of the voters, picks the resume point and plans the new
layout, has the holders offer their stages and hands the new epoch out. A run that has no
holder of some stage pauses until one answers; after `max_reconfig_attempts` failed
reconfigurations the run stops.

`ReconfigureRole` is mixed into `ControlPlane` beside `CoordinatorRole` (control/coordinate.py),
whose hand-out, run-state queries and events it uses through `self`.
"""

from __future__ import annotations

import logging
import time

import trio

from dtfm.net import short_id

from .allocation import Allocation, Holding
from .coordinator.request import TrainError
from .coordinator.reshape import ReshapePlan, reshape
from .coordinator.runstate import PeerRunState, ResumeError, ResumePoint, describe, resume_point
from .coordinator.schedule import Placement
from .messages import ControlMsg

__all__ = ["ReconfigureRole"]

logger = logging.getLogger("dtfm.control.plane")  # one log for the whole control plane

MAX_OFFER_HOLDERS = 64  # holders of one stage asked to offer it (each then keeps its own copy)


class _Paused(TrainError):
    """No reachable peer holds some stage: the run waits for one."""


class ReconfigureRole:
    """The coordinator's reconfiguration methods of `ControlPlane` (a mixin: see the module
    docstring)."""

    # ---- triggers and the coordinator's loop --------------------------------------------------

    def _trigger(self, reason: str) -> None:
        if reason not in self._triggers:
            self._triggers.append(reason)
        self._wake.set()

    def _run_over(self, run) -> bool:
        """Finished, or stopped by an operator: nothing to reconfigure."""
        if self._stopping == run.alloc.run_id:
            return True
        issued = self._issued
        if issued is not None and issued.alloc.run_id == run.alloc.run_id and issued.state == "finished":
            return True
        return run.end is not None and run.end.reason == "finished"

    async def _coordinate(self) -> None:
        """The coordinator's loop: reconfigure on triggers; look for joined peers and drift."""
        while True:
            with trio.move_on_after(self.config.check_interval_s):
                await self._wake.wait()
            self._wake = trio.Event()
            run = self._run
            if not self.election.is_coordinator or run is None or self._run_over(run):
                self._triggers.clear()
                continue
            reasons = await self._reasons(run)
            if reasons:
                await self._try_reconfigure(reasons)

    async def _reasons(self, run) -> list[str]:
        """Why to reconfigure now: the triggers, else a paused run's holders answering (or its
        retry time), else joined peers, else (every `drift_check_s`) a drifted network."""
        reasons, self._triggers = self._triggers, []
        if reasons:
            await trio.sleep(self.config.report_gather_s)  # the other peers' reports of the same event
            reasons += [r for r in self._triggers if r not in reasons]
            self._triggers = []
        elif self._paused_live is not None:
            if await self._holders_back(run):
                reasons = ["peers that were out of reach answer again"]
            elif trio.current_time() >= self._paused_retry_at:
                reasons = ["retrying the paused run"]
        else:
            reasons = await self._joined()
            if not reasons and trio.current_time() >= self._next_drift_check and run.active:
                self._next_drift_check = trio.current_time() + self.config.drift_check_s
                if await self._drifted(run.alloc):
                    reasons = ["a faster allocation is predicted on the measured network"]
        return reasons

    async def _try_reconfigure(self, reasons: list[str]) -> None:
        """Reconfigure; a failure is retried on the next loop, up to `max_reconfig_attempts` times."""
        try:
            await self.reconfigure("; ".join(reasons))
            self._attempts = 0
            self._paused_live = None
        except _Paused:
            pass  # retried when the reachable peers change
        except Exception as e:  # a failed reconfiguration must not take the daemon down
            if not isinstance(e, TrainError):
                logger.exception("reconfiguration (%s) failed", "; ".join(reasons))
            self._attempts += 1
            logger.warning("reconfiguration %d failed: %s", self._attempts, e)
            run = self._run
            if run is not None and not self._run_over(run) and self.election.is_coordinator:
                if self._attempts >= self.config.max_reconfig_attempts:
                    self._stop_run(run.alloc, f"{self.config.max_reconfig_attempts} reconfigurations failed, "
                                   f"the last: {e}", "; ".join(reasons))
                else:
                    self._triggers.extend(r for r in reasons if r not in self._triggers)

    def _pause(self, cur: Allocation, why: str, trigger: str, reachable) -> None:
        """The run waits: retried when a peer out of reach answers, or after a while."""
        self._paused_live = frozenset(reachable)
        self._paused_retry_at = trio.current_time() + self.config.paused_retry_s
        logger.error("training pauses: %s", why)
        if self._issued is not None and self._issued.alloc.run_id == cur.run_id:
            self._issued.state, self._issued.reason = "paused", why
        self._event("paused", term=self.election.term, epoch=cur.epoch, trigger=trigger, reason=why)
        raise _Paused(why)

    # ---- what calls for a reconfiguration -----------------------------------------------------

    async def _holders_back(self, run) -> bool:
        """While the run waits for a holder: does a peer that was out of reach answer now?"""
        named = set(run.alloc.peers) | set(run.alloc.spares) | set(self.gossip.live_peers())
        missing = named - set(self._paused_live or ()) - {self.me}
        if not missing:
            return False
        timeout_s = min(self.config.request_timeout_s, self.config.probe_timeout_s)
        return bool(await self._query_states(missing, timeout_s=timeout_s))

    async def _joined(self) -> list[str]:
        """Live members outside the allocation that answer: peers that joined or came back."""
        run = self._run
        named = set(run.alloc.peers) | set(run.alloc.spares)
        outside = [p for p in self.gossip.live_peers() if p not in named and p != self.me]
        if not outside:
            return []
        timeout_s = min(self.config.request_timeout_s, self.config.probe_timeout_s)
        states = await self._query_states(outside, timeout_s=timeout_s)
        view, _ = self._measured_view(set(states) | set(self.gossip.live_peers()) | {self.me})
        ready = [p for p in states if p in view.peers]
        return [f"peer {short_id(p)} joined" for p in sorted(ready)]

    async def _drifted(self, alloc: Allocation) -> bool:
        view = self.gossip.view()
        live = frozenset(self.gossip.live_peers()) | {self.me}
        if not view.complete or not set(alloc.peers) <= live:
            return False
        cur = alloc.plan()
        issued = self._issued
        done = issued.completed + 1 if issued is not None else alloc.start_step
        try:
            plan = await trio.to_thread.run_sync(lambda: reshape(
                view, alloc.model, alloc.train, current=cur, live=live & frozenset(view.peers),
                remaining_steps=max(1, alloc.end_step - done), regions=self._regions(),
                time_budget_s=self.config.schedule_time_s, min_gain=self.config.min_gain))
        except ValueError:
            return False
        return plan.kind != "keep"

    def _regions(self) -> dict[bytes, str]:
        return {m.peer_id: m.region for m in self.gossip.members()}

    # ---- reconfiguration ----------------------------------------------------------------------

    async def reschedule(self, *, forwarded: bool = False) -> dict:
        """`dtfm-peer train reschedule`: a new allocation now, on the coordinator."""
        if not self.election.is_coordinator:
            c = self.election.coordinator
            if c is None or forwarded:
                raise TrainError("no coordinator is known: is training running?")
            return await self._forward(c, "reschedule", {})
        run = self._run
        if run is None or self._run_over(run):
            raise TrainError("no training run is in progress")
        return await self.reconfigure("operator asked", force=True)

    async def reconfigure(self, trigger: str, *, force: bool = False) -> dict:
        async with self._reconf_lock:
            return await self._reconfigure(trigger, force)

    async def _reconfigure(self, trigger: str, force: bool) -> dict:
        """Stop the epoch, pick the resume point and the new layout, collect the offers and hand
        the next epoch out; returns the reconfiguration's record."""
        t0, started_at = trio.current_time(), time.time()
        run = self._run
        if run is None or not self.election.is_coordinator:
            raise TrainError("not the coordinator of a run")
        cur = run.alloc
        states = await self._stop_epoch(cur, trigger)
        t_stopped = trio.current_time()
        rp, plan = await self._resume_plan(cur, states, trigger, force)
        t_planned = trio.current_time()
        holdings = await self._collect_offers(cur, rp)
        t_offered = trio.current_time()
        alloc = self._next_allocation(cur, plan.placement, rp, holdings, trigger, set(states))
        # Steps already completed and logged that the swarm runs again: the holders of the newer
        # stages are gone (a checkpoint or older in-memory stages serve): a rollback, said as such.
        # (a peer that completed step j means every peer completed j - 1: the steps move together)
        done = set(self._logged.get(cur.run_id, ())) | {r.step - 1 for st in states.values() for r in st.reports}
        rolled_back = rp.rollback or rp.step <= max(done, default=-1)
        await self._hand_out(alloc, backfill=[r for st in states.values() for r in st.reports])
        self._triggers.clear()  # what happened before the new epoch started is accounted for
        t_done = trio.current_time()
        times = {"started_at": started_at, "stop_s": t_stopped - t0, "schedule_s": t_planned - t_stopped,
                 "offer_s": t_offered - t_planned, "transfer_s": getattr(self._issued, "fetch_s", 0.0),
                 "handout_s": t_done - t_offered}
        return self._reconfigured(trigger, cur, alloc, plan, rp, rolled_back, times)

    async def _stop_epoch(self, cur: Allocation, trigger: str) -> dict[bytes, PeerRunState]:
        """The run states of the named and live peers, once those still stepping stopped at a
        common step boundary (or, with a peer of the epoch lost, aborted their step)."""
        named = set(cur.peers) | set(cur.spares)
        asked = named | set(self.gossip.live_peers()) | {self.me}
        states = await self._query_states(asked)
        running = [p for p, s in states.items() if s.running and s.run_id == cur.run_id]
        if not running:
            return states
        ats = [s.at for s in states.values() if s.run_id == cur.run_id and s.at is not None]
        at = max(ats) + 1
        # With a peer of the epoch gone no step can complete: abort the current one at once
        # (it changes nothing) instead of waiting for every receive to time out.
        lost = not set(cur.peers) <= set(states) or any(
            s.run_id == cur.run_id and not s.running and s.layers is not None for s in states.values())
        logger.info("reconfiguring (%s): %s %d peers%s", trigger, "aborting the step of" if lost else "stopping",
                    len(running), "" if lost else f" before step {at}")
        await self._ask_all(running, ControlMsg.STOP, {"run": cur.run_id, "at_step": at, "abort": lost},
                            self.config.request_timeout_s,
                            local=lambda: self._stop_self(cur, at, abort=lost))
        with trio.move_on_after(self.config.stop_timeout_s):
            while running:
                await trio.sleep(self.config.stop_poll_s)
                states = await self._query_states(asked)
                running = [p for p, s in states.items() if s.running and s.run_id == cur.run_id]
        if running:
            self._abort_everywhere(cur, running)
            states = await self._query_states(asked)
        return states

    async def _resume_plan(self, cur: Allocation, states: dict[bytes, PeerRunState], trigger: str,
                           force: bool) -> tuple[ResumePoint, ReshapePlan]:
        """With a majority of the voters reachable: the resume point and the new layout over the
        reachable, measured peers. TrainError without a majority; pauses the run when some stage
        has no holder or no allocation fits."""
        reachable = set(states)
        voters = set(self.election.voters)
        if voters and len(reachable & voters) < len(voters) // 2 + 1:
            raise TrainError(f"only {len(reachable & voters)} of {len(voters)} voters are reachable: "
                             "a minority does not reconfigure")
        logger.info("run states: %s", describe(states))
        try:
            rp = resume_point(cur.run_id, cur.layer_ranges, states)
        except ResumeError as e:
            # Some stage is held by no reachable peer: the run waits (it may be a partition, or a
            # holder restarting) and resumes when the reachable peers change; it never goes on
            # with re-initialised weights.
            self._pause(cur, f"{e}; waiting for a holder to come back", trigger, reachable)
        if rp.step >= cur.end_step:
            raise TrainError("the run already reached its last step")
        view, unmeasured = self._measured_view(reachable)
        if unmeasured:
            logger.info("left out until their links are measured: %s", ", ".join(short_id(p) for p in unmeasured))
        live = frozenset(view.peers)
        try:
            plan = await trio.to_thread.run_sync(lambda: reshape(
                view, cur.model, cur.train, current=cur.plan(), live=live,
                remaining_steps=cur.end_step - rp.step, regions=self._regions(),
                time_budget_s=self.config.schedule_time_s, seed=cur.epoch, min_gain=self.config.min_gain,
                force=force))
        except ValueError as e:
            self._pause(cur, f"no allocation fits the reachable peers: {e}", trigger, reachable)
        return rp, plan

    def _next_allocation(self, cur: Allocation, shape: Placement, rp: ResumePoint, holdings: tuple[Holding, ...],
                         trigger: str, reachable: set[bytes]) -> Allocation:
        """The next epoch of the run: the new layout from the resume point, with the holdings."""
        new_named = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
        return Allocation(epoch=self.election.last_applied[1] + 1, term=self.election.term, issuer=self.me,
                          run_id=cur.run_id, pipelines=shape.pipelines, layer_ranges=shape.layer_ranges,
                          preset=cur.preset, model=cur.model, train=cur.train, data_hash=cur.data_hash,
                          data_name=cur.data_name, start_step=rp.step, end_step=cur.end_step,
                          checkpoint_every=cur.checkpoint_every, predicted_iteration_s=shape.predicted_iteration_s,
                          spares=shape.spares, holdings=holdings, absent=self._absent(new_named),
                          reason=trigger[:1024], voters=self._next_voters(new_named, reachable))

    def _reconfigured(self, trigger: str, cur: Allocation, alloc: Allocation, plan: ReshapePlan, rp: ResumePoint,
                      rolled_back: bool, times: dict) -> dict:
        """Record a reconfiguration (`last_reconfig` in status, an event, one INFO line) and
        return its record."""
        moved = getattr(self._issued, "fetched", 0)
        info = {"at": time.time(), "reason": trigger, "epoch": alloc.epoch, "term": alloc.term,
                "old_shape": f"{cur.stages}x{cur.dp}", "new_shape": f"{alloc.stages}x{alloc.dp}",
                "kind": plan.kind, "predicted_old_s": cur.predicted_iteration_s,
                "predicted_new_s": alloc.predicted_iteration_s, "moves": plan.moves, "bytes_moved": moved,
                "resume_step": rp.step, "rollback": rolled_back, **times}
        self._last_reconfig = info
        self._event("rollback" if rolled_back else "reconfigure", trigger=trigger, **{
            k: v for k, v in info.items() if k not in ("at", "reason")})
        logger.info("reconfigured (%s): %s -> %s (%s), predicted %.3f -> %.3f s per step, %d moves, %d bytes moved, "
                    "resuming at step %d%s", trigger, info["old_shape"], info["new_shape"], plan.kind,
                    cur.predicted_iteration_s, alloc.predicted_iteration_s, plan.moves, moved, rp.step,
                    " (rolled back: steps already logged run again)" if rolled_back else "")
        return {k: v for k, v in info.items()}

    async def _collect_offers(self, cur: Allocation, rp: ResumePoint) -> tuple[Holding, ...]:
        """Ask holders of each stage at the resume step to offer it; the digest most of them
        give goes into the allocation with the holders that gave it."""
        out = []
        for r in cur.layer_ranges:
            holders = list(rp.holders(r))[:MAX_OFFER_HOLDERS]
            body = {"op": "offer", "run": cur.run_id, "step": rp.step, "layers": list(r)}
            answers = await self._ask_all(holders, ControlMsg.RUN_STATE, body, self.config.accept_timeout_s,
                                          local=lambda r=r: self.offer(cur.run_id, rp.step, r))
            by_digest: dict[str, list[bytes]] = {}
            for p, a in answers.items():
                if isinstance(a.get("digest"), str):
                    by_digest.setdefault(a["digest"], []).append(p)
                else:
                    logger.warning("%s offers no layers %s at step %d: %s", short_id(p), r, rp.step,
                                   a.get("error") or a.get("reason"))
            if not by_digest:
                why = f"no holder of layers {r} could offer them at step {rp.step}"
                self._stop_run(cur, why, "offers")
                raise TrainError(why)
            digest, peers = max(by_digest.items(), key=lambda kv: len(kv[1]))
            if len(by_digest) > 1:
                logger.error("holders of layers %s disagree at step %d: %s", r, rp.step,
                             {d[:12]: [short_id(p) for p in ps] for d, ps in by_digest.items()})
            out.append(Holding(r, digest, tuple(sorted(peers))))
        return tuple(out)

    def _abort_everywhere(self, alloc: Allocation, peers: list[bytes]) -> None:
        logger.warning("peers %s did not stop in time: aborting their step", ", ".join(short_id(p) for p in peers))
        if self.me in peers:
            self._abort_run("did not stop in time for a reconfiguration")

    def _stop_run(self, alloc: Allocation, why: str, trigger: str) -> None:
        logger.error("training stops: %s", why)
        if self._issued is not None and self._issued.alloc.run_id == alloc.run_id:
            self._issued.state, self._issued.reason = "stopped", why
        self._stopping = alloc.run_id
        self._event("stopped", term=self.election.term, epoch=alloc.epoch, trigger=trigger, reason=why)

