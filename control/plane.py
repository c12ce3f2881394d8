"""The control plane's IO shell (see docs/control.md, "The shell").

`ControlPlane` owns the IO: it registers the message handlers, owns the nursery, the election
service, the stage host (control/epoch/stages.py: the tensors, comm and runner thread of this
peer's epochs, the tensor router and the recovery server), the corpora, the data dir's files
(applied.json, stopped.json, operations.json, train.jsonl, events.jsonl) and the operator's
requests. It feeds messages, member changes, election events, the runner's steps and time to
the two machines, `EpochMachine` (this peer's part in each epoch) and `Coordinator` (the
coordinator's decisions), executes their actions in order, and builds `status()` from their
snapshots.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from dtfm.gossip import DISAGREEMENT_RATIO, GossipService, Member, NetworkView, build_view, measure_rtt
from dtfm.net import (
    ConnectionClosed,
    Identity,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    get_bytes,
    get_dict,
    get_int,
    get_str,
    short_id,
)
from dtfm.train import (
    PRESETS,
    Corpus,
    GPTSpec,
    TrainConfig,
    load_corpus,
    load_torch_libraries,
)

from .actions import Answers, Ask, Compute, Computed, Emit, LogLine, Reply, ResetLog, Send
from .allocation import AcceptContext, Allocation, SignedAllocation
from .config import PlaneConfig
from .coordinator.machine import (
    Coordinator,
    first_council,
    CoordinatorTick,
    CoordinatorTimings,
    Elected,
    PeerLeaving,
    Reschedule,
    ResumeRun,
    StartRun,
    StepFailed,
    SteppedDownEvent,
    StepReported,
    StopRun,
    Trigger,
    Wake,
)
from .coordinator.deadline import DeadlineRules
from .coordinator.links import ReachAnswer, ReachRequest
from .coordinator.phase import run_over, run_word
from .coordinator.request import TrainError, TrainRequest
from .coordinator.reshape import ReshapePlan, reshape
from .coordinator.schedule import Placement, choose_links, choose_shape, compression_options_of, random_shape
from .election import (
    BecameCoordinator,
    Certificate,
    Council,
    ElectionService,
    FileElectionStore,
    PreviousConfiguration,
    SteppedDown,
)
from .epoch.machine import (
    AbortRunner,
    AllocationOffered,
    ApplyToElection,
    BuildStage,
    EndEpoch,
    EpochMachine,
    EpochTick,
    FailNeighbour,
    KeepStage,
    MemberGone,
    PersistApplied,
    RunClosed,
    StartAsked,
    StartRunner,
    StopAsked,
    StopRunnerAt,
    WaitForCoordinator,
)
from .dataplane import TensorRouter
from .epoch.access import coordinator_certificate, fetch_refusal, parse_fetchers
from .epoch.disk import CheckpointDisk
from .epoch.recovery import RecoveryServer
from .epoch.report import StepReport
from .epoch.runstate import PeerRunState
from .epoch.stopped import clear_stopped, load_stopped, save_stopped
from .epoch.taken import TAKEN_NAME, load_taken, save_taken
from .events import Reconfiguration
from .messages import ControlMsg
from .models import HeldModel, load_held_models, load_peer_corpus, model_refusal
from .operator import OperatorError, SignedOp, check_op, check_time, council_arg, root_council
from .progress import MAX_RECONFIGS, RunProgress, run_progress
from .refusals import Refused, merge_counts

if TYPE_CHECKING:  # (torch: loaded with the first stage, offer or export; see `ControlPlane.stages`)
    from .epoch.stages import StageHost
    from .export import ExportProgress

__all__ = ["ControlPlane"]

ROOT_NAME = "council.bin"  # the council an operator's operation rooted here, before any allocation carried it
logger = logging.getLogger(__name__)

MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim
MAX_CHECKPOINTS_LISTED = 16
FIND_AGAIN_ELECTIONS = 4  # `train start` without a coordinator asks the peers again after this many election timeouts


class GossipSwarm:
    """The gossiped swarm as the coordinator reads it."""

    def __init__(self, gossip: GossipService, me: bytes):
        self.gossip, self.me = gossip, me

    def live_peers(self) -> list[bytes]:
        return list(self.gossip.live_peers())

    def known_peers(self) -> list[bytes]:
        return [m.peer_id for m in self.gossip.members()]

    def regions(self) -> dict[bytes, str]:
        return {m.peer_id: m.region for m in self.gossip.members()}

    def view(self) -> NetworkView:
        return self.gossip.view()

    def incarnations(self) -> dict[bytes, int]:
        return {m.peer_id: m.incarnation for m in self.gossip.members()}

    def measured_view(self, candidates: Iterable[bytes]) -> tuple[NetworkView, list[bytes]]:
        """The view over `candidates`, leaving out (worst first) peers with links that gossip
        has neither measured nor can estimate yet: a restarted or joined peer is placed once
        its report holds a coordinate and its capacities (links its plan uses are measured
        before hand-out: `SchedulerPlanner`)."""
        peers = sorted(set(candidates))
        left: list[bytes] = []
        while True:
            view = build_view(tuple(peers), self.gossip.records.reports, now_wall=time.time())
            if view.complete or len(peers) <= 1:
                return view, left
            known = np.isfinite(view.delay_ms) & np.isfinite(view.bandwidth_gbps)
            unknown = ~known & ~np.eye(len(peers), dtype=bool)
            worst = peers[int(np.argmax(unknown.sum(axis=0) + unknown.sum(axis=1)))]
            peers.remove(worst)
            left.append(worst)


CONFIRM_ROUNDS = 2  # plans whose estimated links are measured before one is handed out


def plan_links(placement: Placement) -> list[tuple[bytes, bytes]]:
    """The links a placement's steps use: each pipeline's consecutive stages, and every pair
    of a stage's data-parallel group."""
    links = [(p[s], p[s + 1]) for p in placement.pipelines for s in range(len(p) - 1)]
    for s in range(len(placement.layer_ranges)):
        group = [p[s] for p in placement.pipelines if s < len(p)]
        links += [(a, b) for i, a in enumerate(group) for b in group[i + 1:]]
    return links


