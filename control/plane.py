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
epoch out. A minority side never reconfigures and so does not train.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import trio

from dtfm.gossip import GossipService, Member
from dtfm.net import (ConnectionClosed, Identity, ProtocolError, RemoteError, RequestTimeout, get_bytes, get_dict,
                      get_int, get_str, short_id)
from dtfm.train import (PRESETS, CheckpointError, CommError, Corpus, MessageRules, StageState, TrainConfig, get_preset,
                        list_checkpoints, load_checkpoint, load_corpus)

from .allocation import AcceptContext, Allocation, Holding, Refusal, SignedAllocation, check_allocation
from .comm import CommConfig, TensorRouter, TransportComm
from .coordinator import ElectionService
from .election import BecameCoordinator, ElectionConfig, SteppedDown
from .election_store import FileElectionStore
from .messages import ControlMsg
from .recovery import RecoveryError, RecoveryServer, assemble_stage, fetch_stage, needed_stages
from .reshape import Current, reshape
from .runner import RunEnd, StageRunner, StepReport
from .runstate import MAX_REPORTS, PeerRunState, ResumeError, describe, resume_point
from .schedule import PLACEMENTS, choose_shape, random_shape

__all__ = ["ControlPlane", "TrainerConfig", "TrainRequest", "TrainError"]

logger = logging.getLogger(__name__)

MAX_RECENT_STEPS = 64
MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim
MAX_OFFER_HOLDERS = 64  # holders of one stage asked to offer it (each then keeps its own copy)
MAX_ATTEMPTS = 5  # reconfigurations of one trigger before the run stops


class TrainError(Exception):
    """A `train start` / `train stop` that cannot be done, with the reason for the operator."""


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


@dataclass(frozen=True)
class TrainRequest:
    """What `dtfm-peer train start` asks for."""

    preset: str = "tiny"
    steps: int = 100
    seed: int = 0
    stages: int | None = None  # None: the scheduler picks the shape
    dp: int | None = None
    checkpoint_every: int = 0
    data_path: str | None = None
    train: TrainConfig | None = None  # None: TrainConfig() with this seed
    placement: str = "scheduler"  # or "random": a random allocation of the given shape (a baseline)

    @classmethod
    def from_args(cls, args: dict) -> "TrainRequest":
        def num(key, default, lo, hi):
            v = args.get(key, default)
            if v is None:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise TrainError(f"{key} must be an integer in [{lo}, {hi}]")
            return v
        preset = args.get("preset", "tiny")
        if preset not in PRESETS:
            raise TrainError(f"unknown preset {preset!r}: choose one of {', '.join(sorted(PRESETS))}")
        data = args.get("data")
        if data is not None and not isinstance(data, str):
            raise TrainError("data must be a path")
        stages = args.get("stages")
        if stages == "auto":
            stages = None
        placement = args.get("placement", "scheduler")
        if placement not in PLACEMENTS:
            raise TrainError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        req = cls(preset=preset, steps=num("steps", 100, 1, 10**9), seed=num("seed", 0, 0, 2**63 - 1),
                  stages=num("stages", stages, 1, 4096) if stages is not None else None,
                  dp=num("dp", None, 1, 4096), checkpoint_every=num("checkpoint_every", 0, 0, 10**9),
                  data_path=data, placement=placement)
        if req.dp is not None and req.stages is None:
            raise TrainError("--dp needs --stages")
        if placement == "random" and req.stages is None:
            raise TrainError("a random placement needs --stages S (and --dp D)")
        return req


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


