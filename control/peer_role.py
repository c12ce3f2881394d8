"""A peer's part in an epoch: accepting an allocation, starting and stopping, running its stage.

ALLOCATION is checked (`check_allocation`, then the election: the issuer must be the coordinator
of the allocation's term), applied (the (term, epoch) is saved before anything else happens),
and the peer takes on its stage: its own copy, fresh weights at step 0, or fetched from the
holders the allocation names. It opens its neighbour connections, then answers; START lets its
runner step, STOP ends the run before a step (or at once, for a reconfiguration after a loss).
Each step is reported to the issuer; a failed step tells the coordinator why.

`PeerRole` is mixed into `ControlPlane` (control/plane.py); it uses the plane's state and the
other roles' methods through `self`.
"""

from __future__ import annotations

import logging
import time

import trio

from dtfm.net import ConnectionClosed, ProtocolError, RequestTimeout, short_id
from dtfm.train import (
    PRESETS,
    CheckpointError,
    CommError,
    Corpus,
    MessageRules,
    StageState,
    stage_tensors,
)

from .allocation import AcceptContext, Allocation, Refusal, SignedAllocation, check_allocation
from .coordinator.request import TrainError
from .epoch.recovery import RecoveryError, fetch_stage
from .epoch.relayout import assemble_stage, needed_stages
from .epoch.runner import RunEnd, StageRunner, StepReport
from .dataplane import TransportComm
from .messages import ControlMsg

__all__ = ["PeerRole"]

logger = logging.getLogger("dtfm.control.plane")  # one log for the whole control plane

MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim


class _Run:
    """This peer's part in one epoch: the allocation, its stage, its comm, its runner."""

    def __init__(self, alloc: Allocation, state: StageState | None, comm: TransportComm | None,
                 runner: StageRunner | None):
        self.alloc, self.state, self.comm, self.runner = alloc, state, comm, runner
        self.started = trio.Event()
        self.done = trio.Event()  # its tasks and worker thread are over
        self.end: RunEnd | None = None
        self.cancel = trio.CancelScope()
        self.fetched_bytes = 0

    @property
    def active(self) -> bool:
        return self.runner is not None and self.end is None and not self.done.is_set()


