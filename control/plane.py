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

`ControlPlane` holds the state and wires the messages, gossip and election events to the roles
it mixes in, each in its own module:

    control/peer_role.py    PeerRole: accepting an allocation, START, STOP, running the stage
    control/holdings.py     HolderRole: the stages this peer holds, its run state, offers
    control/coordinate.py   CoordinatorRole: train start and stop, the hand-out, step reports
    control/reconfigure.py  ReconfigureRole: the coordinator's loop and reconfiguration
    control/steplog.py      the coordinator's step log (`train.jsonl`)
    control/coordinator/request.py  TrainRequest, TrainError
"""

from __future__ import annotations

import collections
import json
import logging
import os
from pathlib import Path
from typing import Any

import trio

from dtfm.gossip import GossipService, Member
from dtfm.net import ConnectionClosed, Identity, ProtocolError, short_id
from dtfm.train import Corpus, StageState, load_corpus

from .allocation import Allocation
from .config import PlaneConfig
from .coordinate import CoordinatorRole
from .coordinator.request import TrainError
from .coordinator.runstate import MAX_REPORTS
from .election import BecameCoordinator, ElectionService, FileElectionStore, SteppedDown
from .epoch.recovery import RecoveryServer
from .epoch.runner import StepReport
from .dataplane import TensorRouter
from .holdings import HolderRole
from .messages import ControlMsg
from .peer_role import PeerRole, _Run
from .reconfigure import ReconfigureRole
from .steplog import _Issued

__all__ = ["ControlPlane"]

logger = logging.getLogger(__name__)

MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim


class ControlPlane(PeerRole, HolderRole, CoordinatorRole, ReconfigureRole):
    """One daemon's control plane: a peer of every run it is placed in, and the coordinator
    while the election makes it one (see the module docstring)."""

    def __init__(self, transport, identity: Identity, gossip: GossipService, data_dir: Path,
                 config: PlaneConfig | None = None):
        self.transport, self.identity, self.gossip = transport, identity, gossip
        self.me = identity.peer_id
        self.data_dir = Path(data_dir)
        self.config = config or PlaneConfig()
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

    # ---- membership and election events -------------------------------------------------------

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
        coordinator. A grace (`coordinator_lost_after_s`, three election timeouts) keeps a slow
        heartbeat from stopping a healthy run."""
        grace_s = self.config.coordinator_lost_after_s
        lost_since = None
        while True:
            await trio.sleep(self.config.coordinator_check_s)
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

