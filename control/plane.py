"""The control plane of one daemon: it takes part in the coordinator election, accepts
allocations and runs its stage, and, while it is the coordinator, issues allocations, follows
the run and reconfigures the swarm when it changes.

Hand-out (coordinator, then every peer of the allocation, the coordinator included):

1. ALLOCATION: the signed allocation goes to every peer. Each checks everything
   (`check_allocation`, and with the election that the issuer is the coordinator of the
   allocation's term and that (term, epoch) is newer than what it applied), ends the epoch it
   was running, gets its stage (its own, a fresh one at step 0, or fetched from the holders the
   allocation names, each chunk verified), opens its neighbour connections, then answers.
2. START: once every peer accepted, the coordinator tells all to start.
3. STEP: after each step every peer reports to the coordinator, which writes `train.jsonl`.
   A peer whose step failed tells the coordinator why.
4. STOP (`train stop` on any peer of the run): every peer ends before the same step.

Reconfiguration (coordinator): a peer of the allocation dies or leaves, a step fails, a peer
joins or comes back, the coordinator changes, the network drifts (`reshape` predicts a better
allocation by more than the cost of moving weights) or an operator asks. The coordinator asks
every peer for its run state (RUN_STATE), stops the peers still stepping at a common step
boundary, checks that it reaches a majority of the voters, picks the resume step
(`resume_point`: the newest step every stage is held at), plans the new layout (`reshape`), has
the holders offer their stages (manifest digests go into the allocation) and hands the new
epoch out. A minority side never reconfigures and so does not train. The coordinator's side
(train start, the hand-out, reconfiguration) is in control/coordinate.py.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from dtfm.gossip import GossipService, Member
from dtfm.net import (
    ConnectionClosed,
    Identity,
    ProtocolError,
    RequestTimeout,
    get_bytes,
    get_dict,
    get_int,
    get_str,
    short_id,
)
from dtfm.train import (
    PRESETS,
    CheckpointError,
    CommError,
    Corpus,
    MessageRules,
    StageState,
    list_checkpoints,
    load_checkpoint,
    load_corpus,
    stage_tensors,
)

from .allocation import AcceptContext, Allocation, Holding, Refusal, SignedAllocation, check_allocation
from .comm import CommConfig, TensorRouter, TransportComm
from .coordinate import CoordinatorRole
from .coordinator import ElectionService
from .election import BecameCoordinator, ElectionConfig, SteppedDown
from .election_store import FileElectionStore
from .messages import ControlMsg
from .reconfigure import ReconfigureRole
from .recovery import RecoveryError, RecoveryServer, assemble_stage, fetch_stage, needed_stages
from .request import TrainError, TrainRequest
from .runner import RunEnd, StageRunner, StepReport
from .runstate import MAX_REPORTS, PeerRunState
from .steplog import _Issued

__all__ = ["ControlPlane", "TrainerConfig"]

logger = logging.getLogger(__name__)

MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim


@dataclass(frozen=True)
class TrainerConfig:
    """The daemon's trainer settings."""

    # torch threads of the stage worker; several daemons on one machine want 1 each.
    torch_threads: int = 1
    # How long a peer may take to build its stage (fetching it included) and connect its
    # neighbours before the coordinator gives up on the hand-out.
    accept_timeout_s: float = 120.0
    # START, STOP and RUN_STATE requests, one per peer.
    request_timeout_s: float = 10.0
    # Scheduler time when `train start` picks the shape, and for each reconfiguration.
    schedule_time_s: float = 3.0
    # Torch data set of this peer (`--data`); None: the standard library's source.
    data_path: str | None = None
    # The coordinator election's timings.
    election: ElectionConfig = field(default_factory=ElectionConfig.wan)
    # How long `train start` waits for this peer to be elected (or learn the coordinator).
    elect_timeout_s: float = 30.0
    # How long the coordinator waits for running peers to stop at a step boundary.
    stop_timeout_s: float = 60.0
    # The coordinator looks for joined peers this often, and for network drift every drift_check_s.
    check_interval_s: float = 5.0
    drift_check_s: float = 60.0
    # A new allocation must be predicted faster by this fraction (and by more than its weight
    # moves) before a drifting network reschedules.
    min_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.torch_threads < 1:
            raise ValueError("torch_threads must be >= 1")
        for name in ("accept_timeout_s", "request_timeout_s", "schedule_time_s", "elect_timeout_s",
                     "stop_timeout_s", "check_interval_s", "drift_check_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.min_gain < 10:
            raise ValueError("min_gain must be in [0, 10)")


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


class ControlPlane(CoordinatorRole, ReconfigureRole):
    def __init__(self, transport, identity: Identity, gossip: GossipService, data_dir: Path,
                 config: TrainerConfig | None = None, comm_config: CommConfig | None = None):
        self.transport, self.identity, self.gossip = transport, identity, gossip
        self.me = identity.peer_id
        self.data_dir = Path(data_dir)
        self.config = config or TrainerConfig()
        self.comm_config = comm_config or CommConfig()
        self.router = TensorRouter(transport)
        self.recovery = RecoveryServer(transport)
        self.election = ElectionService(transport, self.me, FileElectionStore(self.data_dir), self.config.election,
                                        address_of=self._address_of)
        self._corpora: dict[str | None, Corpus] = {}
        self._run: _Run | None = None
        self._prev: _Run | None = None  # the epoch before, whose stage may still be needed
        self._issued: _Issued | None = None
        self._logged: dict[bytes, set[int]] = {}  # run id -> steps this peer logged
        self._applied: dict[bytes, tuple[int, int]] = {}  # run_id -> (term, epoch) applied
        self._reports: collections.deque[StepReport] = collections.deque(maxlen=MAX_REPORTS)
        self._last_end: dict | None = None
        self._last_reconfig: dict | None = None
        self._triggers: list[str] = []
        self._wake = trio.Event()
        self._reconf_lock = trio.Lock()
        self._next_drift_check = 0.0
        self._stopping: bytes | None = None  # the run an operator stopped: not reconfigured
        self._offered: dict[tuple, tuple[str, StageState]] = {}  # (run, step, layers) -> digest, state
        self._attempts = 0
        self._paused_live: frozenset[bytes] | None = None  # reachable peers when the run paused
        self._swarm_wait: dict | None = None  # while `train start --min-peers` waits: have / want / live
        self._paused_retry_at = 0.0
        self._nursery: trio.Nursery | None = None
        self._load_applied()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.transport.handle(ControlMsg.ALLOCATION, self._on_allocation)
        self.transport.handle(ControlMsg.START, self._on_start)
        self.transport.handle(ControlMsg.STOP, self._on_stop)
        self.transport.handle(ControlMsg.STEP, self._on_step)
        self.transport.handle(ControlMsg.RUN_STATE, self._on_run_state)
        self.transport.handle(ControlMsg.TRAIN_OP, self._on_train_op)
        self.gossip.on_member_change(self._on_member_change)
        self.election.on_event(self._on_election_event)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.election.run)
            nursery.start_soon(self._coordinate)
            nursery.start_soon(self._watch_coordinator)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._abort_run("the daemon is leaving")

    async def _connection(self, peer: bytes):
        """The live connection to `peer`, else a new one to its gossiped address (ConnectionClosed
        when it is no member with an address). The caller bounds the wait."""
        conn = self.transport.connection(peer)
        if conn is not None:
            return conn
        address = self._address_of(peer)
        if address is None:
            raise ConnectionClosed(f"{short_id(peer)} is not a member with an address")
        return await self.transport.connect(*address, peer_id=peer)

    def _address_of(self, peer: bytes) -> tuple[str, int] | None:
        for m in self.gossip.members():
            if m.peer_id == peer and m.address[1]:
                return m.address
        return None

    def _load_applied(self) -> None:
        path = self.data_dir / "applied.json"
        try:
            d = json.loads(path.read_text())
            run, term, epoch = bytes.fromhex(d["run"]), int(d["term"]), int(d["epoch"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrainError(f"{path} is damaged ({e}): move it away only if this peer never trains again "
                             "in the same swarm") from None
        self._applied[run] = (term, epoch)
        self.election.applied(term, epoch)
        body = d.get("allocation")
        if isinstance(body, str):
            try:
                alloc = Allocation.decode(bytes.fromhex(body))
            except (ValueError, ProtocolError) as e:
                raise TrainError(f"{path} holds a damaged allocation ({e})") from None
            if alloc.run_id == run and alloc.term_epoch == (term, epoch):
                # The run this peer was part of: a restarted peer that is elected coordinator
                # takes it over from here (it holds no stage: the others' run states decide).
                self._run = _Run(alloc, None, None, None)
                self._run.done.set()

    def _save_applied(self, alloc: Allocation) -> None:
        path = self.data_dir / "applied.json"
        tmp = path.with_name(".applied.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"run": alloc.run_id.hex(), "term": alloc.term, "epoch": alloc.epoch,
                       "allocation": alloc.encode().hex()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    # ---- corpus -------------------------------------------------------------------------------

    async def corpus(self, path: str | None = None) -> Corpus:
        key = path if path is not None else self.config.data_path
        if key not in self._corpora:
            try:
                self._corpora[key] = await trio.to_thread.run_sync(load_corpus, key)
            except ValueError as e:
                raise TrainError(str(e)) from None
        return self._corpora[key]

    # ---- peer side: allocations ---------------------------------------------------------------

    async def _on_allocation(self, conn, msg_type, body, payload) -> dict:
        try:
            signed = SignedAllocation.from_wire(body)
            alloc = signed.open()
        except ProtocolError as e:
            logger.warning("refused an allocation from %s: %s", conn.short_id, e)
            return {"accepted": False, "code": "bad-allocation", "reason": str(e)}
        return await self.accept(alloc)

    async def _election_refusal(self, alloc: Allocation) -> Refusal | None:
        """The election's say on the allocation; waits a moment for the first heartbeat of a
        new coordinator, which may arrive after its allocation."""
        with trio.move_on_after(2 * self.config.election.heartbeat_interval_s + 1.0):
            while True:
                refusal = self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)
                if refusal is None or refusal.code != "not-coordinator" or alloc.term < self.election.term:
                    return refusal
                await self.election.changed()
        return self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)

    async def accept(self, alloc: Allocation) -> dict:
        """Check, get the stage, connect the neighbours; the answer goes to the coordinator."""
        corpus = await self.corpus()
        live = frozenset(self.gossip.live_peers()) | {self.me}
        ctx = AcceptContext(me=self.me, live=live, known_presets=PRESETS, data_hash=corpus.fingerprint,
                            data_name=corpus.name, applied=self._applied.get(alloc.run_id), run_id=alloc.run_id,
                            known=frozenset(m.peer_id for m in self.gossip.members()))
        refusal = check_allocation(alloc, ctx)
        if refusal is None and alloc.issuer != self.me:
            refusal = await self._election_refusal(alloc)
        elif refusal is None:
            refusal = self.election.may_apply(alloc.issuer, alloc.term, alloc.epoch)
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
                             config=self.comm_config)
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
                                 checkpoint_dir=self.data_dir / "checkpoints",
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

    # ---- peer side: the stage's own copies ------------------------------------------------------

    async def _own_copy(self, alloc: Allocation, h: Holding) -> StageState | None:
        """This peer's copy of a holding, if its digest is the allocation's."""
        state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, h.digest)
        if state is None:
            await self.offer(alloc.run_id, alloc.start_step, h.layer_range)
            state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, h.digest)
        return state

    def _state_at(self, run_id: bytes, layers: tuple[int, int], step: int) -> StageState | None:
        """This peer's stage of `layers` at `step`: its stage, its one-step-back snapshot, or a
        checkpoint. Only once its worker stopped."""
        for run in (self._run, self._prev):
            if run is None or run.state is None or run.alloc.run_id != run_id or run.active:
                continue
            if tuple(run.state.layer_range) != tuple(layers):
                continue
            if run.state.step == step:
                return run.state
            if run.runner is not None and run.runner.snapshot_step == step:
                return run.runner.snapshot_state()
        for path in reversed(list_checkpoints(self.data_dir / "checkpoints", layers)):
            if path.name == f"step-{step:08d}.json":
                state = load_checkpoint(path)
                return state
        return None

    def _offered_state(self, run_id: bytes, step: int, layers: tuple[int, int], digest: str) -> StageState | None:
        found = self._offered.get((run_id, step, tuple(layers)))
        if found is None or found[0] != digest or found[1].step != step:  # a stage trained on since
            return None
        return found[1]

    def _checkpoints(self) -> tuple[tuple[int, int, int], ...]:
        root = self.data_dir / "checkpoints"
        out = []
        if root.is_dir():
            for d in sorted(root.iterdir()):
                parts = d.name.split("-")
                if len(parts) != 3 or parts[0] != "stage":
                    continue
                try:
                    a, b = int(parts[1]), int(parts[2])
                except ValueError:
                    continue
                for path in list_checkpoints(root, (a, b))[-2:]:
                    out.append((a, b, int(path.stem.split("-")[1])))
        return tuple(out[-16:])

    def run_state(self) -> PeerRunState:
        run = self._run
        if run is None:
            return PeerRunState(None, *self.election.last_applied, None, None, None, False, self._checkpoints(),
                                tuple(self._reports))
        held = run if run.state is not None else self._prev
        layers = at = prev = None
        if held is not None and held.state is not None and held.alloc.run_id == run.alloc.run_id:
            layers = tuple(held.state.layer_range) if held is run else None
            if held is run:
                at = run.state.step
                prev = run.runner.snapshot_step if run.runner is not None else None
        return PeerRunState(run.alloc.run_id, run.alloc.term, run.alloc.epoch, layers, at, prev, run.active,
                            self._checkpoints(), tuple(self._reports))

    async def _on_run_state(self, conn, msg_type, body, payload) -> dict:
        d = get_dict(body, "RUN_STATE")
        op = get_str(d, "op", 16)
        if op == "query":
            return self.run_state().to_wire()
        if op != "offer":
            raise ProtocolError(f"RUN_STATE: unknown op {op!r}")
        run_id = get_bytes(d, "run", 16, 16)
        step = get_int(d, "step", 0, 2**63 - 1)
        layers = d.get("layers")
        if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers):
            raise ProtocolError("RUN_STATE: layers must be [first, end]")
        if conn.peer_id != self.election.coordinator:
            return {"error": "only the coordinator asks for offers"}
        return await self.offer(run_id, step, (layers[0], layers[1]))

    async def offer(self, run_id: bytes, step: int, layers: tuple[int, int]) -> dict:
        try:
            state = await trio.to_thread.run_sync(self._state_at, run_id, layers, step)
        except CheckpointError as e:
            return {"error": f"checkpoint unreadable: {e}"}
        if state is None:
            return {"error": f"layers {layers} at step {step} are not held here"}
        offer = await self.recovery.offer(run_id, state)
        self._offered = {k: v for k, v in self._offered.items() if k[0] == run_id and k[1] >= step - 1}
        self._offered[(run_id, step, tuple(layers))] = (offer.digest, state)
        return {"digest": offer.digest, "bytes": offer.manifest.total_bytes}

    # ---- peer side: the run -------------------------------------------------------------------

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

    def _on_member_change(self, member: Member) -> None:
        run = self._run
        if run is None:
            return
        named = set(run.alloc.peers) | set(run.alloc.spares)
        if member.state.gone and member.peer_id in run.alloc.peers:
            why = f"peer {member.short_id} is {member.state.name.lower()}"
            if run.comm is not None:
                run.comm.fail(member.peer_id, why)
            if not run.started.is_set() and run.runner is not None:
                self._abort_run(why)
            self._trigger(why)
        elif not member.state.gone and member.peer_id not in named:
            self._wake.set()  # a joined or returned peer: the coordinator's next check looks at it

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

    # ---- the election -------------------------------------------------------------------------

    def _on_election_event(self, event) -> None:
        if isinstance(event, BecameCoordinator):
            self._event("coordinator", term=event.term, trigger="elected")
            run = self._run
            if run is not None and not self._run_over(run) and (run.alloc.issuer != self.me or self._issued is None):
                self._trigger(f"coordinator changed (term {event.term})")
        elif isinstance(event, SteppedDown):
            self._event("stepped-down", term=event.term, trigger=event.reason)

    async def _watch_coordinator(self) -> None:
        """A peer whose epoch's coordinator is gone (stepped down, cut off, replaced) stops
        training, discarding the step in progress: a minority side does not train on without a
        coordinator. A grace of three election timeouts keeps a slow heartbeat from stopping a
        healthy run."""
        el = self.config.election
        grace_s = 3 * el.election_timeout_max_s
        lost_since = None
        while True:
            await trio.sleep(5 * el.heartbeat_interval_s)
            run = self._run
            if run is None or not run.active or not run.started.is_set() or run.runner is None:
                lost_since = None
                continue
            issuer = run.alloc.issuer
            if (self.election.is_coordinator and issuer == self.me) or (
                    self.election.role == "follower" and self.election.coordinator == issuer):
                lost_since = None
                continue
            now = trio.current_time()
            lost_since = now if lost_since is None else lost_since
            if now - lost_since >= grace_s:
                logger.warning("the coordinator of epoch %d (%s) is gone for %.0f s: this peer stops training",
                               run.alloc.epoch, short_id(issuer), now - lost_since)
                self._abort_run(f"the coordinator of epoch {run.alloc.epoch} is gone")  # the step changes nothing
                lost_since = None

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
                                      self.config.accept_timeout_s + 60, local=None)
        a = answers[coordinator]
        if "ok" in a and isinstance(a["ok"], dict):
            return a["ok"]
        raise TrainError(f"the coordinator {short_id(coordinator)}: {a.get('error') or a.get('reason')}")

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": "idle"}
        el = self.election.status()
        out["election"] = el
        out["role"] = el["role"]
        out["term"] = el["term"]
        out["coordinator"] = el["coordinator"]
        run = self._run
        if run is not None:
            a = run.alloc
            out.update({"run_id": a.run_id.hex(), "epoch": a.epoch, "issuer": a.issuer.hex(),
                        "preset": a.preset, "stages": a.stages, "dp": a.dp, "end_step": a.end_step,
                        "start_step": a.start_step, "predicted_iteration_s": a.predicted_iteration_s,
                        "epoch_reason": a.reason})
            if self.me in a.peers:
                d, s = a.position(self.me)
                pipe = a.pipelines[d]
                out.update({"stage": s, "pipeline": d, "layers": list(a.layer_ranges[s]),
                            "prev": pipe[s - 1].hex() if s > 0 else None,
                            "next": pipe[s + 1].hex() if s + 1 < a.stages else None,
                            "dp_group": [p[s].hex() for p in a.pipelines], "fetched_bytes": run.fetched_bytes})
            elif not self.election.is_coordinator:
                out["role"] = "spare"
            if run.end is not None:
                out["state"] = "stopped" if run.end.failed else run.end.reason
            elif run.runner is None and self.me not in a.peers:
                out["state"] = "spare"
            elif run.state is None:
                out["state"] = "waiting"  # restarted: holds no stage until the coordinator places it
            elif run.started.is_set():
                out["state"] = "training"
            else:
                out["state"] = "accepted"
            if run.state is not None:
                out["step"] = run.state.step - 1  # last completed
            last = run.runner.last if run.runner is not None else None
            if last is not None:
                out["last_step"] = {"step": last.step, "loss": last.loss, "iteration_s": last.iteration_s,
                                    "compute_s": last.compute_s, "pipeline_s": last.pipeline_s,
                                    "sync_s": last.sync_s}
        if self._last_end is not None:
            out["last_end"] = self._last_end
        if self._last_reconfig is not None:
            out["last_reconfig"] = self._last_reconfig
        issued = self._issued
        if issued is not None:
            out["issued"] = {"run_id": issued.alloc.run_id.hex(), "state": issued.state, "reason": issued.reason,
                             "completed": issued.completed, "end_step": issued.alloc.end_step,
                             "log": str(issued.log_path), "recent": issued.recent[-8:],
                             "started_at": issued.started_at, "epoch": issued.alloc.epoch}
        if self._swarm_wait is not None:
            out["waiting_for_peers"] = dict(self._swarm_wait)
        out["pid"] = os.getpid()
        return out

