"""The stage objects of this peer's epochs, the IO half of the epoch machine (see
docs/control.md, "The shell").

`StageHost` owns what a stage is made of in the daemon: its tensors (`StageState`), its comm
(`TransportComm`), its runner thread (`StageRunner`), the tasks that serve them, the stages it
encoded for the recovery server (offers), and the checkpoints on disk (`disk`, control/epoch/disk.py:
pruned to the newest `checkpoints_kept` per stage of each run; a stage kept on disk while the
run waits, `keep`). It builds a stage the way
the epoch machine chose (`BuildStage`: fresh, its own copy, or fetched from holders and
re-laid out), runs and stops it, and reports what happens to it as epoch-machine events
(`StepDone`, `RunnerEnded`, `EpochDone`) through `on_event`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path

import trio

from dtfm.net import ConnectionClosed, PeerTransport, ProtocolError, RequestTimeout, short_id
from dtfm.train import (
    CheckpointError,
    CommError,
    Corpus,
    HFError,
    MessageRules,
    StageMemory,
    StageState,
    TrainConfig,
    checkpoint_at,
    checkpoint_notes,
    load_checkpoint,
    hf_stage_state,
    saved_checkpoints,
    stage_from_tensors,
    stage_tensors,
)

from ..allocation import Allocation, Holding
from ..config import PlaneConfig
from ..dataplane import TensorRouter, TransportComm
from ..models import HeldModel, start_model
from ..refusals import Refused
from .access import fetch_refusal
from .disk import CheckpointDisk
from .machine import (BuildFailed, BuildStage, EpochDone, EpochEvent, EpochMachine, EpochPhase, RunnerEnded,
                      StageBuilt, StepDone)
from .recovery import Part, RateOf, RecoveryError, RecoveryServer, fetch_stage
from .relayout import assemble_stage
from .report import REPORTS_NOTE, RunEnd, StepReport
from .runner import StageRunner
from .source import Fetch, Fresh, FromFolder, OwnCopy, replicas_differ, stage_source
from .runstate import MAX_CHECKPOINTS, MAX_REPORTS

__all__ = ["MAX_STAGE_BYTES", "StageHost"]

logger = logging.getLogger(__name__)

MAX_STAGE_BYTES = 1 << 40  # a stage fetched from holders: bounded by what a manifest may claim


class StageError(Exception):
    """The worker of an epoch did not let go of its stage in time."""


class _Stage:
    """The IO objects of this peer's stage in one epoch: the state, its comm, its runner."""

    def __init__(self, alloc: Allocation, state: StageState, comm: TransportComm):
        self.alloc, self.state, self.comm = alloc, state, comm
        self.runner: StageRunner | None = None
        self.started = trio.Event()
        self.done = trio.Event()  # its tasks and worker thread are over
        self.cancel = trio.CancelScope()


