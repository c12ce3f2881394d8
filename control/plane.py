"""The control plane's IO shell (see docs/control.md, "The shell").

`ControlPlane` owns the IO: it registers the message handlers, owns the nursery, the election
service, the stage host (control/epoch/stages.py: the tensors, comm and runner thread of this
peer's epochs, the tensor router and the recovery server), the corpora and model folders, and
the data dir's files (applied.json and stopped.json through its `AppliedStore`,
operations.json, train.jsonl, events.jsonl). Every message body is checked by the input layer
(control/inputs.py) before it feeds the two machines, `EpochMachine` (this peer's part in each
epoch) and `Coordinator` (the coordinator's decisions); it executes their actions in order (a
closed dispatch: each machine's outputs are a union a type checker proves handled), and builds
`status()` from their snapshots. The operator's requests are its `operator`
(control/operator_front.py).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, assert_never

import trio

from dtfm.gossip import GossipService, Member, NetworkView, build_view, measure_rtt
from dtfm.net import (
    ConnectionClosed,
    Identity,
    PeerConnection,
    PeerTransport,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    short_id,
)
from dtfm.train import PRESETS, Corpus, GPTSpec, load_corpus

from . import inputs
from .actions import Answers, Ask, Compute, Computed, CoordinatorAction, Emit, LogLine, Reply, ResetLog, Send
from .allocation import AcceptContext, Allocation, SignedAllocation
from .answers import AllocationAnswer, NoAnswer, StartAnswer, StopAnswer, read_answers
from .compute import ComputeGauge, KindProbe, MachineNow, micro_batch_seqs, training_block_ms
from .config import PlaneConfig
from .coordinator.machine import (
    Coordinator,
    CoordinatorEvent,
    CoordinatorTick,
    Elected,
    SteppedDownEvent,
    Trigger,
    Wake,
)
from .coordinator.request import TrainError
from .dataplane import TensorRouter
from .election import (
    BecameCoordinator,
    Certificate,
    Council,
    ElectionService,
    FileElectionStore,
    SteppedDown,
)
from .epoch.access import fetch_refusal
from .epoch.applied import APPLIED_NAME, AppliedError, AppliedStore, FileAppliedStore
from .epoch.disk import CheckpointDisk
from .epoch.machine import (
    AbortRunner,
    AllocationOffered,
    ApplyToElection,
    BuildStage,
    EndEpoch,
    EpochAction,
    EpochEvent,
    EpochMachine,
    EpochTick,
    FailNeighbour,
    KeepStage,
    MemberGone,
    PersistApplied,
    RunClosed,
    StartRunner,
    StepDone,
    StopRunnerAt,
    WaitForCoordinator,
)
from .epoch.recovery import RecoveryServer
from .epoch.report import StepReport
from .epoch.runstate import PeerRunState
from .epoch.taken import TAKEN_NAME, load_taken, save_taken
from .events import Reconfiguration
from .loading import import_in_thread
from .messages import ControlMsg
from .models import HeldModel, load_held_models, load_peer_corpus
from .operator_front import OperatorFront, load_root
from .planner import GossipSwarm, SchedulerPlanner
from .progress import MAX_RECONFIGS
from .reach import ReachAnswer, ReachRequest
from .refusals import Refused, merge_counts

# A message handler's arguments (net's `Handler`): the connection it came over, its type, its
# body (anything msgpack decodes: the input layer checks it) and its raw payload, if any.
Payload = memoryview | None

if TYPE_CHECKING:  # (torch: loaded with the first stage, offer or export; see `ControlPlane.stages`)
    from .epoch.stages import StageHost

__all__ = ["ControlPlane"]

logger = logging.getLogger(__name__)

SCHEDULES_DIR = "schedules"  # in the data dir: the inputs of the first placements this peer scheduled
# A coordinator deadline that its own tick left in the past is a bug of the machine (nothing
# due would be done by ticking again); the timer ticks it again at most this often, not in a loop.
PAST_DEADLINE_BACKOFF_S = 1.0


@dataclass
class _Pending:
    """An operator's request or a peer's ALLOCATION waiting for the machine's Reply."""

    event: trio.Event
    reply: Reply | None = None