class PeerRole:
    """A peer's methods of `ControlPlane` for its part in an epoch (a mixin: see the module
    docstring)."""

    # ---- allocations --------------------------------------------------------------------------

    async def _on_allocation(self, conn, msg_type, body, payload) -> dict:
        try:
            signed = SignedAllocation.from_wire(body)
            alloc = signed.open()
        except ProtocolError as e:
            logger.warning("refused an allocation from %s: %s", conn.short_id, e)
            return {"accepted": False, "code": "bad-allocation", "reason": str(e)}
        return await self.accept(alloc)

    async def accept(self, alloc: Allocation) -> dict:
        """Check, get the stage, connect the neighbours; the answer goes to the coordinator."""
        corpus = await self.corpus()
        refusal = await self._refusal(alloc, corpus)
        if refusal is not None:
            logger.warning("refused allocation term %d epoch %d from %s: %s", alloc.term, alloc.epoch,
                           short_id(alloc.issuer), refusal.reason)
            return {"accepted": False, "code": refusal.code, "reason": refusal.reason}
        await self._end_run(f"replaced by epoch {alloc.epoch}")
        prev = self._run if self._run is not None and self._run.state is not None else self._prev
        self._applied[alloc.run_id] = (alloc.term, alloc.epoch)
        self.election.applied(alloc.term, alloc.epoch)
        self.election.set_voters(alloc.configuration)
        await trio.to_thread.run_sync(self._save_applied, alloc)
        self._prev = prev
        if self.me not in alloc.peers:
            self._run = _Run(alloc, None, None, None)
            self._run.done.set()
            return {"accepted": True, "role": "spare"}
        return await self._take_stage(alloc, prev, corpus)

    async def _refusal(self, alloc: Allocation, corpus: Corpus) -> Refusal | None:
        """Why this peer refuses `alloc` (`check_allocation`, then the election's say); None: it
        accepts."""
        live = frozenset(self.gossip.live_peers()) | {self.me}
        ctx = AcceptContext(me=self.me, live=live, known_presets=PRESETS, data_hash=corpus.fingerprint,
                            data_name=corpus.name, applied=self._applied.get(alloc.run_id), run_id=alloc.run_id,
                            known=frozenset(m.peer_id for m in self.gossip.members()))
        refusal = check_allocation(alloc, ctx)
        if refusal is None and alloc.issuer != self.me:
            refusal = await self._election_refusal(alloc)
        elif refusal is None:
            refusal = self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)
        return refusal

    async def _election_refusal(self, alloc: Allocation) -> Refusal | None:
        """The election's say on the allocation; waits a moment for the first heartbeat of a
        new coordinator, which may arrive after its allocation."""
        with trio.move_on_after(self.config.heartbeat_wait_s):
            while True:
                refusal = self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)
                if refusal is None or refusal.code != "not-coordinator" or alloc.term < self.election.term:
                    return refusal
                await self.election.changed()
        return self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)

    async def _take_stage(self, alloc: Allocation, prev: _Run | None, corpus: Corpus) -> dict:
        """Build this peer's stage of an applied allocation, serve its comm, connect the
        neighbours and make its runner; the answer to the coordinator."""
        t_fetch = trio.current_time()
        try:
            state, fetched = await self._stage_for(alloc, prev)
        except (RecoveryError, CheckpointError, ValueError, OSError) as e:
            logger.error("cannot build stage for epoch %d: %s", alloc.epoch, e)
            return {"accepted": False, "code": "build-failed", "reason": f"{short_id(self.me)}: {e}"}
        plan = alloc.plan()
        rules = MessageRules.for_peer(plan, alloc.model, alloc.train, self.me,
                                      [tuple(p.shape) for p in state.params.values()])
        comm = TransportComm(self.transport, rules, run=alloc.run_id, router=self.router,
                             config=self.config.comm)
        members = {m.peer_id: m for m in self.gossip.members()}
        addresses = {p: members[p].address for p in rules.peers if p in members}
        run = _Run(alloc, state, comm, None)
        run.fetched_bytes = fetched
        self._run = run
        t_connect = trio.current_time()
        assert self._nursery is not None
        await self._nursery.start(self._serve_run, run)
        try:
            await comm.connect(addresses, self.config.accept_timeout_s / 2)
        except (CommError, OSError, ConnectionClosed, RequestTimeout, ProtocolError, trio.TooSlowError) as e:
            self._abort_run(f"could not connect the neighbours: {e}")
            return {"accepted": False, "code": "connect-failed", "reason": f"{short_id(self.me)}: {e}"}
        run.runner = StageRunner(state, plan, self.me, comm, corpus, end_step=alloc.end_step,
                                 checkpoint_every=alloc.checkpoint_every,
                                 checkpoint_dir=self._checkpoint_root(alloc.run_id),
                                 torch_threads=self.config.torch_threads,
                                 on_step=self._reporter(alloc))
        d, s = alloc.position(self.me)
        logger.info("accepted term %d epoch %d: stage %d of pipeline %d, layers %s, steps %d..%d%s", alloc.term,
                    alloc.epoch, s, d, alloc.layer_ranges[s], alloc.start_step, alloc.end_step - 1,
                    f", {fetched} bytes fetched" if fetched else "")
        return {"accepted": True, "role": "stage", "stage": s, "pipeline": d, "fetched_bytes": fetched,
                "fetch_s": (t_connect - t_fetch) if fetched else 0.0}

    async def _stage_for(self, alloc: Allocation, prev: _Run | None) -> tuple[StageState, int]:
        """This peer's stage of `alloc` at its start step, and the bytes fetched for it."""
        s = alloc.position(self.me)[1]
        layers = alloc.layer_ranges[s]
        if not alloc.holdings:
            if alloc.start_step > 0:
                raise ValueError(f"starting at step {alloc.start_step} needs the stage's weights and the "
                                 "allocation names no holders")
            return await trio.to_thread.run_sync(lambda: StageState(alloc.model, alloc.train, layers)), 0
        own = {h.layer_range: h for h in alloc.holdings}.get(layers)
        if own is not None and self.me in own.holders:
            state = await self._own_copy(alloc, own)
            if state is not None:
                return state, 0
        old_ranges = [h.layer_range for h in alloc.holdings]
        parts, fetched, optim_step = [], 0, None
        for i in needed_stages(old_ranges, layers):
            h = alloc.holdings[i]
            local = await self._own_copy(alloc, h) if self.me in h.holders else None
            if local is not None:
                parts.append(stage_tensors(local))
                optim_step = local.optim.step_count
                continue
            sources = [(p, self._address_of(p)) for p in h.holders if p != self.me]
            result = await fetch_stage(self.transport, sources, run_id=alloc.run_id, step=alloc.start_step,
                                       layer_range=h.layer_range, digest=h.digest, max_total_bytes=MAX_STAGE_BYTES,
                                       timeout_s=self.config.request_timeout_s)
            fetched += result.bytes
            parts.append(result.receiver)
            optim_step = int(result.receiver.manifest.meta["optim_step"])
            logger.info("fetched layers %s at step %d: %d bytes in %.2f s from %s", h.layer_range,
                        alloc.start_step, result.bytes, result.seconds,
                        ", ".join(f"{short_id(p)} ({n})" for p, n in result.per_source.items()))
        state = await trio.to_thread.run_sync(lambda: assemble_stage(
            alloc.model, alloc.train, layers, parts, alloc.start_step, optim_step or 0))
        return state, fetched

    # ---- the run ------------------------------------------------------------------------------

    async def _serve_run(self, run: _Run, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the run's comm tasks and, once started, its runner thread."""
        try:
            with run.cancel:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run.comm.run)
                    task_status.started()
                    await run.started.wait()
                    end = await run.runner.run()
                    run.end = end
                    self._finished(run, end)
                    nursery.cancel_scope.cancel()
        finally:
            if run.comm is not None:
                run.comm.close()
            run.done.set()

    def _finished(self, run: _Run, end: RunEnd) -> None:
        alloc = run.alloc
        if end.failed:
            logger.error("training stopped at epoch %d: %s; last completed step %d", alloc.epoch, end.reason,
                         end.completed)
        else:
            logger.info("training %s at epoch %d after step %d", end.reason, alloc.epoch, end.completed)
        self._last_end = {"epoch": alloc.epoch, "completed": end.completed, "reason": end.reason,
                          "failed": end.failed, "at": time.time(), "params_sha256": end.params_sha256}
        if not end.failed:
            return
        coordinator = self.election.coordinator or alloc.issuer
        if coordinator == self.me:
            self._trigger(f"a step failed: {end.reason}")
        elif self._nursery is not None:
            self._nursery.start_soon(self._send_one_way, coordinator, ControlMsg.STEP,
                                     {"run": alloc.run_id, "epoch": alloc.epoch, "failed": end.reason[:512],
                                      "step": max(end.completed, 0)})

    def _reporter(self, alloc: Allocation):
        token = trio.lowlevel.current_trio_token()

        def report(rep: StepReport) -> None:  # worker thread
            token.run_sync_soon(self._send_report, alloc, rep)
        return report

    def _send_report(self, alloc: Allocation, rep: StepReport) -> None:
        self._reports.append(rep)
        if alloc.issuer == self.me:
            self._record_step(self.me, rep, alloc.run_id)
        elif self._nursery is not None:
            self._nursery.start_soon(self._send_one_way, alloc.issuer, ControlMsg.STEP,
                                     {"run": alloc.run_id, **rep.to_wire()})

    async def _send_one_way(self, peer: bytes, msg_type: int, body: dict) -> None:
        try:
            with trio.move_on_after(self.config.request_timeout_s):
                conn = await self._connection(peer)
                await conn.send(msg_type, body)
        except (ConnectionClosed, ProtocolError, OSError) as e:
            logger.debug("could not send message %d to %s: %s", msg_type, short_id(peer), e)

    async def _on_start(self, conn, msg_type, body, payload) -> dict:
        run = self._run
        if not isinstance(body, dict):
            raise ProtocolError("START body must be a map")
        if run is None or body.get("run") != run.alloc.run_id or body.get("epoch") != run.alloc.epoch:
            return {"started": False, "reason": "no such epoch accepted here"}
        if conn.peer_id != run.alloc.issuer:
            return {"started": False, "reason": "only the issuer starts an epoch"}
        return self._start_local(run)

    def _start_local(self, run: _Run) -> dict:
        if run.runner is not None and not run.started.is_set():
            run.started.set()
        return {"started": True}

    async def _on_stop(self, conn, msg_type, body, payload) -> dict:
        if not isinstance(body, dict):
            raise ProtocolError("STOP body must be a map")
        run = self._run
        if run is None or body.get("run") != run.alloc.run_id:
            return {"stopped": False, "reason": "not in that run"}
        if conn.peer_id not in run.alloc.peers and conn.peer_id not in (run.alloc.issuer, self.election.coordinator):
            return {"stopped": False, "reason": "only a peer of the run may stop it"}
        at = body.get("at_step")
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            raise ProtocolError("STOP at_step must be a non-negative integer")
        if body.get("final") is True:  # an operator's stop: the run is over, nobody reconfigures it
            self._stopping = run.alloc.run_id
        if body.get("abort") is True:  # the coordinator reconfigures after a loss: end the step now
            self._abort_run("aborted for a reconfiguration")
        else:
            self._stop_local(run, at)
        return {"stopped": True}

    def _stop_local(self, run: _Run, at_step: int) -> None:
        if run.runner is not None and run.started.is_set():
            run.runner.stop_at(at_step)
            logger.info("stopping the run before step %d", at_step)
        else:
            self._abort_run("stopped before it started")

    def _abort_run(self, reason: str) -> None:
        run = self._run
        if run is None:
            return
        if run.comm is not None:
            run.comm.abort(reason)
        if run.runner is None or not run.started.is_set():
            run.cancel.cancel()

    async def _end_run(self, reason: str) -> None:
        """End this peer's epoch and wait until its worker let go of the stage."""
        run = self._run
        if run is None or run.done.is_set():
            return
        self._abort_run(reason)
        with trio.move_on_after(self.config.stop_timeout_s):
            await run.done.wait()
        if not run.done.is_set():
            raise TrainError(f"the stage worker did not stop within {self.config.stop_timeout_s:g} s")