class StageHost:
    """This peer's stages (see the module docstring). `epoch` is read, never changed;
    `on_event` feeds an epoch-machine event whose actions do not wait."""

    def __init__(self, me: bytes, transport: PeerTransport, epoch: EpochMachine, data_dir: Path,
                 config: PlaneConfig, *, address_of: Callable[[bytes], tuple[str, int] | None],
                 rate_of: RateOf | None = None, corpus: Callable[[], Awaitable[Corpus]], on_event: Callable[[EpochEvent], None],
                 router: TensorRouter, recovery: RecoveryServer,
                 models: Callable[[], Awaitable[Mapping[str, HeldModel]]] | None = None,
                 disk: CheckpointDisk | None = None):
        """`router` and `recovery`: the daemon's TENSOR handler and recovery server, made before
        this host (they answer peers while this peer holds no stage); `recovery` asks `may_fetch`.
        `address_of` and `rate_of`: a holder's address and the rate of its link to this peer (the
        gossiped view's), which a fetch's chunk deadlines follow."""
        self.me, self.transport, self.epoch = me, transport, epoch
        self.models = models
        self.data_dir, self.config = data_dir, config
        self.address_of, self.rate_of, self.corpus, self.on_event = address_of, rate_of, corpus, on_event
        self.router, self.recovery = router, recovery
        self._stages: dict[int, _Stage] = {}  # epoch -> stage objects (the current and previous epoch)
        self._offered: dict[tuple, tuple[str, StageState]] = {}  # (run, step, layers) -> digest, state
        self._fetchers: dict[tuple, frozenset[bytes]] = {}  # (run, step, layers) -> peers the coordinator named
        self._offer_lock = trio.Lock()  # one offer encoded at a time
        self._nursery: trio.Nursery | None = None
        self.disk = disk or CheckpointDisk(data_dir / "checkpoints", config.checkpoints_kept, config.runs_kept)
        self._keeping = trio.Lock()  # a stage kept on disk is not built on meanwhile

    def attach(self, nursery: trio.Nursery) -> None:
        """The nursery the stages' tasks run in (the plane's)."""
        self._nursery = nursery

    # ---- checkpoints --------------------------------------------------------------------------

    def checkpoint_root(self, run_id: bytes) -> Path:
        """Where this peer saves its checkpoints of run `run_id`: one folder per run, so a run
        never takes another run's checkpoint of the same layers and step for its own."""
        return self.disk.run_root(run_id)

    async def keep(self, run_id: bytes) -> dict:
        """Write what this peer holds of run `run_id` in memory, once its worker stopped (its
        stage, its one-step-back snapshot), to its data dir: each step not on disk yet, step 0
        aside (every peer rebuilds it). The answer to RUN_STATE `keep`: the (first layer, end
        layer, step) written, or why not."""
        kept: list[list[int]] = []
        run = self.epoch.run
        if run is not None and (run.active or run.phase is EpochPhase.BUILDING):
            return {"kept": kept}  # (an epoch is under way: the run does not wait, and its stage may be the old one's)
        async with self._keeping:
            for rec in (self.epoch.run, self.epoch.prev):
                if rec is None or not rec.built or rec.alloc.run_id != run_id or rec.active:
                    continue
                layers = rec.alloc.layer_ranges[rec.alloc.position(self.me)[1]]
                for step in sorted(x for x in (rec.at, rec.prev) if x):
                    if checkpoint_at(self.checkpoint_root(run_id), layers, step) is not None:
                        continue
                    done = await trio.to_thread.run_sync(self._keep_one, run_id, layers, step)
                    if isinstance(done, str):
                        return {"error": done, "kept": kept} if kept else {"error": done}
                    if done:
                        kept.append([layers[0], layers[1], step])
        if kept:
            logger.info("kept on disk while the run waits: %s", ", ".join(
                f"layers {a}-{b - 1} at step {step}" for a, b, step in kept))
        return {"kept": kept}

    def _keep_one(self, run_id: bytes, layers: tuple[int, int], step: int) -> bool | str:
        """Save this peer's stage of `layers` at `step` if it holds it; the refusal's text when
        the disk refused. Blocking."""
        state = self._state_at(run_id, layers, step)
        if state is None:
            return False
        notes = {REPORTS_NOTE: [r.to_wire() for r in self.epoch.reports if r.step < step]}
        if self.disk.save(run_id, state, notes) is None:
            return self.disk.status().refusal or "the disk refused the checkpoint"
        return True

    def checkpoints(self, run_id: bytes | None) -> tuple[tuple[int, int, int], ...]:
        """(first layer, end layer, step) of this peer's newest checkpoints of run `run_id`."""
        if run_id is None:
            return ()
        steps: dict[tuple[int, int], list[int]] = {}
        for a, b, step in saved_checkpoints(self.checkpoint_root(run_id)):
            steps.setdefault((a, b), []).append(step)
        out = [(a, b, step) for (a, b), saved in steps.items() for step in saved[-self.disk.kept:]]
        return tuple(out[-MAX_CHECKPOINTS:])

    def checkpoint_spec(self, run_id: bytes, held: tuple[int, int, int]) -> dict | None:
        """The model spec (`GPTSpec.to_dict`) this peer's checkpoint `held` (first layer, end
        layer, step) of run `run_id` was made with; None when it cannot be read. Blocking."""
        path = checkpoint_at(self.checkpoint_root(run_id), (held[0], held[1]), held[2])
        try:
            meta = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None
        spec = meta.get("spec") if isinstance(meta, dict) else None
        return spec if isinstance(spec, dict) else None

    def kept_reports(self, run_id: bytes) -> list[StepReport]:
        """The step reports saved with this peer's newest checkpoint of each stage of run
        `run_id` (see runner.py), each (epoch, step) once; a damaged note is skipped with a warning."""
        newest: dict[tuple[int, int], int] = {}
        for a, b, step in saved_checkpoints(self.checkpoint_root(run_id)):
            newest[(a, b)] = max(step, newest.get((a, b), step))
        found: dict[tuple[int, int], StepReport] = {}
        for layers, step in newest.items():
            path = checkpoint_at(self.checkpoint_root(run_id), layers, step)
            if path is None:
                continue
            try:
                held = checkpoint_notes(path).get(REPORTS_NOTE, [])
                if not isinstance(held, list):
                    raise ProtocolError("step reports: not a list")
                for wire in held[-MAX_REPORTS:]:
                    rep = StepReport.from_wire(wire)
                    found.setdefault((rep.epoch, rep.step), rep)
            except (CheckpointError, ProtocolError) as e:
                logger.warning("the step reports kept with %s are unusable (%s): left out", path, e)
        return sorted(found.values(), key=lambda r: (r.step, r.epoch))[-MAX_REPORTS:]

    # ---- offers -------------------------------------------------------------------------------

    def state_at(self, run_id: bytes, layers: tuple[int, int], step: int) -> StageState | None:
        """This peer's stage of `layers` of run `run_id` at `step` (in memory once its worker
        stopped, or a checkpoint), None: not held; CheckpointError when the checkpoint is
        unreadable. Blocking: call it in a thread."""
        return self._state_at(run_id, layers, step)

    def _state_at(self, run_id: bytes, layers: tuple[int, int], step: int) -> StageState | None:
        """This peer's stage of `layers` at `step`: its stage, its one-step-back snapshot, or a
        checkpoint. Only once its worker stopped."""
        held = self.epoch.held_at(run_id, layers, step)
        if held is not None:
            where, epoch = held
            stage = self._stages.get(epoch)
            if stage is not None:
                if where == "stage" and stage.state.step == step:
                    return stage.state
                if where == "snapshot" and stage.runner is not None and stage.runner.snapshot_step == step:
                    return stage.runner.snapshot_state()
        path = checkpoint_at(self.checkpoint_root(run_id), layers, step)
        return load_checkpoint(path) if path is not None else None

    async def _held(self, run_id: bytes, layers: tuple[int, int], step: int) -> StageState | dict:
        """The state of `layers` at `step` held here, or the answer that says why not. Step 0
        not held otherwise is the run's initial weights, rebuilt here."""
        try:
            state = await trio.to_thread.run_sync(self._state_at, run_id, layers, step)
        except CheckpointError as e:
            return {"error": f"checkpoint unreadable: {e}"}
        if state is None and step == 0:
            return await self._initial(run_id, layers)
        if state is None:
            return {"error": f"layers {layers} at step {step} are not held here"}
        return state

    async def _initial(self, run_id: bytes, layers: tuple[int, int]) -> StageState | dict:
        """`layers` of run `run_id` at step 0: the run's initial weights, from its seed or from
        this peer's copy of the model folder the operator's start names (by its digest), built
        as the run's first epoch built them; the answer that says why not."""
        alloc = self.epoch.current
        if alloc is None or alloc.run_id != run_id:
            return {"error": f"run {run_id.hex()[:8]} is not this peer's: its initial weights are unknown here"}
        try:
            held = start_model(alloc, await self.models() if self.models is not None else {})
            if held is not None:
                return await trio.to_thread.run_sync(lambda: hf_stage_state(
                    held.path, alloc.train, layers, spec=alloc.model, digest=held.digest, device="cpu",
                    compression=alloc.compression))
            return await trio.to_thread.run_sync(
                lambda: StageState(alloc.model, alloc.train, layers, "cpu", compression=alloc.compression))
        except (ValueError, OSError, HFError) as e:
            return {"error": f"cannot rebuild the initial weights of layers {layers}: {e}"}

    async def offer(self, run_id: bytes, step: int, layers: tuple[int, int],
                    fetchers: frozenset[bytes] = frozenset()) -> dict:
        """Encode `layers` at `step` for the recovery server; the answer to RUN_STATE `offer`.
        `fetchers`: the peers the coordinator named with it (the next allocation's), who may
        fetch it besides the peers of this peer's own allocations. Offers are made one at a
        time: a request that arrives while the same stage is being encoded (a coordinator's
        retry, or a newly elected one asking again) waits and gets that offer, instead of a
        second copy of the stage encoded beside the first."""
        async with self._offer_lock:
            return await self._offer(run_id, step, layers, fetchers)

    async def _offer(self, run_id: bytes, step: int, layers: tuple[int, int], fetchers: frozenset[bytes]) -> dict:
        key = (run_id, step, (layers[0], layers[1]))
        found, held = self._offered.get(key), self.recovery.offered(key)
        if found is not None and held is not None and held.digest == found[0] and found[1].step == step:
            # offered already, and the state has not trained since (a stage's step only grows):
            # the same bytes, so no second encoding (nor a second copy of a snapshot)
            self._fetchers[key] = self._fetchers.get(key, frozenset()) | fetchers
            return {"digest": held.digest, "bytes": held.manifest.total_bytes}
        state = await self._held(run_id, layers, step)
        if isinstance(state, dict):
            return state
        self._fetchers = {k: v for k, v in self._fetchers.items() if k[0] == run_id and k[1] >= step - 1}
        self._fetchers[key] = self._fetchers.get(key, frozenset()) | fetchers
        offer = await self.recovery.offer(run_id, state)
        self._offered = {k: v for k, v in self._offered.items() if k[0] == run_id and k[1] >= step - 1}
        self._offered[key] = (offer.digest, state)
        return {"digest": offer.digest, "bytes": offer.manifest.total_bytes}

    async def offer_weights(self, run_id: bytes, step: int, layers: tuple[int, int], fetcher: bytes) -> dict:
        """Encode the parameters of `layers` at `step` alone for the recovery server, which
        serves them only to `fetcher` (the peer an operator's export names) and only as weights;
        the answer to RUN_STATE `export` with a step. The stage offers and who may fetch them
        stay as they are."""
        state = await self._held(run_id, layers, step)
        if isinstance(state, dict):
            return state
        offer = await self.recovery.offer_weights(run_id, state, frozenset({fetcher}))
        return {"digest": offer.digest, "bytes": offer.manifest.total_bytes}

    def let_go_of_stale_offers(self, alloc: Allocation) -> int:
        """Let go of the stage offers, and the states kept for them, that the build of `alloc`
        cannot use: every fetch of it is at its start step, of a holding that names its holders.
        Called before this peer builds its stage of `alloc`, so that an older offer's encoding
        (a whole stage's bytes) is not held beside the new stage's; the stage it was encoded
        from stays where it was (a later reconfiguration asks for a new offer, encoded again).
        How many offers went."""
        keep = {(alloc.run_id, alloc.start_step, (h.layer_range[0], h.layer_range[1])) for h in alloc.holdings
                if self.me in h.holders}
        gone = self._let_go(keep)
        if gone:
            logger.info("let go of %d stage offer(s) that epoch %d does not fetch", gone, alloc.epoch)
        return gone

    def _let_go(self, keep: Collection[tuple]) -> int:
        """Withdraw every stage offer but those of `keep` ((run, step, layers) keys), with the
        states kept for them and the fetchers named with them; how many offers went."""
        self._offered = {k: v for k, v in self._offered.items() if k in keep}
        self._fetchers = {k: v for k, v in self._fetchers.items() if k in keep}
        return self.recovery.withdraw(None, Part.STAGE, keep=keep)

    def may_fetch(self, peer: bytes, key: tuple[bytes, int, tuple[int, int]]) -> Refused | None:
        """The recovery server's rule (control/epoch/access.py): the peers of this peer's
        allocations of that run, and those the coordinator named with the offer."""
        run, prev = self.epoch.run, self.epoch.prev
        return fetch_refusal(peer, key[0], allocations=(run.alloc if run is not None else None,
                                                        prev.alloc if prev is not None else None),
                             fetchers=self._fetchers.get(key, frozenset()))

    def _offered_state(self, run_id: bytes, step: int, layers: tuple[int, int], digest: str) -> StageState | None:
        found = self._offered.get((run_id, step, tuple(layers)))
        if found is None or found[0] != digest or found[1].step != step:  # a stage trained on since
            return None
        return found[1]

    async def _own_copy(self, alloc: Allocation, h: Holding) -> StageState | None:
        """This peer's copy of a holding, if its digest is the allocation's; with compressed DP,
        whatever its digest (see `replicas_differ`, control/epoch/source.py). ValueError if it was trained with another
        compression than the allocation's."""
        key = (alloc.run_id, alloc.start_step, h.layer_range)
        digest = h.digest
        if replicas_differ(alloc):
            found = self._offered.get(key)
            if found is None or found[1].step != alloc.start_step:
                await self.offer(alloc.run_id, alloc.start_step, h.layer_range)
                found = self._offered.get(key)
            if found is None:
                return None
            digest = found[0]
        state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, digest)
        if state is None and not replicas_differ(alloc):
            await self.offer(alloc.run_id, alloc.start_step, h.layer_range)
            state = self._offered_state(alloc.run_id, alloc.start_step, h.layer_range, digest)
        if state is not None and state.compress.config != alloc.compression:
            raise ValueError(f"this peer's layers {h.layer_range} at step {alloc.start_step} were trained with "
                             f"compression {state.compress.config.describe()!r}, the run uses "
                             f"{alloc.compression.describe()!r}")
        return state

    # ---- building -----------------------------------------------------------------------------

    async def build(self, a: BuildStage, addresses: dict[bytes, tuple[str, int]]) -> StageBuilt | BuildFailed:
        """Build the stage of an applied allocation, serve its comm, connect the neighbours
        (`addresses`) and make its runner; the event that says how it went."""
        alloc = a.alloc
        t_fetch = trio.current_time()
        try:
            async with self._keeping:  # (a stage being written to disk is not trained on yet)
                self.let_go_of_stale_offers(alloc)
                state, fetched = await self._stage_for(alloc)
        except (RecoveryError, CheckpointError, ValueError, OSError, HFError) as e:
            logger.error("cannot build stage for epoch %d: %s", alloc.epoch, e)
            return BuildFailed(a.key, alloc.epoch, "build-failed", f"{short_id(self.me)}: {e}")
        plan = alloc.plan()
        rules = MessageRules.for_peer(plan, alloc.model, alloc.train, self.me,
                                      [tuple(p.shape) for p in state.params.values()], compression=alloc.compression)
        comm = TransportComm(self.transport, rules, run=alloc.run_id, router=self.router, config=self.config.comm)
        stage = _Stage(alloc, state, comm)
        prev = self.epoch.prev
        self._stages = {e: s for e, s in self._stages.items() if prev is not None and prev.alloc.epoch == e}
        self._stages[alloc.epoch] = stage
        t_connect = trio.current_time()
        assert self._nursery is not None
        await self._nursery.start(self._serve, stage)
        try:
            await comm.connect({p: addresses[p] for p in rules.peers if p in addresses},
                               self.config.connect_timeout_s)
        except (CommError, OSError, ConnectionClosed, RequestTimeout, ProtocolError, trio.TooSlowError) as e:
            self.abort(f"could not connect the neighbours: {e}", alloc.epoch)
            return BuildFailed(a.key, alloc.epoch, "connect-failed", f"{short_id(self.me)}: {e}")
        token = trio.lowlevel.current_trio_token()
        stage.runner = StageRunner(state, plan, self.me, comm, await self.corpus(), end_step=alloc.end_step,
                                   checkpoint_every=alloc.checkpoint_every,
                                   save=functools.partial(self.disk.save, alloc.run_id),
                                   torch_threads=self.config.torch_threads,
                                   on_step=lambda rep: token.run_sync_soon(self._step_done, rep),
                                   history=tuple(self.epoch.reports), keep_reports=MAX_REPORTS,
                                   predicted_step_s=alloc.predicted_iteration_s)
        d, s = alloc.position(self.me)
        logger.info("accepted term %d epoch %d: stage %d of pipeline %d, layers %s, steps %d..%d%s", alloc.term,
                    alloc.epoch, s, d, alloc.layer_ranges[s], alloc.start_step, alloc.end_step - 1,
                    f", {fetched} bytes fetched" if fetched else "")
        return StageBuilt(a.key, alloc.epoch, state.step, fetched, (t_connect - t_fetch) if fetched else 0.0)

    async def _stage_for(self, alloc: Allocation) -> tuple[StageState, int]:
        """This peer's stage of `alloc` at its start step, and the bytes fetched for it: from
        where `stage_source` says (control/epoch/source.py)."""
        device = self.config.device
        source = stage_source(alloc, self.me, await self.models() if self.models is not None else {})
        if isinstance(source, FromFolder):  # a run from a model folder: this stage's layers of this peer's copy
            held, layers = source.held, source.layers
            return await trio.to_thread.run_sync(lambda: hf_stage_state(
                held.path, alloc.train, layers, spec=alloc.model, digest=held.digest, device=device,
                compression=alloc.compression)), 0
        if isinstance(source, Fresh):
            layers = source.layers
            return await trio.to_thread.run_sync(
                lambda: StageState(alloc.model, alloc.train, layers, device, compression=alloc.compression)), 0
        if isinstance(source, OwnCopy):
            state = await self._own_copy(alloc, source.holding)
            if state is not None:
                return await trio.to_thread.run_sync(_on_device, state, device, alloc.train), 0
            source = source.fallback
        return await self._fetch(alloc, source)

    async def _fetch(self, alloc: Allocation, source: Fetch) -> tuple[StageState, int]:
        """Assemble the stage from its parts: this peer's own copy of a part where it has one,
        else the part fetched from its holders (hash-verified)."""
        # This peer takes on a stage it does not hold: the snapshots of its earlier stages that
        # no holding of this allocation needs (all are at its start step) go before the fetch,
        # as its offers this allocation does not fetch went (`let_go_of_stale_offers`), so that
        # it holds little more than its old stage, its offers still fetched and the new stage's bytes.
        for old in self._stages.values():
            if old.done.is_set() and old.runner is not None and old.runner.snapshot_step != alloc.start_step:
                old.runner.drop_snapshot()
        parts: list = []
        fetched, optim_step = 0, None
        for part in source.parts:
            h = part.holding
            local = await self._own_copy(alloc, h) if part.own_first else None
            if local is not None:
                parts.append(stage_tensors(local))
                optim_step = local.optim.step_count
                continue
            sources = [(p, self.address_of(p)) for p in h.holders if p != self.me]
            result = await fetch_stage(self.transport, sources, run_id=alloc.run_id, step=alloc.start_step,
                                       layer_range=h.layer_range, digest=h.digest, max_total_bytes=MAX_STAGE_BYTES,
                                       timeout_s=self.config.request_timeout_s, rate_of=self.rate_of)
            fetched += result.bytes
            parts.append(result.receiver)
            optim_step = int(result.receiver.manifest.meta["optim_step"])
            logger.info("fetched layers %s at step %d: %d bytes in %.2f s from %s", h.layer_range,
                        alloc.start_step, result.bytes, result.seconds,
                        ", ".join(f"{short_id(p)} ({n})" for p, n in result.per_source.items()))
        state = await trio.to_thread.run_sync(lambda: assemble_stage(
            alloc.model, alloc.train, source.layers, parts, alloc.start_step, optim_step or 0,
            device=self.config.device, compression=alloc.compression))
        return state, fetched

    # ---- running ------------------------------------------------------------------------------

    async def _serve(self, stage: _Stage, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the epoch's comm tasks and, once started, its runner thread."""
        try:
            with stage.cancel:
                async with trio.open_nursery() as nursery:
                    await nursery.start(stage.comm.run)
                    task_status.started()
                    await stage.started.wait()
                    assert stage.runner is not None
                    end = await stage.runner.run()
                    _log_end(stage.alloc, end)
                    self.on_event(RunnerEnded(stage.alloc.epoch, end, time.time()))
                    nursery.cancel_scope.cancel()
        finally:
            stage.comm.close()
            stage.done.set()
            self.on_event(EpochDone(stage.alloc.epoch))

    def _step_done(self, rep: StepReport) -> None:
        self.on_event(StepDone(rep))

    def memory(self) -> StageMemory | None:
        """The current stage's own state (weights, gradients, optimizer, snapshot, the last
        step's activations), as its runner counted it after its last step; None: no stage."""
        stage = self._current()
        return stage.runner.memory if stage is not None and stage.runner is not None else None

    def _current(self) -> _Stage | None:
        cur = self.epoch.current
        return self._stages.get(cur.epoch) if cur is not None else None

    def start(self, epoch: int) -> None:
        """Start the runner of `epoch`. The coordinator starts an epoch once every peer of it
        has built its stage at the epoch's start step, so no peer fetches a stage of this run
        any more and none is behind that step: the stage offers and the states kept for them
        are let go (a later reconfiguration asks for new offers, encoded again from the stage,
        its snapshot or a checkpoint), and so are the stage objects of the epochs before whose
        worker is over (their state, where the new epoch did not keep it, and their runner's
        snapshot: the new runner makes its own). An export's weights offer stays."""
        stage = self._stages.get(epoch)
        if stage is not None and stage.runner is not None:
            self._let_go(())
            self._stages = {e: s for e, s in self._stages.items() if e == epoch or not s.done.is_set()}
            stage.started.set()

    def stop_at(self, epoch: int, step: int, *, final: bool = False) -> None:
        stage = self._stages.get(epoch)
        if stage is not None and stage.runner is not None:
            stage.runner.stop_at(step, final=final)
            logger.info("stopping the run before step %d", step)

    def fail_neighbour(self, peer: bytes, why: str) -> None:
        stage = self._current()
        if stage is not None:
            stage.comm.fail(peer, why)

    def abort(self, reason: str, epoch: int | None = None) -> None:
        """Abort this peer's current step, or epoch `epoch`'s (a runner not started yet is
        cancelled)."""
        stage = self._current() if epoch is None else self._stages.get(epoch)
        if stage is None:
            return
        stage.comm.abort(reason)
        if stage.runner is None or not stage.started.is_set():
            stage.cancel.cancel()

    async def end(self, epoch: int, reason: str) -> None:
        """End this peer's epoch `epoch` and wait until its worker let go of the stage;
        StageError when it does not within stop_timeout_s."""
        stage = self._stages.get(epoch)
        if stage is None or stage.done.is_set():
            return
        self.abort(reason, epoch)
        with trio.move_on_after(self.config.stop_timeout_s):
            await stage.done.wait()
        if not stage.done.is_set():
            raise StageError(f"the stage worker did not stop within {self.config.stop_timeout_s:g} s")


def _on_device(state: StageState, device: str, cfg: TrainConfig) -> StageState:
    """`state` itself where it is on `device` with training config `cfg`, else a copy there
    with it (a checkpoint is read on the CPU; a run whose start left the micro-batch count to
    the scheduler may change it between epochs, and the state offered at the old count keeps
    it, as its digest says)."""
    same = str(state.device) == device or (device == "cuda" and state.device.type == "cuda")
    if same and state.cfg == cfg:
        return state
    return stage_from_tensors(state.spec, cfg, state.layer_range, stage_tensors(state), state.step,
                              state.optim.step_count, device, compression=state.compress.config)


def _log_end(alloc: Allocation, end: RunEnd) -> None:
    if end.failed:
        logger.log(end.log_level, "training stopped at epoch %d: %s; last completed step %d", alloc.epoch,
                   end.reason, end.completed)
    else:
        logger.info("training %s at epoch %d after step %d", end.reason, alloc.epoch, end.completed)
