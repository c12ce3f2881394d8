"""The coordinator's side of the control plane: starting and stopping a run, the hand-out of
an allocation, the step reports it logs, the train operations other peers forward to it, and
the helpers every coordinator step uses: asking peers at once, their run states, the measured
view, the events log (see control/plane.py for the protocol).

`CoordinatorRole` is mixed into `ControlPlane`: every daemon can become the coordinator, and the
coordinator is also a peer of the run, so both roles share the plane's state (its run, the
election, the transport). Reconfiguring a running swarm is in control/reconfigure.py; what a
peer does in an epoch is in control/peer_role.py.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import trio

from dtfm.gossip import build_view
from dtfm.net import ConnectionClosed, ProtocolError, RemoteError, RequestTimeout, get_dict, get_str, short_id
from dtfm.train import GPTSpec, TrainConfig, get_preset

from .allocation import Allocation, SignedAllocation
from .coordinator.request import TrainError, TrainRequest
from .coordinator.runstate import PeerRunState
from .coordinator.schedule import Placement, choose_shape, random_shape
from .epoch.runner import StepReport
from .messages import ControlMsg
from .steplog import _Issued

__all__ = ["CoordinatorRole"]

logger = logging.getLogger("dtfm.control.plane")

class CoordinatorRole:
    """The coordinator's methods of `ControlPlane` (a mixin: see the module docstring)."""

    # ---- train start and stop, the hand-out ---------------------------------------------------

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
        shape = await self._first_shape(req, spec, cfg, view, regions)
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

    async def _first_shape(self, req: TrainRequest, spec: GPTSpec, cfg: TrainConfig, view, regions) -> Placement:
        """The new run's shape: the scheduler's on the gossiped view, or (`--placement random`)
        a random one of the given stages x dp."""
        try:
            if req.placement == "random":
                return random_shape(view, spec, cfg, stages=req.stages, dp=req.dp, seed=req.seed)
            return await trio.to_thread.run_sync(lambda: choose_shape(
                view, spec, cfg, stages=req.stages, dp=req.dp, regions=regions,
                time_budget_s=self.config.schedule_time_s, seed=req.seed))
        except ValueError as e:
            raise TrainError(f"cannot schedule: {e}") from None

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
                await trio.sleep(min(self.config.swarm_poll_s, left))
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

    async def _hand_out(self, alloc: Allocation, *, backfill: Sequence[StepReport] = ()) -> None:
        """Log the steps before the resume point that `backfill` (the peers' reports) covers and
        this peer has not logged; ALLOCATION to every named peer, then START; TrainError with
        every refusal."""
        signed = SignedAllocation.sign(alloc, self.identity)
        logged = self._logged.setdefault(alloc.run_id, set())
        self._issued = issued = _Issued(alloc, self.data_dir / "train.jsonl", logged)
        issued.backfill(backfill, {r.step for r in backfill if r.step < alloc.start_step})
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

    # ---- step reports -------------------------------------------------------------------------

    async def _on_step(self, conn, msg_type, body, payload) -> None:
        if not isinstance(body, dict):
            raise ProtocolError("STEP body must be a map")
        if "failed" in body:
            reason = body.get("failed")
            if not isinstance(reason, str):
                raise ProtocolError("STEP failed must be a string")
            run = self._run
            if (self.election.is_coordinator and run is not None and body.get("run") == run.alloc.run_id
                    and body.get("epoch") == run.alloc.epoch):  # a late report of an older epoch: already handled
                self._trigger(f"peer {conn.short_id}: {reason[:200]}")
            return
        self._record_step(conn.peer_id, StepReport.from_wire(body), body.get("run"))

    def _record_step(self, peer: bytes, rep: StepReport, run_id) -> None:
        issued = self._issued
        if issued is None or run_id != issued.alloc.run_id:
            return
        for line in issued.add(peer, rep):
            issued.state = "training"
            logger.info("step %d: loss %s, %.2f s, %.0f tokens/s%s", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}", line["iteration_s"] or 0,
                        line["tokens_per_s"] or 0, " (some reports lost)" if line.get("partial") else "")
            if line["step"] + 1 >= issued.alloc.end_step:
                issued.state = "finished"
        if issued.gaps and not issued.filling and self._nursery is not None:
            issued.filling = True
            self._nursery.start_soon(self._fill_gaps, issued)

    # ---- train operations, forwarded to the coordinator ---------------------------------------

    async def _become_coordinator(self) -> bytes | None:
        """Make sure there is a coordinator, standing if there is none; returns it (None: none)."""
        if self.election.is_coordinator:
            return self.me
        if self.election.coordinator is not None:
            return self.election.coordinator
        if self.me not in self.election.voters:
            self.election.set_voters(tuple(sorted(set(self.gossip.live_peers()) | {self.me})))
        self.election.campaign()
        await self.election.wait_for_coordinator(self.config.elect_timeout_s)
        return self.election.coordinator

    async def _on_train_op(self, conn, msg_type, body, payload) -> dict:
        d = get_dict(body, "TRAIN_OP")
        op = get_str(d, "op", 16)
        args = get_dict(d.get("args", {}), "TRAIN_OP args")
        if not self.election.is_coordinator:
            c = self.election.coordinator
            return {"error": f"this peer is not the coordinator ({short_id(c) if c else 'none known'})"}
        try:
            if op == "start":
                return {"ok": await self.start_training(TrainRequest.from_args(args), forwarded=True)}
            if op == "reschedule":
                return {"ok": await self.reschedule(forwarded=True)}
        except TrainError as e:
            return {"error": str(e)}
        raise ProtocolError(f"TRAIN_OP: unknown op {op!r}")

    async def _forward(self, coordinator: bytes, op: str, args: dict) -> dict:
        answers = await self._ask_all([coordinator], ControlMsg.TRAIN_OP, {"op": op, "args": args},
                                      self.config.forward_timeout_s, local=None)
        a = answers[coordinator]
        if "ok" in a and isinstance(a["ok"], dict):
            return a["ok"]
        raise TrainError(f"the coordinator {short_id(coordinator)}: {a.get('error') or a.get('reason')}")

    # ---- asking the peers, their run states, the measured view, events ------------------------

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

    def _event(self, event: str, **fields) -> None:
        line = {"time": time.time(), "event": event, "peer": self.me.hex(), **fields}
        try:
            with open(self.data_dir / "events.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            logger.warning("cannot write events.jsonl: %s", e)


def _num(v: object) -> float:
    return float(v) if type(v) in (int, float) and 0 <= v < 1e18 else 0