class _Issued:
    """The coordinator's record of the epoch it handed out: step reports and the training log."""

    def __init__(self, alloc: Allocation, log_path: Path, logged: set[int]):
        self.alloc = alloc
        self.log_path = log_path
        self.reports: dict[int, dict[bytes, StepReport]] = {}
        self.completed = alloc.start_step - 1
        self.logged = logged  # steps of this run this peer wrote to its log
        self.recent: list[dict] = []
        self.state = "handing out"
        self.reason = ""
        self.started_at = time.time()
        self.fetched = 0  # bytes the peers fetched to take on their stages
        self.fetch_s = 0.0  # the slowest peer's fetch

    def add(self, peer: bytes, rep: StepReport) -> dict | None:
        if rep.epoch != self.alloc.epoch or rep.step <= self.completed or peer not in self.alloc.peers:
            return None
        self.reports.setdefault(rep.step, {})[peer] = rep
        got = self.reports.get(self.completed + 1, {})
        if len(got) < len(self.alloc.peers):
            return None
        step = self.completed + 1
        del self.reports[step]
        self.completed = step
        return self.write(step, list(got.values()), self.alloc.epoch)

    def write(self, step: int, reports: list[StepReport], epoch: int, backfilled: bool = False) -> dict:
        losses = [r.loss for r in reports if r.loss is not None]
        iteration_s = max(r.iteration_s for r in reports)
        tokens = self.alloc.train.global_batch_seqs * self.alloc.model.seq_len
        line = {"step": step, "loss": losses[0] if losses else None, "epoch": epoch, "term": self.alloc.term,
                "iteration_s": iteration_s, "tokens_per_s": tokens / iteration_s if iteration_s > 0 else None,
                "predicted_iteration_s": self.alloc.predicted_iteration_s,
                "compute_s": max(r.compute_s for r in reports),
                "pipeline_s": max(r.pipeline_s for r in reports),
                "sync_s": max(r.sync_s for r in reports),
                "time": time.time()}
        if backfilled:
            line["backfilled"] = True
        self.logged.add(step)
        self.recent = (self.recent + [line])[-MAX_RECENT_STEPS:]
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return line