class ControlPlane:
    """One daemon's control plane (see the module docstring)."""

    def __init__(self, transport: PeerTransport, identity: Identity, gossip: GossipService, data_dir: Path,
                 config: PlaneConfig | None = None, *, operators: Iterable[bytes] = (),
                 applied: AppliedStore | None = None, kind_probe: KindProbe | None = None,
                 fresh_compute: Callable[[], MachineNow] | None = None, machine: bytes = b""):
        self.transport, self.identity, self.gossip = transport, identity, gossip
        self.me = identity.peer_id
        self.data_dir = Path(data_dir)
        self._compute_gauge = ComputeGauge()  # this peer's compute figure from its own steps
        # `kind_factors` of run layers this peer trains, by (model, micro-batch); None: being probed
        self._kind_probe = kind_probe
        self._kinds: dict[tuple[GPTSpec, int], float | None] = {}
        self.config = config or PlaneConfig.wan()
        self.operators = frozenset(operators)  # the swarm's operators' public keys (the swarm key file)
        self.election = ElectionService(transport, self.me, FileElectionStore(self.data_dir), self.config.election,
                                        signer=identity, address_of=self.address_of, peers=gossip.live_peers)
        cfg = self.config
        self.epoch = EpochMachine(self.me, self.election, heartbeat_wait_s=cfg.heartbeat_wait_s,
                                  coordinator_lost_after_s=cfg.coordinator_lost_after_s, operators=self.operators,
                                  operator_skew_s=cfg.operator_skew_s)
        self.coordinator = Coordinator(
            self.me, lambda a: SignedAllocation.sign(a, identity), self.election, self.epoch,
            GossipSwarm(gossip, self.me), SchedulerPlanner(cfg, confirm=self._confirm_links, kind_probe=kind_probe,
                                                         inputs_dir=self.data_dir / SCHEDULES_DIR,
                                                         fresh_compute=fresh_compute, host=machine),
            cfg.coordinator_timings(),
            operators=self.operators,
        )
        self._corpus: Corpus | None = None  # this peer's data set (`join --data`), the only one it reads
        self._data_id: tuple[str, str] | None = None  # its fingerprint and name, once read
        self._corpus_lock = trio.Lock()
        self._models: dict[str, HeldModel] | None = None  # the model folders it holds (`join --model-dir`)
        self._models_lock = trio.Lock()
        self._stages: StageHost | None = None  # made on first use (`stages`)
        self.router = TensorRouter(transport)  # (these two answer peers from the start, stage or not)
        self.recovery = RecoveryServer(transport, authorize=self._may_fetch)
        # this peer's checkpoints on disk (their size and refusals in status, stage host or not)
        self.disk = CheckpointDisk(self.data_dir / "checkpoints", self.config.checkpoints_kept,
                                   self.config.runs_kept)
        self._pending: dict[tuple, _Pending] = {}
        self._keys = 0
        self._nursery: trio.Nursery | None = None
        self._coord_wake = trio.Event()
        self.reconfigurations: collections.deque[Reconfiguration] = collections.deque(maxlen=MAX_RECONFIGS)
        self._taken_saved = 0  # the version of the operations taken (control/epoch/taken.py) on disk
        self._taken_lock = trio.Lock()
        self.applied: AppliedStore = applied if applied is not None else FileAppliedStore(self.data_dir)
        self._load_applied()
        self.operator = OperatorFront(self)  # the operator's requests (control/operator_front.py)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.transport.handle(ControlMsg.ALLOCATION, self._on_allocation)
        self.transport.handle(ControlMsg.START, self._on_start)
        self.transport.handle(ControlMsg.STOP, self._on_stop)
        self.transport.handle(ControlMsg.STEP, self._on_step)
        self.transport.handle(ControlMsg.RUN_STATE, self._on_run_state)
        self.transport.handle(ControlMsg.TRAIN_OP, self.operator.on_train_op)
        self.transport.handle(ControlMsg.LEAVE, self.operator.on_leave)
        self.gossip.on_member_change(self._on_member_change)
        self.election.on_event(self._on_election_event)
        self.coordinator.wall_offset = self.epoch.wall_offset = time.time() - trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._stages is not None:
                self._stages.attach(nursery)
            await nursery.start(self.election.run)
            nursery.start_soon(self._coordinator_timer)
            nursery.start_soon(self._epoch_timer)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                if self._stages is not None:
                    self._stages.abort("the daemon is leaving")

    @property
    def stages(self) -> StageHost:
        """The stage host (control/epoch/stages.py), made on first use: when this peer builds a
        stage, offers one (its memory or a checkpoint) or answers an export. Its module loads
        torch, which an idle daemon never does; its TENSOR and FETCH handlers are registered
        then (before that, no peer has a reason to send either: see docs/daemon.md, "Memory")."""
        if self._stages is None:
            from .epoch.stages import StageHost  # (torch, about 200 MiB: only a peer that handles tensors)

            self._stages = StageHost(self.me, self.transport, self.epoch, self.data_dir, self.config,
                                     address_of=self.address_of, rate_of=self.link_rate, corpus=self.corpus,
                                     on_event=self._feed_epoch_now,
                                     router=self.router, recovery=self.recovery, models=self.models,
                                     disk=self.disk)
            if self._nursery is not None:
                self._stages.attach(self._nursery)
        return self._stages

    async def host(self) -> StageHost:
        """`stages`, its module (and torch with it) imported in a worker thread the first time:
        the event loop goes on answering peers while it loads (seconds on a busy machine)."""
        if self._stages is None:
            await import_in_thread("dtfm.control.epoch.stages")
        return self.stages

    def _may_fetch(self, peer: bytes, key: tuple[bytes, int, tuple[int, int]]) -> Refused | None:
        """The recovery server's rule: the stage host's once made, else the peers of this peer's
        allocations of that run (no offer has named others yet)."""
        if self._stages is not None:
            return self._stages.may_fetch(peer, key)
        run, prev = self.epoch.run, self.epoch.prev
        return fetch_refusal(peer, key[0], allocations=(run.alloc if run is not None else None,
                                                        prev.alloc if prev is not None else None))

    def _stages_of(self, run_id: bytes | None) -> StageHost | None:
        """The stage host where it may know something of run `run_id`: once made, or where the
        data dir holds checkpoints of that run; None otherwise (nothing held, nothing loaded)."""
        if self._stages is None and (run_id is None or not (self.data_dir / "checkpoints" / run_id.hex()).is_dir()):
            return None
        return self.stages

    def _key(self, *parts: object) -> tuple:
        self._keys += 1
        return (*parts, self._keys)

    async def _coordinator_timer(self) -> None:
        """Tick the coordinator at its deadline, or at once when another event may have moved
        the deadline (`_feed_coordinator` sets `_coord_wake`; this loop's own Tick does not)."""
        stuck = False
        while True:
            due = self.coordinator.next_deadline()
            # (a deadline that the last tick left in the past, unchanged: ticked again after a pause)
            with trio.move_on_at(trio.current_time() + PAST_DEADLINE_BACKOFF_S if stuck else due):
                await self._coord_wake.wait()
            self._feed_coordinator(CoordinatorTick())
            self._coord_wake = trio.Event()
            now, was = trio.current_time(), stuck
            stuck = self.coordinator.next_deadline() == due <= now
            if stuck and not was:
                logger.warning("the coordinator's deadline %.3f stays in the past after its tick at %.3f: "
                               "ticking it again every %g s until it moves", due, now, PAST_DEADLINE_BACKOFF_S)

    async def _epoch_timer(self) -> None:
        while True:
            await trio.sleep(self.config.coordinator_check_s)
            self._feed_epoch_now(EpochTick())
            run = self.epoch.restored_run_to_ask(trio.current_time())
            if run is not None:
                self._start_soon(self._ask_restored_run, run)

    async def _ask_restored_run(self, run: bytes) -> None:
        """A restarted peer asks its coordinator how the run it restored stands, so that its
        status says finished or stopped for a run that ended while it was down."""
        try:
            progress = await self.operator.train_progress(run, after=2**62)
        except TrainError as e:
            logger.debug("asked the coordinator about run %s restored here: %s", run.hex()[:8], e)
            return
        if progress.run_id == run:
            self.epoch.restored_run_heard(run, progress.state, progress.completed)

    # ---- feeding the machines and executing their actions ------------------------------------

    def _feed_coordinator(self, event: CoordinatorEvent) -> None:
        try:
            actions = self.coordinator.handle(event, trio.current_time())
        except Exception:
            logger.exception("the coordinator failed on %s: the run stops", type(event).__name__)
            cur = self.epoch.current
            if cur is not None:
                self.epoch.handle(RunClosed(cur.run_id, "the coordinator failed"), trio.current_time())
            return
        self._coord_wake.set()
        if self.epoch.taken.version != self._taken_saved:  # (a resume or reschedule taken)
            self._start_soon(self._save_taken)
        for a in actions:
            self._execute_now(a)

    async def _feed_epoch(self, event: EpochEvent) -> None:
        """Feed an event whose actions may wait (an allocation: end the epoch, persist, build)."""
        for a in self.epoch.handle(event, trio.current_time()):
            await self._execute_epoch(a)

    def _feed_epoch_now(self, event: EpochEvent) -> None:
        """Feed an event whose actions do not wait (start, stop, steps, ticks, members)."""
        if isinstance(event, StepDone):
            self._gauge_compute(event.report)
        for a in self.epoch.handle(event, trio.current_time()):
            self._execute_now(a)

    def _gauge_compute(self, report: StepReport) -> None:
        """This peer's compute figure from its own step (`ComputeGauge`), for its gossip report."""
        alloc = self.epoch.current
        if alloc is None or alloc.epoch != report.epoch or self.me not in alloc.peers:
            return
        d, s = alloc.position(self.me)
        start, end = alloc.layer_ranges[s]
        key = (alloc.model, micro_batch_seqs(alloc.train, alloc.dp))
        if key not in self._kinds:  # (the first step of a run layer: learn its kind factor meanwhile)
            self._kinds[key] = None
            self._start_soon(self._learn_kind, key)
        kind = self._kinds[key]
        figure = training_block_ms(alloc.model, alloc.train, alloc.dp, end - start, s == alloc.stages - 1,
                                   report.compute_s, kind if kind is not None else 1.0, pipeline=d)
        got = self._compute_gauge.add((alloc.run_id, alloc.epoch), figure, report.core_share)
        if got is not None and (kind is not None or self._kind_probe is None):
            self.gossip.set_compute_ms(*got)

    async def _learn_kind(self, key: tuple[GPTSpec, int]) -> None:
        """The kind factor of a run layer this peer trains (`kind_factors`, its probe in a
        worker thread); 1.0 without a probe or when it fails."""
        model, batch = key
        factor = 1.0
        if self._kind_probe is not None:
            try:
                factor = dict(await trio.to_thread.run_sync(self._kind_probe, model, (batch,))).get(batch, 1.0)
            except Exception as e:  # (reported at the reference rate)
                logger.warning("cannot probe the run's layer: %s; this peer's compute is reported at the "
                               "reference rate", e)
        self._kinds[key] = factor

    def _execute_now(self, a: EpochAction | CoordinatorAction) -> None:
        """Execute an action that does not wait (every action of the coordinator); those that
        wait come in order through `_execute_epoch`, from events fed with `_feed_epoch`."""
        if isinstance(a, Ask):
            self._start_soon(self._ask_and_feed, a)
        elif isinstance(a, Compute):
            self._start_soon(self._compute_and_feed, a)
        elif isinstance(a, Send):
            if a.peer == self.me:
                self._feed_coordinator(inputs.step_message(self.me, a.body))
            else:
                self._start_soon(self._send_one_way, a.peer, a.msg, a.body)
        elif isinstance(a, LogLine):
            line = {**a.line, "time": time.time()}
            self._append_jsonl(self._log_path, line)
            self._append_jsonl(self.run_log_path(a.line["run"]), line)
        elif isinstance(a, ResetLog):
            self._log_path.unlink(missing_ok=True)
            self.reconfigurations.clear()
        elif isinstance(a, Emit):
            cur = self.epoch.current  # (every line names its run: the one this peer applied last, if any)
            self._append_jsonl(self.data_dir / "events.jsonl",
                               {"time": time.time(), "event": a.event, "peer": self.me.hex(),
                                "run": cur.run_id.hex() if cur is not None else None, **a.fields})
            if a.record.reconfiguration is not None:
                self.reconfigurations.append(a.record.reconfiguration)
        elif isinstance(a, Reply):
            pending = self._pending.get(a.key)
            if pending is not None:
                pending.reply = a
                pending.event.set()
        elif isinstance(a, AbortRunner):
            if self._stages is not None:
                self._stages.abort(a.reason)
        elif isinstance(a, KeepStage):
            if self._stages is not None:  # (no stage host: this peer holds nothing in memory)
                self._start_soon(self._stages.keep, a.run_id)
        elif isinstance(a, FailNeighbour):
            if self._stages is not None:
                self._stages.fail_neighbour(a.peer, a.why)
        elif isinstance(a, StartRunner):
            if self._stages is not None:
                self._stages.start(a.epoch)
        elif isinstance(a, StopRunnerAt):
            if self._stages is not None:
                self._stages.stop_at(a.epoch, a.step, final=a.final)
        elif isinstance(a, WaitForCoordinator):
            self._start_soon(self._wait_for_coordinator, a)
        elif isinstance(a, (EndEpoch, ApplyToElection, PersistApplied, BuildStage)):
            raise TypeError(f"{type(a).__name__} waits: only an event fed with _feed_epoch may return it")
        else:
            assert_never(a)

    async def _execute_epoch(self, a: EpochAction) -> None:
        """Execute an action of the epoch machine, in order (some wait)."""
        if isinstance(a, EndEpoch):
            if self._stages is not None:
                from .epoch.stages import StageError  # (the host's module: loaded with it)

                try:
                    await self._stages.end(a.epoch, a.reason)
                except StageError as e:
                    raise TrainError(str(e)) from None
        elif isinstance(a, ApplyToElection):
            self.election.apply_allocation(a.term, a.epoch, a.council, a.certificate)
        elif isinstance(a, PersistApplied):
            await trio.to_thread.run_sync(self._save_applied, a.alloc)
        elif isinstance(a, BuildStage):
            members = {m.peer_id: m.address for m in self.gossip.members()}
            await self._feed_epoch(await (await self.host()).build(a, members))
        else:
            self._execute_now(a)

    def _start_soon(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _request(self, key: tuple, event: EpochEvent) -> Reply:
        """Feed `event` to the epoch machine and wait for its Reply with `key`."""
        pending = self._pending[key] = _Pending(trio.Event())
        try:
            await self._feed_epoch(event)
            await pending.event.wait()
            assert pending.reply is not None
            return pending.reply
        finally:
            self._pending.pop(key, None)

    def _ask_now(self, key: tuple, event: EpochEvent) -> dict:
        """Feed an event the epoch machine answers at once (a START or a STOP); its answer, on the
        wire."""
        for a in self.epoch.handle(event, trio.current_time()):
            if isinstance(a, Reply) and a.key == key:
                reply = a
            else:
                self._execute_now(a)
        answer: StartAnswer | StopAnswer = reply.value
        return answer.to_wire()

    async def _ask_and_feed(self, a: Ask) -> None:
        replies = await self._ask_each(a.peers, a.msg, a.body, a.timeout_s)
        self._feed_coordinator(Answers(a.key, read_answers(a.msg, a.body, replies)))

    def _confirm_links(self, view: NetworkView, links: list[tuple[bytes, bytes]]) -> NetworkView | None:
        """From the scheduler's worker thread: measure the links now (`GossipService.confirm`)
        and return the view over the same peers after."""
        try:
            left = trio.from_thread.run(self.gossip.confirm, links)
        except trio.RunFinishedError:
            return None
        if left:
            logger.info("%d of the plan's %d estimated links could not be measured", len(left), len(links))
        return build_view(view.peers, self.gossip.records.reports, now_wall=time.time())

    async def _compute_and_feed(self, a: Compute) -> None:
        try:
            value = await trio.to_thread.run_sync(a.fn)
        except ValueError as e:
            self._feed_coordinator(Computed(a.key, error=str(e)))
            return
        self._feed_coordinator(Computed(a.key, value))

    async def _wait_for_coordinator(self, a: WaitForCoordinator) -> None:
        with trio.move_on_at(a.until):
            await self.election.changed()
        await self._feed_epoch(replace(a.offer, ctx=self._accept_context(a.offer.alloc)))

    # ---- asking peers -------------------------------------------------------------------------

    async def ask_all(self, peers: Iterable[bytes], msg_type: int, body: dict, timeout_s: float) -> dict:
        """Each peer's reply as a map (the operator's requests read them as such); a peer that
        did not answer has `{"reason": why}`."""
        replies = await self._ask_each(peers, msg_type, body, timeout_s)
        return {p: {"reason": r.reason} if isinstance(r, NoAnswer) else r if isinstance(r, dict)
                else {"reason": "malformed answer"} for p, r in replies.items()}

    async def _ask_each(self, peers: Iterable[bytes], msg_type: int, body: dict,
                        timeout_s: float) -> dict[bytes, object]:
        """Each peer's reply as it came (untrusted), or `NoAnswer` when it gave none in time."""
        replies: dict[bytes, object] = {}

        async def ask(peer: bytes) -> None:
            try:
                with trio.fail_after(timeout_s):
                    if peer == self.me:
                        replies[peer] = await self._local_answer(msg_type, body)
                        return
                    conn = await self._connection(peer)
                    replies[peer], _ = await conn.request(msg_type, body, timeout_s=timeout_s)
            except (trio.TooSlowError, RequestTimeout):
                replies[peer] = NoAnswer(f"no answer within {timeout_s:g} s")
            except (ConnectionClosed, RemoteError, ProtocolError, OSError) as e:
                replies[peer] = NoAnswer(f"unreachable: {e}")

        async with trio.open_nursery() as nursery:
            for p in sorted(set(peers)):
                nursery.start_soon(ask, p)
        return replies

    async def _local_answer(self, msg_type: int, body: dict) -> dict:
        """This peer's own answer to a request its coordinator makes (as the remote handlers)."""
        if msg_type == ControlMsg.ALLOCATION:
            return await self._accept_signed(body)
        if msg_type == ControlMsg.START:
            return await self._start_asked(self.me, body)
        if msg_type == ControlMsg.STOP:
            return await self._stop_asked(self.me, body)
        if msg_type == ControlMsg.RUN_STATE:
            return await self._run_state_asked(self.me, body)
        raise AssertionError(f"no local answer to message {msg_type}")

    async def _connection(self, peer: bytes):
        """The live connection to `peer`, else a new one to its gossiped address (ConnectionClosed
        when it is no member with an address). The caller bounds the wait."""
        conn = self.transport.connection(peer)
        if conn is not None:
            return conn
        address = self.address_of(peer)
        if address is None:
            raise ConnectionClosed(f"{short_id(peer)} is not a member with an address")
        return await self.transport.connect(*address, peer_id=peer)

    def link_rate(self, peer: bytes) -> float | None:
        """Bytes per second of the link from `peer` to this peer in the gossiped view; None where
        unknown. A stage fetch's chunk deadlines follow it (control/epoch/recovery.py)."""
        return self.gossip.view().link_bytes_per_s(peer, self.me)

    def address_of(self, peer: bytes) -> tuple[str, int] | None:
        for m in self.gossip.members():
            if m.peer_id == peer and m.address[1]:
                return m.address
        return None

    async def _send_one_way(self, peer: bytes, msg_type: int, body: dict) -> None:
        try:
            with trio.move_on_after(self.config.request_timeout_s):
                conn = await self._connection(peer)
                await conn.send(msg_type, body)
        except (ConnectionClosed, ProtocolError, OSError) as e:
            logger.debug("could not send message %d to %s: %s", msg_type, short_id(peer), e)

    # ---- files --------------------------------------------------------------------------------

    @property
    def _log_path(self) -> Path:
        """The step log of the runs this peer coordinated, the newest run's only (a new run
        starts it empty); `run_log_path` keeps each run's for good."""
        return self.data_dir / "train.jsonl"

    def run_log_path(self, run_hex: str) -> Path:
        """One run's step log, never overwritten: a coordinator that takes the run over
        continues it (in its own data dir) with the lines it back-fills and logs."""
        return self.data_dir / f"train-{run_hex}.jsonl"

    @staticmethod
    def _append_jsonl(path: Path, line: dict) -> None:
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            logger.warning("cannot write %s: %s", path.name, e)

    async def _save_taken(self) -> None:
        """Write the operations this peer took (DATA_DIR/operations.json) if they changed."""
        async with self._taken_lock:
            version = self.epoch.taken.version
            if version == self._taken_saved:
                return
            try:
                await trio.to_thread.run_sync(save_taken, self.data_dir, self.epoch.taken.to_json())
            except OSError as e:
                logger.warning("cannot write %s: %s", TAKEN_NAME, e)
                return
            self._taken_saved = version

    def _load_applied(self) -> None:
        self.epoch.restore_taken(load_taken(self.data_dir))
        try:
            kept = self.applied.load()
        except AppliedError as e:
            raise TrainError(str(e)) from None
        if kept is None:
            root = load_root(self.data_dir)
            if root is not None:
                self.election.set_root(root)
            return
        run, term, epoch, alloc, previous = kept.run_id, kept.term, kept.epoch, kept.alloc, kept.previous
        path = self.data_dir / APPLIED_NAME
        council = None
        if alloc is not None and alloc.council:
            try:
                council = Council.decode(alloc.council)
            except ProtocolError as e:
                raise TrainError(f"{path} holds an allocation with a damaged council ({e})") from None
        root = load_root(self.data_dir)
        if root is not None and (council is None or root.root_at_ms > council.root_at_ms):
            council, previous = root, None  # the operator re-rooted the council after that allocation
        self.election.restore(term, epoch, council, previous)
        host = self._stages_of(run) if alloc is not None and alloc.run_id == run else None
        reports = host.kept_reports(run) if host is not None else []
        self.epoch.restore(run, term, epoch, alloc, reports)
        if self.applied.stopped() == run:
            self.epoch.handle(RunClosed(run, "stopped before this peer restarted"), 0.0)  # (no clock yet)

    def _save_applied(self, alloc: Allocation) -> None:
        self.applied.save(alloc, self.election.previous)

    # ---- corpus -------------------------------------------------------------------------------

    async def corpus(self) -> Corpus:
        """This peer's data set, the one it was started with (`join --data`; the standard
        library's source by default), loaded on first use and kept while this peer may train
        (see `data_identity`): no path from the network is ever opened."""
        async with self._corpus_lock:
            if self._corpus is None:
                self._corpus = await self._read_corpus()
                self._data_id = self._corpus.fingerprint, self._corpus.name
            return self._corpus

    async def data_identity(self) -> tuple[str, str]:
        """The fingerprint and name of this peer's data set: all an allocation's check needs. A
        spare reads its data set for them once and does not keep it (tens of MB in each of a
        large swarm's spares); a peer placed on a stage loads it again (`corpus`)."""
        async with self._corpus_lock:
            if self._data_id is None:
                corpus = self._corpus if self._corpus is not None else await self._read_corpus()
                self._data_id = corpus.fingerprint, corpus.name
            return self._data_id

    async def _read_corpus(self) -> Corpus:
        """This peer's data set read from disk, its fingerprint computed (both in a thread)."""
        def read() -> Corpus:
            corpus = self._load_corpus()
            _ = corpus.fingerprint  # (computed here, not on the trio thread)
            return corpus
        try:
            return await trio.to_thread.run_sync(read)
        except ValueError as e:
            raise TrainError(str(e)) from None

    def _load_corpus(self) -> Corpus:
        if self.config.tokenizer_path is None:  # (this module's load_corpus: the one the shell tests watch)
            return load_corpus(self.config.data_path)
        return load_peer_corpus(self.config.data_path, self.config.tokenizer_path)

    def export_tokenizer(self, spec: GPTSpec) -> Path | None:
        """The tokenizer an export of a run of `spec` carries: the one this peer's text data was
        tokenized with (`--tokenizer`); for token files, the model folder's the run started
        from, if it has one; else None (bytes)."""
        if self.config.tokenizer_path is not None:
            return Path(self.config.tokenizer_path)
        held = (self._models or {}).get(spec.name)
        data = self.config.data_path
        if held is not None and data is not None and data.endswith(".bin") and any(
                (held.path / n).is_file() for n in ("tokenizer.json", "vocab.json")):
            return held.path
        return None

    async def models(self) -> dict[str, HeldModel]:
        """The model folders this peer holds (`join --model-dir`), by preset name, hashed once."""
        async with self._models_lock:
            if self._models is None:
                self._models = await trio.to_thread.run_sync(load_held_models, self.config.model_paths)
            return self._models

    # ---- message handlers ---------------------------------------------------------------------

    async def _on_allocation(self, conn: PeerConnection, msg_type: int, body: object, payload: Payload) -> dict:
        return await self._accept_signed(body, sender=conn.short_id)

    async def _accept_signed(self, body: object, sender: str = "itself") -> dict:
        try:
            alloc, cert = inputs.signed_allocation(body)
        except ProtocolError as e:
            logger.warning("refused an allocation from %s: %s", sender, e)
            return inputs.bad_allocation(e).to_wire()
        return await self.accept(alloc, cert)

    def _accept_context(self, alloc: Allocation) -> AcceptContext:
        assert self._data_id is not None
        live = frozenset(self.gossip.live_peers()) | {self.me}
        known = {**PRESETS, **{name: m.spec for name, m in (self._models or {}).items()}}
        data_hash, data_name = self._data_id
        return AcceptContext(me=self.me, live=live, known_presets=known, data_hash=data_hash,
                             data_name=data_name, known=frozenset(m.peer_id for m in self.gossip.members()))

    async def accept(self, alloc: Allocation, certificate: Certificate | None = None) -> dict:
        """Check, get the stage, connect the neighbours; the answer goes to the coordinator. A
        peer the allocation leaves out (a spare) checks it against its data set's fingerprint
        and lets the data set go (its old stage's runner may still hold it until that goes)."""
        placed = self.me in alloc.peers
        if placed:
            await self.corpus()
        else:
            await self.data_identity()
        await self.models()
        key = self._key("allocation")
        reply = await self._request(key, AllocationOffered(key, alloc, self._accept_context(alloc),
                                                           certificate=certificate))
        answer: AllocationAnswer = reply.value
        if not placed and answer.accepted:
            self._corpus = None
        if not answer.accepted:
            logger.warning("refused allocation term %d epoch %d from %s: %s", alloc.term, alloc.epoch,
                           short_id(alloc.issuer), answer.reason)
        return answer.to_wire()

    async def _on_start(self, conn: PeerConnection, msg_type: int, body: object, payload: Payload) -> dict:
        return await self._start_asked(conn.peer_id, body)

    async def _start_asked(self, sender: bytes, body: object) -> dict:
        key = self._key("start")
        return self._ask_now(key, inputs.start_asked(key, sender, body))

    async def _on_stop(self, conn: PeerConnection, msg_type: int, body: object, payload: Payload) -> dict:
        return await self._stop_asked(conn.peer_id, body)

    async def _stop_asked(self, sender: bytes, body: object) -> dict:
        cur = self.epoch.current
        key = self._key("stop")
        ev, learn = inputs.stop_asked(key, sender, body, current_run=cur.run_id if cur is not None else None,
                                      coordinator=self.election.coordinator)
        if learn is not None:
            self.election.learn(learn)
        answer = self._ask_now(key, ev)
        if ev.final and cur is not None and self.epoch.over_without_finishing(cur.run_id):
            await trio.to_thread.run_sync(self.applied.save_stopped, cur.run_id)  # (a restart keeps it)
        await self._save_taken()  # (and the stop taken: a copy of it is refused after a restart too)
        return answer

    async def _on_step(self, conn: PeerConnection, msg_type: int, body: object, payload: Payload) -> None:
        self._feed_coordinator(inputs.step_message(conn.peer_id, body))

    async def _on_run_state(self, conn: PeerConnection, msg_type: int, body: object, payload: Payload) -> dict:
        return await self._run_state_asked(conn.peer_id, body)

    async def _run_state_asked(self, sender: bytes, body: object) -> dict:
        req = inputs.run_state_request(sender, body, coordinator=self.election.coordinator)
        if isinstance(req, inputs.Query):
            refused = self.epoch.check_run_state_reader(sender)
            return {"error": refused.text} if refused is not None else self.run_state().to_wire()
        if isinstance(req, inputs.Progress):
            refused = self.epoch.check_run_state_reader(sender)
            if refused is not None:
                return {"error": f"{refused.text}: ask a daemon of the run"}
            return self.operator.progress_here(req.run, req.after)
        if isinstance(req, ReachRequest):
            if sender != self.election.coordinator and sender != self.me:
                return {"error": "only the coordinator asks a peer to reach others"}
            return await self._reach(req)
        if isinstance(req, inputs.Export):
            await import_in_thread("dtfm.control.export")
            from .export import answer_export  # (torch: a holder encodes weights)

            cur = self.epoch.current
            return await answer_export(sender, req.body, operators=self.operators, now_s=time.time(),
                                       skew_s=self.config.operator_skew_s, stages=await self.host(), current=cur,
                                       state=self.run_state(), refusals=self.recovery.refusals)
        if isinstance(req, inputs.Keep):  # the run waits: what this peer holds of it in memory goes to its data dir
            refused = self.epoch.check_offer_asker(sender)
            if refused is not None:
                return {"error": refused.text}
            if self._stages is None:  # (no stage host: this peer holds nothing in memory)
                return {"kept": []}
            return await self._stages.keep(req.run_id)
        if isinstance(req, inputs.Offer):
            if req.learn is not None:
                self.election.learn(req.learn)
            refused = self.epoch.check_offer_asker(sender)
            if refused is not None:
                return {"error": refused.text}
            return await (await self.host()).offer(req.run_id, req.step, req.layers, fetchers=req.fetchers)
        assert_never(req)

    async def _reach(self, req: ReachRequest) -> dict:
        """Ping each asked peer (gossip's round-trip measurement), each within the request's time."""
        reached: list[bytes] = []

        async def ping(peer: bytes) -> None:
            with trio.move_on_after(req.timeout_s):
                try:
                    conn = await self._connection(peer)
                except (ConnectionClosed, ProtocolError, OSError):
                    return
                if await measure_rtt(conn, 1, 0.0, req.timeout_s):
                    reached.append(peer)

        peers = sorted(set(req.peers) - {self.me})
        async with trio.open_nursery() as nursery:
            for p in peers:
                nursery.start_soon(ping, p)
        return ReachAnswer(tuple(sorted(reached)), tuple(p for p in peers if p not in reached)).to_wire()

    def run_state(self) -> PeerRunState:
        cur = self.epoch.current
        run_id = cur.run_id if cur is not None else None
        host = self._stages_of(run_id)
        return self.epoch.run_state(host.checkpoints(run_id) if host is not None else ())

    # ---- membership and election events -------------------------------------------------------

    def _on_member_change(self, member: Member) -> None:
        cur = self.epoch.current
        if cur is None or member.peer_id == self.me:  # (this peer's own leave is no news to it)
            return
        named = set(cur.peers) | set(cur.spares)
        if member.state.gone and member.peer_id in cur.peers:
            why = f"peer {member.short_id} is {member.state.name.lower()}"
            self._feed_epoch_now(MemberGone(member.peer_id, why))
            self._feed_coordinator(Trigger(why))
        elif not member.state.gone and member.peer_id not in named:
            self._feed_coordinator(Wake())  # a joined or returned peer: the coordinator looks at it

    def _on_election_event(self, event: object) -> None:
        if isinstance(event, BecameCoordinator):
            self._feed_coordinator(Elected(event.term))
        elif isinstance(event, SteppedDown):
            self._feed_coordinator(SteppedDownEvent(event.term, event.reason))

    # ---- operator operations ------------------------------------------------------------------

    async def coordinator_request(self, event_type: Any, *args: Any) -> Any:
        """Feed the coordinator machine `event_type(key, *args)` (an operator's request, a
        peer's leave) and wait for its Reply: its value, or TrainError with its error."""
        key = self._key("op")
        pending = self._pending[key] = _Pending(trio.Event())
        try:
            self._feed_coordinator(event_type(key, *args))
            await pending.event.wait()
        finally:
            self._pending.pop(key, None)
        reply = pending.reply
        assert reply is not None
        if reply.error is not None:
            raise TrainError(reply.error)
        return reply.value

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        from .status import plane_status
        refusals = merge_counts([self.coordinator.refusals.counts(), self.epoch.refusals.counts(),
                                 self.recovery.refusals.counts()])
        c = self.coordinator.status()
        log = self._log_path if c.run_id is None else self.run_log_path(c.run_id.hex())  # the run's step log
        return plane_status(self.me, self.election.status(), self.election.is_coordinator, self.epoch.status(),
                            c, log, self.operator.swarm_wait, refusals,
                            self.disk.status(), self._stages.memory() if self._stages is not None else None,
                            self._corpus.tokens.nbytes if self._corpus is not None else None).to_wire()
