"""The coordinator's side of the control plane: starting a run, the hand-out, and
reconfiguring the swarm when it changes (see control/plane.py for the protocol).

`CoordinatorRole` is mixed into `ControlPlane`: every daemon can become the coordinator, and the
coordinator is also a peer of the run, so both roles share the plane's state (its run, the
election, the transport). What a peer does lives in plane.py; what only the coordinator does
lives here.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import replace

import numpy as np
import trio

from dtfm.gossip import build_view
from dtfm.net import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout, short_id
from dtfm.train import TrainConfig, get_preset

from .allocation import Allocation, Holding, SignedAllocation
from .messages import ControlMsg
from .request import TrainError, TrainRequest
from .reshape import Current, reshape
from .runner import StepReport
from .runstate import PeerRunState, ResumeError, describe, resume_point
from .schedule import choose_shape, random_shape
from .steplog import _Issued

__all__ = ["CoordinatorRole"]

logger = logging.getLogger("dtfm.control.plane")

MAX_OFFER_HOLDERS = 64  # holders of one stage asked to offer it (each then keeps its own copy)
MAX_ATTEMPTS = 5  # reconfigurations of one trigger before the run stops


class _Paused(TrainError):
    """No reachable peer holds some stage: the run waits for one."""


class CoordinatorRole:
    """The coordinator's methods of `ControlPlane` (a mixin: see the module docstring)."""

    # ---- coordinator: train start -------------------------------------------------------------

    async def start_training(self, req: TrainRequest, *, forwarded: bool = False, args: dict | None = None) -> dict:
        """Wait for `req.min_peers` live, measured peers; stand for coordinator if there is none;
        the coordinator schedules on the gossiped view, hands the allocation out and starts every
        peer."""
        if not forwarded:  # (a forwarding peer has waited)
            await self._await_swarm(req)
        coordinator = self.me if forwarded else await self._become_coordinator()
        if coordinator is None:
            raise TrainError(f"no coordinator was elected within {self.config.elect_timeout_s:g} s: "
                             "is a majority of the swarm reachable?")
        if coordinator != self.me:
            return await self._forward(coordinator, "start", args if args is not None else req.to_args())
        corpus = await self.corpus(req.data_path)
        spec = get_preset(req.preset)
        cfg = req.train or TrainConfig(seed=req.seed)
        members = {m.peer_id: m for m in self.gossip.members() if not m.state.gone}
        view = self.gossip.view()
        regions = {p: m.region for p, m in members.items()}
        if req.stages is not None and req.dp is None:
            req = replace(req, dp=max(1, len(view.peers) // req.stages))
        try:
            if req.placement == "random":
                shape = random_shape(view, spec, cfg, stages=req.stages, dp=req.dp, seed=req.seed)
            else:
                shape = await trio.to_thread.run_sync(lambda: choose_shape(
                    view, spec, cfg, stages=req.stages, dp=req.dp, regions=regions,
                    time_budget_s=self.config.schedule_time_s, seed=req.seed))
        except ValueError as e:
            raise TrainError(f"cannot schedule: {e}") from None
        async with self._reconf_lock:
            run = self._run
            if run is not None and run.active:
                raise TrainError("a run is in progress: `train stop` it first")
            alloc = Allocation(epoch=self.election.last_applied[1] + 1, term=self.election.term, issuer=self.me,
                               pipelines=shape.pipelines, layer_ranges=shape.layer_ranges, preset=req.preset,
                               model=spec, train=cfg, data_hash=corpus.fingerprint, data_name=corpus.name,
                               start_step=0, end_step=req.steps, checkpoint_every=req.checkpoint_every,
                               predicted_iteration_s=shape.predicted_iteration_s, spares=shape.spares,
                               absent=self._absent({p for pipe in shape.pipelines for p in pipe} | set(shape.spares)),
                               run_id=secrets.token_bytes(16), reason="train start",
                               voters=self._next_voters({p for pipe in shape.pipelines for p in pipe}
                                                        | set(shape.spares), set(members)))
            log_path = self.data_dir / "train.jsonl"
            log_path.unlink(missing_ok=True)
            self._paused_live, self._attempts = None, 0
            await self._hand_out(alloc)
            self._event("start", term=alloc.term, epoch=alloc.epoch, trigger="train start", old_shape=None,
                        new_shape=f"{alloc.stages}x{alloc.dp}", predicted_new_s=alloc.predicted_iteration_s,
                        moves=0, bytes_moved=0, resume_step=0)
        return {"run_id": alloc.run_id.hex(), "epoch": alloc.epoch, "term": alloc.term, "stages": alloc.stages,
                "dp": alloc.dp, "coordinator": self.me.hex(),
                "pipelines": [[p.hex() for p in pipe] for pipe in alloc.pipelines],
                "layer_ranges": [list(r) for r in alloc.layer_ranges], "spares": [p.hex() for p in alloc.spares],
                "predicted_iteration_s": alloc.predicted_iteration_s, "objective_s": shape.objective_s,
                "placement": req.placement, "steps": req.steps, "data": corpus.name, "log": str(log_path)}

    async def _await_swarm(self, req: TrainRequest) -> None:
        """Return once `req.min_peers` peers (this one included) are live and their links measured,
        so the first configuration is the swarm the operator expects; TrainError after
        `req.wait_s`. The count is in `status()` while it waits."""
        deadline = trio.current_time() + req.wait_s
        said = -1
        try:
            while True:
                live = set(self.gossip.live_peers()) | {self.me}
                view, _ = self._measured_view(live)
                have = len(view.peers)
                self._swarm_wait = {"have": have, "want": req.min_peers, "live": len(live)}
                if have >= req.min_peers:
                    return
                if have != said:
                    logger.info("train start waits for %d peers: %d live, %d of them measured",
                                req.min_peers, len(live), have)
                    said = have
                left = deadline - trio.current_time()
                if left <= 0:
                    raise TrainError(f"only {have} of the {req.min_peers} peers asked for (--min-peers) are "
                                     f"live and measured after {req.wait_s:g} s ({len(live)} live): "
                                     "are the others started, with this swarm's bootstrap address?")
                await trio.sleep(min(1.0, left))
        finally:
            self._swarm_wait = None

    async def _fill_gaps(self, issued: _Issued) -> None:
        """Ask the epoch's peers for the reports they keep and log the steps whose every report
        was lost on the way here, so `train.jsonl` has no hole while the epoch runs on."""
        try:
            states = await self._query_states(issued.alloc.peers)
            if self._issued is issued:
                for line in issued.fill([r for st in states.values() for r in st.reports]):
                    logger.info("step %d: loss %s (back-filled from the peers' reports)", line["step"],
                                "-" if line["loss"] is None else f"{line['loss']:.4f}")
        finally:
            issued.filling = False

    def _next_voters(self, named: set[bytes], reachable: set[bytes]) -> tuple[bytes, ...]:
        """The next configuration: one step from the current voters toward the named peers (an
        unreachable voter out first, then a named peer in, then a reachable voter out), so every
        majority of the old voters meets every majority of the new and one term never gets two
        coordinators. Further differences go at the next epochs."""
        old = set(self.election.voters) or set(named)
        new = set(old)
        gone = sorted(old - named - reachable - {self.me})
        joining = sorted(named - old)
        leaving = sorted(old - named - {self.me})
        if gone:
            new.discard(gone[0])
        elif joining:
            new.add(joining[0])
        elif leaving:
            new.discard(leaving[0])
        new.add(self.me)  # the issuer is a voter (it was elected by this configuration)
        return tuple(sorted(new))

    def _absent(self, named: set[bytes]) -> tuple[bytes, ...]:
        """Every member this peer knows of that has no place: peers whose gossip still counts
        one of them alive must not refuse the allocation for leaving it out."""
        return tuple(sorted({m.peer_id for m in self.gossip.members()} - named - {self.me})[:4096])

    async def _hand_out(self, alloc: Allocation, *, backfill: dict[int, list[StepReport]] | None = None) -> None:
        """ALLOCATION to every named peer, then START; TrainError with every refusal."""
        signed = SignedAllocation.sign(alloc, self.identity)
        logged = self._logged.setdefault(alloc.run_id, set())
        self._issued = issued = _Issued(alloc, self.data_dir / "train.jsonl", logged)
        for step, reports in sorted((backfill or {}).items()):
            if step not in logged and step < alloc.start_step:
                newest = max(r.epoch for r in reports)  # a step re-run after a rollback: its last run
                issued.write(step, [r for r in reports if r.epoch == newest], newest, backfilled=True)
        targets = list(alloc.peers) + list(alloc.spares)
        logger.info("issuing term %d epoch %d (%s): %d stages x %d pipelines over %d peers from step %d, "
                    "predicted %.3f s per step", alloc.term, alloc.epoch, alloc.reason, alloc.stages, alloc.dp,
                    len(alloc.peers), alloc.start_step, alloc.predicted_iteration_s)
        answers = await self._ask_all(targets, ControlMsg.ALLOCATION, signed.to_wire(),
                                      self.config.accept_timeout_s, local=lambda: self.accept(alloc))
        refused = {p: a for p, a in answers.items() if not a.get("accepted")}
        if refused:
            await self._ask_all([p for p in targets if p not in refused], ControlMsg.STOP,
                                {"run": alloc.run_id, "at_step": 0}, self.config.request_timeout_s,
                                local=lambda: self._stop_self(alloc, 0))
            issued.state = "refused"
            why = "; ".join(f"{short_id(p)}: {a.get('reason', 'no answer')}" for p, a in refused.items())
            issued.reason = why
            raise TrainError(f"the allocation was refused: {why}")
        started = await self._ask_all(list(alloc.peers), ControlMsg.START, {"run": alloc.run_id, "epoch": alloc.epoch},
                                      self.config.request_timeout_s, local=lambda: self._start_self(alloc))
        late = [short_id(p) for p, a in started.items() if not a.get("started")]
        if late:
            logger.warning("peers %s did not confirm the start", ", ".join(late))
        issued.state = "training"
        self._next_drift_check = trio.current_time() + self.config.drift_check_s
        issued.fetched = int(sum(_num(a.get("fetched_bytes")) for a in answers.values()))
        issued.fetch_s = max([_num(a.get("fetch_s")) for a in answers.values()] + [0.0])

    async def _start_self(self, alloc: Allocation) -> dict:
        run = self._run
        if run is None or run.alloc.run_id != alloc.run_id or run.alloc.epoch != alloc.epoch:
            return {"started": False, "reason": "not accepted here"}
        return self._start_local(run)

    async def _stop_self(self, alloc: Allocation, at_step: int, *, abort: bool = False) -> dict:
        run = self._run
        if run is not None and run.alloc.run_id == alloc.run_id:
            if abort:
                self._abort_run("aborted for a reconfiguration")
            else:
                self._stop_local(run, at_step)
        return {"stopped": True}

    async def stop_training(self) -> dict:
        run = self._run
        if run is None or self._run_over(run):
            raise TrainError("no training run is in progress on this peer")
        issued = self._issued if self._issued is not None and self._issued.alloc.run_id == run.alloc.run_id else None
        if run.state is not None:
            now = run.state.step
        else:  # a spare (the coordinator may be one): the run's progress as the coordinator logged it
            now = issued.completed + 1 if issued is not None else run.alloc.start_step
        at = now + 2  # every peer is within one step of every other: this boundary is ahead of all
        self._stopping = run.alloc.run_id  # a stopped run is over: the coordinator does not reconfigure it
        told = set(run.alloc.peers) | {run.alloc.issuer}
        if self.election.coordinator is not None:
            told.add(self.election.coordinator)
        answers = await self._ask_all(sorted(told), ControlMsg.STOP,
                                      {"run": run.alloc.run_id, "at_step": at, "final": True},
                                      self.config.request_timeout_s, local=lambda: self._stop_self(run.alloc, at))
        return {"at_step": at, "told": sum(1 for a in answers.values() if a.get("stopped"))}

    async def _ask_all(self, peers: list[bytes], msg_type: int, body: dict, timeout_s: float, *, local) -> dict:
        answers: dict[bytes, dict] = {}

        async def ask(peer: bytes) -> None:
            try:
                with trio.fail_after(timeout_s):
                    if peer == self.me and local is not None:
                        answers[peer] = await local()
                        return
                    conn = await self._connection(peer)
                    reply, _ = await conn.request(msg_type, body, timeout_s=timeout_s)
                    answers[peer] = reply if isinstance(reply, dict) else {"reason": "malformed answer"}
            except (trio.TooSlowError, RequestTimeout):
                answers[peer] = {"reason": f"no answer within {timeout_s:g} s"}
            except (ConnectionClosed, RemoteError, ProtocolError, OSError) as e:
                answers[peer] = {"reason": f"unreachable: {e}"}

        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(ask, p)
        return answers

    # ---- coordinator: reconfiguration ---------------------------------------------------------

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
            reasons, self._triggers = self._triggers, []
            if reasons:
                await trio.sleep(0.5)  # the other peers' reports of the same event
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
            if reasons:
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
                        if self._attempts >= MAX_ATTEMPTS:
                            self._stop_run(run.alloc, f"{MAX_ATTEMPTS} reconfigurations failed, the last: {e}",
                                           "; ".join(reasons))
                        else:
                            self._triggers.extend(r for r in reasons if r not in self._triggers)

    def _pause(self, cur: Allocation, why: str, trigger: str, reachable) -> None:
        """The run waits: retried when a peer out of reach answers, or after a while."""
        self._paused_live = frozenset(reachable)
        self._paused_retry_at = trio.current_time() + 6 * self.config.check_interval_s
        logger.error("training pauses: %s", why)
        if self._issued is not None and self._issued.alloc.run_id == cur.run_id:
            self._issued.state, self._issued.reason = "paused", why
        self._event("paused", term=self.election.term, epoch=cur.epoch, trigger=trigger, reason=why)
        raise _Paused(why)

    def _measured_view(self, candidates) -> tuple:
        """The view over `candidates`, leaving out (worst first) peers whose links gossip has
        not measured yet: a restarted or joined peer is placed once it has been measured."""
        peers = sorted(candidates)
        left: list[bytes] = []
        while True:
            view = build_view(tuple(peers), self.gossip.records.reports)
            if view.complete or len(peers) <= 1:
                return view, left
            known = np.isfinite(view.delay_ms) & np.isfinite(view.bandwidth_gbps)
            unknown = ~known & ~np.eye(len(peers), dtype=bool)
            worst = peers[int(np.argmax(unknown.sum(axis=0) + unknown.sum(axis=1)))]
            peers.remove(worst)
            left.append(worst)

    async def _holders_back(self, run) -> bool:
        """While the run waits for a holder: does a peer that was out of reach answer now?"""
        named = set(run.alloc.peers) | set(run.alloc.spares) | set(self.gossip.live_peers())
        missing = named - set(self._paused_live or ()) - {self.me}
        if not missing:
            return False
        return bool(await self._query_states(missing, timeout_s=min(self.config.request_timeout_s, 5.0)))

    async def _joined(self) -> list[str]:
        """Live members outside the allocation that answer: peers that joined or came back."""
        run = self._run
        named = set(run.alloc.peers) | set(run.alloc.spares)
        outside = [p for p in self.gossip.live_peers() if p not in named and p != self.me]
        if not outside:
            return []
        states = await self._query_states(outside, timeout_s=min(self.config.request_timeout_s, 5.0))
        view, _ = self._measured_view(set(states) | set(self.gossip.live_peers()) | {self.me})
        ready = [p for p in states if p in view.peers]
        return [f"peer {short_id(p)} joined" for p in sorted(ready)]

    async def _drifted(self, alloc: Allocation) -> bool:
        view = self.gossip.view()
        live = frozenset(self.gossip.live_peers()) | {self.me}
        if not view.complete or not set(alloc.peers) <= live:
            return False
        cur = Current(alloc.pipelines, alloc.layer_ranges)
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

    async def _query_states(self, peers, *, timeout_s: float | None = None) -> dict[bytes, PeerRunState]:
        timeout_s = timeout_s or self.config.request_timeout_s
        answers = await self._ask_all(sorted(set(peers)), ControlMsg.RUN_STATE, {"op": "query"}, timeout_s,
                                      local=self._local_state)
        out = {}
        for p, a in answers.items():
            try:
                out[p] = PeerRunState.from_wire(a)
            except ProtocolError as e:
                logger.debug("run state of %s: %s", short_id(p), e)
        return out

    async def _local_state(self) -> dict:
        return self.run_state().to_wire()

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
        t0, started_at = trio.current_time(), time.time()
        run = self._run
        if run is None or not self.election.is_coordinator:
            raise TrainError("not the coordinator of a run")
        cur = run.alloc
        named = set(cur.peers) | set(cur.spares)
        asked = named | set(self.gossip.live_peers()) | {self.me}
        states = await self._query_states(asked)
        running = [p for p, s in states.items() if s.running and s.run_id == cur.run_id]
        if running:
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
                    await trio.sleep(0.2)
                    states = await self._query_states(asked)
                    running = [p for p, s in states.items() if s.running and s.run_id == cur.run_id]
            if running:
                self._abort_everywhere(cur, running)
                states = await self._query_states(asked)
        t_stopped = trio.current_time()
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
                view, cur.model, cur.train, current=Current(cur.pipelines, cur.layer_ranges), live=live,
                remaining_steps=cur.end_step - rp.step, regions=self._regions(),
                time_budget_s=self.config.schedule_time_s, seed=cur.epoch, min_gain=self.config.min_gain,
                force=force))
        except ValueError as e:
            self._pause(cur, f"no allocation fits the reachable peers: {e}", trigger, reachable)
        t_planned = trio.current_time()
        holdings = await self._collect_offers(cur, rp)
        t_offered = trio.current_time()
        shape = plan.shape
        new_named = {p for pipe in shape.pipelines for p in pipe} | set(shape.spares)
        alloc = Allocation(epoch=self.election.last_applied[1] + 1, term=self.election.term, issuer=self.me,
                           run_id=cur.run_id, pipelines=shape.pipelines, layer_ranges=shape.layer_ranges,
                           preset=cur.preset, model=cur.model, train=cur.train, data_hash=cur.data_hash,
                           data_name=cur.data_name, start_step=rp.step, end_step=cur.end_step,
                           checkpoint_every=cur.checkpoint_every, predicted_iteration_s=shape.predicted_iteration_s,
                           spares=shape.spares, holdings=holdings, absent=self._absent(new_named),
                           reason=trigger[:1024], voters=self._next_voters(new_named, reachable))
        # Steps already completed and logged that the swarm runs again: the holders of the newer
        # stages are gone (a checkpoint or older in-memory stages serve): a rollback, said as such.
        # (a peer that completed step j means every peer completed j - 1: the steps move together)
        done = set(self._logged.get(cur.run_id, ())) | {r.step - 1 for st in states.values() for r in st.reports}
        rolled_back = rp.rollback or rp.step <= max(done, default=-1)
        backfill: dict[int, list[StepReport]] = {}
        for s in states.values():
            for r in s.reports:
                if r.step < rp.step:
                    backfill.setdefault(r.step, []).append(r)
        await self._hand_out(alloc, backfill=backfill)
        self._triggers.clear()  # what happened before the new epoch started is accounted for
        t_done = trio.current_time()
        moved = getattr(self._issued, "fetched", 0)
        info = {"at": time.time(), "reason": trigger, "epoch": alloc.epoch, "term": alloc.term,
                "old_shape": f"{cur.stages}x{cur.dp}", "new_shape": f"{alloc.stages}x{alloc.dp}",
                "kind": plan.kind, "predicted_old_s": cur.predicted_iteration_s,
                "predicted_new_s": alloc.predicted_iteration_s, "moves": plan.moves, "bytes_moved": moved,
                "resume_step": rp.step, "rollback": rolled_back,
                "started_at": started_at, "stop_s": t_stopped - t0, "schedule_s": t_planned - t_stopped,
                "offer_s": t_offered - t_planned, "transfer_s": getattr(self._issued, "fetch_s", 0.0),
                "handout_s": t_done - t_offered}
        self._last_reconfig = info
        self._event("rollback" if rolled_back else "reconfigure", trigger=trigger, **{
            k: v for k, v in info.items() if k not in ("at", "reason")})
        logger.info("reconfigured (%s): %s -> %s (%s), predicted %.3f -> %.3f s per step, %d moves, %d bytes moved, "
                    "resuming at step %d%s", trigger, info["old_shape"], info["new_shape"], plan.kind,
                    cur.predicted_iteration_s, alloc.predicted_iteration_s, plan.moves, moved, rp.step,
                    " (rolled back: steps already logged run again)" if rolled_back else "")
        return {k: v for k, v in info.items()}

    async def _collect_offers(self, cur: Allocation, rp) -> tuple[Holding, ...]:
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

    def _event(self, event: str, **fields) -> None:
        line = {"time": time.time(), "event": event, "peer": self.me.hex(), **fields}
        try:
            with open(self.data_dir / "events.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            logger.warning("cannot write events.jsonl: %s", e)


def _num(v: object) -> float:
    return float(v) if type(v) in (int, float) and 0 <= v < 1e18 else 0