class ControlPlane:
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
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._abort_run("the daemon is leaving")

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

    def _save_applied(self, alloc: Allocation) -> None:
        path = self.data_dir / "applied.json"
        tmp = path.with_name(".applied.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"run": alloc.run_id.hex(), "term": alloc.term, "epoch": alloc.epoch}, f)
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
                await self.election.wait_for_coordinator(0.1)
                await trio.sleep(0.02)
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
        self.election.set_voters(tuple(sorted(set(alloc.peers) | set(alloc.spares))))
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
                parts.append(_tensors_of(local))
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
        conn = self.transport.connection(peer)
        if conn is None:
            return
        try:
            with trio.move_on_after(self.config.request_timeout_s):
                await conn.send(msg_type, body)
        except ConnectionClosed:
            pass

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
        try:
            rep = StepReport(int(body["epoch"]), int(body["step"]),
                             None if body.get("loss") is None else float(body["loss"]),
                             float(body["iteration_s"]), float(body["compute_s"]),
                             float(body["pipeline_s"]), float(body["sync_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"bad STEP report: {e}") from None
        self._record_step(conn.peer_id, rep, body.get("run"))

    def _record_step(self, peer: bytes, rep: StepReport, run_id) -> None:
        issued = self._issued
        if issued is None or run_id != issued.alloc.run_id:
            return
        line = issued.add(peer, rep)
        if line is not None:
            issued.state = "training"
            logger.info("step %d: loss %s, %.2f s, %.0f tokens/s", line["step"],
                        "-" if line["loss"] is None else f"{line['loss']:.4f}", line["iteration_s"],
                        line["tokens_per_s"] or 0)
            if line["step"] + 1 >= issued.alloc.end_step:
                issued.state = "finished"

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
            if run is not None and run.alloc.issuer != self.me and not self._run_over(run):
                self._trigger(f"coordinator changed (term {event.term})")
        elif isinstance(event, SteppedDown):
            self._event("stepped-down", term=event.term, trigger=event.reason)

    async def _become_coordinator(self) -> bytes | None:
        """Make sure there is a coordinator, standing if there is none; returns it (None: none)."""
        if self.election.is_coordinator:
            return self.me
        if self.election.coordinator is not None:
            return self.election.coordinator
        if self.me not in self.election.voters:
            self.election.set_voters(tuple(sorted(set(self.gossip.live_peers()) | {self.me})))
        self.election.campaign()
        with trio.move_on_after(self.config.elect_timeout_s):
            while not self.election.is_coordinator and self.election.coordinator is None:
                await self.election.wait_for_coordinator(0.5)
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

    # ---- coordinator: train start -------------------------------------------------------------

    async def start_training(self, req: TrainRequest, *, forwarded: bool = False, args: dict | None = None) -> dict:
        """Stand for coordinator if there is none; the coordinator schedules on the gossiped
        view, hands the allocation out and starts every peer."""
        coordinator = self.me if forwarded else await self._become_coordinator()
        if coordinator is None:
            raise TrainError(f"no coordinator was elected within {self.config.elect_timeout_s:g} s: "
                             "is a majority of the swarm reachable?")
        if coordinator != self.me:
            return await self._forward(coordinator, "start", args if args is not None else _request_args(req))
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
                               run_id=secrets.token_bytes(16), reason="train start")
            log_path = self.data_dir / "train.jsonl"
            log_path.unlink(missing_ok=True)
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
                issued.write(step, reports, reports[0].epoch, backfilled=True)
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
        if run is None or run.end is not None or run.runner is None:
            raise TrainError("no training run is in progress on this peer")
        now = run.state.step if run.state is not None else run.alloc.start_step
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
                    conn = self.transport.connection(peer)
                    if conn is None:
                        address = self._address_of(peer)
                        if address is None:
                            raise ConnectionClosed("not a member")
                        conn = await self.transport.connect(*address, peer_id=peer)
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

    def _run_over(self, run: _Run) -> bool:
        """Finished, or stopped by an operator: nothing to reconfigure."""
        if self._stopping == run.alloc.run_id:
            return True
        issued = self._issued
        if issued is not None and issued.alloc.run_id == run.alloc.run_id and issued.state == "finished":
            return True
        return run.end is not None and not run.end.failed

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

    async def _joined(self) -> list[str]:
        """Live members outside the allocation that answer: peers that joined or came back."""
        run = self._run
        named = set(run.alloc.peers) | set(run.alloc.spares)
        outside = [p for p in self.gossip.live_peers() if p not in named and p != self.me]
        if not outside:
            return []
        states = await self._query_states(outside, timeout_s=min(self.config.request_timeout_s, 5.0))
        view = self.gossip.view()
        ready = [p for p in states if p in view.peers and view.complete]
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
            self._stop_run(cur, str(e), trigger)
            raise TrainError(str(e)) from None
        if rp.step >= cur.end_step:
            raise TrainError("the run already reached its last step")
        view = self.gossip.view()
        live = frozenset(reachable & set(view.peers))
        try:
            plan = await trio.to_thread.run_sync(lambda: reshape(
                view, cur.model, cur.train, current=Current(cur.pipelines, cur.layer_ranges), live=live,
                remaining_steps=cur.end_step - rp.step, regions=self._regions(),
                time_budget_s=self.config.schedule_time_s, seed=cur.epoch, min_gain=self.config.min_gain,
                force=force))
        except ValueError as e:
            self._stop_run(cur, f"no allocation fits the reachable peers: {e}", trigger)
            raise TrainError(f"no allocation fits the reachable peers: {e}") from None
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
                           reason=trigger[:1024])
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
                "resume_step": rp.step, "rollback": rp.rollback,
                "started_at": started_at, "stop_s": t_stopped - t0, "schedule_s": t_planned - t_stopped,
                "offer_s": t_offered - t_planned, "transfer_s": getattr(self._issued, "fetch_s", 0.0),
                "handout_s": t_done - t_offered}
        self._last_reconfig = info
        self._event("rollback" if rp.rollback else "reconfigure", trigger=trigger, **{
            k: v for k, v in info.items() if k not in ("at", "reason")})
        logger.info("reconfigured (%s): %s -> %s (%s), predicted %.3f -> %.3f s per step, %d moves, %d bytes moved, "
                    "resuming at step %d%s", trigger, info["old_shape"], info["new_shape"], plan.kind,
                    cur.predicted_iteration_s, alloc.predicted_iteration_s, plan.moves, moved, rp.step,
                    " (rolled back to a checkpoint)" if rp.rollback else "")
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
        out["pid"] = os.getpid()
        return out


def _num(v: object) -> float:
    return float(v) if type(v) in (int, float) and 0 <= v < 1e18 else 0


def _tensors_of(state: StageState) -> dict:
    out = {f"param/{n}": p.detach() for n, p in state.params.items()}
    out.update(state.optim.state_tensors())
    return out


def _request_args(req: TrainRequest) -> dict:
    out = {"preset": req.preset, "steps": req.steps, "seed": req.seed, "checkpoint_every": req.checkpoint_every,
           "placement": req.placement}
    if req.stages is not None:
        out["stages"] = req.stages
    if req.dp is not None:
        out["dp"] = req.dp
    if req.data_path is not None:
        out["data"] = req.data_path
    return out