def _estimates_held(before: NetworkView, after: NetworkView, links: list[tuple[bytes, bytes]]) -> bool:
    """Whether the figures measured for `links` are within DISAGREEMENT_RATIO of the estimates
    the plan was made on (a link still unmeasured counts as held)."""
    i_before = {p: i for i, p in enumerate(before.peers)}
    i_after = {p: i for i, p in enumerate(after.peers)}
    for a, b in links:
        i, j, k, m = i_before[a], i_before[b], i_after.get(a), i_after.get(b)
        if k is None or m is None or not after.measured()[k, m]:
            continue
        for old, new in ((before.delay_ms[i, j], after.delay_ms[k, m]),
                         (before.bandwidth_gbps[i, j], after.bandwidth_gbps[k, m])):
            if min(old, new) > 0 and max(old, new) / min(old, new) > DISAGREEMENT_RATIO:
                return False
    return True


class SchedulerPlanner:
    """`reshape` and the first placement with the plane's budget and hysteresis, on the
    gossiped view with its estimates; with `confirm`, the links of the plan chosen that are
    estimated are measured before it is returned (`confirm(view, links)` measures them and
    returns the view over the same peers after), and when the measurements disagree with the
    estimates the search runs again on them, up to CONFIRM_ROUNDS times."""

    def __init__(self, config: PlaneConfig,
                 confirm: Callable[[NetworkView, list[tuple[bytes, bytes]]], NetworkView | None] | None = None):
        self.config = config
        self.confirm = confirm

    def _confirmed(self, view: NetworkView, search: Callable[[NetworkView], Any],
                   placement_of: Callable[[Any], Placement]) -> Any:
        plan = search(view)
        if self.confirm is None:
            return plan
        for _ in range(CONFIRM_ROUNDS):
            todo = view.unmeasured(plan_links(placement_of(plan)))
            if not todo:
                return plan
            fresh = self.confirm(view, todo)
            if fresh is None or _estimates_held(view, fresh, todo):
                return plan
            logger.info("the plan's links measured other than estimated: scheduling again on %d measured links",
                        len(todo))
            view = fresh
            plan = search(view)
        return plan

    def reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                regions: dict[bytes, str], seed: int, force: bool,
                cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan:
        return self._confirmed(view, lambda v: self._reshape(v, cur, live=live, remaining_steps=remaining_steps,
                                                              regions=regions, seed=seed, force=force, cut=cut),
                               lambda plan: plan.placement)

    def _reshape(self, view: NetworkView, cur: Allocation, *, live: frozenset[bytes], remaining_steps: int,
                 regions: dict[bytes, str], seed: int, force: bool,
                 cut: frozenset[tuple[bytes, bytes]] = frozenset()) -> ReshapePlan:
        per_link = cur.compression.per_link  # (then the candidates are costed knowing the codecs)
        plan = reshape(view, cur.model, cur.train, current=cur.plan(), live=live,
                       remaining_steps=remaining_steps, regions=regions, time_budget_s=self.config.schedule_time_s,
                       seed=seed, min_gain=self.config.min_gain, force=force, cut_links=cut,
                       compression=compression_options_of(cur.compression, view=view) if per_link else None)
        if not per_link:
            return plan
        links = cur.compress_links
        kept = [r for s, r in enumerate(cur.layer_ranges) if links is None or links.dp[s]]
        return replace(plan, placement=choose_links(view, plan.placement, cur.model, cur.train,
                                                    cur.compression, keep_compressed=kept))

    def first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                        regions: dict[bytes, str]) -> Placement:
        """A new run's shape: the scheduler's on the gossiped view, or (`--placement random`) a
        random one of the asked stages x dp (ValueError when none fits)."""
        return self._confirmed(view, lambda v: self._first_placement(v, req, model, train, regions),
                               lambda plan: plan)

    def _first_placement(self, view: NetworkView, req: TrainRequest, model: GPTSpec, train: TrainConfig,
                         regions: dict[bytes, str]) -> Placement:
        dp = req.dp
        if req.stages is not None and dp is None:
            dp = max(1, len(view.peers) // req.stages)
        per_link = req.compression.per_link  # (then the search knows the codecs, and each link is chosen)
        if req.placement == "random":
            if req.stages is None or dp is None:  # (TrainRequest refuses a random placement without --stages)
                raise ValueError("a random placement needs --stages and --dp")
            shape = random_shape(view, model, train, stages=req.stages, dp=dp, seed=req.seed)
        elif not per_link:
            return choose_shape(view, model, train, stages=req.stages, dp=dp, regions=regions,
                                time_budget_s=self.config.schedule_time_s, seed=req.seed)
        else:
            # Two searches, each with half the time: one knowing the codecs, one for exact tensors;
            # each gets its links chosen, and the simulator's faster plan wins. The search's
            # objective (the paper's, with each link's cheapest codec) can miss what the
            # simulator counts, the trainer's own round trips above all (a swarm measured the
            # codec-aware plan 41 % slower than every link compressed on the exact search's).
            half = self.config.schedule_time_s / 2
            candidates = [choose_links(view, choose_shape(view, model, train, stages=req.stages, dp=dp, regions=regions,
                                                          time_budget_s=half, seed=req.seed, compression=opts),
                                       model, train, req.compression)
                          for opts in (compression_options_of(req.compression, view=view), None)]
            return min(candidates, key=lambda p: p.predicted_iteration_s)  # (the codec-aware one on a tie)
        return choose_links(view, shape, model, train, req.compression) if per_link else shape


@dataclass
class _Pending:
    """An operator's request or a peer's ALLOCATION waiting for the machine's Reply."""

    event: trio.Event
    reply: Reply | None = None


class ControlPlane:
    """One daemon's control plane (see the module docstring)."""

    def __init__(self, transport, identity: Identity, gossip: GossipService, data_dir: Path,
                 config: PlaneConfig | None = None, *, operators: Iterable[bytes] = ()):
        self.transport, self.identity, self.gossip = transport, identity, gossip
        self.me = identity.peer_id
        self.data_dir = Path(data_dir)
        self.config = config or PlaneConfig.wan()
        self.operators = frozenset(operators)  # the swarm's operators' public keys (the swarm key file)
        self.election = ElectionService(transport, self.me, FileElectionStore(self.data_dir), self.config.election,
                                        signer=identity, address_of=self._address_of, peers=gossip.live_peers)
        cfg = self.config
        self.epoch = EpochMachine(self.me, self.election, heartbeat_wait_s=cfg.heartbeat_wait_s,
                                  coordinator_lost_after_s=cfg.coordinator_lost_after_s, operators=self.operators,
                                  operator_skew_s=cfg.operator_skew_s)
        self.coordinator = Coordinator(
            self.me, lambda a: SignedAllocation.sign(a, identity), self.election, self.epoch,
            GossipSwarm(gossip, self.me), SchedulerPlanner(cfg, confirm=self._confirm_links),
            CoordinatorTimings(accept_timeout_s=cfg.accept_timeout_s, request_timeout_s=cfg.request_timeout_s,
                               stop_timeout_s=cfg.stop_timeout_s, check_interval_s=cfg.check_interval_s,
                               drift_check_s=cfg.drift_check_s, report_gather_s=cfg.report_gather_s,
                               probe_timeout_s=cfg.probe_timeout_s, paused_retry_s=cfg.paused_retry_s,
                               stop_poll_s=cfg.stop_poll_s, max_reconfig_attempts=cfg.max_reconfig_attempts,
                               deadline=DeadlineRules(floor_s=cfg.step_deadline_floor_s, mads=cfg.step_deadline_mads,
                                                      first_s=cfg.step_deadline_first_s),
                               deadline_probe_timeout_s=cfg.deadline_probe_timeout_s,
                               link_retest_s=cfg.link_retest_s, operator_skew_s=cfg.operator_skew_s,
                               council_size=cfg.council_size,
                               refused_backoff_s=cfg.refused_backoff_s,
                               refused_backoff_max_s=cfg.refused_backoff_max_s,
                               join_settle_s=cfg.join_settle_s, join_wait_max_s=cfg.join_wait_max_s),
            operators=self.operators,
        )
        self._corpus: Corpus | None = None  # this peer's data set (`join --data`), the only one it reads
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
        self._swarm_wait: dict | None = None  # while `train start --min-peers` waits: have / want / live
        self._nursery: trio.Nursery | None = None
        self._coord_wake = trio.Event()
        self.export_progress: ExportProgress | None = None  # the export running here (`dtfm-peer export`)
        self._reconfigs: collections.deque[Reconfiguration] = collections.deque(maxlen=MAX_RECONFIGS)
        self._taken_saved = 0  # the version of the operations taken (control/epoch/taken.py) on disk
        self._taken_lock = trio.Lock()
        self._load_applied()

    # ---- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.transport.handle(ControlMsg.ALLOCATION, self._on_allocation)
        self.transport.handle(ControlMsg.START, self._on_start)
        self.transport.handle(ControlMsg.STOP, self._on_stop)
        self.transport.handle(ControlMsg.STEP, self._on_step)
        self.transport.handle(ControlMsg.RUN_STATE, self._on_run_state)
        self.transport.handle(ControlMsg.TRAIN_OP, self._on_train_op)
        self.transport.handle(ControlMsg.LEAVE, self._on_leave)
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
                                     address_of=self._address_of, corpus=self.corpus, on_event=self._feed_epoch_now,
                                     router=self.router, recovery=self.recovery, models=self.models,
                                     disk=self.disk)
            if self._nursery is not None:
                self._stages.attach(self._nursery)
        return self._stages

    async def _host(self) -> StageHost:
        """`stages`, its module (and torch with it) imported in a worker thread the first time:
        the event loop goes on answering peers while it loads (seconds on a busy machine)."""
        if self._stages is None:
            await _import_in_thread("dtfm.control.epoch.stages")
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
        while True:
            with trio.move_on_at(self.coordinator.next_deadline()):
                await self._coord_wake.wait()
            self._feed_coordinator(CoordinatorTick())
            self._coord_wake = trio.Event()

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
            progress = await self.train_progress(run, after=2**62)
        except TrainError as e:
            logger.debug("asked the coordinator about run %s restored here: %s", run.hex()[:8], e)
            return
        if progress.run_id == run:
            self.epoch.restored_run_heard(run, progress.state, progress.completed)

    # ---- feeding the machines and executing their actions ------------------------------------

    def _feed_coordinator(self, event) -> None:
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

    async def _feed_epoch(self, event) -> None:
        """Feed an event whose actions may wait (an allocation: end the epoch, persist, build)."""
        for a in self.epoch.handle(event, trio.current_time()):
            await self._execute_epoch(a)

    def _feed_epoch_now(self, event) -> None:
        """Feed an event whose actions do not wait (start, stop, steps, ticks, members)."""
        for a in self.epoch.handle(event, trio.current_time()):
            self._execute_now(a)

    def _execute_now(self, a) -> None:
        """Execute an action that does not wait (every action of the coordinator)."""
        if isinstance(a, Ask):
            self._start_soon(self._ask_and_feed, a)
        elif isinstance(a, Compute):
            self._start_soon(self._compute_and_feed, a)
        elif isinstance(a, Send):
            if a.peer == self.me:
                self._on_local_step(a.body)
            else:
                self._start_soon(self._send_one_way, a.peer, a.msg, a.body)
        elif isinstance(a, LogLine):
            line = {**a.line, "time": time.time()}
            self._append_jsonl(self._log_path, line)
            self._append_jsonl(self.run_log_path(a.line["run"]), line)
        elif isinstance(a, ResetLog):
            self._log_path.unlink(missing_ok=True)
            self._reconfigs.clear()
        elif isinstance(a, Emit):
            cur = self.epoch.current  # (every line names its run: the one this peer applied last, if any)
            self._append_jsonl(self.data_dir / "events.jsonl",
                               {"time": time.time(), "event": a.event, "peer": self.me.hex(),
                                "run": cur.run_id.hex() if cur is not None else None, **a.fields})
            if a.record.reconfiguration is not None:
                self._reconfigs.append(a.record.reconfiguration)
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
        else:
            raise TypeError(f"cannot execute {a!r} here")

    async def _execute_epoch(self, a) -> None:
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
            await self._feed_epoch(await (await self._host()).build(a, members))
        else:
            self._execute_now(a)

    def _start_soon(self, fn, *args) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _request(self, key: tuple, event) -> Reply:
        """Feed `event` to the epoch machine and wait for its Reply with `key`."""
        pending = self._pending[key] = _Pending(trio.Event())
        try:
            await self._feed_epoch(event)
            await pending.event.wait()
            assert pending.reply is not None
            return pending.reply
        finally:
            self._pending.pop(key, None)

    def _ask_now(self, key: tuple, event) -> dict:
        """Feed an event the epoch machine answers at once; its Reply's value."""
        for a in self.epoch.handle(event, trio.current_time()):
            if isinstance(a, Reply) and a.key == key:
                reply = a
            else:
                self._execute_now(a)
        return dict(reply.value)

    async def _ask_and_feed(self, a: Ask) -> None:
        answers = await self._ask_all(a.peers, a.msg, a.body, a.timeout_s)
        self._feed_coordinator(Answers(a.key, answers))

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

    async def _ask_all(self, peers: Iterable[bytes], msg_type: int, body: dict, timeout_s: float) -> dict:
        answers: dict[bytes, dict] = {}

        async def ask(peer: bytes) -> None:
            try:
                with trio.fail_after(timeout_s):
                    if peer == self.me:
                        answers[peer] = await self._local_answer(msg_type, body)
                        return
                    conn = await self._connection(peer)
                    reply, _ = await conn.request(msg_type, body, timeout_s=timeout_s)
                    answers[peer] = reply if isinstance(reply, dict) else {"reason": "malformed answer"}
            except (trio.TooSlowError, RequestTimeout):
                answers[peer] = {"reason": f"no answer within {timeout_s:g} s"}
            except (ConnectionClosed, RemoteError, ProtocolError, OSError) as e:
                answers[peer] = {"reason": f"unreachable: {e}"}

        async with trio.open_nursery() as nursery:
            for p in sorted(set(peers)):
                nursery.start_soon(ask, p)
        return answers

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
        address = self._address_of(peer)
        if address is None:
            raise ConnectionClosed(f"{short_id(peer)} is not a member with an address")
        return await self.transport.connect(*address, peer_id=peer)

    def _address_of(self, peer: bytes) -> tuple[str, int] | None:
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
        path = self.data_dir / "applied.json"
        try:
            d = json.loads(path.read_text())
            run, term, epoch = bytes.fromhex(d["run"]), int(d["term"]), int(d["epoch"])
        except FileNotFoundError:
            root = self._load_root()
            if root is not None:
                self.election.set_root(root)
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrainError(f"{path} is damaged ({e}): move it away only if this peer never trains again "
                             "in the same swarm") from None
        alloc = None
        body = d.get("allocation")
        if isinstance(body, str):
            try:
                alloc = Allocation.decode(bytes.fromhex(body))
            except (ValueError, ProtocolError) as e:
                raise TrainError(f"{path} holds a damaged allocation ({e})") from None
        previous = None
        prev = d.get("previous")
        if isinstance(prev, dict):
            try:
                previous = PreviousConfiguration(tuple(bytes.fromhex(v) for v in prev["voters"]), int(prev["term"]))
            except (ValueError, KeyError, TypeError) as e:
                raise TrainError(f"{path} holds a damaged previous configuration ({e})") from None
        council = None
        if alloc is not None and alloc.council:
            try:
                council = Council.decode(alloc.council)
            except ProtocolError as e:
                raise TrainError(f"{path} holds an allocation with a damaged council ({e})") from None
        root = self._load_root()
        if root is not None and (council is None or root.root_at_ms > council.root_at_ms):
            council, previous = root, None  # the operator re-rooted the council after that allocation
        self.election.restore(term, epoch, council, previous)
        host = self._stages_of(run) if alloc is not None and alloc.run_id == run else None
        reports = host.kept_reports(run) if host is not None else []
        self.epoch.restore(run, term, epoch, alloc, reports)
        if load_stopped(self.data_dir) == run:
            self.epoch.handle(RunClosed(run, "stopped before this peer restarted"), 0.0)  # (no clock yet)

    def _load_root(self) -> Council | None:
        """The council an operator's operation rooted here (`council.bin`), if any."""
        path = self.data_dir / ROOT_NAME
        try:
            return Council.decode(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ProtocolError) as e:
            raise TrainError(f"{path} is damaged ({e}): move it away; the operator's next start or "
                             "`train council` roots the council again") from None

    def _save_root(self, council: Council) -> None:
        path = self.data_dir / ROOT_NAME
        tmp = path.with_name(f".{ROOT_NAME}.tmp")
        with open(tmp, "wb") as f:
            f.write(council.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _take_root(self, signed: SignedOp) -> Council:
        """The council an operator's fresh start or council operation roots, taken here (a
        start's only by a peer without a council; a council operation's over an older root):
        TrainError when it is no operator's, names no council or is not fresh."""
        try:
            council = root_council(signed, self.operators)
            check_time(signed.open(), time.time(), self.config.operator_skew_s)
        except (OperatorError, ProtocolError) as e:
            raise TrainError(str(e)) from None
        rerooting = signed.open().kind == "council"
        if self.election.council is None or rerooting:
            self.election.set_root(council, rerooting=rerooting)
            if self.election.council is council:
                self._save_root(council)
        return council

    async def _send_root(self, peers: Iterable[bytes], signed: SignedOp) -> int:
        """Hand an operator's root to `peers` (TRAIN_OP `root`); how many took it."""
        peers = [p for p in peers if p != self.me]
        if not peers:
            return 0
        answers = await self._ask_all(peers, ControlMsg.TRAIN_OP, {"op": "root", "signed": signed.to_wire()},
                                      self.config.request_timeout_s)
        return sum(1 for a in answers.values() if isinstance(a.get("ok"), dict))

    def _save_applied(self, alloc: Allocation) -> None:
        path = self.data_dir / "applied.json"
        tmp = path.with_name(".applied.json.tmp")
        with open(tmp, "w") as f:
            prev = self.election.previous
            json.dump({"run": alloc.run_id.hex(), "term": alloc.term, "epoch": alloc.epoch,
                       "allocation": alloc.encode().hex(),
                       "previous": None if prev is None else {"voters": [v.hex() for v in prev.voters],
                                                              "term": prev.term}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        clear_stopped(self.data_dir, alloc.run_id)

    # ---- corpus -------------------------------------------------------------------------------

    async def corpus(self) -> Corpus:
        """This peer's data set, the one it was started with (`join --data`; the standard
        library's source by default), loaded once: no path from the network is ever opened."""
        async with self._corpus_lock:
            if self._corpus is None:
                try:
                    self._corpus = await trio.to_thread.run_sync(self._load_corpus)
                except ValueError as e:
                    raise TrainError(str(e)) from None
            return self._corpus

    def _load_corpus(self) -> Corpus:
        if self.config.tokenizer_path is None:  # (this module's load_corpus: the one the shell tests watch)
            return load_corpus(self.config.data_path)
        return load_peer_corpus(self.config.data_path, self.config.tokenizer_path)

    def _export_tokenizer(self, spec: GPTSpec) -> Path | None:
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

    async def _on_allocation(self, conn, msg_type, body, payload) -> dict:
        return await self._accept_signed(body, sender=conn.short_id)

    async def _accept_signed(self, body, sender: str = "itself") -> dict:
        try:
            alloc = SignedAllocation.from_wire(body).open()
            cert = Certificate.from_wire(body["cert"]) if "cert" in body else None
        except ProtocolError as e:
            logger.warning("refused an allocation from %s: %s", sender, e)
            return {"accepted": False, "code": "bad-allocation", "reason": str(e)}
        return await self.accept(alloc, cert)

    def _accept_context(self, alloc: Allocation, corpus: Corpus | None = None) -> AcceptContext:
        corpus = corpus or self._corpus
        assert corpus is not None
        live = frozenset(self.gossip.live_peers()) | {self.me}
        known = {**PRESETS, **{name: m.spec for name, m in (self._models or {}).items()}}
        return AcceptContext(me=self.me, live=live, known_presets=known, data_hash=corpus.fingerprint,
                             data_name=corpus.name, known=frozenset(m.peer_id for m in self.gossip.members()))

    async def accept(self, alloc: Allocation, certificate: Certificate | None = None) -> dict:
        """Check, get the stage, connect the neighbours; the answer goes to the coordinator."""
        corpus = await self.corpus()
        await self.models()
        key = self._key("allocation")
        reply = await self._request(key, AllocationOffered(key, alloc, self._accept_context(alloc, corpus),
                                                           certificate=certificate))
        answer = dict(reply.value)
        if not answer.get("accepted"):
            logger.warning("refused allocation term %d epoch %d from %s: %s", alloc.term, alloc.epoch,
                           short_id(alloc.issuer), answer.get("reason"))
        return answer

    async def _on_start(self, conn, msg_type, body, payload) -> dict:
        return await self._start_asked(conn.peer_id, body)

    async def _start_asked(self, sender: bytes, body) -> dict:
        if not isinstance(body, dict):
            raise ProtocolError("START body must be a map")
        key = self._key("start")
        return self._ask_now(key, StartAsked(key, sender, body.get("run"), body.get("epoch")))

    async def _on_stop(self, conn, msg_type, body, payload) -> dict:
        return await self._stop_asked(conn.peer_id, body)

    async def _stop_asked(self, sender: bytes, body) -> dict:
        if not isinstance(body, dict):
            raise ProtocolError("STOP body must be a map")
        cur = self.epoch.current
        if cur is not None and body.get("run") == cur.run_id:
            at = body.get("at_step")
            if not isinstance(at, int) or isinstance(at, bool) or at < 0:
                raise ProtocolError("STOP at_step must be a non-negative integer")
        else:
            at = 0
        op = SignedOp.from_wire(body["op"]) if body.get("op") is not None else None
        cert = coordinator_certificate(sender, body)
        if cert is not None and sender != self.election.coordinator:
            self.election.learn(cert)
        epoch = body.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
            raise ProtocolError("STOP epoch must be a non-negative integer")
        key = self._key("stop")
        ev = StopAsked(key, sender, body.get("run"), at, final=body.get("final") is True,
                       abort=body.get("abort") is True, op=op, epoch=epoch)
        answer = self._ask_now(key, ev)
        if ev.final and cur is not None and self.epoch.over_without_finishing(cur.run_id):
            await trio.to_thread.run_sync(save_stopped, self.data_dir, cur.run_id)  # (a restart keeps it)
        await self._save_taken()  # (and the stop taken: a copy of it is refused after a restart too)
        return answer

    async def _on_step(self, conn, msg_type, body, payload) -> None:
        if not isinstance(body, dict):
            raise ProtocolError("STEP body must be a map")
        self._step_message(conn.peer_id, body)

    def _on_local_step(self, body: dict) -> None:
        self._step_message(self.me, body)

    def _step_message(self, sender: bytes, body: dict) -> None:
        if "failed" in body:
            reason = body.get("failed")
            if not isinstance(reason, str):
                raise ProtocolError("STEP failed must be a string")
            self._feed_coordinator(StepFailed(sender, body.get("run"), body.get("epoch"), reason))
            return
        self._feed_coordinator(StepReported(sender, body.get("run"), StepReport.from_wire(body)))

    async def _on_run_state(self, conn, msg_type, body, payload) -> dict:
        return await self._run_state_asked(conn.peer_id, body)

    async def _run_state_asked(self, sender: bytes, body) -> dict:
        d = get_dict(body, "RUN_STATE")
        op = get_str(d, "op", 16)
        if op == "query":
            refused = self.epoch.check_run_state_reader(sender)
            return {"error": refused.text} if refused is not None else self.run_state().to_wire()
        if op == "progress":
            refused = self.epoch.check_run_state_reader(sender)
            if refused is not None:
                return {"error": f"{refused.text}: ask a daemon of the run"}
            run = get_bytes(d, "run", 16, 16) if d.get("run") is not None else None
            return self._progress_here(run, get_int(d, "after", -1, 2**62))
        if op == "reach":
            if sender != self.election.coordinator and sender != self.me:
                return {"error": "only the coordinator asks a peer to reach others"}
            return await self._reach(ReachRequest.from_wire(d))
        if op == "export":
            await _import_in_thread("dtfm.control.export")
            from .export import answer_export  # (torch: a holder encodes weights)

            cur = self.epoch.current
            return await answer_export(sender, d, operators=self.operators, now_s=time.time(),
                                       skew_s=self.config.operator_skew_s, stages=await self._host(), current=cur,
                                       state=self.run_state(), refusals=self.recovery.refusals)
        if op == "keep":  # the run waits: what this peer holds of it in memory goes to its data dir
            run_id = get_bytes(d, "run", 16, 16)
            refused = self.epoch.check_offer_asker(sender)
            if refused is not None:
                return {"error": refused.text}
            if self._stages is None:  # (no stage host: this peer holds nothing in memory)
                return {"kept": []}
            return await self._stages.keep(run_id)
        if op != "offer":
            raise ProtocolError(f"RUN_STATE: unknown op {op!r}")
        run_id = get_bytes(d, "run", 16, 16)
        step = get_int(d, "step", 0, 2**63 - 1)
        layers = d.get("layers")
        if not isinstance(layers, list) or len(layers) != 2 or not all(type(x) is int for x in layers):
            raise ProtocolError("RUN_STATE: layers must be [first, end]")
        fetchers = parse_fetchers(d)
        cert = coordinator_certificate(sender, d)
        if cert is not None and sender != self.election.coordinator:
            self.election.learn(cert)
        refused = self.epoch.check_offer_asker(sender)
        if refused is not None:
            return {"error": refused.text}
        return await (await self._host()).offer(run_id, step, (layers[0], layers[1]), fetchers=fetchers)

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

    def _on_election_event(self, event) -> None:
        if isinstance(event, BecameCoordinator):
            self._feed_coordinator(Elected(event.term))
        elif isinstance(event, SteppedDown):
            self._feed_coordinator(SteppedDownEvent(event.term, event.reason))

    # ---- operator operations ------------------------------------------------------------------

    async def _operator(self, event_type, *args) -> Any:
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

    async def start_training(self, signed: SignedOp, *, forwarded: bool = False) -> dict:
        """An operator's signed start: wait for its `min_peers` live, measured peers; stand for
        coordinator if there is none; the coordinator schedules on the gossiped view, hands the
        allocation out and starts every peer. A start that no operator of the swarm signed is
        refused first, before any wait or work."""
        try:
            req = check_op(signed, "start", self.operators).request()
        except (OperatorError, ValueError) as e:
            raise TrainError(str(e)) from None
        if not forwarded:  # (a forwarding peer has waited)
            await self._await_swarm(req.min_peers, req.wait_s)
        coordinator = self.me if forwarded else await self._become_coordinator(signed)
        if coordinator != self.me:
            return await self._forward(coordinator, "start", signed)
        refusal = self.coordinator.start_refusal()  # (cheap, before this peer's data set is loaded)
        if refusal is not None:
            raise TrainError(refusal)
        corpus = await self.corpus()
        models = await self.models()
        refusal = model_refusal(req.preset, req.init_from, req.init_name, models)
        if refusal is not None:
            raise TrainError(refusal)
        model = models[req.preset].spec if req.init_from is not None else None
        req.check_data(corpus, model)
        alloc = await self._operator(StartRun, signed, corpus.fingerprint, corpus.name, model)
        return {"run_id": alloc.run_id.hex(), "epoch": alloc.epoch, "term": alloc.term, "stages": alloc.stages,
                "dp": alloc.dp, "coordinator": self.me.hex(),
                "pipelines": [[p.hex() for p in pipe] for pipe in alloc.pipelines],
                "layer_ranges": [list(r) for r in alloc.layer_ranges], "spares": [p.hex() for p in alloc.spares],
                "predicted_iteration_s": alloc.predicted_iteration_s, "placement": req.placement,
                "steps": req.steps, "data": corpus.name, "log": str(self.run_log_path(alloc.run_id.hex())),
                "compression": alloc.compression.to_spec(), "model": alloc.preset,
                "train": alloc.train.to_dict(), "init_from": req.init_from,
                **({} if alloc.compress_links is None else {  # a per-link run: which links and groups compress
                    "compress_links": {"pp": [list(r) for r in alloc.compress_links.pp],
                                       "dp": list(alloc.compress_links.dp),
                                       "text": alloc.compress_links.describe(alloc.compression)}})}

    async def _await_swarm(self, min_peers: int, wait_s: float) -> None:
        """Return once `min_peers` peers (this one included) are live and their links measured,
        so the first placement is the swarm the operator expects; TrainError after `wait_s`.
        The count is in `status()` while it waits."""
        deadline = trio.current_time() + wait_s
        said = -1
        swarm = GossipSwarm(self.gossip, self.me)
        try:
            while True:
                live = set(self.gossip.live_peers()) | {self.me}
                view, _ = swarm.measured_view(live)
                have = len(view.peers)
                self._swarm_wait = {"have": have, "want": min_peers, "live": len(live)}
                if have >= min_peers:
                    return
                if have != said:
                    logger.info("train start waits for %d peers: %d live, %d of them measured",
                                min_peers, len(live), have)
                    said = have
                left = deadline - trio.current_time()
                if left <= 0:
                    raise TrainError(f"only {have} of the {min_peers} peers asked for (--min-peers) are "
                                     f"live and measured after {wait_s:g} s ({len(live)} live): "
                                     "are the others started, with this swarm's bootstrap address?")
                await trio.sleep(min(self.config.swarm_poll_s, left))
        finally:
            self._swarm_wait = None

    async def _become_coordinator(self, start: SignedOp) -> bytes:
        """The coordinator: the one this peer follows, else one found by asking the live peers
        (election/discovery.py) and verified against this peer's council, else one elected by
        the council (this peer stands where it is a voter). A swarm without a council takes the
        one the operator's `start` names: this peer roots it and hands the root to its voters.
        Raises TrainError saying why after elect_timeout_s (who holds a lease, how many voters
        answer)."""
        if self.election.is_coordinator:
            return self.me
        if self.election.coordinator is not None:
            return self.election.coordinator
        deadline = trio.current_time() + self.config.elect_timeout_s
        ask_s = min(self.config.request_timeout_s, self.config.elect_timeout_s)
        found = await self.election.find_coordinator(self.gossip.live_peers(), ask_s)
        root: Council | None = None
        # (Peers that say they have a council are only a hint: the claim is unchecked, so it
        # never keeps the operator's start from rooting one here.)
        hint = "" if self.election.council is not None or not found.configured else (
            f"; {found.configured} live peer(s) say they have a council: if the swarm has one, start the run on "
            "a peer of it (`dtfm-peer status` shows the voters), or re-root it with `dtfm-peer train council`")
        if found.coordinator is None and self.election.council is None:
            try:
                root = self._take_root(start)
            except TrainError as e:
                raise TrainError(f"this peer has no council yet, and {e}{hint}") from None
        while found.coordinator is None:
            if root is not None:
                await self._send_root(root.voters, start)
            self.election.campaign()  # stands if it is a voter of its council
            left = deadline - trio.current_time()
            if left <= 0:
                raise TrainError(f"no coordinator was elected within {self.config.elect_timeout_s:g} s: "
                                 f"{found.why}{hint}")
            c = await self.election.wait_for_coordinator(min(left, FIND_AGAIN_ELECTIONS
                                                             * self.config.election.election_timeout_max_s))
            if c is not None:
                return c
            found = await self.election.find_coordinator(self.gossip.live_peers(), ask_s)
        return found.coordinator

    async def stop_training(self, signed: SignedOp) -> dict:
        """An operator's signed stop, on any peer: the coordinator tells every peer of the run
        to end before the same step, and the run is over (nobody reconfigures it)."""
        cur = self.epoch.current
        if cur is None or self._run_over():
            raise TrainError("no training run is in progress on this peer")
        try:
            check_op(signed, "stop", self.operators, run_id=cur.run_id)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("stop", signed, StopRun)

    def _run_over(self) -> bool:
        return run_over(self.epoch.status(), self.coordinator.status())

    async def reschedule(self, signed: SignedOp) -> dict:
        """An operator's signed reschedule, on any peer: a new allocation now, on the coordinator."""
        try:
            check_op(signed, "reschedule", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("reschedule", signed, Reschedule)

    async def resume_training(self, signed: SignedOp) -> dict:
        """An operator's signed resume of a stopped run, on any peer: the coordinator brings it
        back as a new epoch from the newest step every stage is held at (docs/control.md)."""
        try:
            check_op(signed, "resume", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        return await self._on_coordinator("resume", signed, ResumeRun)

    async def _known_coordinator(self) -> bytes:
        """The coordinator this peer recognises, else the one the live peers name
        (election/discovery.py); TrainError with why none is found."""
        c = self.election.coordinator
        if c is None:
            found = await self.election.find_coordinator(self.gossip.live_peers(), self.config.request_timeout_s)
            if found.coordinator is None:
                raise TrainError(f"no coordinator is known: {found.why}")
            c = found.coordinator
        return c

    async def _on_coordinator(self, op: str, signed: SignedOp, event_type, *, forwarded: bool = False) -> dict:
        """Feed an operator's stop or reschedule to the coordinator machine here, or forward it to
        the coordinator this peer knows."""
        if not self.election.is_coordinator:
            if forwarded:
                raise TrainError("this peer is no longer the coordinator")
            return await self._forward(await self._known_coordinator(), op, signed)
        return await self._operator(event_type, signed)

    async def _on_train_op(self, conn, msg_type, body, payload) -> dict:
        """An operator's start, stop, reschedule or resume forwarded by a peer: the signed operation and
        nothing else (no path, no unsigned argument); refused before any work unless an operator
        of the swarm signed it (the machine checks the rest)."""
        d = get_dict(body, "TRAIN_OP")
        op = get_str(d, "op", 16)
        if op not in ("start", "stop", "reschedule", "resume", "root"):
            raise ProtocolError(f"TRAIN_OP: unknown op {op!r}")
        if "signed" not in d:
            return {"error": f"a {op} must carry the operator's signed operation (run the same dtfm version)"}
        signed = SignedOp.from_wire(d["signed"])
        if op == "root":  # an operator's start or council operation naming a council: its voters' root
            try:
                council = self._take_root(signed)
            except TrainError as e:
                logger.warning("refused a council root from %s: %s", conn.short_id, e)
                return {"error": str(e)}
            return {"ok": {"voters": len(council.voters), "taken": self.election.council is council}}
        try:
            check_op(signed, op, self.operators)
        except OperatorError as e:
            logger.warning("refused a forwarded train %s from %s: %s", op, conn.short_id, e)
            return {"error": str(e)}
        if not self.election.is_coordinator:
            c = self.election.coordinator
            return {"error": f"this peer is not the coordinator ({short_id(c) if c else 'none known'})"}
        try:
            if op == "start":
                return {"ok": await self.start_training(signed, forwarded=True)}
            if op == "stop":
                return {"ok": await self._on_coordinator(op, signed, StopRun, forwarded=True)}
            if op == "resume":
                return {"ok": await self._on_coordinator(op, signed, ResumeRun, forwarded=True)}
            return {"ok": await self._on_coordinator(op, signed, Reschedule, forwarded=True)}
        except TrainError as e:
            return {"error": str(e)}

    async def _forward(self, coordinator: bytes, op: str, signed: SignedOp) -> dict:
        answers = await self._ask_all([coordinator], ControlMsg.TRAIN_OP, {"op": op, "signed": signed.to_wire()},
                                      self.config.forward_timeout_s)
        a = answers[coordinator]
        if "ok" in a and isinstance(a["ok"], dict):
            return a["ok"]
        raise TrainError(f"the coordinator {short_id(coordinator)}: {a.get('error') or a.get('reason')}")

    async def hand_off(self) -> str | None:
        """Before a planned leave: tell the coordinator, which reconfigures the run without
        this peer at a step boundary (its stages offered from memory) and answers once the new
        epoch runs; None when done or there was nothing to hand off, else why not (bounded by
        leave_hand_off_s)."""
        target, why = self.epoch.hand_off_to()
        if target is None:
            return why or None
        timeout_s = self.config.leave_hand_off_s
        if target == self.me:
            with trio.move_on_after(timeout_s):
                a = await self._leave_asked(self.me)
                return a.get("error")
            return f"the hand-off took longer than {timeout_s:g} s"
        logger.info("asking the coordinator %s to hand this peer's part off", short_id(target))
        a = (await self._ask_all([target], ControlMsg.LEAVE, {}, timeout_s))[target]
        return None if isinstance(a.get("ok"), dict) else f"the coordinator {short_id(target)}: " + str(
            a.get("error") or a.get("reason"))

    async def _on_leave(self, conn, msg_type, body, payload) -> dict:
        """A peer's own planned leave (the sender is the authenticated peer of the connection:
        no peer announces another's leave)."""
        get_dict(body, "LEAVE")
        with trio.move_on_after(self.config.leave_hand_off_s):
            return await self._leave_asked(conn.peer_id)
        return {"error": f"the hand-off took longer than {self.config.leave_hand_off_s:g} s"}

    async def _leave_asked(self, peer: bytes) -> dict:
        try:
            return {"ok": await self._operator(PeerLeaving, peer)}
        except TrainError as e:
            return {"error": str(e)}

    async def export(self, signed: SignedOp, out_dir: Path, *, overwrite: bool = False) -> dict:
        """An operator's signed export naming this peer: gather the run's stages from their
        holders and write one Hugging Face folder at `out_dir` (control/export.py)."""
        try:
            op = check_op(signed, "export", self.operators)
            if op.exporter() != self.me:
                raise OperatorError(f"the export names peer {short_id(op.exporter())}, not this one")
        except (OperatorError, ValueError) as e:
            raise TrainError(str(e)) from None
        if self.export_progress is not None and self.export_progress.phase not in ("done", "failed"):
            raise TrainError(f"an export of run {self.export_progress.run} is running here: wait for it")
        await _import_in_thread("dtfm.control.export")
        from .export import ExportError, ExportProgress, export_run  # (torch: the stages are tensors)

        progress = self.export_progress = ExportProgress(op.run_id.hex()[:8])
        try:
            return await export_run(
                signed, op.run_id, out_dir, me=self.me, peers=set(self.gossip.live_peers()) | {self.me},
                ask=lambda peers, body, t: self._ask_all(peers, ControlMsg.RUN_STATE, body, t), stages=await self._host(),
                transport=self.transport, address_of=self._address_of, timeout_s=self.config.accept_timeout_s,
                progress=progress, overwrite=overwrite, tokenizer_for=self._export_tokenizer)
        except ExportError as e:
            progress.phase = "failed"
            raise TrainError(str(e)) from None
        finally:
            if progress.phase != "done":
                progress.phase = "failed"

    async def operator_info(self, *, wait_peers: int = 0, wait_s: float = 0.0) -> dict:
        """What an operator's CLI needs to sign: the swarm's operators, the run in progress here,
        the data set this peer trains on, and the council (`council`: this peer's, else the one
        it proposes for a first start, of live measured peers spread over the regions, after
        waiting up to `wait_s` for `wait_peers` of them; `council_rooted`: which)."""
        corpus = await self.corpus()
        cur = self.epoch.current
        live = cur is not None and not self._run_over()
        rooted = self.election.council is not None
        if not rooted and wait_peers > 1:
            await self._await_swarm(wait_peers, wait_s)
        council = self.election.voters if rooted else self.propose_council()
        return {"operators": sorted(p.hex() for p in self.operators), "peer_id": self.me.hex(),
                "run_id": cur.run_id.hex() if cur is not None and live else None,
                "last_run_id": cur.run_id.hex() if cur is not None else None,
                "data_hash": corpus.fingerprint, "data_name": corpus.name,
                "council": council_arg(council), "council_rooted": rooted,
                "council_size": self.config.council_size}

    def propose_council(self) -> tuple[bytes, ...]:
        """A first council: this peer and live measured peers spread over the regions, up to
        `council_size` (`first_council`)."""
        swarm = GossipSwarm(self.gossip, self.me)
        view, _ = swarm.measured_view(set(self.gossip.live_peers()) | {self.me})
        return first_council(self.me, set(view.peers), swarm.regions(), self.config.council_size)

    async def reroot(self, signed: SignedOp) -> dict:
        """An operator's signed council operation (`dtfm-peer train council`): its council
        replaces the one this peer holds (an older root's), and every live peer is handed it;
        the council then elects a coordinator. For a council that lost its quorum."""
        try:
            check_op(signed, "council", self.operators)
        except OperatorError as e:
            raise TrainError(str(e)) from None
        council = self._take_root(signed)
        if self.election.council is not council:
            raise TrainError("this peer's council was rooted by a later operation of the operator: sign again")
        told = await self._send_root(self.gossip.live_peers(), signed)
        self.election.campaign()  # stands if it is a voter of the new council
        return {"voters": [v.hex() for v in council.voters], "told": told}

    # ---- a run's progress (`dtfm-peer train status`) ---------------------------------------------

    def _progress_here(self, run: bytes | None, after: int) -> dict:
        """This coordinator's account of its run (control/progress.py), or why it has none."""
        log = self.coordinator.steplog
        if not self.election.is_coordinator or log is None:
            c = self.election.coordinator
            return {"error": f"{short_id(self.me)} is not the coordinator of a run"
                             + (f" ({short_id(c)} is the coordinator)" if c is not None and c != self.me else "")}
        alloc = log.alloc
        if run is not None and run != alloc.run_id:
            return {"error": f"the coordinator's run is {alloc.run_id.hex()}, not {run.hex()}: an earlier run's "
                             f"steps are in train-{run.hex()}.jsonl in the data dir of the coordinator that logged them"}
        st = self.coordinator.status()
        state = run_word(self.epoch.status(), st)
        return run_progress(run_id=alloc.run_id, coordinator=self.me, state=state, term=alloc.term,
                            epoch=alloc.epoch, shape=f"{alloc.stages}x{alloc.dp}", completed=log.completed + 1,
                            steps=alloc.end_step, recent=log.recent, reconfigurations=self._reconfigs,
                            after_step=after, reason=st.stalled_reason or st.reason,
                            stop_step=self.coordinator.operator_stop_step(alloc.run_id) if state == "stopped"
                            else None).to_wire()

    async def train_progress(self, run: bytes | None, after: int) -> RunProgress:
        """The run's progress from its coordinator, this peer or the one it finds (within
        request_timeout_s); TrainError with the reason when there is none to tell."""
        body = {"op": "progress", "run": run, "after": after}
        if self.election.is_coordinator:
            answer = self._progress_here(run, after)
        else:
            c = await self._known_coordinator()
            answer = (await self._ask_all([c], ControlMsg.RUN_STATE, body, self.config.request_timeout_s))[c]
            if "error" not in answer and "run" not in answer:  # no answer (unreachable, timed out)
                answer = {"error": f"the coordinator {short_id(c)}: {answer['reason']}"}
        if "error" in answer:
            raise TrainError(str(answer["error"])[:512])
        try:
            return RunProgress.from_wire(answer)
        except ProtocolError as e:
            raise TrainError(f"the coordinator's answer is malformed: {e}") from None

    # ---- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        from .status import plane_status
        refusals = merge_counts([self.coordinator.refusals.counts(), self.epoch.refusals.counts(),
                                 self.recovery.refusals.counts()])
        c = self.coordinator.status()
        log = self._log_path if c.run_id is None else self.run_log_path(c.run_id.hex())  # the run's step log
        return plane_status(self.me, self.election.status(), self.election.is_coordinator, self.epoch.status(),
                            c, log, self._swarm_wait, refusals,
                            self.disk.status(), self._stages.memory() if self._stages is not None else None).to_wire()


async def _import_in_thread(module: str) -> None:
    """Import `module`, which imports torch, in a worker thread (seconds of work that would
    stall the event loop), torch's native libraries loaded first without the interpreter lock
    (train/native.py); a later import of it is a lookup."""
    if module not in sys.modules:
        await trio.to_thread.run_sync(load_torch_libraries)
        await trio.to_thread.run_sync(importlib.import_module, module)
